"""Fencing: a learner publishes only while it owns the policy (docs/architecture.md, "Failure model").

The consumer-group election decides who *should* train, but a member learns that it lost
only when it next talks to the group: a learner paused (SIGSTOP, a long GC, a blocked event
loop) past the session timeout resumes believing it is elected, and used to publish a
version the new owner had already published. So ownership is also written down where
it matters, on the model topic:

- on taking over, the learner claims an epoch, one above every epoch on the topic
  (``"{policy}/epoch"``, :class:`topics.manifest.EpochClaim`), and every manifest it
  writes carries that epoch and its writer id;
- immediately before each publish (the chunks, the manifest, a promotion) :meth:`Fence.check`
  asks the election whether the partition is still assigned and reads the model topic's
  tail: a newer claim, or a manifest of a newer epoch or of another writer of the same
  epoch, means another learner owns the policy, and :class:`Fenced` is raised;
- readers (``ModelTopicIndex``: clients, restores) ignore manifests of an older epoch than
  the newest claim, so what a fenced writer still sends in the instant between its check
  and its send is never served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.config import Connection
from pipeline.learner.election import Election
from topics.fields import Rejected
from topics.manifest import decode_epoch_claim, decode_manifest, parse_key
from topics.signing import Key

log = logging.getLogger(__name__)


class Fenced(RuntimeError):
    """This learner no longer owns the policy: it must not publish."""


class Fence:
    """Follows the model topic's tail to tell whether this learner still owns its policy's epoch."""

    def __init__(self, bootstrap: str, conn: Connection, election: Election | None, signing_key: Key | None) -> None:
        self.bootstrap = bootstrap
        self.conn = conn
        self.election = election
        self.signing_key = signing_key
        self.tp = TopicPartition(conn.topics.policy_checkpoints.name, 0)
        self.writer = uuid.uuid4().hex[:16]  # this process's id as a writer
        self.epoch = 0
        self.lost: str = ""  # why this learner was fenced off ("" while it owns the policy)
        self._consumer: Any = None

    async def follow(self, epoch: int, from_offset: int) -> None:
        """Own ``epoch`` from now on; read the tail from ``from_offset`` (the end of the last scan)."""
        await self.close()
        self.epoch, self.lost = epoch, ""
        # A short fetch wait: an empty fetch is what proves the tail was read (see check()).
        self._consumer = kafka.consumer(self.bootstrap, self.conn, group_id=None, fetch_max_wait_ms=50)
        await self._consumer.start()
        self._consumer.assign([self.tp])
        self._consumer.seek(self.tp, from_offset)

    async def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await consumer.stop()

    async def check(self) -> None:
        """Raise :class:`Fenced` unless this learner still owns the policy (called before every publish)."""
        if self.lost:
            raise Fenced(self.lost)
        if self.election is not None:
            await self.election.poll()
            if not self.election.elected:
                self.lost = "the election's partition was revoked"
                raise Fenced(self.lost)
        if self._consumer is None:
            return
        # Read until a fetch comes back empty at the high watermark: records buffered before
        # a pause carry a stale watermark, an empty fetch made now carries the current one.
        for _ in range(200):
            batch = await self._consumer.getmany(self.tp, timeout_ms=60)
            for msg in batch.get(self.tp, []):
                self.observe(msg.key, msg.value)
            if self.lost:
                raise Fenced(self.lost)
            hw = self._consumer.highwater(self.tp)
            if not batch and hw is not None and await self._consumer.position(self.tp) >= hw:
                return
        log.warning("fence: could not reach the model topic's end; assuming ownership unchanged")

    def observe(self, key: bytes | None, value: bytes | None) -> None:
        """Note another writer's claim or manifest (sets :attr:`lost`)."""
        if key is None or value is None:
            return
        try:
            kind, policy, _, _ = parse_key(key.decode("utf-8", "replace"))
            if policy != self.conn.policy:
                return
            writer: str | None
            if kind == "epoch":
                claim = decode_epoch_claim(value, self.signing_key)
                epoch, writer = claim.epoch, claim.writer
            elif kind in ("serving", "candidate"):
                manifest = decode_manifest(value, signing_key=self.signing_key)
                epoch, writer = manifest.epoch or 0, manifest.metrics.get("writer")
            else:
                return
        except Rejected:
            return  # not a valid claim or manifest: readers ignore it, so does the fence
        except Exception as exc:  # whatever else a hostile message makes the parse raise: ignored the same way
            log.warning("fence: ignoring an unparseable model-topic message %r: %r", key[:200], exc)
            return
        if epoch > self.epoch or (epoch == self.epoch and writer is not None and writer != self.writer):
            self.lost = f"epoch {epoch} of writer {writer} on the model topic (ours: {self.epoch})"
