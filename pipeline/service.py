"""The start/stop lifecycle every long-lived component shares (aiokafka's shape).

A component subclasses :class:`Service` and implements ``_start`` and ``_stop``;
``start``/``stop`` guard against a double start and make ``stop`` idempotent, and
``async with`` runs both. Written once here instead of in every component.

>>> import asyncio
>>> class Counter(Service):
...     def __init__(self) -> None:
...         super().__init__()
...         self.starts = 0
...     async def _start(self) -> None:
...         self.starts += 1
...     async def _stop(self) -> None:
...         self.starts -= 1
>>> async def demo() -> tuple[int, bool]:
...     async with Counter() as c:
...         try:
...             await c.start()
...         except RuntimeError:
...             pass
...         inside = c.starts
...     await c.stop()  # a second stop does nothing
...     return inside, c.running
>>> asyncio.run(demo())
(1, False)
"""

from __future__ import annotations

import logging
import os
import sys
from abc import ABC, abstractmethod
from typing import Any, Self


class Service(ABC):
    """Base class: ``start`` once, ``stop`` any number of times, ``async with``."""

    def __init__(self) -> None:
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    async def start(self) -> None:
        if self._running:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._running = True
        try:
            await self._start()
        except BaseException:
            self._running = False
            await self._stop()
            raise

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        await self._stop()

    @abstractmethod
    async def _start(self) -> None:
        """Acquire what the component runs on (clients, tasks)."""

    @abstractmethod
    async def _stop(self) -> None:
        """Release it; called once per start, also when ``_start`` failed part-way."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


def restart_process(reason: str) -> None:
    """Replace this process with a fresh copy of itself (same command line).

    After a cluster reset, a fresh start is the one way to rebuild every consumer, group
    membership and in-memory table from the new cluster's (empty) topics.
    """
    logging.getLogger("causalmem").error("%s: restarting this process from the beginning", reason)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, [sys.executable, "-P", "-m", "pipeline.cli", *sys.argv[1:]])
