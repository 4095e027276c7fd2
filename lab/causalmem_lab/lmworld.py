"""An agent world whose utilities come from a real LM: the real-LM learning benchmark's traffic.

:class:`LMWorld` offers what :class:`causalmem_lab.simulator.Environment` offers to
:func:`causalmem_lab.simrun.run_scenario` (``next_query``, ``step_features``, ``feedback``,
``leak``, ``recall``, ...), over the fictional-fact bank of :mod:`causalmem_lab.lmdata`.
A step's utility is what SmolLM2 measured, read from the cached
:class:`~causalmem_lab.lmdata.LMUtilities`: no noise is added (the LM is deterministic).
Each query is one retrieval step; its "intent" is the question's index.

Traffic asks the training questions only (every paraphrase but ``held_out``); the
benchmark measures the served policy on the held-out paraphrases, whose wording the
learner never saw. A bank with one wording per question (the FanOutQA bank,
:mod:`causalmem_lab.fanout`) has nothing to hold out: traffic then asks every question and
the benchmark measures on the same questions (``test`` = ``train``, whatever ``held_out``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from causalmem_lab.lmdata import LMDataset, LMUtilities
from causalmem_lab.roles import HARMFUL, HELPFUL, IRRELEVANT
from causalmem_lab.simulator import DAY, DEFAULT_START_TS, Query, Step
from models.serving.params import ServingParams


@dataclass
class LMScenario:
    """The traffic of one run; the field names are those run_scenario reads from a Scenario."""

    name: str = "lm"
    seed: int = 0
    events: int = 3000  # retrieval steps (one per query)
    days: float = 6.0  # event time the traffic spans
    attribution_rate: float = 0.0  # share of steps whose feedback carries nll_without_slot
    held_out: int = 3  # the paraphrase never asked in traffic
    embedding_dim: int = 384
    slots: int = 512  # the policy's S: at least the bank's memories (policy_slots)
    k: int = 3
    n_candidates: int = 6  # = the cache's C: the retriever's candidates are the scored ones
    temperature: float = 0.05  # CausalRetriever's defaults (docs/learning.md)
    explore_rate: float = 0.1
    explore_temperature: float = ServingParams.explore_temperature  # the learner's default
    start_ts: float = DEFAULT_START_TS
    need_range: tuple[float, float] = (0.0, 1.0)
    drift_day: float | None = None

    @property
    def total_queries(self) -> int:
        return self.events

    @property
    def queries_per_day(self) -> int:
        return max(1, round(self.events / self.days))


def policy_slots(memories: int, least: int = LMScenario.slots) -> int:
    """The policy's slot count for a bank of ``memories``: ``least``, or the next power of two
    that holds them all (every memory needs a slot of its own).

    >>> policy_slots(300), policy_slots(2215)
    (512, 4096)
    """
    return max(least, 1 << max(0, memories - 1).bit_length())


class LMWorld:
    """Questions, memories and LM-measured utilities, with the simulator Environment's interface.

    Parameters
    ----------
    scenario
        Traffic size, seed, attribution rate, the serving parameters of the client.
    data, utilities
        The bank (:func:`~causalmem_lab.lmdata.build_dataset`) and its cached LM utilities
        (:func:`~causalmem_lab.lmdata.lm_utilities`).
    """

    def __init__(self, scenario: LMScenario, data: LMDataset, utilities: LMUtilities) -> None:
        if utilities.candidates.shape[1] != scenario.n_candidates or utilities.k != scenario.k:
            raise ValueError("the scenario's n_candidates and k must be the cache's C and k")
        if len(data.texts) > scenario.slots:
            raise ValueError(
                f"{len(data.texts)} memories for {scenario.slots} policy slots: "
                f"set LMScenario.slots to at least {policy_slots(len(data.texts))}"
            )
        self.s = scenario
        self.data = data
        self.u = utilities
        self.rng = np.random.default_rng(scenario.seed)
        self.memory = utilities.memory
        self.texts = data.texts
        self.n_memories = len(data.texts)
        self.roles = [data.roles(q) for q in range(len(data.questions))]
        self.need = np.ones(len(data.questions))
        if len(set(data.paraphrase)) > 1:
            self.train = [q for q, p in enumerate(data.paraphrase) if p != scenario.held_out]
            self.test = [q for q, p in enumerate(data.paraphrase) if p == scenario.held_out]
            if not self.test:
                raise ValueError(f"no question is worded as paraphrase {scenario.held_out} (held_out)")
        else:  # one wording per question: nothing to hold out, measured on what traffic asks
            self.train = list(range(len(data.questions)))
            self.test = list(self.train)
        self.query_counter = 0
        self.drifted = False

    # ---------------------------------------------------------------- ground truth
    def role(self, slot: int, intent: int) -> int:
        return self.roles[intent].get(slot, IRRELEVANT)

    def helpful(self, intent: int) -> list[int]:
        return [s for s, r in self.roles[intent].items() if r == HELPFUL]

    def harmful(self, intent: int) -> list[int]:
        return [s for s, r in self.roles[intent].items() if r == HARMFUL]

    def leak(self, intent: int, selected: list[int]) -> bool:
        return any(self.role(m, intent) == HARMFUL for m in selected)

    def recall(self, intent: int, selected: list[int]) -> float:
        """1.0 when the gold fact was read (each question has one)."""
        return float(self.data.gold[intent] in selected)

    def utility(self, intent: int, selected: list[int]) -> float:
        """The LM's ``nll_without − nll_with`` for this set (deterministic)."""
        return self.u.utility(intent, selected) if selected else 0.0

    # ---------------------------------------------------------------- traffic
    def day_of(self, ts: float) -> float:
        return (ts - self.s.start_ts) / DAY

    def next_query(self, ts: float | None = None) -> Query:
        i = self.query_counter
        self.query_counter += 1
        if ts is None:
            ts = self.s.start_ts + self.s.days * DAY * i / max(1, self.s.events)
        q = self.train[int(self.rng.integers(len(self.train)))]
        return Query(f"lm-{self.s.seed}-{i:07d}", q, self.u.query[q], ts, 1, self.data.questions[q])

    def step_features(self, query: Query, step: int) -> Step:
        # One step per query: no previous step, so loss and entropy are 0 as for any first step.
        return Step(query.query_id, step, query.intent, query.embedding, query.ts + 5.0 * step, 0.0, 0.0, query.text)

    def feedback(self, intent: int, selected: list[int]) -> tuple[float, float, float, dict[int, float] | None]:
        """``(true utility, nll_with, nll_without, nll_without_slot)``, all from the LM cache.

        ``nll_without_slot`` (each selected memory left out in turn) comes on a share
        ``attribution_rate`` of steps, and only for sets of candidates (a BM25 fallback's
        subsets were not scored).
        """
        nll_without = float(self.u.nll[intent, 0])
        nll_with = self.u.nll_of(intent, selected) if selected else nll_without
        per_slot = None
        if selected and self.u.mask(intent, selected) is not None and self.rng.random() < self.s.attribution_rate:
            per_slot = {int(s): self.u.nll_of(intent, [m for m in selected if m != s]) for s in selected}
        return nll_without - nll_with, nll_with, nll_without, per_slot

    def rating(self, intent: int) -> int | None:
        return None  # the benchmark measures the learning rule alone: no human labels

    def verdict(self, u_query: float) -> bool | None:
        return None
