"""The learner: the single writer of the policy (DESIGN §2, §4, §5).

Reads joined experiences (and labelled samples) from the one-partition ``experiences``
topic in offset order, applies micro-batches with :class:`models.trainer.PolicyTrainer`,
and publishes checkpoints on the model topic at most every ``checkpoint_interval_s`` and
only when the policy changed. Reset commands arrive on ``control``.

Exactly one learner is active per policy: learners join a consumer group on the
``control`` topic (one partition), and only the member that owns it trains. A standby
takes over when the active one dies, restoring from the model topic.

Restore: on becoming active it reads the model topic, loads the newest checkpoint of its
policy (and the Adam moments from its local state directory when they belong to that
version), and resumes its inputs after the offsets recorded in that manifest, so a crash
loses no experience and applies none twice. Batches are formed by count in offset order,
so a restarted learner replays exactly the batches the crashed one would have applied.
It also keeps its latest checkpoint in a local directory: when the model topic is empty
(an embedded broker restarted and lost everything) it republishes from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import logging
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import orjson
import torch
from aiokafka import ConsumerRebalanceListener, TopicPartition
from safetensors.torch import load_file, save_file

from models.policy import Arch
from models.trainer import PolicyTrainer
from models.weights import to_safetensors, verify_and_load
from pipeline import kafka
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.config import Settings
from pipeline.deadletter import DeadLetterWriter
from pipeline.learner.gate import PromotionGate
from pipeline.metrics import Metrics
from pipeline.modeltopic import CheckpointPublisher, ModelTopicIndex, scan_model_topic
from topics.fields import Rejected
from topics.internal import Experience, decode_control, decode_experience
from topics.manifest import CheckpointError, Manifest, sha256_hex

log = logging.getLogger(__name__)

LINGER_S = 0.5  # apply a partial micro-batch after this long without new input
DEDUPE_IDS = 200_000
LOCAL_VERSIONS = 20  # checkpoint versions kept in the local directory (rollback)


class LocalStore:
    """The learner's latest checkpoint (and optimizer moments) on local disk."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def save(
        self,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        baseline_state: dict[str, Any],
    ) -> None:
        tmp = self.root / "tmp"
        tmp.mkdir(exist_ok=True)
        save_file(tensors, str(tmp / "policy.safetensors"))
        if optimizer:
            save_file(optimizer, str(tmp / "optimizer.safetensors"))
        (tmp / "manifest.json").write_bytes(orjson.dumps({"manifest": manifest.to_dict(), "baseline": baseline_state}))
        for name in ("policy.safetensors", "optimizer.safetensors", "manifest.json"):
            if (tmp / name).exists():
                (tmp / name).replace(self.root / name)
        # Earlier versions, for rollbacks after the model topic has tombstoned them.
        versions = self.root / "versions"
        versions.mkdir(exist_ok=True)
        save_file(tensors, str(versions / f"{manifest.version}.safetensors"))
        for old in sorted(versions.glob("*.safetensors"), key=lambda p: int(p.stem))[:-LOCAL_VERSIONS]:
            old.unlink()

    def load_version(self, version: int, arch: Arch) -> dict[str, torch.Tensor] | None:
        path = self.root / "versions" / f"{version}.safetensors"
        if not path.exists():
            return None
        blob = path.read_bytes()
        try:
            return verify_and_load(blob, sha256_hex(blob), len(blob), arch)
        except CheckpointError as exc:
            log.error("learner: local copy of v%d is unusable (%s)", version, exc)
            return None

    def load(self) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
        try:
            meta = orjson.loads((self.root / "manifest.json").read_bytes())
            tensors = load_file(str(self.root / "policy.safetensors"))
        except (OSError, ValueError):
            return None
        opt_path = self.root / "optimizer.safetensors"
        optimizer = load_file(str(opt_path)) if opt_path.exists() else {}
        return meta, tensors, optimizer


