"""Restoring the learner when it is elected (docs/architecture.md, docs/operations.md).

On becoming active a learner reads the model topic and loads the newest checkpoint of
its policy, serving or candidate (and the Adam moments from its local state directory
when they belong to that version); an unusable one makes it try the next older. It then
resumes its inputs at the offsets recorded in that manifest, so a crash loses no
experience and applies none twice: batches are formed by count in offset order, so a
restarted learner replays exactly the batches the crashed one would have applied.

When the model topic is empty (an embedded broker restarted and lost everything) it
restores from its local directory instead and republishes that.

Before resuming it re-reads what came before the resume point: the ids (so a duplicate
delivered after the restart is skipped) and the experiences (warm-up material for a drift
reset, and the gate's window).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from models.policy import Arch
from models.trainer import PolicyTrainer
from pipeline import kafka
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.config import Connection
from pipeline.learner.inbox import Key
from pipeline.learner.publishing import Progress, applied_through
from pipeline.learner.store import LocalCheckpoint, LocalStore
from pipeline.modeltopic import ModelTopicIndex, scan_model_topic
from topics.fields import Rejected
from topics.internal import Experience, decode_experience
from topics.manifest import CheckpointError, Manifest

log = logging.getLogger(__name__)


@dataclass
class Restored:
    """What a restore loaded into the trainer, and where to continue."""

    source: str  # "topic vN" or "local vN"
    version: int
    progress: Progress
    applied: Key | None  # reorder mode: the last experience applied
    offsets: dict[str, int] = field(default_factory=dict)  # resume offsets ("topic:partition")


def load_checkpoint(
    trainer: PolicyTrainer, manifest: dict[str, Any], tensors: dict[str, torch.Tensor], local: LocalCheckpoint | None
) -> tuple[Progress, Key | None]:
    """Load a checkpoint (its manifest as a dict) into ``trainer``; returns the learner's progress.

    The local optimizer moments are used only when the local copy is this very checkpoint.
    """
    metrics = manifest.get("metrics") or {}
    baseline_state = metrics.get("baseline_state") or {"value": manifest.get("baseline", 0.0), "n": 1}
    trainer.load(tensors, baseline_state)
    trainer.updates = int(metrics.get("updates", 0))
    trainer.experiences = int(metrics.get("experiences", 0))
    if local is not None:
        meta, _, optimizer = local
        if meta["manifest"]["version"] == manifest["version"] and meta["manifest"]["sha256"] == manifest["sha256"]:
            trainer.load_optimizer_tensors(optimizer)
    return Progress.from_metrics(metrics), applied_through(metrics)


async def from_topic(
    bootstrap: str,
    conn: Connection,
    index: ModelTopicIndex,
    trainer: PolicyTrainer,
    local: LocalCheckpoint | None,
) -> Restored | None:
    """The newest usable checkpoint of the policy on the model topic, loaded; None if there is none."""
    manifest = index.newest(conn.policy)
    while manifest is not None:
        try:
            tensors = await fetch_checkpoint(bootstrap, conn, index, manifest)
            progress, applied = load_checkpoint(trainer, manifest.to_dict(), tensors, local)
            return Restored(f"topic v{manifest.version}", manifest.version, progress, applied, manifest.input_offsets)
        except (CheckpointError, ValueError) as exc:
            log.error("learner: checkpoint v%d unusable (%s); trying an older one", manifest.version, exc)
            version = manifest.version
            older = [m for (p, v), m in index.manifests.items() if p == conn.policy and v < version]
            manifest = max(older, key=lambda m: m.version, default=None)
    return None


def from_local(trainer: PolicyTrainer, local: LocalCheckpoint) -> Restored:
    """The local checkpoint, loaded (inputs are then read from the beginning)."""
    meta, tensors, _ = local
    progress, applied = load_checkpoint(trainer, meta["manifest"], tensors, local)
    version = int(meta["manifest"]["version"])
    return Restored(f"local v{version}", version, progress, applied)


async def serving_checkpoint(
    bootstrap: str, conn: Connection, index: ModelTopicIndex
) -> tuple[Manifest, dict[str, torch.Tensor]] | None:
    """The policy clients serve (the gate compares candidates with it), if it is readable."""
    serving = index.serving.get(conn.policy)
    if serving is None:
        return None
    try:
        return serving, await fetch_checkpoint(bootstrap, conn, index, serving)
    except CheckpointError as exc:
        log.error("learner: the serving checkpoint v%d is unusable (%s)", serving.version, exc)
        return None


async def read_history(bootstrap: str, conn: Connection, end: int, keep: int) -> list[Experience]:
    """The last ``keep`` experiences before offset ``end`` of the experiences topic, decoded."""
    if end <= 0:
        return []
    start = max(0, end - max(keep, 1))
    topic = conn.topics.experiences.name
    out: list[Experience] = []
    for msg in await kafka.read_all(bootstrap, conn, topic, partitions=[0], start={0: start}):
        if msg.offset >= end:
            break
        try:
            out.append(decode_experience(msg.value, conn.limits))
        except Rejected:
            continue
    return out


async def find_version(
    bootstrap: str, conn: Connection, store: LocalStore, arch: Arch, version: int
) -> dict[str, torch.Tensor] | None:
    """A version's weights for a rollback: from the model topic, else from the local directory.

    The local directory keeps more versions than the topic, which tombstones old ones.
    """
    index = await scan_model_topic(bootstrap, conn)
    manifest = index.manifests.get((conn.policy, version))
    if manifest is not None:
        try:
            return await fetch_checkpoint(bootstrap, conn, index, manifest)
        except CheckpointError as exc:
            log.info("learner: v%d is not complete on the model topic (%s); trying the local copy", version, exc)
    return store.load_version(version, arch)
