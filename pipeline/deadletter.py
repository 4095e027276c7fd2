"""The dead-letter writer: every rejected message goes to ``dead-letter`` with its reason.

Bad input never stops a worker and never reaches the model (docs/contract.md §5). The record keeps
the original key and (up to 64 KiB of) the original value, and the reason is counted in
``causalmem_events_rejected_total{topic,reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pipeline.metrics import Metrics
from topics.fields import encode
from topics.internal import dead_letter_value

log = logging.getLogger(__name__)


class DeadLetterWriter:
    """Send rejected messages; ``flush`` awaits their delivery (before offsets are committed)."""

    def __init__(self, producer: Any, topic: str, metrics: Metrics, log_every_s: float = 10.0) -> None:
        self.producer = producer
        self.topic = topic
        self.metrics = metrics
        self._pending: list[asyncio.Future[Any]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._log_every_s = log_every_s
        self._last_log = 0.0
        self._suppressed = 0

    def send(self, msg: Any, reason: str, detail: str = "") -> None:
        """Queue one rejected consumer record (non-blocking)."""
        self._queue(msg.topic, msg.partition, msg.offset, msg.key, msg.value, reason, detail)

    def send_copy(self, topic: str, key: bytes | None, raw: bytes, reason: str, detail: str = "") -> None:
        """Queue a copy of a value the process holds but no longer has the record of (non-blocking):
        its ``source`` names ``topic`` with partition and offset -1 (contract §5)."""
        self._queue(topic, -1, -1, key, raw, reason, detail)

    def _queue(
        self, topic: str, partition: int, offset: int, key: bytes | None, raw: bytes | None, reason: str, detail: str
    ) -> None:
        self.metrics.rejected.labels(topic=topic, reason=reason).inc()
        self.metrics.dead_letters.inc()
        value = dead_letter_value(raw, reason, detail, topic, partition, offset, time.time())
        self._tasks.append(asyncio.ensure_future(self._send(key, encode(value))))
        self._log(topic, reason, detail)

    async def send_raw(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        raw: bytes | None,
        reason: str,
        detail: str = "",
    ) -> None:
        self.metrics.rejected.labels(topic=topic, reason=reason).inc()
        self.metrics.dead_letters.inc()
        value = dead_letter_value(raw, reason, detail, topic, partition, offset, time.time())
        await self._send(key, encode(value))
        self._log(topic, reason, detail)

    async def _send(self, key: bytes | None, value: bytes) -> None:
        fut = await self.producer.send(self.topic, value, key=key, partition=0)
        self._pending.append(fut)

    async def flush(self) -> None:
        tasks, self._tasks = self._tasks, []
        if tasks:
            await asyncio.gather(*tasks)
        pending, self._pending = self._pending, []
        if pending:
            await asyncio.gather(*pending)

    def _log(self, topic: str, reason: str, detail: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= self._log_every_s:
            extra = f" (+{self._suppressed} more since)" if self._suppressed else ""
            # Only the reason and a short detail: never the message, which may hold user text.
            log.warning("rejected a message on %s: %s %s%s", topic, reason, detail[:120], extra)
            self._last_log = now
            self._suppressed = 0
        else:
            self._suppressed += 1
