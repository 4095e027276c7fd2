"""Following delta chains (contract 1.3, docs/contract.md §7.1): find a delta's links, fetch, verify, replay.

A delta names its base link by version and id (``topics.delta``). :func:`chain_to` walks
from a delta back to the full snapshot its chain starts from, checking every link's id
against the next one's ``base_sha256``; :func:`fetch_state` loads that full snapshot and
replays the deltas in order, then checks the result against the last delta's
``state_sha256``. Clients use it when they miss a link or a check fails; the learner uses it
to restore a delta version. The subscriber's fast path (one delta onto the policy it
holds) is :func:`fetch_delta` plus ``models.policy.delta.apply_delta``.
"""

from __future__ import annotations

import torch

from models.policy.delta import Delta, apply_delta, decode_delta, state_sha256
from models.policy.network import Arch
from models.policy.weights import verify_and_load
from pipeline.config import Connection, Settings
from pipeline.modeltopic import ModelTopicIndex, fetch_blob
from topics.delta import DeltaManifest
from topics.manifest import CheckpointError, Manifest


def arch_of(manifest: Manifest) -> Arch:
    """The architecture a manifest declares."""
    a = manifest.arch
    return Arch(embedding_dim=int(a["embedding_dim"]), slots=int(a["slots"]), hidden=int(a["hidden"]))


def chain_to(index: ModelTopicIndex, manifest: DeltaManifest) -> tuple[Manifest, list[DeltaManifest]]:
    """The full snapshot ``manifest``'s chain starts from, and the deltas from it to ``manifest``
    (:meth:`ModelTopicIndex.chain_to`). Raises :class:`CheckpointError` (``missing_link``)."""
    return index.chain_to(manifest)


async def fetch_delta(
    bootstrap: str,
    conn: Connection | Settings,
    index: ModelTopicIndex,
    manifest: DeltaManifest,
    topic: str | None = None,
    blob: bytes | memoryview | None = None,
    digest: str | None = None,
) -> Delta:
    """A delta's blob (``blob`` when the caller already holds it, else fetched), verified and decoded.

    ``digest``: the sha256 the caller computed over exactly these bytes as they arrived.
    """
    if blob is None:
        blob, digest = await fetch_blob(bootstrap, conn, index, manifest, topic), None
    return decode_delta(blob, manifest.sha256, manifest.size, arch_of(manifest), manifest.base_sha256, digest)


async def fetch_state(
    bootstrap: str,
    conn: Connection | Settings,
    index: ModelTopicIndex,
    manifest: Manifest,
    topic: str | None = None,
) -> dict[str, torch.Tensor]:
    """A version's tensors: a full snapshot's, or a delta's by replaying its chain from its full snapshot.

    The replayed state is checked against the delta's ``state_sha256``. Raises
    :class:`CheckpointError`.
    """
    if not isinstance(manifest, DeltaManifest):
        blob = await fetch_blob(bootstrap, conn, index, manifest, topic)
        return verify_and_load(blob, manifest.sha256, manifest.size, arch_of(manifest))
    full, links = chain_to(index, manifest)
    tensors = await fetch_state(bootstrap, conn, index, full, topic)
    for link in links:
        apply_delta(tensors, await fetch_delta(bootstrap, conn, index, link, topic))
    if state_sha256(tensors) != manifest.state_sha256:
        raise CheckpointError("state_mismatch", f"v{manifest.version}: replayed state differs from state_sha256")
    return tensors
