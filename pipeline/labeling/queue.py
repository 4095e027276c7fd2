"""The labeling queue behind ``causalmem label``: active-learning samples shared by the labelers.

Samples the pipeline queues on ``active-learning`` are shared by every labeler through
one consumer group: each sample goes to one labeler. A sample's offset is committed only
after its label has been acknowledged by the broker, so a labeler that crashes between
receiving a sample and publishing its answer loses nothing: the sample comes again (to
it or to another labeler). Answers are HumanLabel messages of kind ``memory_choice``
(optionally with a 0–5 rating) on ``human-labels``, keyed by query id, and always carry
the labeler's identity (the label's wire format: docs/contract.md).

The identity is the authenticated SASL principal when the connection has one
(:func:`principal`): a labeler cannot label under another name. A labeler answers a
sample once: at start it reads its own answers from ``human-labels``, and a sample it has
answered already (before a crash, or in another consumer group) is committed and passed
over, never shown again. The worker enforces the same rule on whatever reaches the topic.

A labeler needs no model configuration: samples are decoded without checking the model's
sizes (embedding length, slot count), so a labeler started with other settings than the
worker reads them all. A sample no labeler could read (not JSON, a missing field) is never
consumed silently: it goes to ``dead-letter`` with its reason, and only once the broker has
acknowledged that record is its offset committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import OffsetAndMetadata

from pipeline import kafka
from pipeline.config import Connection, Settings
from pipeline.service import Service
from topics.fields import Limits, Rejected, encode
from topics.internal import dead_letter_value
from topics.labels import (
    ANY_SLOT,
    ActiveLearningSample,
    HumanLabel,
    decode_active_learning_sample,
    decode_human_label,
)

log = logging.getLogger(__name__)

LABELER_GROUP = "causalmem-labelers"


def labeler_group(conn: Connection) -> str:
    """The consumer group every labeler shares (under the deployment's topic prefix)."""
    return f"{conn.topics.prefix}{LABELER_GROUP}"


def principal(conn: Connection) -> str | None:
    """The authenticated SASL user of the connection, or None (PLAINTEXT, SSL: no name to take).

    >>> from pipeline.config import KafkaSecurity, Settings
    >>> sasl = KafkaSecurity("SASL_SSL", "SCRAM-SHA-512", "ann", "secret")
    >>> principal(Settings(security=sasl).connection()), principal(Settings().connection())
    ('ann', None)
    """
    sec = conn.security
    if sec.security_protocol.startswith("SASL") and sec.sasl_username:
        return sec.sasl_username
    return None


def labeler_identity(conn: Connection, asked: str | None) -> str:
    """The identity labels carry: the SASL principal where there is one, else ``asked``.

    Naming someone else while authenticated is refused (ValueError).

    >>> from pipeline.config import KafkaSecurity, Settings
    >>> c = Settings(security=KafkaSecurity("SASL_PLAINTEXT", "SCRAM-SHA-512", "ann", "pw")).connection()
    >>> labeler_identity(c, None), labeler_identity(c, "ann"), labeler_identity(Settings().connection(), "bob")
    ('ann', 'ann', 'bob')
    >>> labeler_identity(c, "bob")
    Traceback (most recent call last):
    ...
    ValueError: labeler 'bob' is not the authenticated principal 'ann'
    """
    who = principal(conn)
    asked = (asked or "").strip() or None
    if who is not None and asked is not None and asked != who:
        raise ValueError(f"labeler {asked!r} is not the authenticated principal {who!r}")
    return who or asked or ""


def label_event_id(sample_id: str, labeler: str) -> str:
    """One id per (sample, labeler): a re-answer after a crash is the same label, applied once.

    Answers from different labelers keep different ids (both count, and agreement can be
    measured).
    """
    return hashlib.sha256(f"{sample_id}\x00{labeler}".encode()).hexdigest()[:32]


def labeler_limits(limits: Limits) -> Limits:
    """The limits a labeler reads with: the deployment's, but any slot number (no model sizes).

    >>> labeler_limits(Limits(slots=32)).slots == ANY_SLOT, labeler_limits(Limits()).max_bytes
    (True, 262144)
    """
    return replace(limits, slots=ANY_SLOT)


def read_sample(raw: bytes, limits: Any, key: Any) -> ActiveLearningSample:
    """A queued sample as a labeler reads it: validated, but with no model sizes checked.

    Raises :class:`~topics.fields.Rejected` for a sample nobody could read, whatever the
    decoder raised: a sample is dead-lettered, never a reason for a labeler to stop.
    """
    try:
        return decode_active_learning_sample(raw, limits, key, any_shape=True)
    except Rejected:
        raise
    except Exception as exc:  # a decoder bug must not crash the queue nor skip the rest of a batch
        raise Rejected("inconsistent", f"unreadable sample ({type(exc).__name__}: {str(exc)[:120]})") from exc


async def dead_letter_sample(producer: Any, topic: str, tp: TopicPartition, msg: Any, rej: Rejected) -> None:
    """Send an unreadable sample to ``dead-letter`` with its reason and wait for the broker's ack.

    Callers commit the sample's offset only after this returns: the record is safe first.
    """
    log.warning("label queue: unreadable sample at %s:%d (%s); sent to dead-letter", tp, msg.offset, rej)
    value = dead_letter_value(msg.value, rej.reason, rej.detail, tp.topic, tp.partition, msg.offset, time.time())
    fut = await producer.send(topic, encode(value), key=msg.key, partition=0)
    await fut


def memory_choice_label(
    sample: ActiveLearningSample,
    labeler: str,
    correct_memories: list[int],
    rating: int | None = None,
    skip_reason: str | None = None,
    ts: float | None = None,
    harmful_memories: list[int] | None = None,
) -> HumanLabel:
    """The ``memory_choice`` label a labeler sends for a sample (every labeling tool sends this one).

    >>> from topics.events import Features
    >>> import numpy as np
    >>> s = ActiveLearningSample("s1", "q1", 2, 5.0, "error", -0.5, 1, Features(np.zeros(2), 0, 0), [3, 4], [3], [])
    >>> lab = memory_choice_label(s, "ann", [4], rating=2)
    >>> (lab.event_id == label_event_id("s1", "ann"), lab.query_id, lab.step, lab.ts, lab.correct_memories)
    (True, 'q1', 2, 5.0, [4])
    """
    return HumanLabel(
        event_id=label_event_id(sample.sample_id, labeler),
        query_id=sample.query_id,
        ts=sample.ts if ts is None else ts,
        labeler=labeler,
        kind="memory_choice",
        sample_id=sample.sample_id,
        correct_memories=list(correct_memories),
        rating=rating,
        step=sample.step,
        skip_reason=skip_reason,
        harmful_memories=list(harmful_memories) if harmful_memories else None,
    )


# A person may look at one sample for a long time. aiokafka leaves the group when the
# consumer has not fetched for max_poll_interval (default 5 min), which would hand the
# sample being looked at to another labeler; heartbeats keep the membership alive meanwhile.
THINK_TIME_S = 3600.0


class SampleMoved(RuntimeError):
    """The sample's partition went to another labeler (a group rebalance) while it was shown.

    ``published`` tells whether this labeler's label reached the topic anyway (the move came
    between the broker's ack and the commit): then the sample is labelled twice.
    """

    def __init__(self, message: str, published: bool = False) -> None:
        super().__init__(message)
        self.published = published


@dataclass
class QueuedSample:
    sample: ActiveLearningSample
    tp: TopicPartition
    offset: int
    epoch: int = 0  # the queue's assignment epoch when the sample was received


class _Revocations(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no types
    def __init__(self, queue: LabelQueue) -> None:
        self.queue = queue

    async def on_partitions_revoked(self, revoked: Any) -> None:
        # Whatever was received before a revocation comes again from the committed offset,
        # to whichever labeler owns the partition next: it must not be answered here.
        self.queue._epoch += 1
        self.queue._buffer.clear()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        return None


class LabelQueue(Service):
    """One labeler's view of the shared queue (async; ``start``/``stop`` or ``async with``).

    ``conn``: the deployment's :class:`~pipeline.config.Connection` (a whole ``Settings``
    is accepted too). ``labeler``: the identity labels carry; on a SASL connection it is the
    principal (empty: take it; another name: ValueError). ``group`` defaults to the shared
    labelers' group, under the topic prefix.
    """

    def __init__(self, bootstrap: str, conn: Connection | Settings, labeler: str, group: str | None = None) -> None:
        conn = Connection.of(conn)
        labeler = labeler_identity(conn, labeler)
        if not labeler:
            raise ValueError("a labeler identity is required (it is carried on every label)")
        super().__init__()
        self.conn = conn
        self.bootstrap = bootstrap
        self.labeler = labeler
        self.topics = self.conn.topics
        self.limits = labeler_limits(self.conn.limits)
        self.group = group or labeler_group(self.conn)
        self.done = 0
        self.skipped = 0
        self.left = 0
        self.bad = 0
        self.repeats = 0  # samples passed over: this labeler had answered them already
        self.answered: set[str] = set()  # sample ids this labeler answered or skipped
        self._epoch = 0
        self._consumer: Any = None
        self._producer: Any = None
        self._buffer: list[QueuedSample] = []

    async def _start(self) -> None:
        self.answered |= await self._own_answers()
        self._producer = await kafka.start_producer(self.bootstrap, self.conn)
        # One sample at a time: a labeler holds only what it shows.
        self._consumer = kafka.consumer(
            self.bootstrap,
            self.conn,
            group_id=self.group,
            max_poll_records=1,
            max_poll_interval_ms=int(THINK_TIME_S * 1000),
        )
        self._consumer.subscribe([self.topics.active_learning.name], listener=_Revocations(self))
        await self._consumer.start()  # returns once the group has assigned partitions

    async def _stop(self) -> None:
        for client in (self._consumer, self._producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
        self._consumer = self._producer = None

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
                        sample = read_sample(msg.value, self.limits, msg.key)
                    except Rejected as rej:
                        await self._dead_letter(tp, msg, rej)
                        continue
                    if sample.sample_id in self.answered:
                        self.repeats += 1  # answered by this labeler already: never twice
                        await self._commit(tp, msg.offset)
                        continue
                    self._buffer.append(QueuedSample(sample, tp, msg.offset, self._epoch))
        return self._buffer.pop(0)

    async def _own_answers(self) -> set[str]:
        """The sample ids this labeler's labels on ``human-labels`` answer (or skip)."""
        out: set[str] = set()
        for msg in await kafka.read_all(self.bootstrap, self.conn, self.topics.human_labels.name):
            try:
                label = decode_human_label(msg.value, self.limits, msg.key)
            except Rejected:
                continue
            if label.labeler == self.labeler and label.sample_id:
                out.add(label.sample_id)
        return out

    async def answer(
        self, item: QueuedSample, correct_memories: list[int], rating: int | None = None, ts: float | None = None
    ) -> HumanLabel:
        """Publish the answer, wait for the broker's acknowledgement, then commit the sample."""
        label = self._label(item, ts, correct_memories=list(correct_memories), rating=rating)
        await self._deliver(item, label)
        self.done += 1
        return label

    async def skip(self, item: QueuedSample, reason: str = "", ts: float | None = None) -> HumanLabel:
        """Skip a sample (recorded as an answer without memories, with the reason)."""
        label = self._label(item, ts, correct_memories=[], skip_reason=reason or "skipped")
        await self._deliver(item, label)
        self.skipped += 1
        return label

    def _label(
        self,
        item: QueuedSample,
        ts: float | None,
        correct_memories: list[int],
        rating: int | None = None,
        skip_reason: str | None = None,
    ) -> HumanLabel:
        """This labeler's ``memory_choice`` label of a sample: an answer, or a skip with its reason."""
        return memory_choice_label(item.sample, self.labeler, correct_memories, rating, skip_reason, ts)

    async def _dead_letter(self, tp: TopicPartition, msg: Any, rej: Rejected) -> None:
        """Send an unreadable sample to ``dead-letter`` (acknowledged), then commit past it."""
        await dead_letter_sample(self._producer, self.topics.dead_letter.name, tp, msg, rej)
        self.bad += 1
        await self._commit(tp, msg.offset)

    async def _deliver(self, item: QueuedSample, label: HumanLabel) -> None:
        self._check_held(item)
        await self._publish(label)
        self.answered.add(item.sample.sample_id)
        await self._commit_answered(item)

    def leave(self, item: QueuedSample) -> None:
        """Leave a sample unanswered and uncommitted, for another labeler or a later run.

        Its partition is paused: committing a later offset there would commit this sample
        too (offsets are per partition), so nothing behind it is taken by this labeler. The
        group gets it again once this labeler stops (or the partition moves).
        """
        self._consumer.pause(item.tp)
        self.left += 1

    def _check_held(self, item: QueuedSample) -> None:
        if item.epoch != self._epoch or item.tp not in self._consumer.assignment():
            raise SampleMoved(f"sample {item.sample.sample_id} moved to another labeler (group rebalance)")

    async def _commit_answered(self, item: QueuedSample) -> None:
        try:
            await self._commit(item.tp, item.offset)
        except (CommitFailedError, IllegalStateError) as exc:
            raise SampleMoved(
                f"sample {item.sample.sample_id}: label published but not committed ({type(exc).__name__}); "
                "the sample moved to another labeler and may be labelled twice",
                published=True,
            ) from exc

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
        try:
            if correct is None:
                await queue.skip(item, "no helpful memory among the candidates")
            else:
                await queue.answer(item, correct, rating)
        except SampleMoved as exc:  # a rebalance: the partition's new owner answers it
            log.info("label queue: %s", exc)
