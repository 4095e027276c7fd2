"""The client's outgoing events: a bounded buffer, and a sender on a thread of its own.

A service's request path hands an encoded event to :meth:`Sender.put` and goes on: ``put``
appends to a buffer bounded in events and in bytes and returns; it never waits on the
broker and never raises because of it. A task on the sender's own loop
(:class:`~pipeline.client.background.Background`) connects to the broker (retrying with
backoff while it is away), sends what is buffered in batches and counts what the broker
acknowledged. Each event ends in exactly one of four counters:

* ``sent``: acknowledged by the broker;
* ``dropped``: never handed to the broker, and pushed out of a full buffer (the oldest first,
  as the broker was away or slower than the service) or still unsent when
  :meth:`Sender.close`'s deadline passed: it is not on the topic;
* ``in_doubt``: the same, for an event that was handed to the broker but whose
  acknowledgement never came (a request timed out as the broker froze): the broker may have
  written it;
* ``refused``: the broker refused it for good (too large, not authorised): retrying cannot help.

An event whose send failed for a reason that may pass (the broker away, a leader moving)
goes back to the head of the buffer and is sent again; a batch that failed part-way may be
delivered twice (at least once: the pipeline keys what it learns by event id). Dropping and
refusing are logged at most every :data:`LOG_EVERY_S` seconds, with counts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any, NamedTuple

from aiokafka.errors import BrokerResponseError

from pipeline import kafka
from pipeline.client.background import Background, Backoff, keep_trying
from pipeline.config import Connection

log = logging.getLogger(__name__)

MAX_EVENTS = 10_000  # events buffered at most
MAX_BYTES = 32 * 1024 * 1024  # bytes buffered at most (values and keys)
BATCH = 500  # events handed to the producer before waiting for their acknowledgements
LOG_EVERY_S = 10.0


class Item(NamedTuple):
    """One event to send."""

    topic: str
    value: bytes | None  # None: a tombstone
    key: bytes | None
    # Handed to the broker before: a retried event whose acknowledgement failed (it may be on the topic already).
    handed: bool = False
    headers: tuple[tuple[str, bytes], ...] = ()  # record headers (a principal's signature, contract 1.16)


def _size(item: Item) -> int:
    return (len(item.value) if item.value else 0) + (len(item.key) if item.key else 0)


def _refused(exc: BaseException) -> bool:
    """Whether the broker refused an event for good (retrying the same bytes cannot succeed)."""
    return (isinstance(exc, BrokerResponseError) and not exc.retriable) or isinstance(exc, ValueError)


class Sender:
    """A bounded buffer of events and the background task that sends them (module docstring).

    Parameters
    ----------
    bootstrap
        The Kafka bootstrap address.
    conn
        The connection's SASL/TLS settings.
    max_events, max_bytes
        The buffer's bounds; beyond either, the oldest events are dropped.
    producer_kwargs
        Passed on to the aiokafka producer.
    """

    def __init__(
        self,
        bootstrap: str,
        conn: Connection,
        *,
        max_events: int = MAX_EVENTS,
        max_bytes: int = MAX_BYTES,
        producer_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError("max_events and max_bytes must be >= 1")
        self.bootstrap = bootstrap
        self.conn = conn
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._producer_kwargs = producer_kwargs or {}
        self._buffer: deque[Item] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._inflight = 0  # taken from the buffer, not yet acknowledged
        self.sent = 0
        self.dropped = 0
        self.in_doubt = 0
        self.refused = 0
        self._logged: dict[str, tuple[float, int]] = {}  # what -> (last logged, count then)
        self.backoff = Backoff()
        self._bg: Background | None = None
        self._wake: asyncio.Event | None = None
        self._task: concurrent.futures.Future[None] | None = None

    # ------------------------------------------------------------------ caller's side (any thread)
    @property
    def buffered(self) -> int:
        """Events waiting to be sent or acknowledged."""
        return len(self._buffer) + self._inflight

    def health(self) -> str:
        """``"ok"``, or ``"degraded: no broker since …"`` while the broker cannot be reached."""
        return self.backoff.health()

    def start(self) -> None:
        """Start the sender's thread; it connects in the background (a broker away is retried)."""
        if self._bg is not None:
            raise RuntimeError("Sender already started")
        self._bg = Background("causalmem-sender")
        ready = threading.Event()

        async def begin() -> None:
            self._wake = asyncio.Event()
            ready.set()
            await self._run()

        self._task = self._bg.submit(begin())
        ready.wait(5.0)

    def put(
        self, topic: str, value: bytes | None, key: bytes | None, headers: tuple[tuple[str, bytes], ...] = ()
    ) -> None:
        """Buffer one event for sending; never blocks, never raises because of the broker."""
        item = Item(topic, value, key, False, headers)
        with self._lock:
            self._buffer.append(item)
            self._bytes += _size(item)
            dropped = self._shed(keep=1)
        if dropped:
            self._note("dropped", f"events dropped, oldest first: the buffer is full ({self.health()})")
        self._kick()

    def flush(self, timeout: float = 30.0, *, give_up_when_away: bool = False) -> bool:
        """Wait up to ``timeout`` s until everything put so far was acknowledged or given up;
        True when nothing is left. ``give_up_when_away``: return at once while the broker is away."""
        deadline = time.monotonic() + timeout
        while self.buffered and time.monotonic() < deadline and self._bg is not None and not self._bg.closed:
            if give_up_when_away and self.backoff.since is not None:
                break
            self._kick()
            time.sleep(0.01)
        return self.buffered == 0

    def close(self, timeout: float = 10.0) -> None:
        """Flush for up to ``timeout`` s (not at all while the broker is away), then stop; what is
        still unsent is counted as dropped (or in doubt, where it was handed to the broker).
        Idempotent."""
        bg = self._bg
        if bg is None or bg.closed:
            return
        self.flush(timeout, give_up_when_away=True)
        bg.close(timeout=2.0)
        with self._lock:
            lost = len(self._buffer) + self._inflight
            self._count_lost(self._buffer)
            self.in_doubt += self._inflight  # handed to the producer when its loop stopped
            self._buffer.clear()
            self._bytes = 0
            self._inflight = 0
        if lost:
            log.warning(
                "sender: closed with %d events unsent (counted as dropped or in doubt; %s)", lost, self.health()
            )

    def _kick(self) -> None:
        bg, wake = self._bg, self._wake
        if bg is not None and wake is not None and not wake.is_set() and not bg.closed:
            try:
                bg.loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _note(self, what: str, message: str) -> None:
        """Log ``message`` with the count of ``what`` at most every :data:`LOG_EVERY_S` seconds."""
        now = time.monotonic()
        last, count = self._logged.get(what, (0.0, 0))
        total = getattr(self, what)
        if now - last >= LOG_EVERY_S:
            log.warning("sender: %d %s (%d in all)", total - count, message, total)
            self._logged[what] = (now, total)

    # ------------------------------------------------------------------ the sender's loop
    def _take(self) -> list[Item]:
        with self._lock:
            n = min(BATCH, len(self._buffer))
            batch = [self._buffer.popleft() for _ in range(n)]
            self._bytes -= sum(_size(i) for i in batch)
            self._inflight = n
        return batch

    def _requeue(self, failed: list[Item]) -> None:
        """Put ``failed`` back at the head; what no longer fits is dropped, the oldest first."""
        with self._lock:
            self._inflight = 0
            self._buffer.extendleft(reversed(failed))
            self._bytes += sum(_size(i) for i in failed)
            self._shed(keep=0)

    def _shed(self, keep: int) -> int:
        """Drop the oldest events beyond the bounds (never the newest ``keep``); the lock is held."""
        shed: list[Item] = []
        while len(self._buffer) > keep and (len(self._buffer) > self.max_events or self._bytes > self.max_bytes):
            item = self._buffer.popleft()
            self._bytes -= _size(item)
            shed.append(item)
        self._count_lost(shed)
        return len(shed)

    def _count_lost(self, items: Any) -> None:
        """Count events given up: in doubt where they were handed to the broker before, else dropped."""
        doubt = sum(1 for item in items if item.handed)
        self.in_doubt += doubt
        self.dropped += len(items) - doubt

    async def _connect(self) -> Any:
        async def attempt() -> Any:
            return await kafka.start_producer(self.bootstrap, self.conn, **self._producer_kwargs)

        return await keep_trying(attempt, self.backoff, self._note_failure)

    def _note_failure(self, exc: BaseException, delay: float) -> None:
        now = time.monotonic()
        last, _ = self._logged.get("failure", (0.0, 0))
        if now - last >= LOG_EVERY_S:
            log.warning(
                "sender: the broker cannot be reached (%r); %d events buffered, retrying in %.1f s",
                exc,
                self.buffered,
                delay,
            )
            self._logged["failure"] = (now, 0)

    async def _run(self) -> None:
        producer = await self._connect()
        try:
            while True:
                batch = self._take()
                if not batch:
                    assert self._wake is not None
                    self._wake.clear()
                    if not self._buffer:
                        await self._wake.wait()
                    continue
                failed, error = await self._send(producer, batch)
                self._requeue(failed)
                if error is not None:
                    delay = self.backoff.failed()
                    self._note_failure(error, delay)
                    await asyncio.sleep(delay)
                else:
                    self.backoff.succeeded()
        finally:
            with self._lock:
                self._inflight = 0
            await producer.stop()

    async def _send(self, producer: Any, batch: list[Item]) -> tuple[list[Item], BaseException | None]:
        """Send ``batch``; returns the events to send again and the error that may pass (None: all went)."""
        futures: list[tuple[Item, asyncio.Future[Any]]] = []
        retry: list[Item] = []
        error: BaseException | None = None
        try:
            for i, item in enumerate(batch):
                try:
                    sent = producer.send(item.topic, item.value, key=item.key, headers=list(item.headers) or None)
                    futures.append((item, await sent))
                except Exception as exc:
                    if not _refused(exc):
                        retry, error = batch[i:], exc
                        break
                    self._refuse(exc)
            results = await asyncio.gather(*(f for _, f in futures), return_exceptions=True)
        except asyncio.CancelledError:
            handed = len(futures)  # these may have reached the broker
            self._requeue([item._replace(handed=True) for item in batch[:handed]] + batch[handed:])
            raise
        done = 0
        for (item, _), result in zip(futures, results, strict=True):
            if not isinstance(result, BaseException):
                done += 1
            elif _refused(result):
                self._refuse(result)
            else:
                retry.append(item._replace(handed=True))  # handed over: it may be on the topic
                error = error or result
        self.sent += done
        return retry, error

    def _refuse(self, exc: BaseException) -> None:
        with self._lock:
            self.refused += 1
        self._note("refused", f"events refused by the broker, not sent again ({exc!r})")
