"""A forged manifest's claimed size reserves nothing before its data arrives: the fetch plan of a
4 GiB claim in four million chunks, with one chunk on the topic, is decided in a few entries
(it used to list every missing index first: ~160 MB for that claim)."""

from __future__ import annotations

import tracemalloc

import pytest

from pipeline.modeltopic import chunk_plan
from topics.manifest import CheckpointError, Manifest, max_blob_bytes, max_chunks

GIB = 1024**3
# An architecture whose tensors could need 4 GiB, so the decoder's bounds let the claim through.
ARCH = {"input_dim": 10, "hidden": 1024, "slots": 2**20, "embedding_dim": 8}


def forged(version: int = 5) -> Manifest:
    assert max_blob_bytes(ARCH) >= 4 * GIB
    return Manifest("default", version, 1.0, "periodic", ARCH, 0.5, 0.0, "0" * 64, 4 * GIB, max_chunks(4 * GIB))


def peak_bytes(fn: object) -> int:
    tracemalloc.start()
    try:
        assert callable(fn)
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_plan_of_a_huge_claim_allocates_a_few_entries() -> None:
    manifest = forged()
    assert manifest.chunks == 4 * 1024**2

    def plan() -> None:
        with pytest.raises(CheckpointError, match=r"missing_chunk.*\[1, 2, 3, 4, 5\].*holds 1 of 4194304"):
            chunk_plan(manifest, {0: 17})

    assert peak_bytes(plan) < 1024 * 1024


def test_complete_plan_maps_offsets_to_indices() -> None:
    manifest = Manifest("default", 2, 1.0, "periodic", ARCH, 0.5, 0.0, "0" * 64, 3000, 3)
    assert chunk_plan(manifest, {0: 7, 1: 9, 2: 12}) == {7: 0, 9: 1, 12: 2}
    with pytest.raises(CheckpointError, match=r"lacks chunks \[1\]"):
        chunk_plan(manifest, {0: 7, 2: 12, 5: 30})
