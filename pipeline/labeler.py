"""Client side: the labeling queue behind ``causalmem label`` (seed 000 §4.3 level 2).

Samples the pipeline queues on ``active-learning`` are shared by every labeler through
one consumer group: each sample goes to one labeler. A sample's offset is committed only
after its label has been acknowledged by the broker, so a labeler that crashes between
receiving a sample and publishing its answer loses nothing: the sample comes again (to
it or to another labeler). Answers are HumanLabel messages of kind ``memory_choice``
(optionally with a 0–5 rating) on ``human-labels``, keyed by query id, and always carry
the labeler's identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import OffsetAndMetadata

from pipeline import kafka
from pipeline.config import Settings
from topics.codec import ActiveLearningSample, HumanLabel, Rejected, decode_active_learning_sample, encode

log = logging.getLogger(__name__)

LABELER_GROUP = "causalmem-labelers"


@dataclass
class QueuedSample:
    sample: ActiveLearningSample
    tp: TopicPartition
    offset: int


class LabelQueue:
    """One labeler's view of the shared queue (async; ``start``/``stop`` or ``async with``)."""

    def __init__(self, bootstrap: str, settings: Settings, labeler: str, group: str | None = None) -> None:
        if not labeler:
            raise ValueError("a labeler identity is required (it is carried on every label)")
        self.bootstrap = bootstrap
        self.settings = settings
        self.labeler = labeler
        self.topics = settings.topics()
        self.limits = settings.limits()
        self.group = group or f"{settings.topic_prefix}{LABELER_GROUP}"
        self.done = 0
        self.skipped = 0
        self.bad = 0
        self._consumer: Any = None
        self._producer: Any = None
        self._buffer: list[QueuedSample] = []

    async def start(self) -> None:
        self._producer = kafka.producer(self.bootstrap, self.settings)
        await self._producer.start()
        # One sample at a time: a labeler holds only what it shows.
        self._consumer = kafka.consumer(
            self.bootstrap, self.settings, self.topics.active_learning.name, group_id=self.group, max_poll_records=1
        )
        await self._consumer.start()

    async def stop(self) -> None:
        for client in (self._consumer, self._producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
        self._consumer = self._producer = None

    async def __aenter__(self) -> LabelQueue:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def next(self, timeout: float = 5.0) -> QueuedSample | None:
        """The next sample for this labeler, or None when none arrived within ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            batch = await self._consumer.getmany(timeout_ms=int(min(remaining, 1.0) * 1000), max_records=1)
            for tp, msgs in batch.items():
                for msg in msgs:
                    try:
                        sample = decode_active_learning_sample(msg.value, self.limits, msg.key)
                    except Rejected as rej:
                        log.warning("label queue: unreadable sample at %s:%d (%s); skipping", tp, msg.offset, rej)
                        self.bad += 1
                        await self._commit(tp, msg.offset)
                        continue
                    self._buffer.append(QueuedSample(sample, tp, msg.offset))
        return self._buffer.pop(0)

    async def answer(
        self, item: QueuedSample, correct_memories: list[int], rating: int | None = None, ts: float | None = None
    ) -> HumanLabel:
        """Publish the answer, wait for the broker's acknowledgement, then commit the sample."""
        label = HumanLabel(
            event_id=uuid.uuid4().hex,
            query_id=item.sample.query_id,
            ts=item.sample.ts if ts is None else ts,
            labeler=self.labeler,
            kind="memory_choice",
            sample_id=item.sample.sample_id,
            correct_memories=list(correct_memories),
            rating=rating,
            step=item.sample.step,
        )
        await self._publish(label)
        await self._commit(item.tp, item.offset)
        self.done += 1
        return label

    async def skip(self, item: QueuedSample, reason: str = "", ts: float | None = None) -> HumanLabel:
        """Skip a sample (recorded as an answer without memories, with the reason)."""
        label = HumanLabel(
            event_id=uuid.uuid4().hex,
            query_id=item.sample.query_id,
            ts=item.sample.ts if ts is None else ts,
            labeler=self.labeler,
            kind="memory_choice",
            sample_id=item.sample.sample_id,
            correct_memories=[],
            skip_reason=reason or "skipped",
            step=item.sample.step,
        )
        await self._publish(label)
        await self._commit(item.tp, item.offset)
        self.skipped += 1
        return label

    async def _publish(self, label: HumanLabel) -> None:
        fut = await self._producer.send(
            self.topics.human_labels.name, encode(label.to_dict()), key=label.query_id.encode()
        )
        await fut  # acknowledged by the broker before the sample is committed

    async def _commit(self, tp: TopicPartition, offset: int) -> None:
        await self._consumer.commit({tp: OffsetAndMetadata(offset + 1, "")})

    async def waiting(self) -> int | None:
        """Samples not yet committed by the group (None until partitions are assigned)."""
        assignment = self._consumer.assignment()
        if not assignment:
            return None
        total = 0
        for tp in assignment:
            hw = self._consumer.highwater(tp)
            if hw is None:
                continue
            committed = await self._consumer.committed(tp)
            total += max(0, hw - (committed or 0))
        return total - len(self._buffer) if total else 0


async def run_queue_until(queue: LabelQueue, stop: asyncio.Event, answer: Any) -> None:
    """Answer samples with ``answer(sample) -> (correct_memories | None, rating)`` until ``stop``."""
    while not stop.is_set():
        item = await queue.next(timeout=0.5)
        if item is None:
            continue
        correct, rating = answer(item.sample)
        if correct is None:
            await queue.skip(item, "no helpful memory among the candidates")
        else:
            await queue.answer(item, correct, rating)
