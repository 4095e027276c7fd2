"""Client side: :class:`CausalRetriever`, retrieval under the policy's intervention mask.

It applies the serving rule (docs/contract.md §6, docs/learning.md): candidates from a faiss index, the policy's mask on
them, the hard drop (dynamic threshold by default), Plackett–Luce selection with
temperature T over ``z = score·(1+α·m)/T``, and a *different* retriever (BM25 over the
memory texts) when the drop leaves nothing. Each call returns the memories and the
RetrievalEvent to publish, with the true ``logprob`` of what it selected.

    retriever = CausalRetriever(embeddings, texts=texts)
    async with PolicySubscriber(bootstrap, on_update=retriever.set_policy):
        result = retriever.retrieve(query_vec, query_id="q1", step=0, query_text="...")
        await publisher.publish(result.event)
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import faiss
import numpy as np

from models.serving import ServingParams
from models.serving_rule import DYNAMIC_DROP_RATIO, revive_dropped
from pipeline.client.serving import draw, keep_flags, policy_masks
from pipeline.client.subscriber import LoadedPolicy
from pipeline.component_config import Connection
from pipeline.config import Settings
from topics.events import Features, RetrievalEvent

log = logging.getLogger(__name__)

FallbackFn = Callable[[str | None, np.ndarray, int], list[int]]


@dataclass
class RetrievalResult:
    slots: list[int]
    texts: list[str] | None
    event: RetrievalEvent


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


class CausalRetriever:
    """Retrieval with the intervention mask; memory slot i is row i of ``embeddings``.

    ``drop``: ``"dynamic"`` (m_i < 0.01·max m, the contract), a float for a fixed
    threshold, or ``"none"`` (soft intervention only: re-rank, never drop).
    ``explore_revive``: on an exploratory request (``explore_rate``), each dropped
    candidate is kept anyway with this probability (0 turns it off).

    Serving parameters (``temperature``, ``explore_rate``, ``explore_temperature``,
    ``drop``): an explicit argument wins; otherwise the loaded checkpoint's manifest
    ``serving`` field (what the learner was configured with and the promotion gate judged
    the policy under) sets them; otherwise T = 0.05, no exploration, explore T = 0.25,
    dynamic drop.

    ``policy`` names the policy on the events (default: ``conn.policy``). ``conn`` (a
    :class:`~pipeline.component_config.Connection` or ``Settings``), when given, also checks the
    memories against the pipeline's limits (dimension, number of slots).
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
        explore_revive: float = 0.1,
    ) -> None:
        self.embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        self.conn = Connection.of(conn) if conn is not None else None
        if self.conn is not None:
            n, dim = self.embeddings.shape
            if dim != self.conn.limits.embedding_dim:
                raise ValueError(
                    f"memories have dimension {dim}; the pipeline expects {self.conn.limits.embedding_dim}"
                )
            if n > self.conn.limits.slots:
                raise ValueError(f"{n} memories for {self.conn.limits.slots} slots")
        self.index = faiss.IndexFlatIP(self.embeddings.shape[1])
        self.index.add(self.embeddings)
        self.texts = list(texts) if texts is not None else None
        self.k = k
        self.n_candidates = n_candidates
        self.explicit = {
            name: value
            for name, value in (
                ("temperature", temperature),
                ("drop", drop),
                ("explore_rate", explore_rate),
                ("explore_temperature", explore_temperature),
            )
            if value is not None
        }
        self.temperature = temperature if temperature is not None else 0.05
        self.drop: str | float = drop if drop is not None else "dynamic"
        self.drop_ratio = DYNAMIC_DROP_RATIO
        if fallback is None and self.texts is not None:
            fallback = BM25Fallback(self.texts)
        if fallback is None:
            log.warning("CausalRetriever without texts or a fallback: an empty hard drop returns nothing")
        self.fallback = fallback
        self.policy_name = policy or (self.conn.policy if self.conn is not None else "default")
        self.policy: LoadedPolicy | None = None
        self.rng = np.random.default_rng(seed)
        # Exploration: a share of requests is served at a higher temperature (logged on the
        # event, so the learner's log π uses it). A near-greedy policy has log π ≈ 0 for
        # what it picks and learns nothing more; these requests keep the gradient alive.
        self.explore_rate = explore_rate if explore_rate is not None else 0.0
        self.explore_temperature = explore_temperature if explore_temperature is not None else 0.25
        # Exploratory requests also give each dropped candidate this chance back, so a
        # dropped memory can be read, and relearnt, again (docs/contract.md §6, step 3b).
        self.explore_revive = explore_revive

    def set_policy(self, policy: LoadedPolicy | None) -> None:
        """Swap the policy in (use as PolicySubscriber's ``on_update``)."""
        if policy is not None and policy.net.arch.slots < self.embeddings.shape[0]:
            raise ValueError(f"policy has {policy.net.arch.slots} slots for {self.embeddings.shape[0]} memories")
        self.policy = policy
        if policy is not None and policy.serving is not None:
            self.follow(policy.serving)

    def follow(self, params: ServingParams) -> None:
        """Serve by ``params`` except where the constructor was given an explicit value."""
        for name, value in (
            ("temperature", params.temperature),
            ("drop", params.drop_spec),
            ("explore_rate", params.explore_rate),
            ("explore_temperature", params.explore_temperature),
        ):
            if name not in self.explicit:
                setattr(self, name, value)
        if "drop" not in self.explicit:
            self.drop_ratio = params.drop_ratio

    def candidate_masks(
        self, query_embedding: np.ndarray, loss: float, entropy: float, slots: np.ndarray
    ) -> np.ndarray:
        return policy_masks(self.policy, query_embedding, loss, entropy, slots)

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
        slots, scores = self.search(q, self.n_candidates)
        masks = self.candidate_masks(q, last_step_loss, last_step_entropy, slots)
        keep = keep_flags(masks, self.drop, self.drop_ratio)
        explore = self.explore_rate > 0 and self.rng.random() < self.explore_rate
        temperature = self.explore_temperature if explore else self.temperature
        if explore and self.explore_revive > 0:
            keep = revive_dropped(keep, self.explore_revive, self.rng) & np.isfinite(masks)
        kept, kept_scores, kept_masks = slots[keep], scores[keep], masks[keep]
        alpha = self.policy.alpha if self.policy is not None else 0.0
        version = self.policy.version if self.policy is not None else 0
        if len(kept) == 0:
            fb = self.fallback(query_text, q, self.k) if self.fallback is not None else []
            selected, logprob, probs = [int(s) for s in fb][: self.k], 0.0, None
            candidates, cand_scores, cand_masks, fallback = [], np.zeros(0), None, True
        else:
            d = draw(kept_scores, kept_masks, alpha, temperature, self.k, self.rng)
            selected, logprob, probs = [int(kept[p]) for p in d.positions], d.logprob, d.probs
            candidates, cand_scores, cand_masks, fallback = [int(s) for s in kept], kept_scores, kept_masks, False
        memory_texts = None
        if with_texts and self.texts is not None:
            shown = set(selected) | set(candidates[:10])
            memory_texts = {s: self.texts[s] for s in shown}
        event = RetrievalEvent(
            event_id=uuid.uuid4().hex,
            query_id=query_id,
            step=step,
            ts=time.time() if ts is None else ts,
            features=Features(q, float(last_step_loss), float(last_step_entropy)),
            candidates=candidates,
            scores=cand_scores,
            selected=selected,
            temperature=temperature,
            logprob=float(logprob),
            fallback=fallback,
            policy=self.policy_name,
            policy_version=version,
            mask_max=float(masks.max()) if len(masks) and np.isfinite(masks).all() else None,
            query_text=query_text,
            memory_texts=memory_texts,
            dropped=[int(s) for s in slots[~keep]],
            candidate_masks=cand_masks,
            candidate_probs=probs,
        )
        texts = [self.texts[s] for s in selected] if self.texts is not None else None
        return RetrievalResult(slots=selected, texts=texts, event=event)
