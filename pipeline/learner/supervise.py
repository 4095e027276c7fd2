"""Supervision of long-running tasks: a task that ends unexpectedly ends the process.

A task that dies inside a process that stays up is the worst failure: /metrics answers,
the probes may look healthy and nothing more is done (docs/architecture.md, "Failure
model"). :func:`supervise` attaches a callback to a task that is meant to run until it is
cancelled: if it raises, or returns, the failure is logged with its traceback and
``on_failure`` is called; the learner's command then stops and exits non-zero, so the
orchestrator restarts it.

>>> import asyncio
>>> async def demo() -> list[str]:
...     seen: list[str] = []
...     async def boom() -> None:
...         raise ValueError("bad")
...     task = supervise(asyncio.create_task(boom()), lambda exc: seen.append(repr(exc)), "demo")
...     await asyncio.sleep(0)
...     await asyncio.sleep(0)
...     return seen
>>> asyncio.run(demo())
["ValueError('bad')"]
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T", bound="asyncio.Task[Any]")


def supervise(
    task: T,
    on_failure: Callable[[BaseException], None],
    name: str = "",
    stopping: Callable[[], bool] | None = None,
) -> T:
    """Call ``on_failure`` when ``task`` raises or returns (cancelling it is a normal stop).

    ``stopping`` tells whether the process is stopping: a task that returns then has ended
    as asked (the learner's training loop returns once :meth:`stop` is called), not failed.
    """
    what = name or task.get_name()

    def done(t: asyncio.Task[Any]) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is None and stopping is not None and stopping():
            log.debug("supervisor: task %s ended with the stop", what)
            return
        if exc is None:
            exc = RuntimeError(f"task {what} ended although it should run until stopped")
            log.critical("supervisor: %s", exc)
        else:
            log.critical("supervisor: task %s failed; the process exits to be restarted", what, exc_info=exc)
        on_failure(exc)

    task.add_done_callback(done)
    return task
