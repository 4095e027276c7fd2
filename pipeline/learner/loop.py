"""The learner: the single writer of the policy (docs/architecture.md, docs/learning.md).

Reads joined experiences (and labelled samples) from the one-partition ``experiences``
topic in offset order, applies micro-batches with :class:`models.policy.trainer.PolicyTrainer`,
and publishes checkpoints on the model topic at most every ``checkpoint_interval_s`` and
only when the policy changed. Commands (drift reset, rollback, cut-over, "do not use")
arrive on ``control``; memory ids arrive on ``memory-lifecycle`` (contract 1.3).

:class:`Learner` composes the parts of this package:

- :mod:`~pipeline.learner.election`: only the elected learner of a policy trains; a
  standby takes over when the active one dies;
- :mod:`~pipeline.learner.fence`: the epoch it claims on taking over, checked before
  every publish, so a learner that lost the election without knowing publishes nothing;
- :mod:`~pipeline.learner.restore`: on election, the newest checkpoint and the offsets to
  resume from;
- :mod:`~pipeline.learner.inbox`: pending and held experiences, positions, reorder mode,
  dedupe, micro-batches;
- :mod:`~pipeline.learner.replay`: the kept experiences (drift warm-up);
- :mod:`~pipeline.learner.control`: the commands, carried out by a
  :class:`~pipeline.learner.control.ControlHandler` this loop builds and hands what they change;
- :mod:`~pipeline.learner.memories`: the memory-lifecycle topic, slots for memory ids, the
  id → slot map published with the checkpoints;
- :mod:`~pipeline.learner.publishing` and :mod:`~pipeline.learner.gate`: checkpoints, candidates
  and promotion (the rule: :mod:`~pipeline.learner.promotion`);
- :mod:`~pipeline.learner.store`: the local copy of its checkpoints.

Long work (a drift reset's warm-up, decoding the history, loading a checkpoint) runs in
a worker thread, so the event loop keeps the group membership alive meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import torch
from aiokafka import TopicPartition

from models.policy.network import Arch
from models.policy.trainer import PolicyTrainer
from pipeline import kafka
from pipeline.config import LearnerConfig
from pipeline.deadletter import DeadLetterWriter
from pipeline.learner.control import ControlHandler
from pipeline.learner.election import Election
from pipeline.learner.fence import Fence, Fenced
from pipeline.learner.gate import RuleGate
from pipeline.learner.inbox import Inbox
from pipeline.learner.memories import MemoryBank
from pipeline.learner.principals import PrincipalBook
from pipeline.learner.publishing import Progress, Publishing, manifest_metrics
from pipeline.learner.replay import Replay
from pipeline.learner.restore import (
    Restored,
    RestoreError,
    find_version,
    from_local,
    from_topic,
    newest_local,
    policy_versions,
    read_history,
    serving_checkpoints,
)
from pipeline.learner.store import LocalStore, local_dir
from pipeline.metrics import Metrics
from pipeline.modeltopic import scan_model_topic
from pipeline.service import Service
from topics.fields import Rejected
from topics.internal import Experience, decode_experience, experience_bytes
from topics.manifest import Manifest

log = logging.getLogger(__name__)

LINGER_S = 0.5  # apply a partial micro-batch after this long without new input
FENCED_BACKOFF_S = 15.0  # after being fenced off, wait this long (> 2 session timeouts) before taking over again


class Learner(Service):
    """The learner process's core: ``start``, then ``run`` until ``stop``."""

    def __init__(self, config: LearnerConfig, bootstrap: str, metrics: Metrics | None = None) -> None:
        super().__init__()
        self.config = config
        self.bootstrap = bootstrap
        self.metrics = metrics or Metrics()
        conn = config.connection
        t = config.trainer
        self.arch = Arch(t.embedding_dim, t.slots, t.hidden)
        # Micro-batches are small: one intra-op thread is as fast, and spinning OpenMP
        # threads on cores shared with the worker and the broker slow everything ~30×.
        torch.set_num_threads(max(1, config.torch_threads))
        self.trainer = PolicyTrainer(t)
        self.exp_tp = TopicPartition(conn.topics.experiences.name, 0)
        self.ctl_tp = TopicPartition(conn.topics.control.name, 0)
        self.life_tp = TopicPartition(conn.topics.memory_lifecycle.name, 0)
        self.memories = MemoryBank.of(config)  # memory ids → slots (contract 1.3), the map signed (1.7)
        self.store = LocalStore(local_dir(config.state_dir, bootstrap, conn.topics.prefix, conn.policy))
        self.inbox = Inbox(
            self.exp_tp.topic,
            self.ctl_tp.topic,
            config.batch_size,
            config.reorder_s,
            policy=conn.policy,
            dedupe_horizon_s=config.dedupe_horizon_s,
            max_future_s=config.max_future_skew_s,
        )
        self.replay = Replay(config.replay_window_s, config.replay_max)
        # Contract 1.15: each principal's share, weight, disagreement (quarantine: progress.quarantined).
        self.principals = PrincipalBook(
            config.influence_cap, config.influence_window, config.disagreement_tolerance, config.disagreement_min_n
        )
        self.progress = Progress()
        self.version = 0
        self.dirty = False  # the policy changed since the last checkpoint
        self.last_publish = 0.0
        self.active = asyncio.Event()
        self.restored_from = "none"
        self.publishing: Publishing | None = None  # made in start() (needs the producer)
        self._producer: Any = None
        self._election: Election | None = None
        self._input: Any = None  # manually assigned consumer for experiences + control
        self._dead: DeadLetterWriter | None = None
        self._stopping = asyncio.Event()
        self._last_input = time.monotonic()
        self.fence: Fence | None = None
        self._fenced_at = -FENCED_BACKOFF_S
        self._publish_lock = asyncio.Lock()  # one publish at a time (periodic vs shutdown)
        self._run_done = asyncio.Event()  # set while run() is not executing
        self._run_done.set()
        self._final_published = False
        self.control = ControlHandler(
            config,
            trainer=self.trainer,
            memories=self.memories,
            replay=self.replay,
            progress=self.progress,
            inbox=self.inbox,
            metrics=self.metrics,
            apply_pending=lambda: self._apply_pending(force=True),
            find_version=self._find_version,
            local_dir=self.store.root,
            publish_change=self.publish_change,
            dead_letter=self._dead_letter,
            principals=self.principals,
        )

    @property
    def gate(self) -> RuleGate | None:
        return self.publishing.gate if self.publishing is not None else None

    @property
    def held(self) -> list[tuple[float, str, int, Experience]]:
        return self.inbox.held

    @property
    def elected(self) -> bool:
        return self._election is not None and self._election.elected

    # ------------------------------------------------------------------ lifecycle
    async def _start(self) -> None:
        conn = self.config.connection
        self._producer = await kafka.start_producer(self.bootstrap, conn)
        self._dead = DeadLetterWriter(self._producer, conn.topics.dead_letter.name, self.metrics)
        self.publishing = Publishing(self._producer, self.config, self.store, self.arch, self.metrics)
        gate = self.publishing.gate
        if gate is not None:
            gate.on_mismatch = self._dead_letter_copy
            gate.on_rollback = self._guardrail_rollback
            gate.on_republish = self._republish
        self._election = Election(self.bootstrap, conn, on_lost=self.become_standby)
        await self._election.start()
        self.fence = Fence(self.bootstrap, conn, self._election, self.config.signing_key)
        self.publishing.publisher.before_send = self.fence.check
        self._input = kafka.consumer(self.bootstrap, conn, group_id=None)
        await self._input.start()

    async def stop(self, publish: bool = True) -> None:
        """Stop; with ``publish``, first checkpoint what the active learner has not published."""
        if not self.running:
            return
        self._stopping.set()
        # The training loop finishes its step first: the final checkpoint is then the only
        # publish of that state (no periodic one racing it).
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._run_done.wait(), 30.0)
        if publish and not self._final_published and self.active.is_set():
            self._final_published = True
            with contextlib.suppress(Exception):
                await self._apply_pending(force=True)
                if self.dirty:
                    await self.publish("shutdown")
        await super().stop()

    async def _stop(self) -> None:
        self._stopping.set()
        if self._input is not None:
            # A consumer stopped while still starting raises CancelledError: stop anyway.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._input.stop()
        if self.fence is not None:
            await self.fence.close()
        if self._election is not None:
            await self._election.stop()
        if self._dead is not None:
            with contextlib.suppress(Exception):
                await self._dead.flush()
        if self._producer is not None:
            await self._producer.stop()
        self._input = self._producer = None

    async def run(self) -> None:
        """Wait to be elected, restore, then train until :meth:`stop`.

        Raises :class:`~pipeline.learner.restore.RestoreError` when no checkpoint verifies
        (the process must not start over); anything unexpected also propagates, for the
        supervisor to end the process.
        """
        self._run_done.clear()
        try:
            while not self._stopping.is_set():
                assert self._election is not None
                await self._election.poll()
                backoff = time.monotonic() - self._fenced_at < FENCED_BACKOFF_S
                if self._election.elected and not self.active.is_set() and not backoff:
                    try:
                        await self.become_active()
                    except Fenced as exc:
                        self.fenced(str(exc))
                if not self.active.is_set() or self._stopping.is_set():
                    await asyncio.sleep(0.1)
                    continue
                try:
                    await self.step()
                except Fenced as exc:
                    self.fenced(str(exc))
        finally:
            self._run_done.set()

    def fenced(self, why: str) -> None:
        """Another learner owns the policy: stop training, publish nothing, restore before training again."""
        log.error("learner: fenced off (%s); standing by", why)
        self.metrics.learner_skipped.labels(reason="fenced").inc()
        self._fenced_at = time.monotonic()
        self.active.clear()

    async def become_active(self) -> None:
        log.info("learner: elected for policy %r; restoring", self.config.policy)
        await self.restore()
        self.active.set()

    def become_standby(self) -> None:
        if self.active.is_set():
            log.warning("learner: lost the election for policy %r; standing by", self.config.policy)
        self.active.clear()

    # ------------------------------------------------------------------ restore
    async def restore(self) -> None:
        """Claim the policy, load the newest verified checkpoint (topic, else local), resume the inputs.

        A fresh policy is published only when neither the model topic nor the local
        directory has any checkpoint of the policy; when the topic has some and none
        verifies, :class:`RestoreError` is raised (docs/architecture.md, "Failure model").
        """
        assert self.publishing is not None and self.fence is not None
        conn = self.config.connection
        publisher = self.publishing.publisher
        index = await scan_model_topic(self.bootstrap, conn, signing_key=self.config.signing_key)
        publisher.adopt(index)
        # Control commands: the rollbacks, resets and cut-overs of the last hour that the checkpoints
        # carry count against control_checkpoints_per_hour, so a restart does not reset the limit.
        self.control.recall(m.metrics for m in index.links(conn.policy))
        # Own the policy before anything else: claim the next epoch, then make sure no
        # other learner claimed one meanwhile.
        epoch = index.epochs.get(conn.policy, 0) + 1
        await self.fence.follow(epoch, index.end_offset)
        await publisher.claim(epoch, self.fence.writer)
        await self.fence.check()
        restored = await from_topic(self.bootstrap, conn, index, self.trainer, self.store, self.arch)
        # The id → slot map, from the model topic (contract 1.3).
        self.dirty = await self.memories.restore(self.bootstrap, restored, self.trainer) or self.dirty
        offsets: dict[str, int] = {}
        if restored is not None:
            self._resume(restored)
            offsets = restored.offsets
        elif policy_versions(index, conn.policy):
            raise RestoreError(
                f"no checkpoint of policy {conn.policy!r} verifies (model topic versions "
                f"{policy_versions(index, conn.policy)[:5]}, local {self.store.versions()[-5:]} in {self.store.root}); "
                "refusing to start a fresh policy (docs/operations.md, 'Restore')"
            )
        elif (local := newest_local(self.store, self.arch)) is not None:
            # The model topic is empty: a new (or reset) cluster. Keep what was learnt.
            self._resume(await asyncio.to_thread(from_local, self.trainer, local))
            log.warning("learner: model topic is empty; republishing the local checkpoint %s", self.restored_from)
            # Clients may still run that version: continue above it, so they take the republished one.
            publisher.last_version = max(publisher.last_version, self.version)
            self.version = publisher.last_version
            await self.publish("init", extra={"restored_from": "local"})
        else:
            self.restored_from = "fresh"
            await self.publish("init")
        gate = self.gate
        if gate is not None and gate.serving_net is None:
            for manifest, tensors in await serving_checkpoints(self.bootstrap, conn, index):
                gate.set_serving(manifest, tensors)
        await self._seek(offsets)
        # What came before the resume point: ids for dedupe, experiences for warm-up.
        end = offsets.get(f"{self.exp_tp.topic}:0", 0)
        history = await read_history(self.bootstrap, conn, end, self.config.replay_max, self.config.dedupe_horizon_s)
        for ident, ts in history.ids:
            self.inbox.mark_seen(ident, ts)
        self.replay.extend(self.memories.known(history.experiences))
        log.info(
            "learner: active from %s at version %d (epoch %d), offsets %s",
            self.restored_from,
            self.version,
            epoch,
            {self.exp_tp.topic: self.inbox.position, self.ctl_tp.topic: self.inbox.control_position},
        )

    def _resume(self, restored: Restored) -> None:
        self.restored_from = restored.source
        self.version = restored.version
        self.progress.carry_over(restored.progress)
        self.inbox.resume_after(restored.applied)

    async def _seek(self, offsets: dict[str, int]) -> None:
        tps = [self.exp_tp, self.ctl_tp]
        self._input.assign([*tps, self.life_tp])
        self._input.seek(self.life_tp, self.memories.position)
        positions = []
        for tp in tps:
            off = offsets.get(f"{tp.topic}:{tp.partition}")
            if off is None:
                await self._input.seek_to_beginning(tp)
                off = 0
            else:
                self._input.seek(tp, off)
            positions.append(off)
        self.inbox.rewind(*positions)

    # ------------------------------------------------------------------ training loop
    async def step(self) -> None:
        """One poll of the inputs, then whatever updates and publishing are due."""
        # Events by id wait until the lifecycle is read (they may name memories it adds).
        self.memories.hold_experiences(self._input, self.exp_tp)
        try:
            batch = await self._input.getmany(timeout_ms=100, max_records=16 * self.config.batch_size)
        except Exception as exc:
            log.warning("learner: fetch failed: %r", exc)
            await asyncio.sleep(0.5)
            return
        if batch:
            self._last_input = time.monotonic()
        # Lifecycle records first: an event read with them may name the memories they add.
        for tp, msgs in sorted(batch.items(), key=lambda item: item[0] != self.life_tp):
            for msg in msgs:
                if tp == self.life_tp:
                    self.dirty = self.memories.on_message(msg, self.trainer, self._dead) or self.dirty
                    self.control.forget_removed()
                elif tp == self.ctl_tp:
                    # Commands apply between batches: everything read before comes first.
                    self.inbox.release(force=True)
                    await self._apply_pending(force=True)
                    await self.control.handle(msg)
                    self.inbox.control_position = msg.offset + 1
                else:
                    self._accept(msg)
        idle = time.monotonic() - self._last_input > LINGER_S
        self.inbox.release(force=idle)
        await self._apply_pending(force=idle)
        self._export_lag()
        await self.maybe_publish()

    def _accept(self, msg: Any) -> None:
        exp: Experience | None = None
        try:
            decoded = decode_experience(msg.value, self.config.connection.limits)
            # Events naming candidates by memory id (contract 1.3) are translated to the
            # learner's slots; an id that is not live rejects the experience.
            exp = self.memories.translate(decoded)
        except Rejected as rej:
            self._dead_letter(msg, rej.reason, rej.detail)
        skipped = self.inbox.accept(msg.offset, exp, now=time.time())
        if skipped is not None:
            self.metrics.learner_skipped.labels(reason=skipped).inc()
        if skipped == "ts_in_future":
            assert exp is not None
            self._dead_letter(msg, "ts_in_future", f"ts {exp.event.ts} > now + {self.config.max_future_skew_s} s")

    def _dead_letter(self, msg: Any, reason: str, detail: str) -> None:
        assert self._dead is not None  # made in start(), before any input is read
        self._dead.send(msg, reason, detail)

    def _dead_letter_copy(self, exp: Experience, detail: str) -> None:
        """A copy of an experience the gate left out (contract 1.8 ``logging_mismatch``): it still trains."""
        assert self._dead is not None
        raw = experience_bytes(exp.event, exp.utility, exp.slot_effects, feedback_principal=exp.feedback_principal)
        topic = self.config.connection.topics.experiences.name
        self._dead.send_copy(topic, exp.event.query_id.encode(), raw, "logging_mismatch", detail)

    async def _apply_pending(self, force: bool = False) -> None:
        for chunk in self.inbox.batches(force):
            self.apply(chunk)

    async def _guardrail_rollback(self, version: int, reason: str) -> bool:
        """The promotion rule's guardrail showed the served version below similarity-only: publish
        ``version``'s weights (the anchor's, or the first policy's) again, as a promotion's copy
        (:meth:`_republish`). The trainer goes on from where it is: the rollback is evidence against
        the version served, not against what was learnt since, whose candidates are tested before
        they are served (loading the rollback's weights into the trainer sent a T = 1 client's
        training back to the first policy at every probe's rollback: docs/promotion.md)."""
        return await self._republish(version, f"guardrail: {reason}")

    def _awaited(self, version: int) -> bool:
        """Whether the promotion rule still waits for ``version``'s weights to go out again."""
        gate = self.gate
        return gate is not None and gate.state is not None and gate.state.awaiting == version

    async def _republish(self, version: int, reason: str) -> bool:
        """The promotion rule asked for ``version``'s weights again under a new version, served at
        once (``Action.republish``: it promoted ``version`` after clients were told to serve a newer
        one, a probe; or its guardrail rolled back to it): a task of its own, whose checkpoint comes
        back to the gate. Only while the rule still waits for it (a drift reset or an operator's
        command served meanwhile ends the wait). The trainer goes on from where it is."""
        assert self.publishing is not None
        async with self._publish_lock:
            if not self._awaited(version):
                log.warning("learner: v%d's copy is no longer wanted (something else was served): none", version)
                return False
            # Memories given a slot after `version`, whose records the copy's version will follow.
            fresh = self.memories.given_between(version, self.publishing.publisher.last_version)
            published = await self.publishing.republish(
                version,
                reason=reason,
                metrics=self._manifest_metrics(),
                input_offsets=self.input_offsets(),
                fresh_rows=fresh,
                suppressed=self.progress.suppressed,
            )
            if published is None:
                log.warning("learner: the gate no longer holds v%d: its copy is not served", version)
                return False
            self.version = published.manifest.version
            await self.publishing.settle(published)
            return True

    def apply(self, chunk: list[Experience]) -> None:
        """Apply one micro-batch (feedback → REINFORCE, labels → last-layer fine-tune).

        With the gate on, the feedback is also the promotion rule's evidence
        (pipeline/learner/gate.py): the trials open now were published before it was applied, so
        none of them was trained on it.
        """
        t0 = time.perf_counter()
        m = self.metrics
        feedback = [e for e in chunk if e.kind == "feedback"]
        # Contract 1.15: no principal carries more than influence_cap of the recent window's weight,
        # and a quarantined or flagged one's experiences weigh 0: left out of the update, the gate
        # and the replay.
        weights = self.principals.weigh(feedback, self.progress.quarantined)
        # The step moves as far as the weight the micro-batch carries: a principal held at 0
        # (or down) must not make the others' steps more frequent by thinning their batches.
        carried = float(weights.sum()) / len(feedback) if feedback else 1.0
        if feedback and not weights.all():
            for e in (e for e, w in zip(feedback, weights, strict=True) if w == 0):
                if e.principal in self.progress.quarantined:
                    m.quarantined_experiences.labels(principal=e.principal).inc()
                else:
                    m.held_experiences.inc()
            out = {id(e) for e, w in zip(feedback, weights, strict=True) if w == 0}
            chunk = [e for e in chunk if id(e) not in out]
            feedback, weights = [e for e in feedback if id(e) not in out], weights[weights > 0]
        if feedback:
            m.export_principals(self.principals.view(self.progress.quarantined))
        if self.gate is not None:
            self.gate.observe(feedback, weights)  # the gate's evidence thinned to the same caps
        labels = [e for e in chunk if e.kind == "label"]
        if feedback:
            # All 1 (one principal, or none over the cap): the update is exactly the unweighted one.
            stats = self.trainer.update(feedback, None if (weights == 1.0).all() else weights, carried)
            m.batch_size.observe(len(feedback))
            if stats.skipped_non_finite:
                m.learner_skipped.labels(reason="non_finite").inc(len(feedback))
            else:
                m.updates.labels(kind="feedback").inc()
                m.experiences_applied.labels(kind="feedback").inc(stats.applied)
                m.loss.set(stats.loss)
                m.grad_norm.observe(stats.grad_norm)
                for w in stats.weights:
                    m.importance_weight.observe(w)
                for a in stats.advantages:
                    m.advantage.observe(a)
            m.baseline.set(self.trainer.baseline.get())
            m.export_memory_stats(self.trainer.memory_stats)
        if labels:
            stats = self.trainer.fine_tune(labels)
            if stats.applied:
                m.updates.labels(kind="label").inc()
                m.experiences_applied.labels(kind="label").inc(stats.applied)
                m.labels_applied.inc(stats.applied)
                self.progress.labels_since_checkpoint += stats.applied
                self.progress.labels_total += stats.applied
            unusable = len(labels) - stats.applied
            if unusable:
                m.learner_skipped.labels(reason="label_not_candidate").inc(unusable)
        self.replay.extend(chunk)
        self.dirty = True
        m.update_seconds.observe(time.perf_counter() - t0)
        m.last_update.set(time.time())

    # ------------------------------------------------------------------ checkpoints
    def input_offsets(self) -> dict[str, int]:
        """The offsets a checkpoint taken now records (unapplied input comes again)."""
        return {**self.inbox.input_offsets(), **self.memories.offsets()}

    async def maybe_publish(self) -> None:
        if time.monotonic() - self.last_publish < self.config.checkpoint_interval_s:
            return
        if not self.dirty:
            assert self.publishing is not None
            if self.publishing.candidate_waiting:
                self.last_publish = time.monotonic()
                await self.publishing.reconsider()
            return
        await self.publish("label" if self.progress.labels_since_checkpoint else "periodic")

    async def publish(self, reason: str, extra: dict[str, Any] | None = None) -> Manifest | None:
        """Publish a checkpoint (one at a time); a ``periodic``/``label`` one only if the policy changed.

        Raises :class:`~pipeline.learner.fence.Fenced` when another learner owns the policy.
        """
        assert self.publishing is not None
        async with self._publish_lock:
            if reason in ("periodic", "label") and not self.dirty:
                return None  # published meanwhile (e.g. by the shutdown checkpoint)
            metrics = self._manifest_metrics(extra)
            # The map's changes go just before the manifest that holds them.
            await self.memories.publish(self.publishing.publisher)
            rows = self.trainer.take_changed_rows()  # what a delta checkpoint ships
            published = await self.publishing.publish(
                self.trainer, reason=reason, metrics=metrics, input_offsets=self.input_offsets(), changed_rows=rows
            )
            self.version = published.manifest.version
            self.dirty = False
            self.progress.labels_since_checkpoint = 0
            self.last_publish = time.monotonic()
            await self.publishing.settle(published)
            return published.manifest

    def _manifest_metrics(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The next manifest's ``metrics``: the learner's progress now (:func:`manifest_metrics`)."""
        principals = self.principals.view(self.progress.quarantined)
        applied = self.inbox.applied_key
        return manifest_metrics(self.trainer, self.progress, applied, self.config.batch_size, extra, principals)

    async def publish_change(self, reason: str, extra: dict[str, Any]) -> int:
        """A command changed the policy: publish a checkpoint of ``reason`` now, whatever the
        interval; returns its version."""
        self.dirty = True  # the policy changed; publish() clears it once the checkpoint is out
        await self.publish(reason, extra)
        return self.version

    async def _find_version(self, version: int) -> dict[str, torch.Tensor] | None:
        conn = self.config.connection
        return await find_version(self.bootstrap, conn, self.store, self.arch, version, self.config.signing_key)

    def _export_lag(self) -> None:
        hw = self._input.highwater(self.exp_tp)
        if hw is not None:
            self.metrics.consumer_lag.labels(topic=self.exp_tp.topic).set(max(0, hw - self.inbox.position))
