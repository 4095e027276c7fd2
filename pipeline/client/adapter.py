"""The framework-free core of the LangChain and LlamaIndex adapters (docs/byo-retriever.md).

:class:`CausalServing` takes the candidates the user's own retriever found — document
ids, scores (higher is better), texts — and serves them the way ``CausalRetriever``
serves its own: ids become memory slots through the :class:`~pipeline.client.idmap.IdSlotMap`,
the served policy masks them, the hard drop and the Plackett–Luce draw pick k
(:mod:`pipeline.client.serving`), and a RetrievalEvent with the true ``logprob``,
``query_text`` and ``memory_texts`` is published. In shadow mode
(:mod:`pipeline.client.shadow`) the incumbent's ranking serves instead, except for the
logged exploration budget.

Each result also says:

* ``memory_conflict``: the step's expected utility — the sum of the selected memories'
  running utility estimates, learned from the feedback sent through :meth:`CausalServing.feedback`
  — is below ``conflict_threshold`` (−0.2): the agent may say it doubts its memories;
* ``early_exit`` and ``saved_latency_s``: the policy's largest mask over *every* mapped
  slot was below ``early_exit_below``, so no candidate could survive a drop at that
  threshold: the search was skipped (the time saved is the search's running mean
  latency) and the fallback served.

The framework modules only translate documents and nodes to :class:`Candidate` and back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from pipeline.client.idmap import IdSlotMap
from pipeline.client.outbox import Outbox
from pipeline.client.serving import FOLLOWED, draw, follow, keep_flags, policy_masks
from pipeline.client.shadow import Decision, ShadowMode, uniform_draw
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import AdapterConfig, Connection, Settings
from topics.events import Features, RetrievalEvent

D = TypeVar("D")

SHOWN_CANDIDATES = 10  # memory texts sent for the selected slots and the first candidates (the evaluator's)


@dataclass
class Candidate(Generic[D]):
    """One document the user's retriever found: its id, score (higher is better), text and the object itself."""

    key: str
    score: float
    text: str | None
    item: D


@dataclass
class Served(Generic[D]):
    """What a retrieval served, and the event that logs it."""

    items: list[D]
    slots: list[int]
    event: RetrievalEvent
    decision: str  # policy | incumbent | explore | fallback | early_exit
    memory_conflict: bool = False
    expected_utility: float | None = None
    saved_latency_s: float = 0.0


Search = Callable[[str, int], list[Candidate[D]]]
AsyncSearch = Callable[[str, int], Awaitable[list[Candidate[D]]]]
Fallback = Callable[[str, int], list[Candidate[D]]]


