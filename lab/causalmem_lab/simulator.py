"""A simulated agent environment with known ground truth (demo and benchmarks).

Query intents each have helpful, harmful and irrelevant-but-similar memories, plus a
background of unrelated ones. Harmful memories are *similar to the query* yet lower the
answer's utility, like seed 000's "Zhang San" case: similarity alone cannot tell them
apart. Each intent has a memory need (how much the answer depends on memory); a
human rating of a query is a noisy reading of that need, and a step's utility is
``need · mean(effect of the selected memories) + noise``. On a share ``attribution_rate``
of steps the feedback also measures each selected memory on its own (leave-one-out
NLLs, contract 1.1): ``nll_without_slot[s] = nll_with + need·effect(s)/k + noise``. At ``drift_day`` the
environment changes which memories help: yesterday's helpful memories turn stale
(harmful) and some of the irrelevant-but-similar ones become the helpful ones.

Scenarios are YAML files (see ``lab/causalmem_lab/scenarios/``): any field of :class:`Scenario`.

>>> env = Environment(Scenario(embedding_dim=16, slots=64, intents=2, background=10))
>>> q = env.next_query()
>>> q.embedding.shape, q.intent in (0, 1)
((16,), True)
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.roles import HARMFUL, HELPFUL, IRRELEVANT
from causalmem_lab.textdata import text_bank
from models.serving.params import ServingParams

DAY = 86400.0  # seconds of event time; the lab's one definition
DEFAULT_START_TS = 1_767_225_600.0  # 2026-01-01T00:00:00Z

SCENARIO_DIR = Path(__file__).parent / "scenarios"


@dataclass
class Scenario:
    name: str = "default"
    seed: int = 7
    embedding_dim: int = 384
    slots: int = 1024
    intents: int = 12
    helpful_per_intent: int = 4
    harmful_per_intent: int = 3
    similar_per_intent: int = 4  # irrelevant but similar to the intent's queries
    background: int = 300  # unrelated memories
    query_noise: float = 0.35  # spread of queries around their intent
    helpful_similarity: tuple[float, float] = (0.45, 0.70)
    harmful_similarity: tuple[float, float] = (0.50, 0.75)
    similar_similarity: tuple[float, float] = (0.40, 0.65)
    helpful_effect: float = 1.5
    harmful_effect: float = -1.5
    irrelevant_effect: float = 0.0
    need_range: tuple[float, float] = (0.2, 1.0)
    utility_noise: float = 0.15
    attribution_rate: float = 0.0  # share of steps whose feedback carries nll_without_slot
    steps_per_query: tuple[int, int] = (1, 3)
    days: float = 14.0
    queries_per_day: int = 500
    drift_day: float | None = 8.0
    drift_swap: int = 3  # helpful memories per intent that turn stale at the drift
    rating_rate: float = 0.5
    rating_noise: float = 0.5
    verdict_rate: float = 0.3
    k: int = 3
    n_candidates: int = 20
    temperature: float = 0.05
    explore_rate: float = 0.1  # share of requests served at explore_temperature
    explore_temperature: float = ServingParams.explore_temperature  # the learner's default
    start_ts: float = DEFAULT_START_TS
    text: bool = False  # memories and queries as texts embedded with MiniLM (D=384)

    @classmethod
    def load(cls, path_or_name: str | Path) -> Scenario:
        path = Path(path_or_name)
        if not path.exists():
            path = SCENARIO_DIR / f"{path_or_name}.yaml"
        data = importlib.import_module("yaml").safe_load(path.read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown scenario fields {sorted(unknown)}")
        for key in ("helpful_similarity", "harmful_similarity", "similar_similarity", "need_range", "steps_per_query"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)

    def replace(self, **changes: Any) -> Scenario:
        return Scenario(**{**asdict(self), **{k: v for k, v in changes.items() if v is not None}})

    @property
    def total_queries(self) -> int:
        return int(self.days * self.queries_per_day)


@dataclass
class Step:
    query_id: str
    step: int
    intent: int
    embedding: np.ndarray
    ts: float
    last_step_loss: float
    last_step_entropy: float
    text: str | None = None


@dataclass
class Query:
    query_id: str
    intent: int
    embedding: np.ndarray
    ts: float
    steps: int
    text: str | None = None
    utilities: list[float] = field(default_factory=list)


def _unit(x: np.ndarray) -> np.ndarray:
    return np.asarray(x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-12))


class Environment:
    """Memory bank, queries, utilities, ratings and verdicts with known ground truth."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = s = scenario
        self.rng = np.random.default_rng(s.seed)
        d = s.embedding_dim
        self.need = self.rng.uniform(*s.need_range, size=s.intents)
        self.roles: list[dict[int, int]] = []  # per intent: slot -> role (after the drift too)
        self.intent_of: dict[int, int] = {}
        # the text flavour's queries: per intent, its texts and their embeddings (None: synthetic)
        self.query_texts: list[list[str]] | None = None
        self._query_vectors: list[np.ndarray] | None = None
        per_intent = s.helpful_per_intent + s.harmful_per_intent + s.similar_per_intent
        n = s.intents * per_intent + s.background
        if n > s.slots:
            raise ValueError(f"scenario needs {n} memory slots, the policy has {s.slots}")
        if s.text:
            bank = text_bank(s, self.rng)
            self.centroids, self.memory, self.texts = bank.centroids, bank.memory, bank.texts
            self.query_texts = bank.query_texts
            self._query_vectors = bank.query_vectors
            for k in range(s.intents):
                self.roles.append(dict(bank.roles[k]))
                for slot in bank.roles[k]:
                    self.intent_of[slot] = k
        else:
            self.centroids = _unit(self.rng.normal(size=(s.intents, d))).astype(np.float32)
            memory = np.zeros((n, d), np.float32)
            slot = 0
            for k in range(s.intents):
                roles: dict[int, int] = {}
                for count, role, sim in (
                    (s.helpful_per_intent, HELPFUL, s.helpful_similarity),
                    (s.harmful_per_intent, HARMFUL, s.harmful_similarity),
                    (s.similar_per_intent, IRRELEVANT, s.similar_similarity),
                ):
                    for _ in range(count):
                        memory[slot] = self._near(self.centroids[k], self.rng.uniform(*sim))
                        roles[slot] = role
                        self.intent_of[slot] = k
                        slot += 1
                self.roles.append(roles)
            memory[slot:] = _unit(self.rng.normal(size=(n - slot, d)))
            self.memory = memory
            self.texts = self._synthetic_texts(n)
        self.n_memories = n
        self.drifted = False
        self.query_counter = 0

    def _near(self, c: np.ndarray, rho: float) -> np.ndarray:
        r = self.rng.normal(size=c.shape)
        r -= r.dot(c) * c
        r = _unit(r)
        return (rho * c + math.sqrt(max(0.0, 1 - rho * rho)) * r).astype(np.float32)

    def _synthetic_texts(self, n: int) -> list[str]:
        words = [f"topic{k}" for k in range(self.s.intents)]
        out = []
        for slot in range(n):
            k = self.intent_of.get(slot)
            out.append(f"note {slot} about {words[k]} {words[k]} details" if k is not None else f"note {slot} misc")
        return out

    # ---------------------------------------------------------------- ground truth
    def role(self, slot: int, intent: int) -> int:
        return self.roles[intent].get(slot, IRRELEVANT)

    def helpful(self, intent: int) -> list[int]:
        return [s for s, r in self.roles[intent].items() if r == HELPFUL]

    def harmful(self, intent: int) -> list[int]:
        return [s for s, r in self.roles[intent].items() if r == HARMFUL]

    def apply_drift(self) -> None:
        """The environment changes which memories help (stale facts, new sources)."""
        if self.drifted:
            return
        for roles in self.roles:
            helpful = [s for s, r in roles.items() if r == HELPFUL]
            similar = [s for s, r in roles.items() if r == IRRELEVANT]
            swap = min(self.s.drift_swap, len(helpful), len(similar))
            for slot in helpful[:swap]:
                roles[slot] = HARMFUL
            for slot in similar[:swap]:
                roles[slot] = HELPFUL
        self.drifted = True

    # ---------------------------------------------------------------- traffic
    def day_of(self, ts: float) -> float:
        return (ts - self.s.start_ts) / DAY

    def next_query(self, ts: float | None = None) -> Query:
        s = self.s
        i = self.query_counter
        self.query_counter += 1
        if ts is None:
            ts = s.start_ts + s.days * DAY * i / max(1, s.total_queries)
        if s.drift_day is not None and self.day_of(ts) >= s.drift_day:
            self.apply_drift()
        intent = int(self.rng.integers(s.intents))
        if self._query_vectors is not None and self.query_texts is not None:
            j = int(self.rng.integers(len(self._query_vectors[intent])))
            emb = self._query_vectors[intent][j]
            text = self.query_texts[intent][j]
        else:
            emb = _unit(self.centroids[intent] + s.query_noise * _unit(self.rng.normal(size=s.embedding_dim)))
            text = f"question about topic{intent}"
        steps = int(self.rng.integers(s.steps_per_query[0], s.steps_per_query[1] + 1))
        return Query(f"q-{s.seed}-{i:07d}", intent, emb.astype(np.float32), ts, steps, text)

    def step_features(self, query: Query, step: int) -> Step:
        prev = query.utilities[-1] if query.utilities else None
        loss = 0.0 if prev is None else float(max(0.0, 2.0 - prev))  # last step's answer NLL
        entropy = 0.0 if prev is None else float(1.5 + 0.2 * self.rng.normal())
        return Step(
            query.query_id, step, query.intent, query.embedding, query.ts + 5.0 * step, loss, entropy, query.text
        )

    def utility(self, intent: int, selected: list[int]) -> float:
        """True expected utility of a selection (before noise)."""
        s = self.s
        if not selected:
            return 0.0
        effects = {HELPFUL: s.helpful_effect, HARMFUL: s.harmful_effect, IRRELEVANT: s.irrelevant_effect}
        return float(self.need[intent] * sum(effects[self.role(m, intent)] for m in selected) / s.k)

    def effect(self, intent: int, slot: int) -> float:
        """A selected memory's true contribution to the utility: need · effect(role) / k."""
        s = self.s
        effects = {HELPFUL: s.helpful_effect, HARMFUL: s.harmful_effect, IRRELEVANT: s.irrelevant_effect}
        return float(self.need[intent] * effects[self.role(slot, intent)] / s.k)

    def feedback(self, intent: int, selected: list[int]) -> tuple[float, float, float, dict[int, float] | None]:
        """(true utility, nll_with, nll_without, nll_without_slot or None): u = nll_without − nll_with.

        On a share ``attribution_rate`` of steps with a selection, ``nll_without_slot[s]``
        is ``nll_with`` plus the memory's true effect and noise of the same scale as the
        utility's; otherwise ``None``. With the default rate 0 the random stream is
        exactly what it was before per-memory credit existed.
        """
        true_u = self.utility(intent, selected)
        observed = true_u + self.s.utility_noise * float(self.rng.normal())
        nll_without = 2.0 + 0.2 * abs(float(self.rng.normal()))
        nll_with = nll_without - observed
        per_slot = None
        if self.s.attribution_rate > 0 and selected and self.rng.random() < self.s.attribution_rate:
            noise = self.s.utility_noise * self.rng.normal(size=len(selected))
            per_slot = {
                int(m): max(0.0, nll_with + self.effect(intent, m) + float(e))
                for m, e in zip(selected, noise, strict=True)
            }
        return true_u, nll_with, nll_without, per_slot

    def rating(self, intent: int) -> int | None:
        """How much the query needed memory, 0..5, for a share of queries (else None)."""
        if self.rng.random() >= self.s.rating_rate:
            return None
        r = 5 * (self.need[intent] - self.s.need_range[0]) / max(1e-9, self.s.need_range[1] - self.s.need_range[0])
        return int(np.clip(round(r + self.s.rating_noise * self.rng.normal()), 0, 5))

    def verdict(self, u_query: float) -> bool | None:
        """Was the answer correct? For a share of queries (else None)."""
        if self.rng.random() >= self.s.verdict_rate:
            return None
        return bool(self.rng.random() < 1 / (1 + math.exp(-4 * (u_query + 0.1))))

    # ---------------------------------------------------------------- measures
    def leak(self, intent: int, selected: list[int]) -> bool:
        return any(self.role(m, intent) == HARMFUL for m in selected)

    def recall(self, intent: int, selected: list[int]) -> float:
        helpful = set(self.helpful(intent))
        if not helpful:
            return 0.0
        return len(helpful & set(selected)) / min(self.s.k, len(helpful))


