"""The learner's memories: the ``memory-lifecycle`` topic, slots, and the id → slot map it publishes.

:class:`MemoryBank` applies lifecycle records in the topic's order (one partition): an
``add`` gets a slot from :class:`models.memory.slots.SlotAllocator` and a freshly initialised
output row; an ``update`` of a live memory changes nothing the policy sees; a ``remove``
tombstones the slot, reused only after the grace period. Every change waits in
:attr:`MemoryBank.pending` until the next checkpoint, whose version it then names: its
records (``"{policy}/slot/{slot}"``, :mod:`topics.slotmap`) go out just before that
checkpoint's manifest (docs/contract.md §9.1).

*Restart.* The published map *is* the saved state: a restore reads the newest record of
each slot from the model topic, then re-reads the lifecycle topic from the offset the
restored manifest recorded (``input_offsets["memory-lifecycle:0"]``). Records of a version
above the restored one (published, then the learner died before the manifest) are kept,
and their rows re-initialised, so a slot never carries a removed memory's learned row.

Events that name candidates by memory id (contract 1.3, ``candidate_ids``) are translated
to the learner's slots by :meth:`MemoryBank.translate`; an id that is not live dead-letters
the experience (``unknown_memory``) and never reaches the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from aiokafka import TopicPartition

from models.memory.slots import SlotAllocator, SlotChange, SlotsFull, UnknownMemory
from models.policy.cold_start import SlotEmbeddings, knn_rows
from models.policy.trainer import PolicyTrainer
from pipeline import kafka
from pipeline.config import Connection, LearnerConfig
from pipeline.learner.restore import Restored
from pipeline.modeltopic import CheckpointPublisher
from topics.fields import Limits, Rejected
from topics.internal import Experience
from topics.lifecycle import MemoryRecord, decode_memory_record
from topics.signing import Key
from topics.slotmap import SlotRecord, decode_slot_record, parse_slot_key

log = logging.getLogger(__name__)

HOLD_UNKNOWN_S = 5.0  # experiences wait at most this long for the lifecycle's first high watermark
K_NEAREST = 5  # neighbours a new memory's row is made from (models.policy.cold_start.knn_rows)


class MemoryBank:
    """Slots for memory ids, fed by the lifecycle topic; the learner's single source of the map.

    Parameters
    ----------
    conn
        The learner's connection (topic names, limits, policy).
    slots
        S, the policy's number of slots.
    grace_s
        Event time a removed memory's slot stays tombstoned before reuse.
    """

    @classmethod
    def of(cls, config: LearnerConfig) -> MemoryBank:
        """The learner's bank: its connection, slot count, grace period and signing key (the map it
        publishes is signed, and a restore ignores records not signed with the key)."""
        return cls(config.connection, config.trainer.slots, config.lifecycle_grace_s, config.signing_key)

    def __init__(self, conn: Connection, slots: int, grace_s: float = 3600.0, signing_key: Key | None = None) -> None:
        self.conn = conn
        self.signing_key = signing_key  # contract 1.7: the map's records are signed and verified with it
        self.policy = conn.policy
        self.topic = conn.topics.memory_lifecycle.name
        self.limits: Limits = conn.limits
        self.allocator = SlotAllocator(slots, grace_s)
        self.position = 0  # the next lifecycle offset to read
        self.pending: dict[int, SlotChange] = {}  # slot -> newest change not yet published
        self.since: dict[int, int] = {}  # live slot -> the first version with its row
        self.embeddings = SlotEmbeddings(slots)  # live slots' memory embeddings, when given
        self.version = 0  # the newest version whose map is published
        self.changes = 0  # slot changes applied (a checkpoint is due when it grows)
        self.removed: list[int] = []  # slots whose memory was removed, until the learner takes them
        self.tp = TopicPartition(self.topic, 0)
        self._unknown_since: float | None = None

    @property
    def offset_key(self) -> str:
        return f"{self.topic}:0"

    def offsets(self) -> dict[str, int]:
        """What a checkpoint records to resume the lifecycle from."""
        return {self.offset_key: self.position}

    # ------------------------------------------------------------------ lifecycle records
    def on_message(self, msg: Any, trainer: PolicyTrainer, dead: Any) -> bool:
        """Apply one consumer record; a rejected one goes to ``dead`` (a DeadLetterWriter).

        Returns whether the map changed (a checkpoint is then due).
        """
        before = self.changes
        rej = self.handle(msg.offset, msg.key, msg.value, trainer)
        if rej is not None:
            dead.send(msg, rej.reason, rej.detail)
        return self.changes != before

    def handle(self, offset: int, key: bytes | None, value: bytes | None, trainer: PolicyTrainer) -> Rejected | None:
        """Apply one lifecycle message; returns why it is dead-lettered, or None.

        A rejected record changes nothing (no slot, no row).
        """
        self.position = offset + 1
        if value is None:  # a compaction tombstone of the topic itself: nothing to apply
            return None
        try:
            record = decode_memory_record(value, self.limits, key=key)
        except Rejected as rej:
            return rej
        return self.apply(record, trainer)

    def apply(self, record: MemoryRecord, trainer: PolicyTrainer) -> Rejected | None:
        """Apply one decoded record (see :meth:`handle`)."""
        a = self.allocator
        try:
            if record.op == "remove":
                change = a.remove(record.memory_id, record.ts)
                self.embeddings.drop(change.slot)
                self.removed.append(change.slot)
                self.pending[change.slot] = change
                self.changes += 1
                return None
            if record.op == "update":
                slot = a.check_live(record.memory_id)
                if record.embedding is not None:
                    self.embeddings.set(slot, record.embedding)
                return None
            added = a.add(record.memory_id, record.ts)
        except UnknownMemory as exc:
            return Rejected("unknown_memory", f"{record.op}: {exc}")
        except SlotsFull as exc:
            return Rejected("slots_full", str(exc))
        if added is None:  # an add of a live memory: a repeat, or an update by another name
            if record.embedding is not None:
                self.embeddings.set(a.live[record.memory_id], record.embedding)
            return None
        self._cold_start(trainer, added.slot, record.embedding)
        if record.embedding is not None:
            self.embeddings.set(added.slot, record.embedding)
        self.pending[added.slot] = added
        self.changes += 1
        return None

    def given_between(self, after: int, upto: int) -> list[int]:
        """The live slots whose memory has held them since a version in (``after``, ``upto``]: a
        network of version ``after`` holds an earlier owner's row there, one of ``upto`` the new one's."""
        return sorted(s for s, since in self.since.items() if after < since <= upto)

    def given_since(self, version: int) -> list[int]:
        """The live slots given to their memory after ``version``, published or not yet: a network
        of ``version`` holds an earlier owner's row there (or a neutral one)."""
        owner = self.allocator.owner
        later = {s for s, since in self.since.items() if since > version and s in owner}
        return sorted(later | {s for s, c in self.pending.items() if c.live})

    def take_removed(self) -> list[int]:
        """The slots whose memory was removed since the last call (the learner releases their
        "do not use": a slot given to another memory later is not that memory)."""
        removed, self.removed = self.removed, []
        return removed

    def hold_experiences(self, consumer: Any, experiences: TopicPartition) -> bool:
        """Pause ``experiences`` on ``consumer`` while the lifecycle is behind its high watermark.

        An experience may name a memory whose ``add`` is further down the lifecycle topic (a
        learner restoring with a lifecycle backlog, a fresh one reading it from the
        beginning): read first, the experience would be dead-lettered as ``unknown_memory``.
        Until the first fetch reports the lifecycle's high watermark, experiences wait at
        most ``HOLD_UNKNOWN_S``. Returns whether experiences are held.
        """
        hw = consumer.highwater(self.tp)
        now = time.monotonic()
        if hw is None:
            self._unknown_since = self._unknown_since or now
            behind = now - self._unknown_since < HOLD_UNKNOWN_S
        else:
            behind = self.position < hw
        paused = experiences in consumer.paused()
        if behind and not paused:
            consumer.pause(experiences)
        elif not behind and paused:
            consumer.resume(experiences)
        return behind

    # ------------------------------------------------------------------ events by id
    def translate(self, exp: Experience) -> Experience:
        """``exp`` with the event's slot labels replaced by the learner's slots (events with ``candidate_ids``).

        Raises :class:`Rejected` (``unknown_memory``) when an id is not live, or a slot of
        the experience names no candidate.
        """
        ev = exp.event
        if ev.candidate_ids is None:
            return exp
        live = self.allocator.live
        mapping: dict[int, int] = {}
        for label, memory_id in zip(ev.candidates, ev.candidate_ids, strict=True):
            slot = live.get(memory_id)
            if slot is None:
                raise Rejected("unknown_memory", f"candidate {memory_id!r} is not a live memory")
            mapping[label] = slot

        def to_slots(labels: list[int] | None, what: str) -> list[int] | None:
            if labels is None:
                return None
            missing = [s for s in labels if s not in mapping]
            if missing:
                raise Rejected("unknown_memory", f"{what} {missing[:3]} names no candidate")
            return [mapping[s] for s in labels]

        event = dataclasses.replace(
            ev,
            candidates=[mapping[s] for s in ev.candidates],
            selected=to_slots(ev.selected, "selected") or [],
            dropped=None,  # dropped memories carry no id; only their count was ever used
            memory_texts=None,
            candidate_ids=None,
        )
        effects = None
        if exp.slot_effects is not None:
            keys = to_slots(list(exp.slot_effects), "nll_without_slot") or []
            effects = dict(zip(keys, exp.slot_effects.values(), strict=True))
        return dataclasses.replace(
            exp,
            event=event,
            correct_memories=to_slots(exp.correct_memories, "correct_memories"),
            harmful_memories=to_slots(exp.harmful_memories, "harmful_memories"),
            slot_effects=effects,
        )

    def known(self, experiences: Sequence[Experience]) -> list[Experience]:
        """``experiences`` translated by :meth:`translate`, without those naming a memory not live
        (the warm-up material a restore re-reads: never trained on a slot's next owner)."""
        out = []
        for exp in experiences:
            try:
                out.append(self.translate(exp))
            except Rejected:
                continue
        return out

    # ------------------------------------------------------------------ the published map
    def records(self, version: int) -> list[SlotRecord]:
        """The pending changes as slot-map records of ``version`` (the checkpoint about to be published)."""
        out = []
        for slot, c in sorted(self.pending.items()):
            since = version if c.live else self.since.get(slot, version)
            out.append(SlotRecord(self.policy, slot, c.memory_id, c.live, version, since, c.ts))
        return out

    async def publish(self, publisher: CheckpointPublisher) -> int:
        """Send the pending changes as records of the publisher's next version; returns how many.

        Called just before that checkpoint is published (its manifest comes after), under
        the same fence as its chunks; waits until the broker acknowledged them.
        """
        version = publisher.next_version()
        records = self.records(version)
        if not records:
            return 0
        if publisher.before_send is not None:
            await publisher.before_send()
        producer, topic = publisher.producer, publisher.topic
        signing_key = publisher.signing_key
        futures = [
            await producer.send(topic, r.to_bytes(signing_key), key=r.key.encode(), partition=0) for r in records
        ]
        await asyncio.gather(*futures)
        for r in records:
            if r.live:
                self.since[r.slot] = r.version
            else:
                self.since.pop(r.slot, None)
        self.pending.clear()
        self.version = version
        log.info(
            "learner: published %d slot-map changes with v%d (%d live memories)",
            len(records),
            version,
            len(self.allocator.live),
        )
        return len(records)

    def _cold_start(self, trainer: PolicyTrainer, slot: int, embedding: np.ndarray | None) -> None:
        """The new memory's row: from its nearest live memories' rows when its embedding is
        known (``models.policy.cold_start.knn_rows``), else a neutral row; its Adam moments cleared."""
        if embedding is None:
            trainer.init_rows([slot])
            return
        slots, embs = self.embeddings.nearest(embedding, K_NEAREST, exclude=slot)
        if slots.size == 0:
            trainer.init_rows([slot])
            return
        out = trainer.net.out
        w, b = knn_rows(
            out.weight.detach(), out.bias.detach(), embs, slots, embedding[None].astype(np.float32), k=K_NEAREST
        )
        trainer.init_rows([slot], w, b)

    def rows_from(self, version: int, trainer: PolicyTrainer) -> list[int]:
        """The trainer now holds the weights of ``version`` (a rollback, a cut-over to a judged version).

        Memories whose slot was given after ``version`` (published or not) would serve the
        rows of the slot's earlier owner: they get fresh rows, and their records go out
        again with the next checkpoint (whose version is then the first to hold the row).
        Returns those slots.
        """
        slots = self.given_since(version)
        if not slots:
            return []
        trainer.init_rows(sorted(set(slots)))
        clock = self.allocator.clock
        for slot in slots:
            self.pending[slot] = SlotChange(self.allocator.owner[slot], slot, True, clock)
            self.since.pop(slot, None)
        self.changes += 1
        return slots

    # ------------------------------------------------------------------ restore
    async def restore(self, bootstrap: str, restored: Restored | None, trainer: PolicyTrainer) -> bool:
        """Rebuild the map from the model topic and resume after the restored checkpoint's lifecycle offset.

        ``restored``: the checkpoint the trainer now holds (None: none, start from the
        topic's beginning). Rows of records above its version are re-initialised and those
        records published again with the next checkpoint. Returns whether rows changed.
        """
        version = restored.version if restored is not None else 0
        offsets = restored.offsets if restored is not None else {}
        model_topic = self.conn.topics.policy_checkpoints.name
        newest: dict[int, SlotRecord] = {}
        for msg in await kafka.read_all(bootstrap, self.conn, model_topic, partitions=[0]):
            if msg.key is None:
                continue
            parsed = parse_slot_key(msg.key.decode("utf-8", "replace"))
            if parsed is None or parsed[0] != self.policy:
                continue
            if msg.value is None:
                newest.pop(parsed[1], None)
                continue
            try:
                newest[parsed[1]] = decode_slot_record(msg.value, key=msg.key, signing_key=self.signing_key)
            except Exception as exc:  # Rejected, or whatever else a hostile record makes the parse raise
                log.warning("learner: ignoring slot-map record %s: %r", msg.key, exc)
        self.load(list(newest.values()), version, trainer)
        self.position = offsets.get(self.offset_key, 0)
        return bool(self.pending)

    def load(self, records: Sequence[SlotRecord], version: int, trainer: PolicyTrainer) -> None:
        """The state the newest record of each slot gives (see :meth:`restore`)."""
        self.allocator = SlotAllocator(self.allocator.slots, self.allocator.grace_s)
        self.allocator.restore(SlotChange(r.memory_id, r.slot, r.live, r.ts) for r in records)
        self.pending.clear()
        self.since = {r.slot: r.since for r in records if r.live}
        self.embeddings.clear()
        ahead = [r for r in records if r.version > version]
        if ahead:
            # Published, but the checkpoint holding their rows never was: the restored rows
            # may be a previous owner's. Fresh rows, and the records go out again.
            trainer.init_rows(sorted({r.slot for r in ahead}))
            for r in ahead:
                self.pending[r.slot] = SlotChange(r.memory_id, r.slot, r.live, r.ts)
                if r.live:
                    self.since.pop(r.slot, None)
                else:
                    self.since[r.slot] = r.since
        self.version = version
        log.info(
            "learner: memory map restored: %d live, %d tombstoned, %d to republish",
            len(self.allocator.live),
            len(self.allocator.tombstones),
            len(ahead),
        )
