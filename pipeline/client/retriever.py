"""Client side: :class:`CausalRetriever`, retrieval under the policy's intervention mask.

It applies the serving rule (docs/contract.md §6, docs/learning.md): candidates from a faiss index, the policy's mask on
them, the hard drop (dynamic threshold by default), Plackett–Luce selection with
temperature T over ``z = score·(1+α·m)/T``, and a *different* retriever (BM25 over the
memory texts) when the drop leaves nothing. Each call returns the memories and the
RetrievalEvent to publish, with the true ``logprob`` of what it selected. It serves
through the client's one serving core (:mod:`pipeline.client.serving_core`), as the
LangChain and LlamaIndex adapters do: the retriever itself searches, computes the masks
(overlapped with the search) and names memories by slot or by id.

    retriever = CausalRetriever(embeddings, texts=texts)
    async with PolicySubscriber(bootstrap, on_update=retriever.set_policy, on_canary=retriever.set_canary):
        result = retriever.retrieve(query_vec, query_id="q1", step=0, query_text="...")
        await publisher.publish(result.event)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import faiss
import numpy as np

from models.serving.params import ServingParams
from pipeline.client.choice import event_labels
from pipeline.client.memory_index import IdIndex
from pipeline.client.overlap import FeatureOverlap
from pipeline.client.serving import masks_from_features, policy_features
from pipeline.client.serving_core import EXPLORE_REVIVE, Found, ServingCore
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import Connection, Settings
from topics.events import Features, RetrievalEvent

log = logging.getLogger(__name__)

V = TypeVar("V")
FallbackFn = Callable[[str | None, np.ndarray, int], list[int]]


NEUTRAL_MASK = 1.0  # softplus(NEUTRAL_BIAS): the mask of a fresh row (models/policy/network.py neutral_out)


@dataclass
class RetrievalResult:
    slots: list[int]  # by id: the event's labels of the selected memories (see ``ids``)
    texts: list[str] | None
    event: RetrievalEvent
    ids: list[str] | None = None  # the selected memories' ids, when memories are named by id


class BM25Fallback:
    """Sparse retrieval over the memory texts (a fallback must differ from the dense retriever)."""

    def __init__(self, texts: Sequence[str]) -> None:
        import bm25s

        self._bm25 = bm25s.BM25()
        self._bm25.index(bm25s.tokenize(list(texts), show_progress=False), show_progress=False)
        self._n = len(texts)

    def __call__(self, query_text: str | None, query_embedding: np.ndarray, k: int) -> list[int]:
        if not query_text:
            return []
        import bm25s

        tokens = bm25s.tokenize([query_text], show_progress=False)
        try:
            docs, scores = self._bm25.retrieve(tokens, k=min(k, self._n), show_progress=False)
        except ValueError:  # no query token is in the vocabulary
            return []
        return [int(d) for d, s in zip(docs[0], scores[0], strict=False) if s > 0]


class ServingValue(Generic[V]):
    """A serving value in force (``CausalRetriever.temperature`` …), read from and written to its ServingCore."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: CausalRetriever, objtype: type | None = None) -> V:
        value: V = getattr(obj.core.values, self.name)
        return value

    def __set__(self, obj: CausalRetriever, value: V) -> None:
        changed: dict[str, Any] = {self.name: value}
        obj.core.values = dataclasses.replace(obj.core.values, **changed)