def scenario_retriever(world: Any, scenario: Any, **overrides: Any) -> Any:
    """A :class:`~pipeline.client.retriever.CausalRetriever` over ``world``'s memories, serving
    as ``scenario`` says (k, candidates, temperatures, exploration, seed); ``overrides`` win."""
    from pipeline.client.retriever import CausalRetriever

    args: dict[str, Any] = {
        "texts": world.texts,
        "k": scenario.k,
        "n_candidates": scenario.n_candidates,
        "temperature": scenario.temperature,
        "seed": scenario.seed,
        "explore_rate": scenario.explore_rate,
        "explore_temperature": scenario.explore_temperature,
    }
    return CausalRetriever(world.memory, **{**args, **overrides})


def serve(retriever: Any, st: Step, **kwargs: Any) -> Any:
    """``CausalRetriever.retrieve`` for a simulated step: its features, text and event time."""
    return retriever.retrieve(
        st.embedding,
        st.query_id,
        st.step,
        st.last_step_loss,
        st.last_step_entropy,
        query_text=st.text,
        ts=st.ts,
        **kwargs,
    )


@dataclass
class Tally:
    """Per-retrieval outcomes, for summaries and learning curves."""

    leak: list[bool] = field(default_factory=list)
    recall: list[float] = field(default_factory=list)
    empty: list[bool] = field(default_factory=list)
    utility: list[float] = field(default_factory=list)
    ts: list[float] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    explore: list[bool] = field(default_factory=list)  # served at the exploration temperature

    def record(
        self, env: Environment, intent: int, selected: list[int], utility: float, ts: float, version: int, explore: bool
    ) -> None:
        """One retrieval's outcome, measured against the environment's ground truth."""
        self.add(env.leak(intent, selected), env.recall(intent, selected), not selected, utility, ts, version, explore)

    def add(
        self, leak: bool, recall: float, empty: bool, utility: float, ts: float, version: int, explore: bool = False
    ) -> None:
        self.leak.append(leak)
        self.recall.append(recall)
        self.empty.append(empty)
        self.utility.append(utility)
        self.ts.append(ts)
        self.version.append(version)
        self.explore.append(explore)

    def window(self, start: float, end: float) -> dict[str, float]:
        """Means over a fraction [start, end) of the run."""
        n = len(self.leak)
        a, b = int(n * start), max(int(n * start) + 1, int(n * end))
        sl = slice(a, min(b, n))
        if a >= n:
            return {"leak": float("nan"), "recall": float("nan"), "empty": float("nan"), "utility": float("nan")}
        return {
            "leak": float(np.mean(self.leak[sl])),
            "recall": float(np.mean(self.recall[sl])),
            "empty": float(np.mean(self.empty[sl])),
            "utility": float(np.mean(self.utility[sl])),
        }

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """Means over event time [t0, t1)."""
        ts = np.asarray(self.ts)
        sel = (ts >= t0) & (ts < t1)
        if not sel.any():
            return {"leak": float("nan"), "recall": float("nan"), "empty": float("nan"), "utility": float("nan")}
        return {
            "leak": float(np.mean(np.asarray(self.leak)[sel])),
            "recall": float(np.mean(np.asarray(self.recall)[sel])),
            "empty": float(np.mean(np.asarray(self.empty)[sel])),
            "utility": float(np.mean(np.asarray(self.utility)[sel])),
        }
