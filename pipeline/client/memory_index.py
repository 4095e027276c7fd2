"""Memories by id in a faiss index that grows and shrinks (contract 1.3, docs/contract.md §9).

:class:`IdIndex` holds the memories :class:`~pipeline.client.retriever.CausalRetriever`
serves when they are named by id: a faiss ``IndexIDMap2`` over an exact inner-product
index, whose int64 keys are the index's own numbers for the ids, so a memory can be added,
replaced and removed at any time. Searches and changes hold one lock: a
:class:`~pipeline.client.follower.MemoryFollower` changes the index while requests search it.

Removing a vector from a flat index moves every vector after it (1.5 GB at 10^6 memories
of D = 384), so a removed or replaced memory's vector stays in the index as a tombstone —
searches skip it (a faiss ``IDSelector``) — until tombstones reach a tenth of the index,
when they are removed in one pass. The BM25 index of the texts is rebuilt outside the lock.

>>> import numpy as np
>>> idx = IdIndex(dim=2)
>>> idx.add("a", np.array([1.0, 0.0]), "about a"); idx.add("b", np.array([0.0, 1.0]), "about b")
>>> ids, scores = idx.search(np.array([1.0, 0.1], np.float32), 5)
>>> ids, len(idx)
(['a', 'b'], 2)
>>> idx.remove("a")
True
>>> idx.search(np.array([1.0, 0.1], np.float32), 5)[0], idx.text("b")
(['b'], 'about b')
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import faiss
import numpy as np

COMPACT_MIN = 1024  # tombstones removed in one pass once there are this many ...
COMPACT_SHARE = 0.1  # ... and they are this share of the index's vectors


class IdIndex:
    """Memory id → (vector, text), searchable by inner product; safe to change while searched.

    ``base``: the faiss index the vectors go in (default: exact ``IndexFlatIP``). For a
    million memories, an approximate one: a trained, empty inner-product index such as
    ``IndexIVFFlat`` (searched with its ``nprobe``).

    >>> import faiss
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(400, 4)).astype(np.float32)
    >>> x /= np.linalg.norm(x, axis=1, keepdims=True)
    >>> ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(4), 4, 8, faiss.METRIC_INNER_PRODUCT)
    >>> ivf.train(x); ivf.nprobe = 8  # every list: exact here
    >>> idx = IdIndex(4, base=ivf)
    >>> idx.add_many([f"m{i}" for i in range(400)], x)
    >>> best = idx.search(x[7], 1)[0]
    >>> idx.remove("m7"), best, "m7" in idx.search(x[7], 3)[0]
    (True, ['m7'], False)
    """

    def __init__(self, dim: int, base: Any = None) -> None:
        self.dim = dim
        if base is None:
            base = faiss.IndexFlatIP(dim)
        elif base.d != dim or not base.is_trained or base.ntotal or base.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError("base must be a trained, empty inner-product faiss index of dimension " + str(dim))
        self._index = faiss.IndexIDMap2(base)
        self._base = base  # the map does not own it: kept alive here
        self._key_of: dict[str, int] = {}
        self._id_of: dict[int, str] = {}
        self._texts: dict[str, str] = {}
        self._next_key = 0
        self._dead: set[int] = set()  # keys still in the faiss index whose memory is gone
        self._skip: tuple[Any, ...] | None = None  # search parameters that skip ``_dead``
        self._lock = threading.Lock()
        self._version = 0  # changes so far: a BM25 index built at an older one is stale
        self._bm25: tuple[object, list[str], int] | None = None  # (BM25 index, its ids, version)
        self._building = threading.Lock()  # one BM25 build at a time

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, memory_id: object) -> bool:
        return memory_id in self._key_of

    def add(self, memory_id: str, embedding: np.ndarray, text: str | None = None) -> None:
        """Add ``memory_id``, or replace its vector (and text, when given)."""
        vec = np.ascontiguousarray(np.asarray(embedding, dtype=np.float32).reshape(1, -1))
        if vec.shape[1] != self.dim:
            raise ValueError(f"embedding of {memory_id!r} has {vec.shape[1]} values, not {self.dim}")
        with self._lock:
            old = self._key_of.get(memory_id)
            if old is not None:
                self._bury(old)
            key = self._next_key
            self._next_key += 1
            self._index.add_with_ids(vec, np.array([key], dtype=np.int64))
            self._key_of[memory_id] = key
            self._id_of[key] = memory_id
            if text is not None:
                self._texts[memory_id] = text
            self._version += 1

    def remove(self, memory_id: str) -> bool:
        """Remove ``memory_id``; False when it was not there."""
        with self._lock:
            key = self._key_of.pop(memory_id, None)
            if key is None:
                return False
            self._bury(key)
            self._texts.pop(memory_id, None)
            self._version += 1
            return True

    def _bury(self, key: int) -> None:
        """Tombstone ``key`` (lock held); remove every tombstone in one pass once they are many."""
        del self._id_of[key]
        self._dead.add(key)
        if len(self._dead) >= max(COMPACT_MIN, COMPACT_SHARE * self._index.ntotal):
            self._index.remove_ids(np.fromiter(self._dead, dtype=np.int64, count=len(self._dead)))  # type: ignore[arg-type]
            self._dead.clear()
        self._skip = None

    def _search_params(self) -> Any:
        """Search parameters that skip the tombstones (lock held); None when there are none."""
        if not self._dead:
            return None
        nprobe = getattr(self._base, "nprobe", None)  # an IVF base: searched with its nprobe as set now
        if self._skip is None or self._skip[1] != nprobe:
            batch = faiss.IDSelectorBatch(np.fromiter(self._dead, dtype=np.int64, count=len(self._dead)))
            not_dead = faiss.IDSelectorNot(batch)
            params: Any
            if nprobe is not None:
                params = faiss.SearchParametersIVF(sel=not_dead, nprobe=nprobe)  # type: ignore[call-arg]
            else:
                params = faiss.SearchParameters(sel=not_dead)  # type: ignore[call-arg]
            self._skip = (params, nprobe, not_dead, batch)  # the selectors live as long as the parameters
        return self._skip[0]

    def text(self, memory_id: str) -> str | None:
        return self._texts.get(memory_id)

    def search(self, query: np.ndarray, n: int) -> tuple[list[str], np.ndarray]:
        """The ``n`` nearest memories' ids and inner-product scores (float64), best first."""
        with self._lock:
            if not self._key_of:
                return [], np.zeros(0)
            x = np.ascontiguousarray(query, dtype=np.float32)[None]
            scores, keys = self._index.search(x, min(n, len(self)), params=self._search_params())
            found = [(self._id_of[int(k)], float(s)) for k, s in zip(keys[0], scores[0], strict=True) if k >= 0]
        return [i for i, _ in found], np.array([s for _, s in found], dtype=np.float64)

    def text_search(self, query_text: str | None, k: int) -> list[str]:
        """BM25 over the memories' texts (the fallback when the hard drop leaves nothing)."""
        if not query_text:
            return []
        import bm25s

        built = self._bm25_index(bm25s)
        if built is None:
            return []
        bm25, ids = built
        try:
            docs, scores = bm25.retrieve(
                bm25s.tokenize([query_text], show_progress=False), k=min(k, len(ids)), show_progress=False
            )
        except ValueError:  # no query token is in the vocabulary
            return []
        with self._lock:  # a memory removed since the build is not returned
            return [
                ids[int(d)] for d, s in zip(docs[0], scores[0], strict=False) if s > 0 and ids[int(d)] in self._texts
            ]

    def _bm25_index(self, bm25s: Any) -> tuple[Any, list[str]] | None:
        """The BM25 index of the texts, rebuilt (outside the lock) when the memories changed.

        While one caller rebuilds, others use the index as it was (their results are filtered
        to the memories still there); the first build is waited for.
        """
        current = self._bm25
        if current is not None and current[2] == self._version:
            return current[0], current[1]
        blocking = current is None
        if not self._building.acquire(blocking=blocking):
            return (current[0], current[1]) if current is not None else None
        try:
            with self._lock:
                version = self._version
                ids = [i for i in self._key_of if i in self._texts]
                texts = [self._texts[i] for i in ids]
            if not ids:
                return None
            bm25 = bm25s.BM25()
            bm25.index(bm25s.tokenize(texts, show_progress=False), show_progress=False)
            self._bm25 = (bm25, ids, version)
            return bm25, ids
        finally:
            self._building.release()

    def add_many(self, memory_ids: Sequence[str], embeddings: np.ndarray, texts: Sequence[str] | None = None) -> None:
        for i, memory_id in enumerate(memory_ids):
            self.add(memory_id, embeddings[i], texts[i] if texts is not None else None)
