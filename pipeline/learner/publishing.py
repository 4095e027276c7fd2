"""Checkpoint publishing: what the learner writes on the model topic, and the gate.

A checkpoint is the trainer's tensors (safetensors), a manifest with the learner's
progress in ``metrics`` and the input offsets to resume from (docs/contract.md). With the
promotion gate on, a trained checkpoint is published as a *candidate* and served only
once the gate promotes it; the first policy, rollbacks and drift resets are served at
once (docs/learning.md).

The manifest's ``metrics`` are written by :func:`manifest_metrics` and read back on a
restore by :meth:`Progress.from_metrics` and :func:`applied_through`.

Which checkpoints are candidates and which are served at once is
:func:`pipeline.learner.promotion.is_candidate`; what the gate does with a candidate is the
promotion rule's (:mod:`pipeline.learner.promotion`, docs/promotion.md).

*Delta checkpoints* (contract 1.3): with ``full_every`` > 1, checkpoints between full
snapshots are published as deltas of the serving version (``pipeline.learner.deltas``).
Only their keys differ: a delta is a candidate or served at once like a full checkpoint,
and the gate promotes it the same way (under ``"{policy}/delta"``). The local copy of
every version is its full state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from models.policy.delta import encode_delta
from models.policy.network import Arch, PolicyNetwork, neutral_rows
from models.policy.trainer import PolicyTrainer
from models.policy.weights import to_safetensors
from models.serving.params import ServingParams
from pipeline.config import LearnerConfig
from pipeline.learner.deltas import DeltaPlanner
from pipeline.learner.freeze import ServingClock
from pipeline.learner.gate import RuleGate
from pipeline.learner.inbox import Key
from pipeline.learner.promotion import is_candidate, probe_base
from pipeline.learner.store import LocalStore
from pipeline.learner.suppression import read_audit
from pipeline.metrics import Metrics
from pipeline.modeltopic import CheckpointPublisher
from topics.delta import DeltaManifest
from topics.fields import PROBE
from topics.manifest import Manifest, sha256_hex, split_chunks
from topics.principal import valid_principal

log = logging.getLogger(__name__)

# With the gate on, a fresh first policy (the same mask for every memory: similarity search)
# is not certified: its manifest says ``incumbent`` (contract 1.17), and clients serve their
# own ranking, the first k candidates as found, on every request but the explored share, until
# the gate promotes a candidate. Clients before 1.17 draw at this temperature instead, which
# serves near-greedy top-k: drawn at the serving temperature, near-tied candidates are read
# almost at random, below similarity-only (docs/learning.md, "The promotion gate").
FRESH_TEMPERATURE = 0.001


def first_serving(
    serving: ServingParams, gated: bool, reason: str, updates: int, incumbent: bool = False, base: int | None = None
) -> ServingParams:
    """The serving parameters a checkpoint is published with. An incumbent (contract 1.17): a
    fresh first policy, a probe while nothing is certified (1.19), a drift reset (1.20: what was
    certified described the world before the change, and the reset's warm-up is not certified
    either), and an operator's rollback while the rule serves an incumbent (``incumbent``:
    nothing is certified, so what is rolled back to is not either; the guardrail's rollbacks are
    copies, served as the version they copy was: :meth:`Publishing.republish`). A probe over a certified version
    (``base``, 1.23) is served as configured, that version on the share not explored.

    >>> fresh = first_serving(ServingParams(), True, "init", 0)
    >>> fresh.incumbent, fresh.temperature, fresh.explore_rate
    (True, 0.001, 0.1)
    >>> first_serving(ServingParams(), True, "init", 12).incumbent  # restored, trained: as configured
    False
    >>> probe = first_serving(ServingParams(), True, PROBE, 12)
    >>> back = first_serving(ServingParams(), True, "rollback", 9, incumbent=True)
    >>> reset = first_serving(ServingParams(), True, "reset", 140)
    >>> probe.incumbent, back.incumbent, reset.incumbent
    (True, True, True)
    >>> first_serving(ServingParams(), False, "init", 0).temperature  # no gate: as configured
    0.05
    >>> over = first_serving(ServingParams(), True, PROBE, 40, base=7)
    >>> over.base, over.incumbent, over.temperature
    (7, False, 0.05)
    """
    if gated and reason == PROBE and base is not None:
        return replace(serving, base=base)
    fresh = reason == "init" and updates == 0
    if gated and (fresh or reason in (PROBE, "reset") or (incumbent and reason == "rollback")):
        return replace(serving, temperature=min(serving.temperature, FRESH_TEMPERATURE), incumbent=True)
    return serving


@dataclass
class Progress:
    """The learner's counters that checkpoints carry (besides the trainer's own).

    >>> Progress.from_metrics({"labels_applied_total": 5, "resets": 1})
    Progress(labels_since_checkpoint=0, labels_total=5, resets=1, suppressed=[], suppression_audit=[], quarantined=[])
    """

    labels_since_checkpoint: int = 0
    labels_total: int = 0
    resets: int = 0
    suppressed: list[int] = field(default_factory=list)  # memories an operator suppressed ("do not use")
    # who suppressed or restored which memories, when and why (pipeline.learner.suppression)
    suppression_audit: list[dict[str, Any]] = field(default_factory=list)
    # contract 1.15: principals an operator quarantined (their experiences weigh 0; pipeline.learner.principals)
    quarantined: list[str] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> Progress:
        return cls(
            labels_total=int(metrics.get("labels_applied_total", 0)),
            resets=int(metrics.get("resets", 0)),
            suppressed=[int(s) for s in metrics.get("suppressed") or []],
            suppression_audit=read_audit(metrics.get("suppression_audit")),
            quarantined=[str(p) for p in metrics.get("quarantined") or [] if valid_principal(p)],
        )

    def carry_over(self, restored: Progress) -> None:
        """Take what a restart keeps from the restored checkpoint's counters, in place (the
        control handler holds this object): the label and reset counts, the memories operators
        suppressed (a later rollback, reset or cut-over suppresses them again) and the audit
        trail (the suppress rate limit counts from it, so a restart does not reset it), and the
        principals operators quarantined.

        >>> now = Progress()
        >>> now.carry_over(Progress.from_metrics({"resets": 2, "suppressed": [4, 9]}))
        >>> now.resets, now.suppressed
        (2, [4, 9])
        """
        self.labels_total = restored.labels_total
        self.resets = restored.resets
        self.suppressed = list(restored.suppressed)
        self.suppression_audit = list(restored.suppression_audit)
        self.quarantined = list(restored.quarantined)


def manifest_metrics(
    trainer: PolicyTrainer,
    progress: Progress,
    applied: Key | None,
    batch_size: int,
    extra: dict[str, Any] | None = None,
    principals: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The manifest's ``metrics``: what a restore needs, and what operators read (``principals``:
    :meth:`pipeline.learner.principals.PrincipalBook.view`, what ``causalmem status`` shows)."""
    return {
        "updates": trainer.updates,
        "experiences": trainer.experiences,
        "labels_applied": progress.labels_since_checkpoint,
        "labels_applied_total": progress.labels_total,
        "resets": progress.resets,
        "suppressed": progress.suppressed,
        "suppression_audit": progress.suppression_audit,
        "quarantined": progress.quarantined,
        "principals": principals or {},
        "baseline_state": trainer.baseline.state(),
        "lr": trainer.config.lr,
        "batch_size": batch_size,
        "applied_through": list(applied) if applied else None,
        **(extra or {}),
    }


