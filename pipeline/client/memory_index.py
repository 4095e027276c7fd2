"""Memories by id in a faiss index that grows and shrinks (contract 1.3, docs/contract.md §9).

:class:`IdIndex` holds the memories :class:`~pipeline.client.retriever.CausalRetriever`
serves when they are named by id: a faiss ``IndexIDMap2`` over an exact inner-product
index, whose int64 keys are the index's own numbers for the ids, so a memory can be added,
replaced and removed at any time (``remove_ids``). Searches and changes hold one lock: a
:class:`~pipeline.client.follower.MemoryFollower` changes the index while requests search it.

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

import faiss
import numpy as np


class IdIndex:
    """Memory id → (vector, text), searchable by inner product; safe to change while searched."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._key_of: dict[str, int] = {}
        self._id_of: dict[int, str] = {}
        self._texts: dict[str, str] = {}
        self._next_key = 0
        self._lock = threading.Lock()
        self._bm25: tuple[object, list[str]] | None = None  # (BM25 index, its ids), rebuilt after changes

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
                self._index.remove_ids(np.array([old], dtype=np.int64))  # type: ignore[arg-type]
                del self._id_of[old]
            key = self._next_key
            self._next_key += 1
            self._index.add_with_ids(vec, np.array([key], dtype=np.int64))
            self._key_of[memory_id] = key
            self._id_of[key] = memory_id
            if text is not None:
                self._texts[memory_id] = text
            self._bm25 = None

    def remove(self, memory_id: str) -> bool:
        """Remove ``memory_id``; False when it was not there."""
        with self._lock:
            key = self._key_of.pop(memory_id, None)
            if key is None:
                return False
            self._index.remove_ids(np.array([key], dtype=np.int64))  # type: ignore[arg-type]
            del self._id_of[key]
            self._texts.pop(memory_id, None)
            self._bm25 = None
            return True

    def text(self, memory_id: str) -> str | None:
        return self._texts.get(memory_id)

    def search(self, query: np.ndarray, n: int) -> tuple[list[str], np.ndarray]:
        """The ``n`` nearest memories' ids and inner-product scores (float64), best first."""
        with self._lock:
            if not self._key_of:
                return [], np.zeros(0)
            scores, keys = self._index.search(np.ascontiguousarray(query, dtype=np.float32)[None], min(n, len(self)))
            found = [(self._id_of[int(k)], float(s)) for k, s in zip(keys[0], scores[0], strict=True) if k >= 0]
        return [i for i, _ in found], np.array([s for _, s in found], dtype=np.float64)

    def text_search(self, query_text: str | None, k: int) -> list[str]:
        """BM25 over the memories' texts (the fallback when the hard drop leaves nothing)."""
        if not query_text:
            return []
        import bm25s

        with self._lock:
            if self._bm25 is None:
                ids = [i for i in self._key_of if i in self._texts]
                if not ids:
                    return []
                bm25 = bm25s.BM25()
                bm25.index(bm25s.tokenize([self._texts[i] for i in ids], show_progress=False), show_progress=False)
                self._bm25 = (bm25, ids)
            bm25, ids = self._bm25
        try:
            docs, scores = bm25.retrieve(  # type: ignore[attr-defined]
                bm25s.tokenize([query_text], show_progress=False), k=min(k, len(ids)), show_progress=False
            )
        except ValueError:  # no query token is in the vocabulary
            return []
        return [ids[int(d)] for d, s in zip(docs[0], scores[0], strict=False) if s > 0]

    def add_many(self, memory_ids: Sequence[str], embeddings: np.ndarray, texts: Sequence[str] | None = None) -> None:
        for i, memory_id in enumerate(memory_ids):
            self.add(memory_id, embeddings[i], texts[i] if texts is not None else None)
