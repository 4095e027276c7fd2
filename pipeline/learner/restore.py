"""Restoring the learner when it is elected (docs/architecture.md, "Failure model"; docs/operations.md).

On becoming active a learner reads the model topic and loads the newest checkpoint of
its policy that verifies (serving or candidate), and the Adam moments its local state
directory kept for that very checkpoint. A version whose chunks are missing or corrupt on
the topic is taken from the local directory when the copy there has the manifest's
sha256; otherwise the next older version is tried. It never starts a fresh policy while
any verified checkpoint exists: when the topic holds manifests of the policy and none of
them (nor a local copy) verifies, :class:`RestoreError` says so and the learner exits.

It resumes its inputs at the offsets recorded in the checkpoint's manifest, so a crash
loses no experience and applies none twice: batches are formed by count in offset order,
so a restarted learner replays exactly the batches the crashed one would have applied.

When the model topic is empty (an embedded broker restarted and lost everything) it
restores the newest verified local version instead and republishes that.

Before resuming it re-reads what came before the resume point (:func:`read_history`):
the ids seen within the dedupe horizon (so a duplicate delivered after the restart is
skipped) and the last experiences (warm-up material for a drift reset, the gate's
window). Every read is bounded by an offset known at the start (the resume offset, a
chunk's offset), never "to the end": the cost does not grow with the backlog behind.

A delta version (contract 1.3) counts like any other: its state is its local copy (the
full state, checked against the delta's ``state_sha256``) or, from the topic, its chain's
full snapshot with the deltas replayed (``pipeline.client.chain.fetch_state``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from models.policy.network import Arch
from models.policy.trainer import PolicyTrainer
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.config import Connection
from pipeline.learner.inbox import Key
from pipeline.learner.publishing import Progress, applied_through, is_promotion_copy
from pipeline.learner.store import LocalCheckpoint, LocalStore
from pipeline.modeltopic import ModelTopicIndex, read_range, scan_model_topic
from topics.delta import DeltaManifest
from topics.fields import PROBE, Rejected
from topics.internal import Experience, decode_experience
from topics.manifest import CheckpointError, Manifest
from topics.signing import Key as SigningKey

log = logging.getLogger(__name__)

HISTORY_CHUNK = 20_000  # experiences read back per step when rebuilding the dedupe memory


class RestoreError(RuntimeError):
    """No checkpoint of the policy verifies although the model topic holds some: refuse to start over."""


@dataclass
class Restored:
    """What a restore loaded into the trainer, and where to continue."""

    source: str  # "topic vN" or "local vN"
    version: int
    progress: Progress
    applied: Key | None  # reorder mode: the last experience applied
    offsets: dict[str, int] = field(default_factory=dict)  # resume offsets ("topic:partition")


def load_checkpoint(
    trainer: PolicyTrainer,
    manifest: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor] | None = None,
) -> tuple[Progress, Key | None]:
    """Load a checkpoint (its manifest as a dict) into ``trainer``; returns the learner's progress.

    ``optimizer`` holds the Adam moments saved with this very checkpoint (none: a fresh optimizer).
    """
    metrics = manifest.get("metrics") or {}
    baseline_state = metrics.get("baseline_state") or {"value": manifest.get("baseline", 0.0), "n": 1}
    trainer.load(tensors, baseline_state)
    trainer.updates = int(metrics.get("updates", 0))
    trainer.experiences = int(metrics.get("experiences", 0))
    if optimizer:
        trainer.load_optimizer_tensors(optimizer)
    return Progress.from_metrics(metrics), applied_through(metrics)


def policy_versions(index: ModelTopicIndex, policy: str) -> list[int]:
    """The versions of a policy with an accepted manifest on the topic (full or delta), newest first."""
    return sorted((v for (p, v) in [*index.manifests, *index.deltas] if p == policy), reverse=True)


def manifest_of(index: ModelTopicIndex, policy: str, version: int) -> Manifest | None:
    """A version's accepted manifest, full or delta."""
    return index.manifests.get((policy, version)) or index.deltas.get((policy, version))


def state_sha(manifest: Manifest) -> str:
    """The sha256 of a version's full state (what its local copy holds)."""
    return manifest.state_sha256 if isinstance(manifest, DeltaManifest) else manifest.sha256


async def from_topic(
    bootstrap: str,
    conn: Connection,
    index: ModelTopicIndex,
    trainer: PolicyTrainer,
    store: LocalStore,
    arch: Arch,
) -> Restored | None:
    """The newest checkpoint of the policy on the model topic that verifies, loaded; None if none does.

    Each version's bytes come from the topic, else from the local directory when its copy
    has the manifest's sha256 (the topic may have tombstoned or lost them). A copy of a promoted
    version is not the trainer's state: passed over.
    """
    for version in policy_versions(index, conn.policy):
        manifest = manifest_of(index, conn.policy, version)
        assert manifest is not None
        if is_promotion_copy(manifest.metrics):
            continue
        source = f"topic v{version}"
        try:
            tensors = await fetch_checkpoint(bootstrap, conn, index, manifest)
        except (CheckpointError, ValueError) as exc:
            local = store.verified(version, arch)
            if local is None or local[0]["manifest"].get("sha256") != state_sha(manifest):
                log.error(
                    "learner: checkpoint v%d unverifiable (%s) and no local copy; trying an older one", version, exc
                )
                continue
            log.warning("learner: checkpoint v%d unverifiable on the topic (%s); using the local copy", version, exc)
            tensors, source = local[1], f"local v{version}"
        optimizer = store.optimizer_of(version, state_sha(manifest))
        progress, applied = await asyncio.to_thread(load_checkpoint, trainer, manifest.to_dict(), tensors, optimizer)
        return Restored(source, version, progress, applied, manifest.input_offsets)
    return None