class CausalRetriever:
    """Retrieval with the intervention mask; memory slot i is row i of ``embeddings``.

    ``drop``: ``"dynamic"`` (m_i < 0.01·max m, the contract), a float for a fixed
    threshold, or ``"none"`` (soft intervention only: re-rank, never drop).
    ``explore_revive``: on an exploratory request (``explore_rate``), each dropped
    candidate is kept anyway with this probability (0 turns it off).

    Serving parameters (``temperature``, ``explore_rate``, ``explore_temperature``,
    ``drop``): an explicit argument wins; otherwise the loaded checkpoint's manifest
    ``serving`` field (what the learner was configured with and the promotion gate judged
    the policy under) sets them; otherwise what a manifest without ``serving`` means
    (docs/contract.md §7: :data:`pipeline.client.serving.UNSERVED`: T = 0.05, 10% of requests
    explored at T = 0.25, dynamic drop, no canary; the learner writes its own values in every
    manifest).

    ``policy`` names the policy on the events (default: ``conn.policy``). ``conn`` (a
    :class:`~pipeline.config.Connection` or ``Settings``), when given, also checks the
    memories against the pipeline's limits (dimension, number of slots).

    *Memories by id* (contract 1.3, docs/contract.md §9): with ``memory_ids`` (one per row of
    ``embeddings``; may be empty) the retriever names memories by id, and
    :meth:`add_memory`/:meth:`remove_memory` (called by a
    :class:`~pipeline.client.follower.MemoryFollower`) change its index at any time. A
    memory's mask comes from the loaded policy when that version holds its row
    (``LoadedPolicy.slot_of``), else it is neutral (1, a fresh row's). Events then carry
    ``candidate_ids``; their slot numbers are labels (the slot when known).

    *Canary* (contract 1.4): :meth:`set_canary` (a
    :class:`~pipeline.client.subscriber.PolicySubscriber`'s ``on_canary``) holds the
    learner's canary, a candidate the promotion gate judges on the requests it serves
    itself. A share of requests (``canary_rate``: the serving manifest's unless given)
    is then served by the canary, as its own manifest says; their events say
    ``canary: true`` and carry the canary's version and probabilities. Where the serving
    manifest says ``canary_coupled`` (contract 1.5), those requests draw both slates with
    the same random numbers instead and serve the canary's on half of those where the two
    differ (:mod:`pipeline.client.choice`); their events carry ``canary_arm``.

    ``faiss_index``: the index to search (default: exact ``IndexFlatIP``); for a large bank a
    trained, empty approximate one (e.g. ``IndexIVFFlat`` with its ``nprobe``, inner
    product), which the memories are added to.

    ``overlap_features``: compute the policy's query features on a worker thread while the
    index searches (:mod:`pipeline.client.overlap`); None (default): while the searches take
    1 ms or more (e.g. an IVF index over 10^6 memories), long enough to hide them.
    :meth:`close` ends that thread.
    """

    def __init__(
        self,
        embeddings: np.ndarray,
        texts: Sequence[str] | None = None,
        k: int = 3,
        n_candidates: int = 20,
        temperature: float | None = None,
        drop: str | float | None = None,
        fallback: FallbackFn | None = None,
        policy: str | None = None,
        seed: int | None = None,
        explore_rate: float | None = None,
        explore_temperature: float | None = None,
        conn: Connection | Settings | None = None,
        explore_revive: float = EXPLORE_REVIVE,
        memory_ids: Sequence[str] | None = None,
        faiss_index: Any = None,
        canary_rate: float | None = None,
        overlap_features: bool | None = None,
    ) -> None:
        self.embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        self.conn = Connection.of(conn) if conn is not None else None
        self.memories: IdIndex | None = None
        if memory_ids is not None:
            if len(memory_ids) != self.embeddings.shape[0]:
                raise ValueError(f"{len(memory_ids)} memory ids for {self.embeddings.shape[0]} embeddings")
            self.memories = IdIndex(self.embeddings.shape[1], base=faiss_index)
            self.memories.add_many(list(memory_ids), self.embeddings, texts)
            texts = None  # kept by id in the index
        if self.conn is not None:
            n, dim = self.embeddings.shape
            if dim != self.conn.limits.embedding_dim:
                raise ValueError(
                    f"memories have dimension {dim}; the pipeline expects {self.conn.limits.embedding_dim}"
                )
            if n > self.conn.limits.slots and self.memories is None:
                raise ValueError(f"{n} memories for {self.conn.limits.slots} slots")
        dim = self.embeddings.shape[1]
        if self.memories is None and faiss_index is not None:
            if faiss_index.d != dim or not faiss_index.is_trained or faiss_index.ntotal:
                raise ValueError(f"faiss_index must be a trained, empty faiss index of dimension {dim}")
            self.index = faiss_index
        else:
            self.index = faiss.IndexFlatIP(dim)
        if self.memories is None:
            self.index.add(self.embeddings)
        self.texts = list(texts) if texts is not None else None
        self.n_candidates = n_candidates
        explicit = {
            "temperature": temperature,
            "drop": drop,
            "explore_rate": explore_rate,
            "explore_temperature": explore_temperature,
            "canary_rate": canary_rate,
        }
        # The serving state and rule every client front shares (pipeline/client/serving_core.py):
        # the policy, the canary, the values in force, and every random draw. Exploration: a
        # share of requests is served at a higher temperature (logged on the event, so the
        # learner's log π uses it); a near-greedy policy has log π ≈ 0 for what it picks and
        # learns nothing more, and these requests keep the gradient alive. They also give each
        # dropped candidate ``explore_revive`` of a chance back, so a dropped memory can be
        # read, and relearnt, again (docs/contract.md §6, step 3b).
        self.core = ServingCore(k=k, explicit=explicit, explore_revive=explore_revive, seed=seed)
        if fallback is None and self.texts is not None:
            fallback = BM25Fallback(self.texts)
        if fallback is None and self.memories is None:
            log.warning("CausalRetriever without texts or a fallback: an empty hard drop returns nothing")
        self.fallback = fallback
        self.policy_name = policy or (self.conn.policy if self.conn is not None else "default")
        self.features = FeatureOverlap(overlap_features)

    @classmethod
    def by_id(cls, dim: int, **kwargs: Any) -> CausalRetriever:
        """A retriever of memories named by id, empty until memories are added (e.g. by a MemoryFollower)."""
        return cls(np.zeros((0, dim), np.float32), memory_ids=[], **kwargs)

    def add_memory(self, memory_id: str, embedding: np.ndarray, text: str | None = None) -> None:
        """Add (or replace) a memory named by id: searchable at once (memories by id only)."""
        if self.memories is None:
            raise TypeError("this retriever numbers its memories by slot: construct it with memory_ids")
        self.memories.add(memory_id, embedding, text)

    def remove_memory(self, memory_id: str) -> bool:
        """Remove a memory named by id; False when it was not there."""
        if self.memories is None:
            raise TypeError("this retriever numbers its memories by slot: construct it with memory_ids")
        return self.memories.remove(memory_id)

    def set_policy(self, policy: LoadedPolicy | None) -> None:
        """Swap the policy in (use as PolicySubscriber's ``on_update``)."""
        if policy is not None and self.memories is None and policy.net.arch.slots < self.embeddings.shape[0]:
            raise ValueError(f"policy has {policy.net.arch.slots} slots for {self.embeddings.shape[0]} memories")
        self.core.set_policy(policy)

    def set_canary(self, canary: LoadedPolicy | None) -> None:
        """Hold the learner's canary (None: it ended); use as PolicySubscriber's ``on_canary``."""
        if canary is not None and self.memories is None and canary.net.arch.slots < self.embeddings.shape[0]:
            raise ValueError(f"canary has {canary.net.arch.slots} slots for {self.embeddings.shape[0]} memories")
        self.core.set_canary(canary)

    def follow(self, params: ServingParams) -> None:
        """Serve by ``params`` except where the constructor was given an explicit value."""
        self.core.follow(params)

    # The serving state lives in ``self.core``; these read it (and set it: the lab and tests
    # tune a retriever's values, or hand it a policy, directly).
    @property
    def policy(self) -> LoadedPolicy | None:
        return self.core.policy

    @policy.setter
    def policy(self, policy: LoadedPolicy | None) -> None:
        self.core.policy = policy  # as it is: no manifest followed, no check

    @property
    def canary(self) -> LoadedPolicy | None:
        return self.core.canary

    @property
    def k(self) -> int:
        return self.core.k

    @k.setter
    def k(self, k: int) -> None:
        self.core.k = k

    @property
    def rng(self) -> np.random.Generator:
        return self.core.rng

    @rng.setter
    def rng(self, rng: np.random.Generator) -> None:
        self.core.rng = rng

    @property
    def explore_revive(self) -> float:
        return self.core.explore_revive

    @explore_revive.setter
    def explore_revive(self, chance: float) -> None:
        self.core.explore_revive = chance

    @property
    def explicit(self) -> dict[str, Any]:
        """The serving values fixed at construction (they win over a manifest's)."""
        return self.core.explicit

    temperature = ServingValue[float]()
    drop = ServingValue[str | float]()
    drop_ratio = ServingValue[float]()
    explore_rate = ServingValue[float]()
    explore_temperature = ServingValue[float]()
    canary_rate = ServingValue[float]()
    canary_coupled = ServingValue[bool]()

    def close(self) -> None:
        """End the features' worker thread if one was started; the retriever stays usable."""
        self.features.close()

    def search(self, query_embedding: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        scores, ids = self.index.search(query_embedding[None], min(n, self.index.ntotal))
        keep = ids[0] >= 0
        return ids[0][keep].astype(np.int64), scores[0][keep].astype(np.float64)

    def retrieve(
        self,
        query_embedding: np.ndarray,
        query_id: str,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
        query_text: str | None = None,
        ts: float | None = None,
        with_texts: bool = True,
    ) -> RetrievalResult:
        q = np.ascontiguousarray(query_embedding, dtype=np.float32)
        ids: list[str] | None = None
        arm = self.core.arm()
        policy = arm.policy
        features = self.features.start(policy, q, last_step_loss, last_step_entropy)  # may run during the search
        started = time.perf_counter()
        if self.memories is None:
            slots, scores = self.search(q, self.n_candidates)
            self.features.observe(time.perf_counter() - started)
            h = features()
            masks = np.zeros(len(slots)) if policy is None or h is None else masks_from_features(policy, h, slots)
        else:
            ids, scores = self.memories.search(q, self.n_candidates)
            self.features.observe(time.perf_counter() - started)
            slots, masks = self._by_id(ids, features(), policy)

        def under(other: LoadedPolicy) -> tuple[np.ndarray, np.ndarray]:  # a coupled canary's view
            h = policy_features(other, q, last_step_loss, last_step_entropy)
            return (slots, masks_from_features(other, h, slots)) if ids is None else self._by_id(ids, h, other)

        def fallback() -> list[Any]:
            if ids is not None:
                assert self.memories is not None
                return self.memories.text_search(query_text, self.k)[: self.k]
            return self.fallback(query_text, q, self.k) if self.fallback is not None else []

        slate = self.core.serve(arm, Found(slots, masks, scores, fallback, ids, under))
        selected, id_of = slate.choice.selected, slate.choice.id_of
        text_of: Callable[[int], str | None] | None = None
        if with_texts and ids is not None:
            memories = self.memories
            assert memories is not None
            text_of = lambda s: memories.text(id_of[s])  # noqa: E731
        elif with_texts and self.texts is not None:
            bank = self.texts
            text_of = lambda s: bank[s]  # noqa: E731
        event = self.core.event(
            slate,
            policy_name=self.policy_name,
            query_id=query_id,
            step=step,
            features=Features(q, float(last_step_loss), float(last_step_entropy)),
            ts=ts,
            query_text=query_text,
            text_of=text_of,
        )
        if ids is not None:
            assert self.memories is not None
            selected_ids = [id_of[s] for s in selected]
            found = [self.memories.text(i) or "" for i in selected_ids]
            return RetrievalResult(slots=selected, texts=found, event=event, ids=selected_ids)
        texts = [self.texts[s] for s in selected] if self.texts is not None else None
        return RetrievalResult(slots=selected, texts=texts, event=event)

    def _by_id(
        self, ids: list[str], h: np.ndarray | None, policy: LoadedPolicy | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Event labels and masks of memories named by id: the policy's where it holds their row, else
        neutral; ``h``: the query's features under ``policy``."""
        known = [policy.slot_of(i) if policy is not None else None for i in ids]
        if policy is None or h is None:
            return np.array(event_labels(known), dtype=np.int64), np.zeros(len(ids))
        masks = np.full(len(ids), NEUTRAL_MASK)
        rows = [j for j, s in enumerate(known) if s is not None]
        if rows:
            masks[rows] = masks_from_features(policy, h, np.array([known[j] for j in rows], dtype=np.int64))
        return np.array(event_labels(known), dtype=np.int64), masks
