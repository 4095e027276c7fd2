"""The client's memories by id: removals are tombstones skipped by searches, compacted in one pass."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.client import memory_index
from pipeline.client.memory_index import IdIndex


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_searches_after_removals_and_replacements_equal_an_index_built_from_the_survivors(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(memory_index, "COMPACT_MIN", 8)
    rng = np.random.default_rng(0)
    vecs = _unit(rng, 60, 8)
    idx = IdIndex(8)
    idx.add_many([f"m{i}" for i in range(60)], vecs)
    gone = [f"m{i}" for i in range(0, 60, 3)]
    for m in gone[:5]:
        assert idx.remove(m)
    assert len(idx._dead) == 5  # below the compaction threshold: tombstones in the index
    assert idx._index.ntotal == 60
    for m in gone[5:]:
        idx.remove(m)
    # Compacted each time 8 tombstones (≥ 10% of the index) gathered: twice, 4 left.
    assert len(idx._dead) == 4 and idx._index.ntotal == 44 and len(idx) == 40
    moved = _unit(rng, 1, 8)[0]
    idx.add("m1", moved)  # a replacement leaves a tombstone too
    assert len(idx._dead) == 5 and not idx.remove("m0")
    live = {f"m{i}": vecs[i] for i in range(60) if f"m{i}" not in gone} | {"m1": moved}
    names, mat = list(live), np.stack(list(live.values()))
    for q in _unit(rng, 20, 8):
        ids, scores = idx.search(q, 7)
        want = np.argsort(-(mat @ q), kind="stable")[:7]
        assert ids == [names[i] for i in want]
        np.testing.assert_allclose(scores, (mat @ q)[want], rtol=1e-5)
    assert len(idx.search(_unit(rng, 1, 8)[0], 100)[0]) == len(live) == len(idx)


def test_text_search_follows_adds_and_never_returns_a_removed_memory() -> None:
    idx = IdIndex(2)
    idx.add("a", np.array([1.0, 0.0]), "the capital of freedonia is fredville")
    idx.add("b", np.array([0.0, 1.0]), "sylvania exports cheese")
    assert idx.text_search("freedonia capital", 5) == ["a"]
    idx.add("c", np.array([0.6, 0.8]), "freedonia borders sylvania")
    assert sorted(idx.text_search("freedonia", 5)) == ["a", "c"]  # rebuilt after the change
    idx.remove("a")
    assert idx.text_search("freedonia", 5) == ["c"]


@pytest.mark.slow  # several seconds: make test runs it, make check does not
def test_an_ivf_base_keeps_its_nprobe_with_tombstones_and_a_wrong_base_is_refused() -> None:
    import faiss
    import pytest

    rng = np.random.default_rng(1)
    x = _unit(rng, 2000, 8)
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(8), 8, 32, faiss.METRIC_INNER_PRODUCT)
    ivf.train(x)
    ivf.nprobe = 32  # every list: the IVF answers exactly, tombstones or not
    idx = IdIndex(8, base=ivf)
    idx.add_many([f"m{i}" for i in range(2000)], x)
    for i in range(0, 2000, 7):
        idx.remove(f"m{i}")
    assert idx._dead  # some not yet compacted: searched with an IVF selector
    live = [i for i in range(2000) if i % 7]
    for q in _unit(rng, 10, 8):
        want = [f"m{live[j]}" for j in np.argsort(-(x[live] @ q))[:5]]
        assert idx.search(q, 5)[0] == want
    with pytest.raises(ValueError, match="trained, empty inner-product"):
        IdIndex(8, base=faiss.IndexFlatL2(8))
    with pytest.raises(ValueError):
        IdIndex(4, base=ivf)


def test_a_retriever_searches_the_approximate_index_it_is_given_by_slot_and_by_id() -> None:
    import faiss
    import pytest

    from pipeline.client.retriever import CausalRetriever

    rng = np.random.default_rng(2)
    x = _unit(rng, 500, 8)

    def ivf() -> faiss.Index:
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(8), 8, 8, faiss.METRIC_INNER_PRODUCT)
        index.train(x)
        index.nprobe = 8
        return index

    by_slot = CausalRetriever(x, k=3, n_candidates=5, faiss_index=ivf())
    assert isinstance(by_slot.index, faiss.IndexIVFFlat) and by_slot.index.ntotal == 500
    assert by_slot.search(x[3], 1)[0].tolist() == [3]
    by_id = CausalRetriever(x, k=3, n_candidates=5, memory_ids=[f"m{i}" for i in range(500)], faiss_index=ivf())
    assert by_id.memories is not None and by_id.memories.search(x[3], 1)[0] == ["m3"]
    with pytest.raises(ValueError, match="trained, empty"):
        CausalRetriever(x, faiss_index=faiss.IndexFlatIP(4))
