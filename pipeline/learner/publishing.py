"""Checkpoint publishing: what the learner writes on the model topic, and the gate.

A checkpoint is the trainer's tensors (safetensors), a manifest with the learner's
progress in ``metrics`` and the input offsets to resume from (docs/contract.md). With the
promotion gate on, a trained checkpoint is published as a *candidate* and served only
once the gate promotes it; the first policy, rollbacks and drift resets are served at
once (docs/learning.md).

The manifest's ``metrics`` are written by :func:`manifest_metrics` and read back on a
restore by :meth:`Progress.from_metrics` and :func:`applied_through`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.policy import Arch
from models.trainer import PolicyTrainer
from models.weights import to_safetensors
from pipeline.config import LearnerConfig
from pipeline.learner.gate import PromotionGate
from pipeline.learner.inbox import Key
from pipeline.learner.store import LocalStore
from pipeline.metrics import Metrics
from pipeline.modeltopic import CheckpointPublisher
from topics.internal import Experience
from topics.manifest import Manifest

log = logging.getLogger(__name__)

SERVED_AT_ONCE = ("init", "rollback", "reset")  # reasons whose checkpoints skip the gate


@dataclass
class Progress:
    """The learner's counters that checkpoints carry (besides the trainer's own).

    >>> Progress.from_metrics({"labels_applied_total": 5, "resets": 1})
    Progress(labels_since_checkpoint=0, labels_total=5, resets=1)
    """

    labels_since_checkpoint: int = 0
    labels_total: int = 0
    resets: int = 0

    @classmethod
    def from_metrics(cls, metrics: dict[str, Any]) -> Progress:
        return cls(labels_total=int(metrics.get("labels_applied_total", 0)), resets=int(metrics.get("resets", 0)))


def manifest_metrics(
    trainer: PolicyTrainer,
    progress: Progress,
    applied: Key | None,
    batch_size: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest's ``metrics``: what a restore needs, and what operators read."""
    return {
        "updates": trainer.updates,
        "experiences": trainer.experiences,
        "labels_applied": progress.labels_since_checkpoint,
        "labels_applied_total": progress.labels_total,
        "resets": progress.resets,
        "baseline_state": trainer.baseline.state(),
        "lr": trainer.config.lr,
        "batch_size": batch_size,
        "applied_through": list(applied) if applied else None,
        **(extra or {}),
    }


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
        window: Callable[[], Sequence[Experience]],
    ) -> None:
        conn = config.connection
        self.publisher = CheckpointPublisher(
            producer, conn.topics.policy_checkpoints.name, conn.policy, config.keep_versions
        )
        self.store = store
        self.arch = arch
        self.serving = config.serving
        self.metrics = metrics
        self.gate = (
            PromotionGate(config.gate, self.publisher, metrics, window, serving=config.serving) if config.gate else None
        )

    def is_candidate(self, reason: str) -> bool:
        # A drift reset is served at once: the detector has just shown that the serving
        # policy no longer agrees with human judgement, and the gate's window still
        # describes the world before the change.
        return self.gate is not None and reason not in SERVED_AT_ONCE

    async def publish(
        self, trainer: PolicyTrainer, *, reason: str, metrics: dict[str, Any], input_offsets: dict[str, int]
    ) -> Published:
        """Publish the trainer's state and save it locally; :meth:`settle` then hands it to the gate."""
        tensors = trainer.tensors()
        candidate = self.is_candidate(reason)
        manifest = await self.publisher.publish(
            to_safetensors(tensors),
            alpha=float(tensors["alpha"].reshape(-1)[0]),
            reason=reason,
            arch=self.arch.to_dict(),
            baseline=trainer.baseline.get(),
            metrics=metrics,
            input_offsets=input_offsets,
            candidate=candidate,
            serving=self.serving.to_wire(),
        )
        self.store.save(manifest, tensors, trainer.optimizer_tensors(), trainer.baseline.state())
        role = "candidate" if candidate else "serving"
        m = self.metrics
        m.checkpoint_publishes.labels(reason=reason).inc()
        m.checkpoint_version.labels(role=role).set(manifest.version)
        m.checkpoint_timestamp.labels(role=role).set(manifest.created_ts)
        m.checkpoint_bytes.set(manifest.size)
        log.info(
            "learner: published v%d (%s%s) after %d updates",
            manifest.version,
            reason,
            ", candidate" if candidate else "",
            trainer.updates,
        )
        return Published(manifest, tensors, candidate)

    async def settle(self, published: Published) -> None:
        """The gate judges a candidate now; a checkpoint served at once becomes its reference."""
        if self.gate is None:
            return
        if published.candidate:
            await self.gate.consider(published.manifest, published.tensors)
        else:
            self.gate.set_serving(published.manifest, published.tensors)

    @property
    def candidate_waiting(self) -> bool:
        """A candidate lacked data for a decision: :meth:`reconsider` looks at it again."""
        return self.gate is not None and self.gate.pending is not None

    async def reconsider(self) -> None:
        if self.gate is not None:
            await self.gate.reconsider()


@dataclass
class Published:
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    candidate: bool
