"""The browser's share of the labeling queue: samples held for labelers, leases, overlap.

The web app is one member of the labelers' consumer group (``{prefix}causalmem-labelers``,
shared with ``causalmem label``): it fetches a few samples at a time and hands each to
labelers through *leases*. A lease is one labeler's claim on one sample: it ends when the
labeler answers or skips, leaves the sample (the page's "leave" action, logging out, or
closing the tab), or after ``lease_s`` without an answer. With ``overlap`` N a sample is
leased to N different labelers; its offset is committed only once N answers (skips
count) have been acknowledged by the broker, and only in offset order per partition, so
a sample held here comes back to the group if the app stops first.

Labels are exactly what ``causalmem label`` sends
(:func:`~pipeline.labeling.queue.memory_choice_label`). With ``undo_s`` > 0 an answer is
held that long before it is published, and the labeler may take it back (:meth:`SamplePool.undo`):
the sample returns to them, nothing was sent. A held answer is published when its time
is up, when the same labeler sends the next one, or when the app stops. A labeler answers a sample once:
their earlier answers are read from ``human-labels`` at start. Submitting for a sample the
pool does not hold, with a lease that expired or moved (a group rebalance), or a second
time, raises :class:`LabelError` and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from pipeline import kafka
from pipeline.config import Connection
from pipeline.labeling.answers import RATING_MAX, offered_slots
from pipeline.labeling.queue import (
    THINK_TIME_S,
    dead_letter_sample,
    labeler_group,
    labeler_limits,
    memory_choice_label,
    read_sample,
)
from pipeline.service import Service
from topics.fields import Rejected, encode
from topics.labels import ActiveLearningSample, HumanLabel, decode_human_label

log = logging.getLogger(__name__)


FETCH_ROUNDS = 4  # batches one page view reads at most while every sample it got was passed over


class LabelError(ValueError):
    """A submission that writes nothing, with the message the page shows."""


@dataclass
class Lease:
    labeler: str
    token: str
    expires: float


@dataclass
class Entry:
    sample: ActiveLearningSample
    tp: TopicPartition
    offset: int
    epoch: int
    answers: dict[str, HumanLabel] = field(default_factory=dict)  # given (held for undo, or sent)
    sent: set[str] = field(default_factory=set)  # labelers whose answer the broker acknowledged
    leases: dict[str, Lease] = field(default_factory=dict)
    # Labelers whose answer was on human-labels before this delivery (a redelivery after a
    # restart or a rebalance): their answers count towards the overlap, as sent ones.
    prior: frozenset[str] = frozenset()

    def open_slots(self, overlap: int) -> int:
        return overlap - len(self.answers) - len(self.leases) - len(self.prior)

    def complete(self, overlap: int) -> bool:
        """The sample has its ``overlap`` acknowledged answers (before this delivery or here)."""
        return len(self.sent | self.prior) >= overlap


@dataclass
class Held:
    """An answer waiting ``undo_s`` before it is published."""

    label: HumanLabel
    entry: Entry
    due: float


class _Revoked(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no types
    def __init__(self, pool: SamplePool) -> None:
        self.pool = pool

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self.pool.drop_partitions(set(revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        return None


class SamplePool(Service):
    """Samples held for the browser's labelers (async; ``start``/``stop``)."""

    def __init__(
        self,
        bootstrap: str,
        conn: Connection,
        overlap: int = 1,
        lease_s: float = 900.0,
        prefetch: int = 16,
        undo_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.bootstrap = bootstrap
        self.conn = conn
        self.topics = conn.topics
        self.limits = labeler_limits(conn.limits)
        self.overlap = overlap
        self.lease_s = lease_s
        self.prefetch = prefetch
        self.undo_s = undo_s
        self.clock = clock
        self.held: dict[str, Held] = {}  # labeler → their answer that may still be undone
        self.producers: dict[str, Any] = {}  # labeler → their own producer (SASL logins)
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.answered: dict[str, set[str]] = {}  # labeler → sample ids answered (here or before)
        self.done: dict[str, int] = {}  # labeler → answers sent from this app
        self.unreadable = 0
        self.repeats = 0  # samples delivered again with all their answers given already: committed, not held
        self._epoch = 0
        self._next: dict[TopicPartition, int] = {}  # per partition: the offset after the last fetched
        self._consumer: Any = None
        self._producer: Any = None
        self._flusher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def _start(self) -> None:
        await self._read_own_answers()
        await self._open_clients()
        if self.undo_s > 0:
            self._flusher = asyncio.create_task(self._flush_loop())

    async def _open_clients(self) -> None:
        self._producer = await kafka.start_producer(self.bootstrap, self.conn)
        self._consumer = kafka.consumer(
            self.bootstrap,
            self.conn,
            group_id=labeler_group(self.conn),
            max_poll_interval_ms=int(THINK_TIME_S * 1000),
        )
        self._consumer.subscribe([self.topics.active_learning.name], listener=_Revoked(self))
        await self._consumer.start()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.undo_s))
            try:
                await self.flush()
            except Exception as exc:  # the broker is away: the answers stay held and go next time
                log.warning("ui: held answers not sent yet: %r", exc)

    async def _stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self.flush(force=True)  # what a labeler sent is not lost when the app stops
        for who in list(self.producers):
            await self.set_producer(who, None)
        for client in (self._consumer, self._producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
        self._consumer = self._producer = None

    async def _read_own_answers(self) -> None:
        for msg in await kafka.read_all(self.bootstrap, self.conn, self.topics.human_labels.name):
            try:
                label = decode_human_label(msg.value, self.limits, msg.key)
            except Rejected:
                continue
            if label.kind == "memory_choice" and label.sample_id:
                self.answered.setdefault(label.labeler, set()).add(label.sample_id)

    def drop_partitions(self, revoked: set[TopicPartition]) -> None:
        """A rebalance took these partitions: their samples go to their new owner, leases end."""
        self._epoch += 1
        for sid in [sid for sid, e in self.entries.items() if e.tp in revoked]:
            del self.entries[sid]
        for tp in revoked:
            self._next.pop(tp, None)

    # ------------------------------------------------------------------ leases
    def _expire(self) -> None:
        now = self.clock()
        for e in self.entries.values():
            for who in [w for w, lease in e.leases.items() if lease.expires <= now]:
                del e.leases[who]

    def held_by(self, labeler: str) -> Entry | None:
        self._expire()
        return next((e for e in self.entries.values() if labeler in e.leases), None)

    def _free_for(self, labeler: str) -> Entry | None:
        mine = self.answered.get(labeler, set())
        for e in self.entries.values():
            if e.sample.sample_id not in mine and labeler not in e.answers and e.open_slots(self.overlap) > 0:
                return e
        return None

    async def lease(self, labeler: str, wait_s: float = 1.0) -> tuple[Entry, Lease] | None:
        """The sample this labeler holds, else a new lease on the next one for them (None: nothing now)."""
        held = self.held_by(labeler)
        if held is not None:
            lease = held.leases[labeler]
            lease.expires = self.clock() + self.lease_s
            return held, lease
        entry = self._free_for(labeler)
        # A batch may be all passed over (answered already) or dead-lettered: read on, a few batches at most.
        for attempt in range(FETCH_ROUNDS):
            if entry is not None or len(self.entries) >= self.prefetch:
                break
            if not await self._fetch(wait_s if attempt == 0 else 0.0):
                break
            entry = self._free_for(labeler)
        if entry is None:
            return None
        lease = Lease(labeler, secrets.token_urlsafe(12), self.clock() + self.lease_s)
        entry.leases[labeler] = lease
        return entry, lease

    def release(self, labeler: str, sample_id: str | None = None) -> bool:
        """End this labeler's lease (on ``sample_id``, or whichever they hold): the sample is free again."""
        for e in self.entries.values():
            if labeler in e.leases and (sample_id is None or e.sample.sample_id == sample_id):
                del e.leases[labeler]
                return True
        return False

    async def _fetch(self, wait_s: float) -> int:
        """Read a batch (waiting up to ``wait_s``); the number of records it had."""
        batch = await self._consumer.getmany(timeout_ms=int(wait_s * 1000), max_records=self.prefetch)
        for tp, msgs in batch.items():
            consumed = False
            for msg in msgs:
                try:
                    consumed |= await self._take(tp, msg)
                except Exception as exc:  # the dead-letter write failed: read this one again, commit nothing past it
                    log.warning("ui: sample at %s:%d not handled yet: %r", tp, msg.offset, exc)
                    self._consumer.seek(tp, msg.offset)
                    break
                self._next[tp] = msg.offset + 1  # handled: held, passed over or dead-lettered
            if consumed:
                await self._commit_done(tp)
        return sum(len(msgs) for msgs in batch.values())

    async def _take(self, tp: TopicPartition, msg: Any) -> bool:
        """Hold one fetched sample for the labelers; True when it was consumed without being held.

        A sample nobody can read goes to ``dead-letter`` (acknowledged) first. A sample
        delivered again (the app restarted, or the partition came back after a rebalance)
        whose answers were all given already is passed over; one answered by fewer than
        ``overlap`` labelers is held for the others, its earlier answers counted.
        """
        try:
            sample = read_sample(msg.value, self.limits, msg.key)
        except Rejected as rej:
            await dead_letter_sample(self._producer, self.topics.dead_letter.name, tp, msg, rej)
            self.unreadable += 1
            return True
        sid = sample.sample_id
        if sid in self.entries:
            return False  # delivered again while held here (a commit that did not happen): one entry
        prior = frozenset(who for who, ids in self.answered.items() if sid in ids)
        if len(prior) >= self.overlap:
            self.repeats += 1
            return True
        self.entries[sid] = Entry(sample, tp, msg.offset, self._epoch, prior=prior)
        return False

    # ------------------------------------------------------------------ answers
    async def submit(
        self,
        labeler: str,
        sample_id: str,
        token: str,
        correct: list[int],
        harmful: list[int] | None = None,
        rating: int | None = None,
        skip_reason: str | None = None,
    ) -> HumanLabel:
        """Publish this labeler's answer (or skip) to a leased sample; raises LabelError, writing nothing."""
        if sample_id in self.answered.get(labeler, set()):
            raise LabelError("You have already answered this sample (a second submit is ignored; nothing was sent).")
        entry = self.entries.get(sample_id)
        if entry is None:
            raise LabelError("Unknown sample: it is not in the queue here (answered by others, or moved).")
        self._expire()
        lease = entry.leases.get(labeler)
        # Bytes: compare_digest raises TypeError on non-ASCII str, and a form field may be anything.
        same = lease is not None and secrets.compare_digest(lease.token.encode(), token.encode("utf-8", "replace"))
        if lease is None or not same or entry.epoch != self._epoch:
            raise LabelError("Your lease on this sample has expired or moved to another labeler; nothing was sent.")
        offered = set(offered_slots(entry.sample))
        harmful = sorted(set(harmful or ()))
        bad = sorted((set(correct) | set(harmful)) - offered)
        if bad:
            raise LabelError(f"Slots {bad} are not among this sample's candidates; nothing was sent.")
        if set(correct) & set(harmful):
            raise LabelError("A memory cannot be both correct and harmful; nothing was sent.")
        if rating is not None and not 0 <= rating <= RATING_MAX:
            raise LabelError(f"A rating is 0–{RATING_MAX}; nothing was sent.")
        label = memory_choice_label(
            entry.sample, labeler, sorted(set(correct)), rating, skip_reason, harmful_memories=harmful
        )
        if self.undo_s > 0:
            await self.flush(labeler, force=True)  # one held answer per labeler: the previous one goes now
            self._given(labeler, entry, label)
            self.held[labeler] = Held(label, entry, self.clock() + self.undo_s)
        else:
            await self.publish_label(label)  # acknowledged before the sample counts as answered
            self._given(labeler, entry, label)
            await self._sent(labeler, entry)
        return label

    def _given(self, labeler: str, entry: Entry, label: HumanLabel) -> None:
        entry.answers[labeler] = label
        entry.leases.pop(labeler, None)
        self.answered.setdefault(labeler, set()).add(entry.sample.sample_id)

    async def _sent(self, labeler: str, entry: Entry) -> None:
        entry.sent.add(labeler)
        self.done[labeler] = self.done.get(labeler, 0) + 1
        sid = entry.sample.sample_id
        if entry.complete(self.overlap) and self.entries.get(sid) is entry:
            del self.entries[sid]
            await self._commit_done(entry.tp)

    async def flush(self, labeler: str | None = None, force: bool = False) -> None:
        """Publish the held answers whose undo time is over (``force``: now), or only ``labeler``'s."""
        now = self.clock()
        for who in [w for w, h in self.held.items() if (labeler is None or w == labeler) and (force or h.due <= now)]:
            held = self.held.pop(who, None)  # taken first: a concurrent flush or undo finds it gone
            if held is None:
                continue
            try:
                await self.publish_label(held.label)
            except Exception:
                self.held.setdefault(who, held)  # not sent: held again, for the next flush
                raise
            await self._sent(who, held.entry)

    def undo(self, labeler: str) -> Entry | None:
        """Take back this labeler's held answer: nothing is sent, and the sample is theirs again.

        Returns the sample's entry (leased to them again), or None when the sample moved to
        another labeler meanwhile (a group rebalance). Raises LabelError when there is no
        held answer (it has been sent: a sent label is final).
        """
        held = self.held.pop(labeler, None)
        if held is None:
            raise LabelError("Nothing to undo: your last answer has been sent already (a sent label is final).")
        entry = held.entry
        entry.answers.pop(labeler, None)
        self.answered.get(labeler, set()).discard(entry.sample.sample_id)
        if self.entries.get(entry.sample.sample_id) is not entry or entry.epoch != self._epoch:
            return None
        entry.leases[labeler] = Lease(labeler, secrets.token_urlsafe(12), self.clock() + self.lease_s)
        return entry

    async def set_producer(self, labeler: str, producer: Any | None) -> None:
        """Write ``labeler``'s labels through ``producer`` (their own SASL login); None stops and drops it."""
        old = self.producers.pop(labeler, None)
        if old is not None and old is not producer:
            with contextlib.suppress(Exception):
                await old.stop()
        if producer is not None:
            self.producers[labeler] = producer

    async def publish_label(self, label: HumanLabel) -> None:
        """Publish a label and wait for the broker's acknowledgement (answers, settlements, "do not use").

        Through the labeler's own producer when they logged in with their SASL principal.
        """
        producer = self.producers.get(label.labeler, self._producer)
        fut = await producer.send(self.topics.human_labels.name, encode(label.to_dict()), key=label.query_id.encode())
        await fut
        if label.sample_id:
            self.answered.setdefault(label.labeler, set()).add(label.sample_id)

    async def _commit_done(self, tp: TopicPartition) -> None:
        """Commit the partition up to its oldest sample still held (or all it fetched)."""
        if tp not in self._next or tp not in self._consumer.assignment():
            return
        held = [e.offset for e in self.entries.values() if e.tp == tp]
        upto = min(held) if held else self._next[tp]
        await self._consumer.commit({tp: OffsetAndMetadata(upto, "")})

    def progress(self, labeler: str) -> dict[str, Any]:
        """What the queue page shows next to the sample."""
        mine = self.answered.get(labeler, set())
        return {
            "in_pool": len(self.entries),
            "for_you": sum(
                1 for e in self.entries.values() if e.sample.sample_id not in mine and labeler not in e.answers
            ),
            "done_here": self.done.get(labeler, 0),
            "answered_total": len(mine),
            "overlap": self.overlap,
            "unreadable": self.unreadable,
            "undo": self.held_view(labeler),
        }

    def held_view(self, labeler: str) -> dict[str, Any] | None:
        """This labeler's answer that can still be undone: its sample and the seconds left."""
        held = self.held.get(labeler)
        if held is None:
            return None
        return {"sample_id": held.label.sample_id, "seconds": max(0.0, held.due - self.clock())}
