"""The worker's faust producer: an input offset is committed only after its outputs are acknowledged.

faust (at least once) commits a stream stage's input offsets after calling the producer's
``flush``, meant to wait for every buffered send. It does not quite: table changelog
writes go through faust's producer buffer, whose flush returns as soon as the buffer
looks empty, or after 0.1 s without progress, while a message taken from it may still be
on its way into the Kafka client (waiting for metadata or for room in a batch). The
stage's offset could then be committed before the changelog write of the table update
it made, and a worker killed at that moment lost the update for good: the input was
not read again, the changelog never had it (docs/architecture.md, "Nothing lost on a
crash").

:class:`AckedProducer` keeps every send it was handed (buffered or direct) until the
broker answers, and its ``flush`` waits for all of them. A send that failed makes the
flush raise, so faust's commit fails (its commit task crashes) instead of committing past
a lost write. Nothing else waits: each record is still sent asynchronously, and only the
periodic commit waits for the acknowledgements of what was sent before it.

:class:`WorkerApp` is a faust app with this producer and the consumer of
:mod:`pipeline.worker.commits` (commits only over processed inputs) and
:mod:`pipeline.worker.recovery` (recovery to a changelog's real end).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import faust
from faust.exceptions import ProducerSendError
from faust.transport.drivers.aiokafka import Producer as AIOKafkaProducer
from faust.types import ConsumerT, ProducerT

from pipeline.worker.commits import StageConsumer
from pipeline.worker.recovery import HighwaterFetch

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a waiting flush checks that the producer has not crashed


class Unacked:
    """The sends not yet answered by the broker, and the first that failed.

    >>> async def demo() -> tuple[bool, bool]:
    ...     ledger, loop = Unacked(), asyncio.get_running_loop()
    ...     fut = loop.create_future()
    ...     ledger.track(fut)
    ...     early = await ledger.settle(timeout=0.01)
    ...     fut.set_result(None)
    ...     return early, await ledger.settle(timeout=0.01)
    >>> asyncio.run(demo())
    (False, True)
    """

    def __init__(self) -> None:
        self.pending: set[asyncio.Future[Any]] = set()
        self.failure: BaseException | None = None

    def track(self, fut: asyncio.Future[Any]) -> None:
        """Keep ``fut`` until it is done."""
        if fut.done():
            self._done(fut)
            return
        self.pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[Any]) -> None:
        self.pending.discard(fut)
        if self.failure is None:
            self.failure = asyncio.CancelledError() if fut.cancelled() else fut.exception()

    async def wait(self, alive: Any = None) -> None:
        """Wait until every send tracked so far is answered; raise if one failed.

        ``alive`` (a callable) is asked every :data:`POLL_S` while waiting: a producer whose
        sending task crashed never answers the rest.
        """
        pending = set(self.pending)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=POLL_S)
            if pending and alive is not None and not alive():
                raise ProducerSendError(f"producer stopped with {len(pending)} sends unanswered")
        if self.failure is not None:
            raise ProducerSendError(f"a send failed: {self.failure!r}") from self.failure

    async def settle(self, timeout: float) -> bool:
        """True when every send tracked so far was acknowledged within ``timeout`` seconds."""
        pending = set(self.pending)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout)
        return not pending and self.failure is None


class AckedProducer(AIOKafkaProducer):
    """faust's aiokafka producer whose ``flush`` waits for every acknowledgement, idempotent
    where the app's ``idempotence`` says so (``kafka_idempotence``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unacked = Unacked()
        self.idempotent = False

    async def on_start(self) -> None:
        ask = getattr(self.app, "idempotence", None)
        self.idempotent = bool(ask is not None and await ask())
        await super().on_start()

    def _settings_extra(self) -> Mapping[str, Any]:
        # faust turns idempotence on only inside its transactions (exactly-once).
        extra = dict(super()._settings_extra())
        if self.idempotent:
            extra.update(acks="all", enable_idempotence=True)
        return extra

    def send_soon(self, fut: Any) -> None:
        # Table changelog writes: buffered, sent by faust's buffer task.
        self.unacked.track(fut)
        super().send_soon(fut)

    async def send(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        # Every send reaches the client here, buffered or not (topic.send).
        fut = await super().send(*args, **kwargs)
        if isinstance(fut, asyncio.Future):
            self.unacked.track(fut)
        return fut

    async def flush(self) -> None:
        await super().flush()
        await self.unacked.wait(alive=self._alive)

    def _alive(self) -> bool:
        # A stopped or crashed buffer task sends nothing more: what it holds stays unanswered.
        buffer = self.buffer
        return not (buffer.should_stop or buffer.crashed or self.crashed)


class WorkerApp(faust.App):
    """The worker's faust app: its producer waits for acknowledgements before a commit
    (:class:`AckedProducer`; idempotent where ``idempotence`` answers yes), its commits never
    pass an input not processed (:class:`pipeline.worker.commits.StageConsumer`), and its table recovery reads each
    changelog to the end a fetch reports (:class:`pipeline.worker.recovery.WatermarkConsumer`,
    using ``fetch_highwaters``; without it, faust's ``end_offsets``).
    """

    def __init__(
        self,
        *args: Any,
        fetch_highwaters: HighwaterFetch | None = None,
        idempotence: Callable[[], Awaitable[bool]] | None = None,
        **kwargs: Any,
    ) -> None:
        self.fetch_highwaters = fetch_highwaters
        self.idempotence = idempotence
        super().__init__(*args, **kwargs)

    def _new_producer(self) -> ProducerT:
        return AckedProducer(self.transport, loop=self.loop, beacon=self.beacon)

    def _new_consumer(self) -> ConsumerT:
        return StageConsumer(
            self.transport,
            loop=self.loop,
            callback=self.topics.on_message,
            on_partitions_revoked=self._on_partitions_revoked,
            on_partitions_assigned=self._on_partitions_assigned,
            beacon=self.beacon,
        )
