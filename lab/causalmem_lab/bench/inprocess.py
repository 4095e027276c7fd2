"""``causalmem bench learning --in-process``: the learning rows in one process, several seeds.

The same retriever, trainer, replay and drift monitor as the pipeline, without Kafka
(:func:`causalmem_lab.offline.run_offline`: a refresh of the served policy every 300
steps, micro-batches of the learner's default size, 64). Minutes per seed instead of the
pipeline's tens, so rows can be compared over several seeds side by side; the figures
are for the policy *as served* (requests not served at the exploration temperature).

Rows on the default scenario (6 days, ~5,900 steps; measured over the last 30%), on
its drift variant (12 days, drift on day 6; correct on the last day against the last day
before the drift) and on the real-LM world (``lm_*``: :class:`causalmem_lab.lmworld.LMWorld`,
utilities from the LM cache of ``causalmem bench learning --lm``, 3,000 steps; the share
of the similarity → oracle gap that the final served policy closes on the held-out
questions). They differ in the share of steps whose feedback carries per-memory credit
and in whether steps without it get imputed credit (docs/learning.md). The freshness rows
(``fresh_*``: 15 days, a refresh every 200 steps, their own learning rate and gate margin)
add :mod:`causalmem_lab.bench.staleness`'s figures: in-process freshness and every
version's true value (docs/benchmarks.md, "Freshness"). The ``minimal_*`` rows serve as a
client written from docs/contract.md that sends only the required fields (no
``candidate_probs``, no ``candidate_masks``, no canary), gated at the defaults: the gate
judges them on the logging probabilities the learner computes itself
(:class:`pipeline.learner.logging_policy.LoggingPolicies`). Such a client explores every
request, so every request is the policy as it serves it; the rows add the leak of the
first version served (``leak_start``) and the version served at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.bench import finish
from causalmem_lab.bench.staleness import staleness, true_value
from causalmem_lab.lmworld import LMScenario
from causalmem_lab.offline import PRODUCT, OfflineConfig, run_offline
from causalmem_lab.simulator import DAY, Scenario
from models.policy.trainer import PolicyTrainer


@dataclass(frozen=True)
class InProcessRow:
    name: str
    attribution_rate: float
    drift: bool = False
    credit_impute: bool = True
    lm: bool = False  # the real-LM world instead of the simulator
    gate: bool = False  # the promotion gate on (the product's default): clients serve what it promotes
    explore_temperature: float | None = None  # None: the scenario's (the learner's default)
    explore_rate: float | None = None  # None: the scenario's; 1.0: every request explored
    minimal_client: bool = False  # events with the contract's required fields only, no canary
    # The gate's canary (docs/promotion.md): the share of requests serving it; None: the learner's default.
    canary_rate: float | None = None
    coupled: bool | None = None  # contract 1.5's coupled canary; None: the learner's default
    # The freshness rows (lab/causalmem_lab/bench/staleness.py): a candidate every ``refresh_every``
    # steps over ``days`` of the default scenario, true values of every version, and settings
    # of their own (None: the loop's and the learner's defaults).
    freshness: bool = False
    refresh_every: int | None = None
    days: float | None = None
    lr: float | None = None
    gate_epsilon: float | None = None

    def canary(self) -> dict[str, Any]:
        """The loop's canary settings: the learner's defaults unless the row sets them; none ungated."""
        if not self.gate:
            return {"canary_rate": 0.0}
        rate = PRODUCT.serve_canary_rate if self.canary_rate is None else self.canary_rate
        coupled = PRODUCT.serve_canary_coupled if self.coupled is None else self.coupled
        return {"canary_rate": rate, "canary_coupled": coupled}


_FRESH: dict[str, Any] = {"freshness": True, "refresh_every": 200, "days": 15.0}

ROWS: dict[str, InProcessRow] = {
    "dynamic": InProcessRow("step reward", 0.0),
    "credit25": InProcessRow("per-memory credit on 25% of steps, imputed credit between", 0.25),
    "credit25_plain": InProcessRow("per-memory credit on 25% of steps, step reward between", 0.25, credit_impute=False),
    "credit": InProcessRow("per-memory credit on every step", 1.0),
    "credit25_gated": InProcessRow("per-memory credit on 25%, imputed between, gated (the defaults)", 0.25, gate=True),
    "credit25_gated_t1": InProcessRow(
        "per-memory credit on 25%, imputed between, gated, explored at T = 1.0",
        0.25,
        gate=True,
        explore_temperature=1.0,
        canary_rate=0.0,  # measured before canaries (docs/learning.md)
    ),
    "credit25_t1": InProcessRow(
        "per-memory credit on 25%, imputed between, explored at T = 1.0", 0.25, explore_temperature=1.0
    ),
    "credit25_gated_nocanary": InProcessRow(
        "per-memory credit on 25%, imputed between, gated, no canary", 0.25, gate=True, canary_rate=0.0
    ),
    "credit25_gated_canary10": InProcessRow(
        "per-memory credit on 25%, imputed between, gated, canary on 10%", 0.25, gate=True, canary_rate=0.1
    ),
    "credit25_gated_canary20": InProcessRow(
        "per-memory credit on 25%, imputed between, gated, canary on 20%", 0.25, gate=True, canary_rate=0.2
    ),
    "credit25_gated_coupled": InProcessRow(
        "per-memory credit on 25%, imputed between, gated, coupled canary on 20%", 0.25, gate=True, coupled=True
    ),
    "credit25_gated_coupled100": InProcessRow(
        "per-memory credit on 25%, imputed between, gated, coupled canary on every request",
        0.25,
        gate=True,
        canary_rate=1.0,
        coupled=True,
    ),
    # A client written from docs/contract.md: required fields only, every request at T = 1,
    # no canary, the gate at the defaults (docs/benchmarks.md, "A minimal contract client").
    "minimal_t1": InProcessRow(
        "minimal contract client (required fields only), every request at T = 1, gated (the defaults)",
        0.0,
        gate=True,
        explore_temperature=1.0,
        explore_rate=1.0,
        minimal_client=True,
    ),
    # The freshness bench's traffic in process: step reward, a candidate every 200 steps (its
    # 2 s cadence at 100 pairs/s), 15 days (docs/benchmarks.md, "Freshness").
    # At lr 1e-3 (the default until 2026-12-07), against the same rows at 3e-4 below: a step-reward
    # learner at 1e-3 wanders once it has learnt (docs/learning.md, the lr row).
    "fresh_step": InProcessRow("step reward, lr 1e-3, a candidate every 200 steps", 0.0, lr=1e-3, **_FRESH),
    "fresh_step_gated": InProcessRow(
        "step reward, gated, lr 1e-3, a candidate every 200 steps", 0.0, gate=True, lr=1e-3, **_FRESH
    ),
    "fresh_step_gated_eps05": InProcessRow(
        "step reward, gated (ε = 0.05), lr 1e-3, a candidate every 200 steps",
        0.0,
        gate=True,
        gate_epsilon=0.05,
        lr=1e-3,
        **_FRESH,
    ),
    # The same traffic with per-memory credit on 25% of steps (the LM evaluator's default share).
    "fresh_credit25": InProcessRow("per-memory credit on 25%, a candidate every 200 steps", 0.25, **_FRESH),
    "fresh_credit25_gated": InProcessRow(
        "per-memory credit on 25%, gated, a candidate every 200 steps", 0.25, gate=True, **_FRESH
    ),
    "fresh_step_lr3e4": InProcessRow("step reward, lr 3e-4, a candidate every 200 steps", 0.0, lr=3e-4, **_FRESH),
    "fresh_step_gated_lr3e4": InProcessRow(
        "step reward, gated, lr 3e-4, a candidate every 200 steps", 0.0, gate=True, lr=3e-4, **_FRESH
    ),
    "fresh_step_gated_lr3e4_eps05": InProcessRow(
        "step reward, gated (ε = 0.05), lr 3e-4, a candidate every 200 steps",
        0.0,
        gate=True,
        lr=3e-4,
        gate_epsilon=0.05,
        **_FRESH,
    ),
    "reset": InProcessRow("drift, step reward", 0.0, drift=True),
    "reset_credit": InProcessRow("drift, per-memory credit on 25%, imputed between", 0.25, drift=True),
    "reset_credit_plain": InProcessRow(
        "drift, per-memory credit on 25%, step reward between", 0.25, drift=True, credit_impute=False
    ),
    "reset_credit100": InProcessRow("drift, per-memory credit on every step", 1.0, drift=True),
    "lm_step": InProcessRow("real LM, step reward", 0.0, lm=True),
    "lm_credit25": InProcessRow("real LM, per-memory credit on 25%, imputed between", 0.25, lm=True),
    "lm_credit25_plain": InProcessRow(
        "real LM, per-memory credit on 25%, step reward between", 0.25, lm=True, credit_impute=False
    ),
    "lm_credit": InProcessRow("real LM, per-memory credit on every step", 1.0, lm=True),
    "lm_credit25_gated": InProcessRow(
        "real LM, per-memory credit on 25%, gated (the defaults)", 0.25, lm=True, gate=True
    ),
    "lm_credit25_gated_t1": InProcessRow(
        "real LM, per-memory credit on 25%, gated, explored at T = 1.0",
        0.25,
        lm=True,
        gate=True,
        explore_temperature=1.0,
        canary_rate=0.0,  # measured before canaries (docs/learning.md)
    ),
    "lm_credit25_gated_nocanary": InProcessRow(
        "real LM, per-memory credit on 25%, gated, no canary", 0.25, lm=True, gate=True, canary_rate=0.0
    ),
    "lm_credit25_gated_canary10": InProcessRow(
        "real LM, per-memory credit on 25%, gated, canary on 10%", 0.25, lm=True, gate=True, canary_rate=0.1
    ),
    "lm_credit25_gated_canary20": InProcessRow(
        "real LM, per-memory credit on 25%, gated, canary on 20%", 0.25, lm=True, gate=True, canary_rate=0.2
    ),
}
DEFAULT_ROWS = ("dynamic", "credit25", "credit25_plain", "credit")


class StepRewardBetween(PolicyTrainer):
    """The learner's trainer without imputed credit: a step without measured per-memory effects
    is learnt from its step reward (``u − b``) even once credit has arrived. The ``*_plain``
    rows measure what imputation adds against it (docs/learning.md, "Per-memory credit")."""

    def imputes(self) -> bool:
        return False


@dataclass
class _Config(OfflineConfig):
    credit_impute: bool = True  # False: StepRewardBetween

    def make_trainer(self, scenario: Scenario | LMScenario) -> PolicyTrainer:
        config = self.trainer(scenario)
        return PolicyTrainer(config) if self.credit_impute else StepRewardBetween(config)


def rolling_recall(result: Any, window: int = 300) -> np.ndarray:
    """Helpful recall over all traffic, as a ``window``-step rolling mean (the speed measures' curve)."""
    return np.convolve(np.asarray(result.tally.recall, float), np.ones(window) / window, mode="valid")


def steps_to(curve: np.ndarray, level: float, window: int = 300) -> float | None:
    """The step at which a rolling curve first reaches ``level`` (its window's last step).

    >>> steps_to(np.array([0.2, 0.5, 0.9, 0.95]), 0.8)
    302.0
    >>> steps_to(np.array([0.2, 0.5]), 0.8) is None
    True
    """
    reach = np.nonzero(curve >= level)[0]
    return float(reach[0] + window) if len(reach) else None


def measure(
    result: Any, scenario: Scenario, final_share: float = 0.3, explores_all: bool = False
) -> dict[str, float | None]:
    """As served: leak, recall, utility over the last ``final_share`` and the steps to 90% of
    the final recall (all traffic, 300-step rolling mean); for a drift scenario, correct on the
    last day before the drift and on the last day, and their ratio. ``leak_start``: the leak of
    the requests the first version served; ``requests_to_half_leak``: the served requests until
    the served leak's 300-request rolling mean is half of it (None: never). ``explores_all``: the client explores every
    request, so every request is the policy as that client serves it (else none would count)."""
    t = result.tally
    served = np.ones(len(t.explore), bool) if explores_all else ~np.asarray(t.explore, bool)
    if scenario.drift_day is not None:
        ts = np.asarray(t.ts)
        ok = (~np.asarray(t.leak, bool)) & (np.asarray(t.recall) > 0)
        drift = scenario.start_ts + scenario.drift_day * DAY
        before = float(ok[(ts >= drift - DAY) & (ts < drift)].mean())
        last = float(ok[ts >= scenario.start_ts + (scenario.days - 1) * DAY].mean())
        ratio = last / before if before else None
        return {"before": before, "last_day": last, "ratio": ratio, "resets": float(len(result.resets))}
    n = len(t.leak)
    tail = slice(int(n * (1 - final_share)), n)
    recall = np.asarray(t.recall)
    final = float(recall[tail].mean())
    keep = served[tail]
    leak = np.asarray(t.leak, float)
    first = served & (np.asarray(t.version) == t.version[0])
    start = float(leak[first].mean()) if first.any() else None
    # Served requests until the served leak (300-request rolling mean) is half the first version's.
    rolling = np.convolve(leak[served], np.ones(300) / 300, mode="valid") if served.sum() >= 300 else np.array([])
    halved = np.nonzero(rolling <= start / 2)[0] if start else np.array([], int)
    return {
        "leak_start": start,
        "requests_to_half_leak": float(halved[0] + 300) if len(halved) else None,
        "leak": float(leak[tail][keep].mean()),
        "recall": float(recall[tail][keep].mean()),
        "utility": float(np.asarray(t.utility)[tail][keep].mean()),
        "steps_to_90pct_recall": steps_to(rolling_recall(result), 0.9 * final),
        "final_recall_all": final,  # all traffic, exploration included: the speed measure's reference
        "pairs": float(n),
    }


def at_step_reward_level(report: dict[str, Any], curves: dict[str, dict[int, np.ndarray]]) -> None:
    """Add, to every simulator row, the steps to 90% of the *step reward's* final recall on the
    same seed (``steps_to_90pct_step_reward_final``): a common level, so that a row whose
    final recall is higher is not asked to climb further (docs/benchmarks.md). Needs the
    ``dynamic`` row in the same run."""
    ref = report["rows"].get("dynamic")
    if ref is None:
        return
    level = {s["seed"]: 0.9 * s["final_recall_all"] for s in ref["per_seed"]}
    for key, row in report["rows"].items():
        if ROWS[key].drift or ROWS[key].lm:
            continue
        for s in row["per_seed"]:
            s["steps_to_90pct_step_reward_final"] = steps_to(curves[key][s["seed"]], level[s["seed"]])
        figures = [{k: v for k, v in s.items() if k not in ("seed", "wall_s")} for s in row["per_seed"]]
        row["mean"] = mean_of(figures)


def promotions(result: Any) -> dict[str, float | None]:
    """Candidates the promotion rule promoted, and what the canary requests themselves were
    worth (true utility; None without a canary)."""
    cu = result.canary_utility
    return {
        "promoted": float(sum(d == "promoted" for d in result.gate)),
        "canary_share": len(cu) / max(1, len(result.tally.utility)),
        "canary_utility": float(np.mean(cu)) if cu else None,
        "all_utility": float(np.mean(result.tally.utility)),
        "served_version": float(result.served.version) if result.served is not None else None,
        "refused": float(sum(d == "refused" for d in result.gate)),
    }


def mean_of(per_seed: list[dict[str, Any]]) -> dict[str, float | None]:
    """The mean of each figure over seeds (over the seeds that have it).

    >>> mean_of([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}])
    {'a': 2.0, 'b': 2.0}
    """
    out: dict[str, float | None] = {}
    for k in per_seed[0]:
        v = [s[k] for s in per_seed if s.get(k) is not None]
        out[k] = float(np.mean(v)) if v else None
    return out


class LMRunner:
    """The real-LM world's bank, cached utilities and reference values, loaded once per run.

    ``data`` and ``utilities`` are :func:`causalmem_lab.lmdata.build_dataset`'s bank and its
    :func:`~causalmem_lab.lmdata.lm_utilities` (:meth:`load` reads the bench's cache);
    ``events`` the steps of traffic per seed.
    """

    def __init__(self, data: Any, utilities: Any, events: int = 3000) -> None:
        from causalmem_lab.bench import lmlearning
        from causalmem_lab.lmworld import LMScenario, LMWorld

        self.data, self.u, self.events = data, utilities, events
        self.test = LMWorld(LMScenario(), data, utilities).test
        self.similarity = lmlearning.measure(utilities, data, self.test)["value"]
        self.oracle = lmlearning.oracle(utilities, data, self.test)["value"]

    @classmethod
    def load(cls, cache_dir: str | None = None, model: str | None = None) -> LMRunner:
        from causalmem_lab.lmdata import build_dataset, lm_utilities

        data = build_dataset()
        return cls(data, lm_utilities(data, cache_dir=Path(cache_dir) if cache_dir else None, model=model or ""))

    def run(self, row: InProcessRow, cfg: OfflineConfig) -> dict[str, float | None]:
        """One seed of an ``lm_*`` row: the final served policy on the held-out questions."""
        from causalmem_lab.bench import lmlearning
        from causalmem_lab.lmworld import LMScenario, LMWorld

        scenario = LMScenario(seed=cfg.seed, events=self.events, attribution_rate=row.attribution_rate)
        res = run_offline(scenario, cfg, env=LMWorld(scenario, self.data, self.u))
        base = res.served_versions.get(lmlearning.base_of(res.served))  # a probe over a certified version
        m = lmlearning.measure(self.u, self.data, self.test, res.served, seed=cfg.seed, base=base)
        return {
            **m,
            "gap_closed": lmlearning.gap_closed(m["value"], self.similarity, self.oracle),
            **promotions(res),
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from causalmem_lab.bench.learning import drift_scenario, learning_scenario

    seeds = [int(s) for s in str(args.seeds or args.seed).split(",") if s.strip()]
    wanted = [r.strip() for r in (args.rows or "").split(",") if r.strip()] or list(DEFAULT_ROWS)
    unknown = [k for k in wanted if k not in ROWS]
    if unknown:
        raise ValueError(f"unknown in-process rows {unknown}; known: {list(ROWS)}")
    lr = args.lr or PRODUCT.lr
    report: dict[str, Any] = {"seeds": seeds, "lr": lr, "batch_size": PRODUCT.batch_size, "rows": {}}
    curves: dict[str, dict[int, np.ndarray]] = {}
    lm = (
        LMRunner.load(getattr(args, "cache_dir", None), getattr(args, "lm_model", None))
        if any(ROWS[k].lm for k in wanted)
        else None
    )
    if lm is not None:
        report["lm"] = {"similarity": lm.similarity, "oracle": lm.oracle}
    for key in wanted:
        row = ROWS[key]
        per_seed: list[dict[str, Any]] = []
        for seed in seeds:
            t0 = time.monotonic()
            cfg = _Config(
                lr=row.lr or lr,
                seed=seed,
                refresh_every=row.refresh_every or OfflineConfig.refresh_every,
                gate_epsilon=row.gate_epsilon or OfflineConfig.gate_epsilon,
                credit_impute=row.credit_impute,
                gate=row.gate,
                explore_temperature=row.explore_temperature,
                explore_rate=row.explore_rate,
                minimal_client=row.minimal_client,
                **row.canary(),
            )
            if row.lm:
                assert lm is not None
                per_seed.append({"seed": seed, **lm.run(row, cfg), "wall_s": time.monotonic() - t0})
                print(f"{key} seed {seed}: {json.dumps(per_seed[-1])}", flush=True)
                continue
            base = drift_scenario(args.quick, seed) if row.drift else learning_scenario(args.quick, False, seed)
            scenario = dataclasses.replace(base, attribution_rate=row.attribution_rate)
            if row.days is not None and not args.quick:
                scenario = dataclasses.replace(scenario, days=row.days)
            res = run_offline(scenario, cfg, value=true_value(scenario) if row.freshness else None)
            curves.setdefault(key, {})[seed] = rolling_recall(res)
            fresh = staleness(res, end=2 * cfg.refresh_every) if row.freshness else {}
            per_seed.append(
                {
                    "seed": seed,
                    **measure(res, scenario, explores_all=row.explore_rate == 1.0),
                    **promotions(res),
                    **fresh,
                    "wall_s": time.monotonic() - t0,
                }
            )
            print(f"{key} seed {seed}: {json.dumps(per_seed[-1])}", flush=True)
        figures = mean_of([{k: v for k, v in s.items() if k not in ("seed", "wall_s")} for s in per_seed])
        report["rows"][key] = {"name": row.name, **dataclasses.asdict(row), "per_seed": per_seed, "mean": figures}
    at_step_reward_level(report, curves)
    return report


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _cell(seeds: list[Any], mean: float | None, fmt: Any) -> str:
    return " / ".join("–" if s is None else fmt(s) for s in seeds) + f" → **{'–' if mean is None else fmt(mean)}**"


def table(report: dict[str, Any]) -> str:
    """Markdown tables: seeds in order, then the mean (bold)."""
    common = any("steps_to_90pct_step_reward_final" in r["mean"] for r in report["rows"].values())
    sim = [
        "| row | leak (served) | recall (served) | utility (served) | steps to 90% of final recall |"
        + (" steps to 90% of the step reward's final recall |" if common else ""),
        "|---|---|---|---|---|" + ("---|" if common else ""),
    ]
    drift = ["| drift row | correct, last day before | correct, last day | last day / before |", "|---|---|---|---|"]
    lm = ["| real-LM row | gap closed (held out, as served) | gold read | harmful leak |", "|---|---|---|---|"]
    fresh = [
        "| freshness row | median freshness (steps) | never fresh | never fresh, last 30% "
        "| candidates' true gain over served, last 30% | served value: final (fall from best) | promoted |",
        "|---|---|---|---|---|---|---|",
    ]
    minimal = [
        "| minimal-client row | leak of the first version served | leak at the end (last 30%) "
        "| requests until the leak is halved | promoted | version served at the end | pairs |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, row in report["rows"].items():
        ps, m = row["per_seed"], row["mean"]
        if ROWS[key].lm:
            cells = [_cell([s[f] for s in ps], m[f], lambda v: f"{v:.0%}") for f in ("gap_closed", "gold", "leak")]
            lm.append(f"| {row['name']} | " + " | ".join(cells) + " |")
        elif ROWS[key].drift:
            cells = [_cell([s[f] for s in ps], m[f], _pct) for f in ("before", "last_day", "ratio")]
            drift.append(f"| {row['name']} | " + " | ".join(cells) + " |")
        else:
            cells = [_cell([s[f] for s in ps], m[f], _pct) for f in ("leak", "recall")]
            cells.append(_cell([s["utility"] for s in ps], m["utility"], lambda v: f"{v:+.3f}"))
            steps = [s["steps_to_90pct_recall"] for s in ps]
            cells.append(_cell(steps, m["steps_to_90pct_recall"], lambda v: f"{v:,.0f}"))
            if common:
                at_ref = [s.get("steps_to_90pct_step_reward_final") for s in ps]
                cells.append(_cell(at_ref, m.get("steps_to_90pct_step_reward_final"), lambda v: f"{v:,.0f}"))
            sim.append(f"| {row['name']} | " + " | ".join(cells) + " |")
            if ROWS[key].minimal_client:
                minimal.append(f"| {row['name']} | " + " | ".join(_minimal_cells(ps, m)) + " |")
            if ROWS[key].freshness:
                fresh.append(f"| {row['name']} | " + " | ".join(_freshness_cells(ps, m, ROWS[key].gate)) + " |")
    return "\n\n".join("\n".join(t) for t in (sim, drift, lm, fresh, minimal) if len(t) > 2)


def _minimal_cells(ps: list[dict[str, Any]], m: dict[str, Any]) -> list[str]:
    """A minimal-client row's cells: the served leak at the start and at the end, the promotions
    and the version served at the end, seeds then the mean."""
    count = "{:.0f}".format
    return [
        _cell([s["leak_start"] for s in ps], m["leak_start"], _pct),
        _cell([s["leak"] for s in ps], m["leak"], _pct),
        _cell([s["requests_to_half_leak"] for s in ps], m["requests_to_half_leak"], lambda v: f"{v:,.0f}"),
        _cell([s["promoted"] for s in ps], m["promoted"], count),
        _cell([s["served_version"] for s in ps], m["served_version"], count),
        _cell([s["pairs"] for s in ps], m["pairs"], lambda v: f"{v:,.0f}"),
    ]


def _freshness_cells(ps: list[dict[str, Any]], m: dict[str, Any], gated: bool) -> list[str]:
    """A freshness row's cells (lab/causalmem_lab/bench/staleness.py), seeds then the mean."""

    def steps(v: float) -> str:
        return "never" if v == float("inf") else f"{v:,.0f}"

    def fall(i: int | None) -> str:
        s = m if i is None else ps[i]
        if s.get("served_value_final") is None:
            return "–"
        return f"{s['served_value_final']:+.3f} ({s['served_fall']:.3f})"

    value = " / ".join(fall(i) for i in range(len(ps))) + f" → **{fall(None)}**"
    return [
        _cell([s["median_steps"] for s in ps], m["median_steps"], steps),
        _cell([s["never"] for s in ps], m["never"], _pct),
        _cell([s["never_tail"] for s in ps], m["never_tail"], _pct),
        _cell([s.get("candidate_gain_tail") for s in ps], m.get("candidate_gain_tail"), lambda v: f"{v:+.3f}"),
        value,
        _cell([s["promoted"] + s["canary_promoted"] for s in ps], m["promoted"] + m["canary_promoted"], "{:.0f}".format)
        if gated
        else "every candidate",
    ]


def main(args: argparse.Namespace) -> int:
    return finish(run(args), table, args.out)
