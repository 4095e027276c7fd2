"""An asyncio loop on a thread of its own, for a client component's Kafka I/O.

The request path of a service must never wait on the pipeline (docs/byo-retriever.md, "When
the broker is away"). So :class:`~pipeline.client.publisher.EventPublisher` and
:class:`~pipeline.client.subscriber.PolicySubscriber` do their I/O on a :class:`Background`
loop: neither a busy caller's loop (a blocking LLM call inside ``async def``) nor a broker that
is away delays a request, and a broker that is away when the component starts is retried
here, with :class:`Backoff`, while the caller goes on.

>>> bg = Background("example")
>>> async def twice(x: int) -> int:
...     return 2 * x
>>> bg.call(twice(21), timeout=5)
42
>>> bg.close()
>>> bg.closed
True
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class Background:
    """A daemon thread running an asyncio loop; coroutines are submitted to it from any thread.

    Parameters
    ----------
    name
        The thread's name (it shows in thread dumps and ``py-spy``).
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on this loop; its future can be waited on from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` here and block until it is done (``TimeoutError`` after ``timeout`` s,
        and the coroutine is cancelled)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"not done after {timeout} s") from None

    async def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` here and await it from the caller's own loop (cancelling the await cancels it)."""
        return await asyncio.wrap_future(self.submit(coro))

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs here, stop the loop and join the thread. Idempotent."""
        if self.closed:
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        if self._thread.is_alive():
            try:
                self.call(cancel_all(), timeout + 1.0)
            except (TimeoutError, RuntimeError):
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class Backoff:
    """Exponential backoff between attempts to reach the broker, and since when it has been away.

    >>> b = Backoff(first=0.5, most=4.0)
    >>> [b.failed(now=10.0) for _ in range(5)]
    [0.5, 1.0, 2.0, 4.0, 4.0]
    >>> b.health()
    'degraded: no broker since 1970-01-01T00:00:10Z'
    >>> b.succeeded(); b.health()
    'ok'
    """

    first: float = 0.2
    most: float = 30.0
    _delay: float = 0.0
    since: float | None = None  # when the broker was first found away (None: it is reachable)

    def failed(self, now: float | None = None) -> float:
        """Record a failed attempt; returns how long to wait before the next one."""
        if self.since is None:
            self.since = time.time() if now is None else now
        self._delay = self.first if self._delay == 0.0 else min(self.most, 2.0 * self._delay)
        return self._delay

    def succeeded(self) -> None:
        self._delay = 0.0
        self.since = None

    def health(self) -> str:
        """``"ok"``, or ``"degraded: no broker since <UTC time>"``."""
        if self.since is None:
            return "ok"
        return "degraded: no broker since " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))


async def keep_trying(
    attempt: Callable[[], Awaitable[T]], backoff: Backoff, failed: Callable[[BaseException, float], None]
) -> T:
    """``await attempt()`` until it succeeds, waiting as ``backoff`` says after each failure
    (``failed(error, delay)`` is told of each: log it). An attempt cleans up after itself.

    >>> tries = iter([OSError("refused"), OSError("refused"), "connected"])
    >>> async def attempt() -> str:
    ...     x = next(tries)
    ...     if isinstance(x, Exception):
    ...         raise x
    ...     return x
    >>> b = Backoff(first=0.001)
    >>> asyncio.run(keep_trying(attempt, b, lambda e, d: print(f"{e}; again in {d} s"))), b.health()
    refused; again in 0.001 s
    refused; again in 0.002 s
    ('connected', 'ok')
    """
    while True:
        try:
            result = await attempt()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            delay = backoff.failed()
            failed(exc, delay)
            await asyncio.sleep(delay)
            continue
        backoff.succeeded()
        return result
