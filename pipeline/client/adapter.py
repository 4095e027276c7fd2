"""The framework-free part of the LangChain and LlamaIndex adapters (docs/byo-retriever.md).

:class:`CausalServing` takes the candidates the user's own retriever found — document
ids, scores (higher is better), texts — and serves them through the same serving core as
``CausalRetriever`` (:mod:`pipeline.client.serving_core`): ids become memory slots through
the :class:`~pipeline.client.idmap.IdSlotMap`; the learner's canary serves its share of the
requests (contract 1.4, 1.5); the arm's policy masks the candidates, the hard drop, the
exploration (with the revival of dropped candidates) and the Plackett–Luce draw pick k; and
the RetrievalEvent, with the true ``logprob``, the canary fields, ``query_text`` and
``memory_texts``, is published. For the same candidates, seed and policies it serves and
logs exactly what ``CausalRetriever`` does. In shadow mode (:mod:`pipeline.client.shadow`)
the incumbent's ranking serves instead, except for the logged exploration budget.

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

from pipeline.client.choice import Choice
from pipeline.client.idmap import IdSlotMap
from pipeline.client.outbox import Outbox
from pipeline.client.serving import CANARY_RATE, FOLLOWED, ServingValues, policy_masks
from pipeline.client.serving_core import EXPLORE_REVIVE, Arm, Found, ServingCore, Slate
from pipeline.client.shadow import Decision, ShadowMode, uniform_draw
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import AdapterConfig, Connection, Settings
from topics.events import Features, RetrievalEvent

D = TypeVar("D")


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


# ``search(query, n, embedding)``: the n candidates of ``query``; ``embedding`` is the query's
# embedding as ``embed_query`` returned it, which a front may search by instead of embedding
# the query again where the wrapped store embeds with the same model.
Search = Callable[[str, int, np.ndarray], list[Candidate[D]]]
AsyncSearch = Callable[[str, int, np.ndarray], Awaitable[list[Candidate[D]]]]
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
        # The serving state and rule every client front shares (pipeline/client/serving_core.py):
        # the config's explicit values, else the manifest's ``serving`` (set_policy); the canary.
        cfg = self.config
        explicit = {name: getattr(cfg, name) for name in (*FOLLOWED, CANARY_RATE)}
        revive = cfg.explore_revive if cfg.explore_revive is not None else EXPLORE_REVIVE
        self.core = ServingCore(k=cfg.k, explicit=explicit, explore_revive=revive, seed=cfg.seed)
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
        self.core.set_policy(policy)
        if self.shadow is not None:
            self.shadow.observe(policy)

    def set_canary(self, canary: LoadedPolicy | None) -> None:
        """Hold the learner's canary (None: it ended; use as ``PolicySubscriber``'s ``on_canary``).

        Served on the serving manifest's ``canary_rate`` of the requests (``AdapterConfig.canary_rate``
        fixes it), as the canary's own manifest says, exactly as ``CausalRetriever`` serves it
        (docs/contract.md §7.2). Shadow mode serves no canary: the policy does not serve yet.
        """
        if canary is not None and canary.net.arch.slots < self.idmap.slots:
            raise ValueError(f"canary has {canary.net.arch.slots} slots; the id map {self.idmap.slots}")
        self.core.set_canary(canary)

    @property
    def policy(self) -> LoadedPolicy | None:
        return self.core.policy

    @property
    def canary(self) -> LoadedPolicy | None:
        return self.core.canary

    @property
    def params(self) -> ServingValues:
        """The serving values in force."""
        return self.core.values

    @property
    def rng(self) -> np.random.Generator:
        return self.core.rng

    @property
    def mode(self) -> str:
        """``"shadow"`` or ``"policy"``."""
        return self.shadow.mode if self.shadow is not None else "policy"

    # ------------------------------------------------------------------ serving
    def _embed(self, query: str) -> tuple[np.ndarray, np.ndarray]:
        """The query's embedding as ``embed_query`` gave it (what a store searches by) and as the
        policy reads it (float32)."""
        raw = np.asarray(self.embed_query(query)).reshape(-1)
        q = np.ascontiguousarray(raw, dtype=np.float32)
        if q.shape[0] != self.conn.limits.embedding_dim:
            raise ValueError(
                f"the query embedding has {q.shape[0]} values; the pipeline expects {self.conn.limits.embedding_dim}"
            )
        return raw, q

    def _decide(self, q: np.ndarray, loss: float, entropy: float) -> tuple[Decision | str, Arm | None]:
        """Shadow mode's decision, then (when the policy serves) the arm; ``"early_exit"`` when the
        arm's policy trusts no mapped memory (a coupled request always searches: both policies draw)."""
        decision = self.shadow.decide(self.rng) if self.shadow is not None else "policy"
        if decision != "policy":
            return decision, None
        arm = self.core.arm()
        tau = self.config.early_exit_below
        if tau is not None and arm.policy is not None and arm.name != "coupled" and len(self.idmap):
            every = policy_masks(arm.policy, q, loss, entropy, np.asarray(self.idmap.assigned()))
            if np.isfinite(every).all() and float(every.max()) < tau:
                return "early_exit", arm
        return decision, arm

    def serve(
        self,
        query: str,
        search: Search[D],
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
        ts: float | None = None,
        *,
        k: int | None = None,
    ) -> Served[D]:
        """Serve ``query`` with candidates from ``search(query, n, embedding)``; publishes through a sync publisher.

        ``k``: the memories to serve for this request (None: ``config.k``); the search is asked
        for ``max(config.n_candidates, k)``, so that a larger k can be served.
        """
        k = self._k(k)
        raw, q = self._embed(query)
        decision, arm = self._decide(q, last_step_loss, last_step_entropy)
        cands: list[Candidate[D]] = []
        if decision != "early_exit":
            t0 = time.perf_counter()
            cands = search(query, max(self.config.n_candidates, k), raw)
            self._timed(time.perf_counter() - t0)
        served = self._finish(query, q, decision, arm, cands, query_id, step, last_step_loss, last_step_entropy, ts, k)
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
        *,
        k: int | None = None,
    ) -> Served[D]:
        """:meth:`serve` with an async search and publisher (``EventPublisher`` or ``SyncEventPublisher``)."""
        k = self._k(k)
        raw, q = self._embed(query)
        decision, arm = self._decide(q, last_step_loss, last_step_entropy)
        cands: list[Candidate[D]] = []
        if decision != "early_exit":
            t0 = time.perf_counter()
            cands = await search(query, max(self.config.n_candidates, k), raw)
            self._timed(time.perf_counter() - t0)
        served = self._finish(query, q, decision, arm, cands, query_id, step, last_step_loss, last_step_entropy, ts, k)
        for event in self._remember(served.event):
            await self._publish_async(event)
        return served

    def _k(self, k: int | None) -> int:
        """This request's k: ``k``, else the config's; a positive integer."""
        if k is None:
            return self.config.k
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        return int(k)

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
        arm: Arm | None,
        cands: list[Candidate[D]],
        query_id: str | None,
        step: int,
        loss: float,
        entropy: float,
        ts: float | None,
        k: int,
    ) -> Served[D]:
        cfg = self.config
        seen: dict[int, Candidate[D]] = {}
        for c in cands:
            seen.setdefault(self.idmap.slot(c.key), c)  # a store may return one document twice
        slots = np.fromiter(seen, dtype=np.int64, count=len(seen))
        scores = np.array([c.score for c in seen.values()], dtype=np.float64)
        policy = arm.policy if arm is not None else self.policy
        masks = policy_masks(policy, q, loss, entropy, slots) if len(slots) else np.zeros(0)
        saved = 0.0
        if decision == "early_exit":
            saved = self.search_latency_s or 0.0
            self.saved_latency_s += saved
        found_by_fallback: dict[int, Candidate[D]] = {}

        def fallback() -> list[int]:
            out = []
            for c in self.fallback(query, k)[:k] if self.fallback is not None else []:
                s = self.idmap.slot(c.key)
                found_by_fallback.setdefault(s, c)
                out.append(s)
            return out

        if arm is None:  # shadow mode: the incumbent's ranking, or the logged exploration over it
            slate = self._shadow(decision, slots, masks, scores, k)
        else:

            def under(other: LoadedPolicy) -> tuple[np.ndarray, np.ndarray]:  # a coupled canary's view
                return slots, policy_masks(other, q, loss, entropy, slots) if len(slots) else np.zeros(0)

            scale = self._threshold_scale(float(scores.max())) if len(scores) else 1.0
            slate = self.core.serve(arm, Found(slots, masks, scores, fallback, under=under), drop_scale=scale, k=k)
            if slate.choice.wrapped:
                decision = "incumbent"  # cold start: no policy yet, the wrapped ranking serves
            elif slate.choice.fallback and decision != "early_exit":
                decision = "fallback"
        items = found_by_fallback if slate.choice.fallback and decision != "incumbent" else seen
        chosen = [items[s] for s in slate.choice.selected]
        texts = {s: c.text for s, c in seen.items()}
        texts.update({s: c.text for s, c in zip(slate.choice.selected, chosen, strict=True)})
        event = self.core.event(
            slate,
            policy_name=self.conn.policy,
            query_id=query_id or uuid.uuid4().hex,
            step=step,
            features=Features(q, float(loss), float(entropy)),
            ts=ts,
            query_text=query[: self.conn.limits.max_text_len],
            text_of=texts.get,
            text_limit=self.conn.limits.max_text_len,
        )
        chosen_slots = list(slate.choice.selected)
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

    def _shadow(self, decision: str, slots: np.ndarray, masks: np.ndarray, scores: np.ndarray, k: int) -> Slate:
        """Shadow mode's slate (:mod:`pipeline.client.shadow`): the incumbent's top k (logged as a
        fallback: another retriever served it), or k of its candidates in a uniformly random order."""
        v, policy = self.core.values, self.policy
        every = np.ones(len(slots), dtype=bool)
        if decision == "incumbent":
            choice = Choice(
                policy=policy,
                labels=slots,
                masks=masks,
                keep=every,
                temperature=v.temperature,
                selected=[int(s) for s in slots[:k]],
                logprob=0.0,
                probs=None,
                candidates=[],
                cand_scores=np.zeros(0),
                cand_masks=None,
                fallback=True,
                id_of={},
            )
        else:
            pos, logprob = uniform_draw(len(slots), k, self.core.rng)
            choice = Choice(
                policy=policy,
                labels=slots,
                masks=masks,
                keep=every,
                temperature=v.temperature,
                selected=[int(slots[p]) for p in pos],
                logprob=logprob,
                probs=np.full(len(slots), 1.0 / len(slots)) if len(slots) else None,
                candidates=[int(s) for s in slots],
                cand_scores=scores,
                cand_masks=masks,
                fallback=False,
                id_of={},
            )
        return Slate(choice, Arm(self.policy, v, "serving"))