def newest_local(store: LocalStore, arch: Arch) -> LocalCheckpoint | None:
    """The newest local version that verifies against its saved manifest (not a promoted
    version's copy: not the trainer's state)."""
    for version in reversed(store.versions()):
        local = store.verified(version, arch)
        if local is not None and not is_promotion_copy(local[0]["manifest"].get("metrics") or {}):
            return local
    return None


def from_local(trainer: PolicyTrainer, local: LocalCheckpoint) -> Restored:
    """A local checkpoint, loaded (inputs are then read from the beginning: the topics are new)."""
    meta, tensors, optimizer = local
    progress, applied = load_checkpoint(trainer, meta["manifest"], tensors, optimizer)
    version = int(meta["manifest"]["version"])
    return Restored(f"local v{version}", version, progress, applied)


async def serving_checkpoints(
    bootstrap: str, conn: Connection, index: ModelTopicIndex
) -> list[tuple[Manifest, dict[str, torch.Tensor]]]:
    """The policy clients serve (the gate compares candidates with it), if it is readable.

    When it is a probe (contract 1.19: a candidate's weights on the exploration share), the
    incumbent before the probes comes first (the promotion rule's first policy, which a rollback
    of the probe goes back to), then the probe the
    serving one replaced, if any (clients may still log under it): the order they were served
    in. A learner restarted under a probe then holds the rule's state it held before, not the
    probe as its first policy."""
    head = index.serving_head(conn.policy)
    if head is None:
        return []
    chain = [head]
    if head.reason == PROBE:
        # 1.25: a version probes name may be left only under the base key (compaction).
        served = [
            m for m in index.links(conn.policy) if m.version < head.version and m.role in ("serving", "delta", "base")
        ]
        firsts = [i for i, m in enumerate(served) if m.reason != PROBE]
        if firsts:
            chain = [served[firsts[-1]], *served[firsts[-1] + 1 :][-1:], head]
        else:
            log.warning("learner: the probe v%d serves and no incumbent before it is on the topic", head.version)
    out = []
    for manifest in chain:
        try:
            out.append((manifest, await fetch_checkpoint(bootstrap, conn, index, manifest)))
        except CheckpointError as exc:
            log.error("learner: the serving checkpoint v%d is unusable (%s)", manifest.version, exc)
    return out


@dataclass
class History:
    """What came before the resume offset: ids to dedupe (with event time), experiences to keep."""

    ids: list[tuple[str, float]] = field(default_factory=list)  # offset order
    experiences: list[Experience] = field(default_factory=list)  # the last ``keep``, offset order
    read: int = 0  # messages read


def _decode(msgs: list[Any], conn: Connection) -> list[Experience]:
    out = []
    for msg in msgs:
        try:
            out.append(decode_experience(msg.value, conn.limits))
        except Rejected:
            continue
    return out


async def read_history(
    bootstrap: str, conn: Connection, end: int, keep: int, horizon_s: float, chunk: int = HISTORY_CHUNK
) -> History:
    """Re-read the experiences before offset ``end``: back through ``horizon_s`` of event time for ids, ``keep`` kept.

    Reads go backwards in steps of ``chunk`` offsets, each bounded by offsets known before
    it starts, and stop once a whole step is older than the newest event time minus
    ``horizon_s`` (label experiences, whose ``ts`` is their query's, do not count) or at
    offset 0. Memory: one step's messages, the ids and the ``keep`` experiences.
    """
    history = History()
    if end <= 0:
        return history
    topic = conn.topics.experiences.name
    id_steps: list[list[tuple[str, float]]] = []  # newest step first
    exp_steps: list[list[Experience]] = []  # only until ``keep`` are held
    kept = 0
    newest: float | None = None
    hi = end
    while hi > 0:
        lo = max(0, hi - max(chunk, 1))
        msgs = [m async for m in read_range(bootstrap, conn, topic, lo, hi)]
        history.read += len(msgs)
        exps = await asyncio.to_thread(_decode, msgs, conn)
        del msgs
        id_steps.append([(e.id, e.event.ts) for e in exps])
        if kept < keep:
            exp_steps.append(exps[-(keep - kept) :])
            kept += len(exp_steps[-1])
        feedback_ts = [e.event.ts for e in exps if e.kind == "feedback"]
        if newest is None and feedback_ts:
            newest = max(feedback_ts)
        hi = lo
        if newest is not None and feedback_ts and max(feedback_ts) < newest - horizon_s:
            break
    for ids in reversed(id_steps):
        history.ids.extend(ids)
    for exps in reversed(exp_steps):
        history.experiences.extend(exps)
    return history


async def find_version(
    bootstrap: str, conn: Connection, store: LocalStore, arch: Arch, version: int, signing_key: SigningKey | None = None
) -> dict[str, torch.Tensor] | None:
    """A version's weights for a rollback: from the model topic, else from the local directory.

    The local directory keeps more versions than the topic, which tombstones old ones.
    """
    index = await scan_model_topic(bootstrap, conn, signing_key=signing_key)
    manifest = manifest_of(index, conn.policy, version)
    if manifest is not None:
        try:
            return await fetch_checkpoint(bootstrap, conn, index, manifest)
        except CheckpointError as exc:
            log.info("learner: v%d is not complete on the model topic (%s); trying the local copy", version, exc)
    return store.load_version(version, arch)