class CausalServing(Outbox, Generic[D]):
    """Serve candidates from any retriever under the policy; publish what was served.

    Parameters
    ----------
    embed_query
        Text → the query embedding the policy sees (dimension ``conn.limits.embedding_dim``).
    conn
        Limits (D, S), the policy name and the topics.
    config
        :class:`~pipeline.config.AdapterConfig`.
    idmap
        The id → slot map, or a path for one (None: in memory, lost on restart).
    publisher
        ``EventPublisher`` (async methods only), ``SyncEventPublisher``, or None: the events
        are only returned (``Served.event``).
    fallback
        ``(query, k) → candidates`` used when the hard drop leaves nothing or on early exit;
        it should differ from the dense retriever (e.g. keyword search). None: serve nothing.
    shadow
        The :class:`ShadowMode` (default: one built from ``config.shadow``).
    publish_on
        ``"retrieve"``: publish each event at once; ``"answer"``: hold it until
        :meth:`answer` (for the evaluator, which needs ``answer_text``) or :meth:`feedback`.
    """

    def __init__(
        self,
        embed_query: Callable[[str], Sequence[float] | np.ndarray],
        conn: Connection | Settings | None = None,
        config: AdapterConfig | None = None,
        idmap: IdSlotMap | str | None = None,
        publisher: Any = None,
        fallback: Fallback[D] | None = None,
        shadow: ShadowMode | None = None,
        publish_on: str = "retrieve",
        max_pending: int = 10_000,
    ) -> None:
        self.conn = Connection.of(conn)
        self.config = config or AdapterConfig()
        slots = self.conn.limits.slots
        self.idmap = idmap if isinstance(idmap, IdSlotMap) else IdSlotMap(slots, idmap)
        if self.idmap.slots > slots:
            raise ValueError(f"the id map has {self.idmap.slots} slots; the pipeline has {slots}")
        self.embed_query = embed_query
        Outbox.__init__(self, publisher, publish_on, max_pending, self.conn.limits.max_text_len)
        self.fallback = fallback
        if shadow is None and self.config.shadow:
            shadow = ShadowMode(self.config.shadow_explore_rate)
        self.shadow = shadow
        self.policy: LoadedPolicy | None = None
        # Serving parameters: the config's explicit values, else the manifest's ``serving`` (set_policy).
        self.explicit = {
            name: getattr(self.config, name) for name in FOLLOWED if getattr(self.config, name) is not None
        }
        self.params = follow(None, self.explicit)
        self.rng = np.random.default_rng(self.config.seed)
        self.search_latency_s: float | None = None  # running mean of the wrapped search
        self.saved_latency_s = 0.0
        self.counts: dict[str, int] = {}

    # ------------------------------------------------------------------ policy
    def set_policy(self, policy: LoadedPolicy | None) -> None:
        """Swap the policy in (use as ``PolicySubscriber``'s ``on_update``); sees shadow mode's cut-over.

        Serves by the manifest's ``serving`` parameters where the config sets none.
        """
        if policy is not None and policy.net.arch.slots < self.idmap.slots:
            raise ValueError(f"policy has {policy.net.arch.slots} slots; the id map {self.idmap.slots}")
        self.policy = policy
        if policy is not None and policy.serving is not None:
            self.params = follow(policy.serving, self.explicit)
        if self.shadow is not None:
            self.shadow.observe(policy)

    @property
    def mode(self) -> str:
        """``"shadow"`` or ``"policy"``."""
        return self.shadow.mode if self.shadow is not None else "policy"

    # ------------------------------------------------------------------ serving
    def _embed(self, query: str) -> np.ndarray:
        q = np.ascontiguousarray(np.asarray(self.embed_query(query), dtype=np.float32).reshape(-1))
        if q.shape[0] != self.conn.limits.embedding_dim:
            raise ValueError(
                f"the query embedding has {q.shape[0]} values; the pipeline expects {self.conn.limits.embedding_dim}"
            )
        return q

    def _decide(self, q: np.ndarray, loss: float, entropy: float) -> Decision | str:
        decision = self.shadow.decide(self.rng) if self.shadow is not None else "policy"
        tau = self.config.early_exit_below
        if decision == "policy" and tau is not None and self.policy is not None and len(self.idmap):
            every = policy_masks(self.policy, q, loss, entropy, np.asarray(self.idmap.assigned()))
            if np.isfinite(every).all() and float(every.max()) < tau:
                return "early_exit"
        return decision

    def serve(
        self,
        query: str,
        search: Search[D],
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
        ts: float | None = None,
    ) -> Served[D]:
        """Serve ``query`` with candidates from ``search(query, n)``; publishes through a sync publisher."""
        q = self._embed(query)
        decision = self._decide(q, last_step_loss, last_step_entropy)
        cands: list[Candidate[D]] = []
        if decision != "early_exit":
            t0 = time.perf_counter()
            cands = search(query, self.config.n_candidates)
            self._timed(time.perf_counter() - t0)
        served = self._finish(query, q, decision, cands, query_id, step, last_step_loss, last_step_entropy, ts)
        for event in self._remember(served.event):
            self._publish_sync(event)
        return served

    async def aserve(
        self,
        query: str,
        search: AsyncSearch[D],
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
        ts: float | None = None,
    ) -> Served[D]:
        """:meth:`serve` with an async search and publisher (``EventPublisher`` or ``SyncEventPublisher``)."""
        q = self._embed(query)
        decision = self._decide(q, last_step_loss, last_step_entropy)
        cands: list[Candidate[D]] = []
        if decision != "early_exit":
            t0 = time.perf_counter()
            cands = await search(query, self.config.n_candidates)
            self._timed(time.perf_counter() - t0)
        served = self._finish(query, q, decision, cands, query_id, step, last_step_loss, last_step_entropy, ts)
        for event in self._remember(served.event):
            await self._publish_async(event)
        return served

    def _timed(self, seconds: float) -> None:
        old = self.search_latency_s
        self.search_latency_s = seconds if old is None else old + 0.1 * (seconds - old)

    def _threshold_scale(self, top_score: float) -> float:
        """Difficulty scaling of the drop threshold: 1 + β·(1 − top score), difficulty clipped to [0, 1]."""
        beta = self.config.difficulty_scaling
        return 1.0 + beta * float(np.clip(1.0 - top_score, 0.0, 1.0)) if beta else 1.0

    def _finish(
        self,
        query: str,
        q: np.ndarray,
        decision: str,
        cands: list[Candidate[D]],
        query_id: str | None,
        step: int,
        loss: float,
        entropy: float,
        ts: float | None,
    ) -> Served[D]:
        cfg = self.config
        seen: dict[int, Candidate[D]] = {}
        for c in cands:
            seen.setdefault(self.idmap.slot(c.key), c)  # a store may return one document twice
        slots = np.fromiter(seen, dtype=np.int64, count=len(seen))
        pool = list(seen.values())
        scores = np.array([c.score for c in pool], dtype=np.float64)
        masks = policy_masks(self.policy, q, loss, entropy, slots) if len(slots) else np.zeros(0)
        serving = self.params
        temperature, logprob, probs, fallback = serving.temperature, 0.0, None, False
        kept_pos: list[int] = list(range(len(pool)))
        cand_masks: np.ndarray | None = masks
        dropped: list[int] = []
        saved = 0.0
        if decision == "early_exit":
            saved = self.search_latency_s or 0.0
            self.saved_latency_s += saved
            chosen: list[Candidate[D]] = []
        elif decision == "incumbent":
            chosen, fallback, kept_pos = pool[: cfg.k], True, []  # the incumbent is another retriever
        elif decision == "explore":
            pos, logprob = uniform_draw(len(pool), cfg.k, self.rng)
            chosen = [pool[p] for p in pos]
            probs = np.full(len(pool), 1.0 / len(pool)) if pool else None
        else:
            ratio_scale = self._threshold_scale(float(scores.max())) if len(scores) else 1.0
            drop: str | float = serving.drop
            if not isinstance(drop, str):
                drop = float(drop) * ratio_scale
            ratio = serving.drop_ratio * ratio_scale
            keep = keep_flags(masks, drop, ratio=ratio) if len(masks) else np.zeros(0, bool)
            kept_pos = [int(i) for i in np.flatnonzero(keep)]
            dropped = [int(s) for s in slots[~keep]]
            cand_masks = masks[keep]
            explore = serving.explore_rate > 0 and self.rng.random() < serving.explore_rate
            temperature = serving.explore_temperature if explore else serving.temperature
            if kept_pos:
                alpha = self.policy.alpha if self.policy is not None else 0.0
                d = draw(scores[keep], masks[keep], alpha, temperature, cfg.k, self.rng)
                chosen, logprob, probs = [pool[kept_pos[p]] for p in d.positions], d.logprob, d.probs
            else:
                chosen = []
        if not chosen and decision in ("policy", "early_exit"):
            chosen = self.fallback(query, cfg.k)[: cfg.k] if self.fallback is not None else []
            fallback, kept_pos, cand_masks, probs, logprob = True, [], None, None, 0.0
            decision = decision if decision == "early_exit" else "fallback"
        chosen_slots = [self.idmap.slot(c.key) for c in chosen]
        event = self._event(
            query, q, query_id, step, loss, entropy, ts, pool, slots, scores, kept_pos, chosen, chosen_slots
        )
        event.temperature, event.logprob, event.fallback = temperature, float(logprob), fallback
        event.candidate_masks = cand_masks if not fallback and cand_masks is not None else None
        event.candidate_probs = probs
        event.dropped = dropped or None
        event.mask_max = float(masks.max()) if len(masks) and np.isfinite(masks).all() else None
        expected = self.utility.expected(chosen_slots)
        self.counts[decision] = self.counts.get(decision, 0) + 1
        return Served(
            items=[c.item for c in chosen],
            slots=chosen_slots,
            event=event,
            decision=decision,
            memory_conflict=expected is not None and expected < cfg.conflict_threshold,
            expected_utility=expected,
            saved_latency_s=saved,
        )

    def _event(
        self,
        query: str,
        q: np.ndarray,
        query_id: str | None,
        step: int,
        loss: float,
        entropy: float,
        ts: float | None,
        pool: list[Candidate[D]],
        slots: np.ndarray,
        scores: np.ndarray,
        kept_pos: list[int],
        chosen: list[Candidate[D]],
        chosen_slots: list[int],
    ) -> RetrievalEvent:
        limit = self.conn.limits.max_text_len
        texts: dict[int, str] = {}
        for s, c in [*zip(chosen_slots, chosen, strict=True), *((int(slots[p]), pool[p]) for p in kept_pos)]:
            if c.text is not None and (s in texts or len(texts) < len(chosen_slots) + SHOWN_CANDIDATES):
                texts[s] = c.text[:limit]
        return RetrievalEvent(
            event_id=uuid.uuid4().hex,
            query_id=query_id or uuid.uuid4().hex,
            step=step,
            ts=time.time() if ts is None else ts,
            features=Features(q, float(loss), float(entropy)),
            candidates=[int(slots[p]) for p in kept_pos],
            scores=scores[kept_pos] if kept_pos else np.zeros(0),
            selected=chosen_slots,
            temperature=self.params.temperature,
            logprob=0.0,
            fallback=False,
            policy=self.conn.policy,
            policy_version=self.policy.version if self.policy is not None else 0,
            query_text=query[:limit],
            memory_texts=texts or None,
        )