PROMOTION_COPY = "promotion_copy"  # in the metrics of a copy the promotion rule asked for (Publishing.republish)


def is_promotion_copy(metrics: dict[str, Any]) -> bool:
    """Whether a checkpoint with these ``metrics`` is a copy the promotion rule asked for (a
    promoted version's, a guardrail rollback's: :meth:`Publishing.republish`): its weights are
    not the trainer's, and a learner never restores its trainer from it.

    >>> is_promotion_copy({PROMOTION_COPY: True}), is_promotion_copy({"rolled_back_to": 3})
    (True, False)
    """
    return metrics.get(PROMOTION_COPY) is True


def applied_through(metrics: dict[str, Any]) -> Key | None:
    """Reorder mode: the (event time, id) of the last experience a checkpoint applied.

    >>> applied_through({"applied_through": [12.5, "e7"]}), applied_through({})
    ((12.5, 'e7'), None)
    """
    through = metrics.get("applied_through")
    return (float(through[0]), str(through[1])) if through else None


class Publishing:
    """Publishes the trainer's checkpoints (as candidates when the gate is on) and keeps a local copy."""

    def __init__(
        self,
        producer: Any,
        config: LearnerConfig,
        store: LocalStore,
        arch: Arch,
        metrics: Metrics,
    ) -> None:
        conn = config.connection
        self.publisher = CheckpointPublisher(
            producer,
            conn.topics.policy_checkpoints.name,
            conn.policy,
            config.keep_versions,
            signing_key=config.signing_key,
        )
        self.store = store
        self.arch = arch
        self.serving = config.serving
        self.metrics = metrics
        self.gate: RuleGate | None = None
        if config.gate is not None:
            self.gate = RuleGate(config.gate, self.publisher, metrics, serving=config.serving)
        self.deltas = DeltaPlanner(self.publisher, arch, config.full_every, config.delta_max_share)
        self.clock = ServingClock()  # how long serving has stood while candidates waited
        if self.gate is not None:
            metrics.seconds_since_promotion.set_function(self.clock.seconds)

    def _observe_serving(self) -> None:
        """The serving version after a judgement (or a restore): the clock and its gauges."""
        if self.gate is not None:
            self.clock.serving(self.gate.serving_manifest)
            self.metrics.candidates_waiting.set(self.clock.waiting)

    def gate_record(self, rolled_back_to: object = None) -> dict[str, Any]:
        """``metrics.gate`` for the next manifest (:meth:`ServingClock.record`); empty without a gate.
        A rollback's copy of the anchor carries its certification (:meth:`RuleGate.certification`)."""
        if self.gate is None:
            return {}
        self._observe_serving()
        record = self.clock.record(self.gate.decisions)
        if isinstance(rolled_back_to, int) and not isinstance(rolled_back_to, bool):
            record = {**record, **self.gate.certification(rolled_back_to)}
        return {"gate": record}

    def is_candidate(self, reason: str) -> bool:
        return is_candidate(reason, self.gate is not None)

    async def publish(
        self,
        trainer: PolicyTrainer,
        *,
        reason: str,
        metrics: dict[str, Any],
        input_offsets: dict[str, int],
        changed_rows: np.ndarray,
    ) -> Published:
        """Publish the trainer's state and save it locally; :meth:`settle` then hands it to the gate.

        ``changed_rows``: the output rows written since the last publish
        (``PolicyTrainer.take_changed_rows()``): a delta ships them and those of the
        versions since its base.
        """
        candidate = self.is_candidate(reason)
        if candidate and self.gate is not None:
            # Contract 1.19: the weights of a candidate that starts a trial are first served as a
            # probe under a version of its own below the candidate's: clients' exploration share
            # then draws from them (an incumbent while nothing is certified; 1.23: over the
            # certified version, which clients serve on the rest).
            async def probe() -> tuple[Manifest, dict[str, torch.Tensor]]:
                await self._keep_base()
                p = await self.publish(
                    trainer, reason=PROBE, metrics=metrics, input_offsets=input_offsets, changed_rows=changed_rows
                )
                return p.manifest, p.tensors

            if await self.gate.probe(probe):
                changed_rows = np.zeros(0, np.int64)  # the probe carried them
        tensors = trainer.tensors()
        full = to_safetensors(tensors)
        trial = candidate and self.gate is not None and self.gate.next_opens_trial()
        rows = None if trial else self.deltas.plan(reason, changed_rows)
        delta: dict[str, Any] | None = None
        blob = full
        if rows is not None and self.publisher.head is not None:
            base_version, base_sha = self.publisher.head
            blob = encode_delta(tensors, rows, base_sha)
            # The full blob is hashed once, here; its local copy's manifest reuses the hash (full_manifest).
            delta = {"base_version": base_version, "base_sha256": base_sha, "state_sha256": sha256_hex(full)}
            delta["rows"] = len(rows)
        optimizer = trainer.optimizer_tensors()
        baseline_state = trainer.baseline.state()

        def save_locally(manifest: Manifest) -> None:
            # Before anything is sent: every published version has its local copy (full) and moments.
            self.store.save(full_manifest(manifest, full), tensors, optimizer, baseline_state, full)

        try:
            manifest = await self.publisher.publish(
                blob,
                alpha=float(tensors["alpha"].reshape(-1)[0]),
                reason=reason,
                arch=self.arch.to_dict(),
                baseline=trainer.baseline.get(),
                metrics={
                    **metrics,
                    **self.gate_record(metrics.get("rolled_back_to") if reason == "rollback" else None),
                },
                input_offsets=input_offsets,
                candidate=candidate,
                prepare=save_locally,
                serving=first_serving(
                    self.serving, self.gate is not None, reason, trainer.updates, self._incumbent(), self._base()
                ).to_wire(),
                delta=delta,
            )
        except BaseException:  # not published: the next checkpoint must still ship these rows
            trainer.keep_changed_rows(changed_rows)
            raise
        self.deltas.record(manifest.version, delta is not None, changed_rows)
        role = "candidate" if candidate else "serving"
        if candidate:
            self.clock.candidate(manifest.version)
            self.metrics.candidates_waiting.set(self.clock.waiting)
        m = self.metrics
        m.checkpoint_publishes.labels(reason=reason).inc()
        m.checkpoint_version.labels(role=role).set(manifest.version)
        m.checkpoint_timestamp.labels(role=role).set(manifest.created_ts)
        m.checkpoint_bytes.set(manifest.size)
        log.info(
            "learner: published v%d (%s%s%s) after %d updates",
            manifest.version,
            reason,
            ", candidate" if candidate else "",
            f", delta of {delta['rows']} rows on v{delta['base_version']}" if delta else "",
            trainer.updates,
        )
        return Published(manifest, tensors, candidate)

    async def republish(
        self,
        version: int,
        *,
        reason: str,
        metrics: dict[str, Any],
        input_offsets: dict[str, int],
        fresh_rows: Sequence[int] = (),
        suppressed: Sequence[int] = (),
    ) -> Published | None:
        """Publish the weights of ``version``, which the gate holds, again under a new version,
        served at once: a copy (reason ``rollback``, ``metrics.rolled_back_to``, and
        ``metrics.promotion_copy``) of a version the promotion rule serves again: a promotion of a
        version older than one clients were told to serve since (a probe; versions only grow on
        the serving key, docs/contract.md §7), or the guardrail's rollback to the anchor or the
        first policy (contract 1.26). The trainer goes on untouched and is never restored from the copy
        (:func:`is_promotion_copy`): ``metrics`` and ``input_offsets`` are the learner's now, as
        any checkpoint's. It is served as ``version`` was published (a probe naming a base, which
        only a probe may, as an incumbent), and carries its certification. ``fresh_rows``: slots
        given to a memory after ``version`` whose records
        the copy's version follows; ``version``'s weights hold an earlier owner's rows there:
        neutral in the copy. ``suppressed``: the slots an operator suppresses now ("do not use"),
        suppressed in the copy too (a rollback's copy of an older version would serve them again).
        Returns None where the gate no longer holds ``version``."""
        held = self.gate.versions.get(version) if self.gate is not None else None
        if held is None:
            return None
        source, net = held
        tensors = {k: t.clone() for k, t in net.tensors().items()}  # the gate's network stays as it is
        rows = sorted({int(r) for r in fresh_rows})
        if rows:
            hidden = tensors["out.weight"].shape[1]
            weight, bias = neutral_rows(len(rows), hidden, torch.Generator().manual_seed(version))
            tensors["out.weight"][rows], tensors["out.bias"][rows] = weight, bias
        if len(suppressed):
            kept = PolicyNetwork.from_tensors(tensors)
            kept.suppress(list(suppressed))
            tensors = kept.tensors()
        full = to_safetensors(tensors)
        serving, params = source.serving, ServingParams.from_wire(source.serving)
        if params.base is not None:
            # A probe over a certified version this learner did not take as one (it could not read
            # it): only a probe names a base (contract 1.23). Its copy is served as an incumbent,
            # the client's own ranking but on the exploration share: what the promise is about.
            log.warning("learner: v%d's copy cannot name v%d: served as an incumbent", version, params.base)
            serving = first_serving(replace(params, base=None), True, "rollback", 0, incumbent=True).to_wire()
        marks = {"rolled_back_to": version, "rollback_reason": reason, PROMOTION_COPY: True}
        manifest = await self.publisher.publish(
            full,
            alpha=source.alpha,
            reason="rollback",
            arch=source.arch,
            baseline=source.baseline,
            metrics={**metrics, **marks, **self.gate_record(version)},
            input_offsets=input_offsets,
            # Its weights on disk as every published version's (an operator may roll back to it).
            prepare=lambda m: self.store.save(m, tensors, {}, {}, full),
            serving=serving,
        )
        # Not recorded as the planner's own: the trainer's weights differ from it, so the next
        # checkpoint is a full snapshot.
        self.metrics.checkpoint_publishes.labels(reason="rollback").inc()
        log.info("learner: published v%d, a copy of v%d (%s)", manifest.version, version, reason)
        return Published(manifest, tensors, candidate=False)

    def _incumbent(self) -> bool:
        """The rule serves an incumbent now (nothing certified)."""
        state = self.gate.state if self.gate is not None else None
        return state is not None and state.incumbent

    def _base(self) -> int | None:
        """What a probe published now names as its base (contract 1.23): the certified anchor, if any."""
        state = self.gate.state if self.gate is not None else None
        return probe_base(state) if state is not None else None

    async def _keep_base(self) -> None:
        """Before a probe over a certified version (contract 1.23), that version's manifest under
        the base key (1.25), which compaction keeps: a client started while a probe serves loads
        it from there once its own serving manifest is compacted away. A delta is not (a client
        rebuilds it from its chain; a candidate that starts a trial is a full snapshot)."""
        base = self._base()
        held = self.gate.versions.get(base) if self.gate is not None and base is not None else None
        if held is not None and not isinstance(held[0], DeltaManifest):
            await self.publisher.set_base(held[0])

    async def settle(self, published: Published) -> None:
        """The gate judges a candidate now; a checkpoint served at once becomes its reference."""
        if self.gate is None:
            return
        if published.candidate:
            await self.gate.consider(published.manifest, published.tensors)
        else:
            await self.gate.serve_at_once(published.manifest, published.tensors)
        self._observe_serving()

    @property
    def candidate_waiting(self) -> bool:
        """The rule has open trials or a served version to watch: :meth:`reconsider` looks again."""
        return self.gate is not None and self.gate.pending

    async def reconsider(self) -> None:
        if self.gate is not None:
            await self.gate.reconsider()
            self._observe_serving()


@dataclass
class Published:
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    candidate: bool


def full_manifest(manifest: Manifest, full: bytes) -> Manifest:
    """The manifest of a version's full state: itself for a full snapshot; for a delta, a plain
    manifest naming the full blob (what the local copy holds and a restore checks), whose
    sha256 is the delta's ``state_sha256`` (the full blob is not hashed again).

    >>> from topics.delta import DeltaManifest
    >>> d = DeltaManifest("p", 2, 0.0, "periodic", {}, 0.5, 0.0, "a" * 64, 9, 1, base_version=1,
    ...                   state_sha256=sha256_hex(b"full"))
    >>> m = full_manifest(d, b"full")
    >>> type(m).__name__, m.sha256 == sha256_hex(b"full"), m.size
    ('Manifest', True, 4)
    """
    if not isinstance(manifest, DeltaManifest):
        return manifest
    base = {f.name: getattr(manifest, f.name) for f in fields(Manifest)}
    base.update(sha256=manifest.state_sha256, size=len(full), chunks=len(split_chunks(full)), signature=None)
    return Manifest(**base)