class Learner:
    """The learner process's core, with an explicit async lifecycle."""

    def __init__(self, settings: Settings, bootstrap: str, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.metrics = metrics or Metrics()
        self.topics = settings.topics()
        self.limits = settings.limits()
        self.arch = Arch(settings.embedding_dim, settings.slots, settings.hidden)
        self.trainer = self._new_trainer()
        self.exp_tp = TopicPartition(self.topics.experiences.name, 0)
        self.ctl_tp = TopicPartition(self.topics.control.name, 0)
        self.store = LocalStore(self._local_dir())
        self.pending: deque[tuple[int, Experience | None]] = deque()
        self.pending_n = 0  # experiences (not placeholders) in pending
        # Reorder mode (reorder_s > 0): experiences wait here, a heap by (event time, id),
        # until the event-time watermark passes them by reorder_s; they are then applied in
        # that canonical order, whatever order (and how often) they were delivered in.
        self.held: list[tuple[float, str, int, Experience]] = []
        self.watermark = 0.0
        self.released_key: tuple[float, str] | None = None  # newer keys only may still come in
        self.applied_key: tuple[float, str] | None = None  # the last key applied (in the manifest)
        self.positions: dict[TopicPartition, int] = {}
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.replay: deque[Experience] = deque(maxlen=settings.replay_max)
        self.version = 0
        self.dirty = False
        self.labels_since_checkpoint = 0
        self.labels_total = 0
        self.resets = 0
        self.last_publish = 0.0
        self.active = asyncio.Event()
        self.elected = False  # owns the control partition of the learner group
        self.gate_since = 0.0  # event time from which the gate's window counts (moved by resets)

        self.restored_from = "none"
        self._producer: Any = None
        self._group: Any = None  # consumer group on control: leader election
        self._input: Any = None  # manually assigned consumer for experiences + control
        self._publisher: CheckpointPublisher | None = None
        self._dead: DeadLetterWriter | None = None
        self._stopping = asyncio.Event()
        self._last_input = time.monotonic()
        self.gate: PromotionGate | None = None  # set in start() when the gate is on

    def _new_trainer(self) -> PolicyTrainer:
        s = self.settings
        # Micro-batches are small: one intra-op thread is as fast, and spinning OpenMP
        # threads on cores shared with the worker and the broker slow everything ~30×.
        torch.set_num_threads(max(1, s.torch_threads))

        return PolicyTrainer(
            s.embedding_dim,
            s.slots,
            s.hidden,
            lr=s.lr,
            grad_clip=s.grad_clip,
            importance_clip=s.importance_clip,
            baseline=s.baseline,
            baseline_fading=s.baseline_fading,
            label_lr=s.label_lr,
            device=s.torch_device(),
            seed=s.seed,
        )

    def _local_dir(self) -> Path:
        ident = hashlib.sha256(f"{self.bootstrap}|{self.settings.topic_prefix}".encode()).hexdigest()[:12]
        return self.settings.state_path() / "learner" / f"{self.settings.policy}-{ident}"

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._producer = kafka.producer(self.bootstrap, self.settings, linger_ms=5)
        await self._producer.start()
        self._dead = DeadLetterWriter(self._producer, self.topics.dead_letter.name, self.metrics)
        self._publisher = CheckpointPublisher(
            self._producer, self.topics.policy_checkpoints.name, self.settings.policy, self.settings.keep_versions
        )
        self._group = kafka.consumer(
            self.bootstrap,
            self.settings,
            group_id=f"{self.settings.topic_prefix}causalmem-learner-{self.settings.policy}",
        )
        if self.settings.gate:
            self.gate = PromotionGate(self.settings, self._publisher, self.metrics, window=self._gate_window)
        self._group.subscribe([self.topics.control.name], listener=_Election(self))
        await self._group.start()
        self._input = kafka.consumer(self.bootstrap, self.settings, group_id=None)
        await self._input.start()

    async def stop(self, publish: bool = True) -> None:
        self._stopping.set()
        if publish and self.active.is_set() and self.dirty:
            with contextlib.suppress(Exception):
                await self._apply_pending(force=True)
                await self.publish("shutdown")
        for c in (self._input, self._group):
            if c is not None:
                # A consumer stopped while still starting raises CancelledError: stop anyway.
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await c.stop()

        if self._dead is not None:
            with contextlib.suppress(Exception):
                await self._dead.flush()
        if self._producer is not None:
            await self._producer.stop()
        self._input = self._group = self._producer = None

    async def __aenter__(self) -> Learner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def run(self) -> None:
        """Wait to be elected, restore, then train until :meth:`stop`."""
        while not self._stopping.is_set():
            # The group consumer only elects: poll it so that its membership stays alive.
            with contextlib.suppress(Exception):
                await self._group.getmany(timeout_ms=0)
            if self.elected and not self.active.is_set():
                await self.become_active()
            if not self.active.is_set():
                await asyncio.sleep(0.1)
                continue
            await self.step()

    async def become_active(self) -> None:
        log.info("learner: elected for policy %r; restoring", self.settings.policy)
        await self.restore()
        self.active.set()

    def become_standby(self) -> None:
        self.elected = False
        if self.active.is_set():
            log.warning("learner: lost the election for policy %r; standing by", self.settings.policy)
        self.active.clear()

    # ------------------------------------------------------------------ restore
    async def restore(self) -> None:
        index = await scan_model_topic(self.bootstrap, self.settings)
        assert self._publisher is not None
        self._publisher.adopt(index)
        policy = self.settings.policy
        local = self.store.load()
        offsets: dict[str, int] = {}
        manifest = index.newest(policy)
        loaded = False
        while manifest is not None and not loaded:
            try:
                tensors = await fetch_checkpoint(self.bootstrap, self.settings, index, manifest)
                self._load(manifest.to_dict(), tensors, local)
                offsets = manifest.input_offsets
                self.version = manifest.version
                self.restored_from = f"topic v{manifest.version}"
                loaded = True
            except (CheckpointError, ValueError) as exc:
                log.error("learner: checkpoint v%d unusable (%s); trying an older one", manifest.version, exc)
                older = [m for (p, v), m in index.manifests.items() if p == policy and v < manifest.version]
                manifest = max(older, key=lambda m: m.version, default=None)
        if not loaded and local is not None and not index.manifests:
            # The model topic is empty: a new (or reset) cluster. Keep what was learnt.
            meta, tensors, _ = local
            self._load(meta["manifest"], tensors, local)
            self.restored_from = f"local v{meta['manifest']['version']}"
            log.warning("learner: model topic is empty; republishing the local checkpoint %s", self.restored_from)
            # Clients may still run that version: continue above it, so they take the republished one.
            self._publisher.last_version = max(self._publisher.last_version, int(meta["manifest"]["version"]))
            self.version = self._publisher.last_version
            await self.publish("init", extra={"restored_from": "local"})

        elif not loaded:
            self.restored_from = "fresh"
            await self.publish("init")
        if self.gate is not None and self.gate.serving_net is None:
            await self._restore_serving(index)
        await self._seek(offsets)
        await self._rebuild_history(offsets)
        log.info(
            "learner: active from %s at version %d, offsets %s",
            self.restored_from,
            self.version,
            {tp.topic: off for tp, off in self.positions.items()},
        )

    async def _restore_serving(self, index: ModelTopicIndex) -> None:
        """The gate compares candidates with what clients serve: load that policy too."""
        serving = index.serving.get(self.settings.policy)
        if serving is None:
            return
        try:
            tensors = await fetch_checkpoint(self.bootstrap, self.settings, index, serving)
        except CheckpointError as exc:
            log.error("learner: the serving checkpoint v%d is unusable (%s)", serving.version, exc)
            return
        self.gate.set_serving(serving, tensors)

    def _load(self, manifest: dict[str, Any], tensors: dict[str, torch.Tensor], local: Any) -> None:
        metrics = manifest.get("metrics") or {}
        baseline_state = metrics.get("baseline_state") or {"value": manifest.get("baseline", 0.0), "n": 1}
        self.trainer.load(tensors, baseline_state)
        self.trainer.updates = int(metrics.get("updates", 0))
        self.trainer.experiences = int(metrics.get("experiences", 0))
        self.labels_total = int(metrics.get("labels_applied_total", 0))
        self.resets = int(metrics.get("resets", 0))
        through = metrics.get("applied_through")
        self.applied_key = self.released_key = (float(through[0]), str(through[1])) if through else None
        if local is not None:
            meta, _, optimizer = local
            if meta["manifest"]["version"] == manifest["version"] and meta["manifest"]["sha256"] == manifest["sha256"]:
                self.trainer.load_optimizer_tensors(optimizer)

    async def _seek(self, offsets: dict[str, int]) -> None:
        tps = [self.exp_tp, self.ctl_tp]
        self._input.assign(tps)
        for tp in tps:
            off = offsets.get(f"{tp.topic}:{tp.partition}")
            if off is None:
                await self._input.seek_to_beginning(tp)
                self.positions[tp] = 0
            else:
                self._input.seek(tp, off)
                self.positions[tp] = off
        self.pending.clear()
        self.pending_n = 0
        self.held.clear()

    async def _rebuild_history(self, offsets: dict[str, int]) -> None:
        """Re-read what came before the resume point: ids for dedupe, experiences for warm-up."""
        end = offsets.get(f"{self.exp_tp.topic}:0", 0)
        if end <= 0:
            return
        start = max(0, end - max(self.settings.replay_max, 1))
        msgs = await kafka.read_all(self.bootstrap, self.settings, self.exp_tp.topic, partitions=[0], start={0: start})
        for msg in msgs:
            if msg.offset >= end:
                break
            try:
                exp = decode_experience(msg.value, self.limits)
            except Rejected:
                continue
            self._mark_seen(exp.id)
            self.replay.append(exp)
        self._trim_replay()

    # ------------------------------------------------------------------ training loop
    async def step(self) -> None:
        """One poll of the inputs, then whatever updates and publishing are due."""
        try:
            batch = await self._input.getmany(timeout_ms=100, max_records=16 * self.settings.batch_size)

        except Exception as exc:
            log.warning("learner: fetch failed: %r", exc)
            await asyncio.sleep(0.5)
            return
        if batch:
            self._last_input = time.monotonic()
        for tp, msgs in batch.items():
            for msg in msgs:
                if tp == self.ctl_tp:
                    self._release(force=True)
                    await self._apply_pending(force=True)
                    await self._handle_control(msg)
                    self.positions[tp] = msg.offset + 1
                else:
                    self._accept(msg)
        idle = time.monotonic() - self._last_input > LINGER_S
        self._release(force=idle)
        await self._apply_pending(force=idle)
        self._export_lag()
        await self.maybe_publish()

    def _accept(self, msg: Any) -> None:
        """Queue one experience message in offset order (``None`` for one that needs no update)."""
        exp: Experience | None = None
        try:
            exp = decode_experience(msg.value, self.limits)
        except Rejected as rej:
            assert self._dead is not None
            self._dead.send(msg, rej.reason, rej.detail)
        if exp is not None and exp.event.policy != self.settings.policy:
            self.metrics.learner_skipped.labels(reason="other_policy").inc()
            exp = None
        elif exp is not None and exp.id in self.seen:
            self.metrics.learner_skipped.labels(reason="duplicate").inc()
            exp = None
        if self.settings.reorder_s > 0:
            self._hold(msg.offset, exp)
            return
        if exp is not None:
            self._mark_seen(exp.id)
            self.pending_n += 1
        # Skipped messages stay in line so that the resume offset never jumps over an
        # experience that is not applied yet.
        self.pending.append((msg.offset, exp))

    def _hold(self, offset: int, exp: Experience | None) -> None:
        """Reorder mode: hold an experience until the watermark has passed it by reorder_s."""
        self.positions[self.exp_tp] = offset + 1
        if exp is None:
            return
        key = (exp.event.ts, exp.id)
        if self.applied_key is not None and key <= self.applied_key:
            return  # applied before a restart (re-read from the resume offset)
        if self.released_key is not None and key <= self.released_key:
            # Later than the reorder window: applying it now would break the canonical order.
            self.metrics.learner_skipped.labels(reason="late").inc()
            return
        self._mark_seen(exp.id)
        self.watermark = max(self.watermark, exp.event.ts)
        heapq.heappush(self.held, (key[0], key[1], offset, exp))

    def _release(self, force: bool = False) -> None:
        horizon = self.watermark - self.settings.reorder_s
        while self.held and (force or self.held[0][0] <= horizon):
            ts, ident, offset, exp = heapq.heappop(self.held)
            self.released_key = (ts, ident)
            self.pending.append((offset, exp))
            self.pending_n += 1

    async def _apply_pending(self, force: bool = False) -> None:
        b = self.settings.batch_size
        while self.pending_n >= b or (force and self.pending):
            chunk: list[Experience] = []
            last = -1
            while self.pending and len(chunk) < b:
                last, exp = self.pending.popleft()
                if exp is not None:
                    chunk.append(exp)
                    self.pending_n -= 1
            while self.pending and self.pending[0][1] is None:
                last = self.pending.popleft()[0]
            if chunk:
                self.apply(chunk)
                if self.settings.reorder_s > 0:
                    self.applied_key = (chunk[-1].event.ts, chunk[-1].id)
                    continue  # positions follow reads, not batches, in reorder mode
            self.positions[self.exp_tp] = last + 1

    def apply(self, chunk: list[Experience]) -> None:
        """Apply one micro-batch (feedback → REINFORCE, labels → last-layer fine-tune)."""
        t0 = time.perf_counter()
        feedback = [e for e in chunk if e.kind == "feedback"]
        labels = [e for e in chunk if e.kind == "label"]
        m = self.metrics
        if feedback:
            stats = self.trainer.update(feedback)
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
        if labels:
            stats = self.trainer.fine_tune(labels)
            if stats.applied:
                m.updates.labels(kind="label").inc()
                m.experiences_applied.labels(kind="label").inc(stats.applied)
                m.labels_applied.inc(stats.applied)
                self.labels_since_checkpoint += stats.applied
                self.labels_total += stats.applied
            unusable = len(labels) - stats.applied
            if unusable:
                m.learner_skipped.labels(reason="label_not_candidate").inc(unusable)
        self.replay.extend(chunk)
        self._trim_replay()
        self.dirty = True
        m.update_seconds.observe(time.perf_counter() - t0)
        m.last_update.set(time.time())

    def _gate_window(self) -> list[Experience]:
        return [e for e in self.replay if e.event.ts >= self.gate_since]

    def _mark_seen(self, ident: str) -> None:

        self.seen[ident] = None
        if len(self.seen) > DEDUPE_IDS:
            self.seen.popitem(last=False)

    def _trim_replay(self) -> None:
        if not self.replay:
            return
        horizon = self.replay[-1].event.ts - self.settings.drift_window_days * 86400
        while self.replay and self.replay[0].event.ts < horizon:
            self.replay.popleft()

    async def _handle_control(self, msg: Any) -> None:
        try:
            ctl = decode_control(msg.value, self.limits)
        except Rejected as rej:
            assert self._dead is not None
            self._dead.send(msg, rej.reason, rej.detail)
            return
        if ctl.id and ctl.id in self.seen:
            return
        if ctl.id:
            self._mark_seen(ctl.id)
        if ctl.command == "reset":
            await self.reset(ctl.reason, ctl.details)
        elif ctl.command == "rollback":
            await self.rollback(int(ctl.details.get("to_version", -1)), ctl.reason)

    async def rollback(self, version: int, reason: str = "") -> bool:
        """Serve (and continue from) an earlier checkpoint, republished under a new version.

        The weights come from the model topic when its chunks are still there, else from
        the local directory (which keeps more versions than the topic). Training goes on
        from them with a fresh optimizer: the policy that was rolled back is abandoned.
        """
        tensors = await self._find_version(version)
        if tensors is None:
            log.error(
                "learner: rollback to v%d impossible: neither the model topic nor %s has it", version, self.store.root
            )
            return False
        await self._apply_pending(force=True)
        self.trainer.load(tensors, self.trainer.baseline.state())
        self.dirty = True
        await self.publish("rollback", extra={"rolled_back_to": version, "rollback_reason": reason})
        log.warning("learner: rolled back to the weights of v%d, now serving as v%d", version, self.version)
        return True

    async def _find_version(self, version: int) -> dict[str, torch.Tensor] | None:
        index = await scan_model_topic(self.bootstrap, self.settings)
        manifest = index.manifests.get((self.settings.policy, version))
        if manifest is not None:
            try:
                return await fetch_checkpoint(self.bootstrap, self.settings, index, manifest)
            except CheckpointError as exc:
                log.info("learner: v%d is not complete on the model topic (%s); trying the local copy", version, exc)
        return self.store.load_version(version, self.arch)

    async def reset(self, reason: str = "", details: dict[str, Any] | None = None) -> None:
        """Drift reset: new last layer, warm-up on the kept 7 days, publish ``reset``.

        The warm-up uses the kept experiences from the detector's estimate of when the
        drift began (``since_ts``) on: what came before teaches the world that changed.
        """
        since = (details or {}).get("since_ts")
        replay = [e for e in self.replay if since is None or e.event.ts >= float(since)]
        # From now on the gate judges candidates on what happened after the change only.
        self.gate_since = float(since) if since is not None else max((e.event.ts for e in self.replay), default=0.0)

        t0 = time.perf_counter()
        stats = self.trainer.reset_last_layer(
            replay,
            epochs=self.settings.warmup_epochs,
            batch_size=self.settings.batch_size,
            half_life_s=self.settings.warmup_half_life_s,
        )

        self.resets += 1
        self.metrics.resets.inc()
        log.warning(
            "learner: drift reset (%s): last layer re-initialised, warmed up on %d experiences in %.1f s",
            reason or "requested",
            len(replay),
            time.perf_counter() - t0,
        )
        self.dirty = True
        await self.publish("reset", extra={"warmup_experiences": stats.applied, "reset_details": details or {}})

    # ------------------------------------------------------------------ checkpoints
    def input_offsets(self) -> dict[str, int]:
        out = {}
        for tp in (self.exp_tp, self.ctl_tp):
            out[f"{tp.topic}:{tp.partition}"] = self.positions.get(tp, 0)
        # Anything consumed but not yet applied comes again after a restore.
        unapplied = [o for o, e in self.pending if e is not None] + [h[2] for h in self.held]
        if self.settings.reorder_s > 0:
            if unapplied:
                out[f"{self.exp_tp.topic}:0"] = min(unapplied)
        elif self.pending:
            out[f"{self.exp_tp.topic}:0"] = self.pending[0][0]
        return out

    async def maybe_publish(self) -> None:
        if time.monotonic() - self.last_publish < self.settings.checkpoint_interval_s:
            return
        if not self.dirty:
            if self.gate is not None and self.gate.pending is not None:
                self.last_publish = time.monotonic()
                await self.gate.reconsider()
            return
        await self.publish("label" if self.labels_since_checkpoint else "periodic")

    async def publish(self, reason: str, extra: dict[str, Any] | None = None) -> Manifest:
        assert self._publisher is not None
        trainer = self.trainer
        baseline_state = trainer.baseline.state()
        metrics: dict[str, Any] = {
            "updates": trainer.updates,
            "experiences": trainer.experiences,
            "labels_applied": self.labels_since_checkpoint,
            "labels_applied_total": self.labels_total,
            "resets": self.resets,
            "baseline_state": baseline_state,
            "lr": self.settings.lr,
            "batch_size": self.settings.batch_size,
            "applied_through": list(self.applied_key) if self.applied_key else None,
            **(extra or {}),
        }
        tensors = trainer.tensors()
        offsets = self.input_offsets()
        # A drift reset is served at once: the detector has just shown that the serving policy
        # no longer agrees with human judgement, and the gate's window still describes the
        # world before the change. (Rollbacks and the first policy skip the gate too.)
        candidate = self.gate is not None and reason not in ("init", "rollback", "reset")
        manifest = await self._publisher.publish(
            to_safetensors(tensors),
            alpha=float(tensors["alpha"].reshape(-1)[0]),
            reason=reason,
            arch=self.arch.to_dict(),
            baseline=trainer.baseline.get(),
            metrics=metrics,
            input_offsets=offsets,
            candidate=candidate,
        )
        self.version = manifest.version
        self.store.save(manifest, tensors, trainer.optimizer_tensors(), baseline_state)
        self.dirty = False
        self.labels_since_checkpoint = 0
        self.last_publish = time.monotonic()
        m = self.metrics
        m.checkpoint_publishes.labels(reason=reason).inc()
        m.checkpoint_version.labels(role="candidate" if candidate else "serving").set(manifest.version)
        m.checkpoint_timestamp.labels(role="candidate" if candidate else "serving").set(manifest.created_ts)
        m.checkpoint_bytes.set(manifest.size)
        log.info(
            "learner: published v%d (%s%s) after %d updates",
            manifest.version,
            reason,
            ", candidate" if candidate else "",
            trainer.updates,
        )
        if self.gate is not None:
            if candidate:
                await self.gate.consider(manifest, tensors)
            else:
                self.gate.set_serving(manifest, tensors)
        return manifest

    def _export_lag(self) -> None:
        hw = self._input.highwater(self.exp_tp)
        if hw is not None:
            self.metrics.consumer_lag.labels(topic=self.exp_tp.topic).set(
                max(0, hw - self.positions.get(self.exp_tp, 0))
            )


class _Election(ConsumerRebalanceListener):
    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:
            self.learner.become_standby()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if assigned:
            # The group consumer only elects; the input consumer reads. Restoring happens
            # in the run loop, not inside the rebalance callback.
            self.learner._group.pause(*assigned)
        if any(tp.topic == self.learner.ctl_tp.topic for tp in assigned):
            self.learner.elected = True
