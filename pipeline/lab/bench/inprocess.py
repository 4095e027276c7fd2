"""``causalmem bench learning --in-process``: the learning rows in one process, several seeds.

The same retriever, trainer, replay and drift monitor as the pipeline, without Kafka
(:func:`pipeline.lab.offline.run_offline`: a refresh of the served policy every 300
steps, micro-batches of 64 as the learner's default). Minutes per seed instead of the
pipeline's tens, so rows can be compared over several seeds side by side; the figures
are for the policy *as served* (requests not served at the exploration temperature).

Rows on the default scenario (6 days, ~5,900 steps; measured over the last 30%) and on
its drift variant (12 days, drift on day 6; correct on the last day against the last day
before the drift). They differ in the share of steps whose feedback carries per-memory
credit and in whether steps without it get imputed credit (docs/learning.md).
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

from models.trainer import TrainerConfig
from pipeline.lab.offline import OfflineConfig, run_offline
from pipeline.lab.simulator import DAY, Scenario


@dataclass(frozen=True)
class InProcessRow:
    name: str
    attribution_rate: float
    drift: bool = False
    credit_impute: bool = True


ROWS: dict[str, InProcessRow] = {
    "dynamic": InProcessRow("step reward", 0.0),
    "credit25": InProcessRow("per-memory credit on 25% of steps, imputed credit between", 0.25),
    "credit25_plain": InProcessRow("per-memory credit on 25% of steps, step reward between", 0.25, credit_impute=False),
    "credit": InProcessRow("per-memory credit on every step", 1.0),
    "reset": InProcessRow("drift, step reward", 0.0, drift=True),
    "reset_credit": InProcessRow("drift, per-memory credit on 25%, imputed between", 0.25, drift=True),
    "reset_credit_plain": InProcessRow(
        "drift, per-memory credit on 25%, step reward between", 0.25, drift=True, credit_impute=False
    ),
    "reset_credit100": InProcessRow("drift, per-memory credit on every step", 1.0, drift=True),
}
DEFAULT_ROWS = ("dynamic", "credit25", "credit25_plain", "credit")


@dataclass
class _Config(OfflineConfig):
    credit_impute: bool = True

    def trainer(self, scenario: Scenario) -> TrainerConfig:
        return dataclasses.replace(super().trainer(scenario), credit_impute=self.credit_impute)


def measure(result: Any, scenario: Scenario, final_share: float = 0.3) -> dict[str, float | None]:
    """As served: leak, recall, utility over the last ``final_share`` and the steps to 90% of
    the final recall (all traffic, 300-step rolling mean); for a drift scenario, correct on the
    last day before the drift and on the last day, and their ratio."""
    t = result.tally
    served = ~np.asarray(t.explore, bool)
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
    reach = np.nonzero(np.convolve(recall, np.ones(300) / 300, mode="valid") >= 0.9 * final)[0]
    keep = served[tail]
    return {
        "leak": float(np.asarray(t.leak, float)[tail][keep].mean()),
        "recall": float(recall[tail][keep].mean()),
        "utility": float(np.asarray(t.utility)[tail][keep].mean()),
        "steps_to_90pct_recall": float(reach[0] + 300) if len(reach) else None,
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.lab.bench.learning import drift_scenario, learning_scenario

    seeds = [int(s) for s in str(args.seeds or args.seed).split(",") if s.strip()]
    wanted = [r.strip() for r in (args.rows or "").split(",") if r.strip()] or list(DEFAULT_ROWS)
    unknown = [k for k in wanted if k not in ROWS]
    if unknown:
        raise ValueError(f"unknown in-process rows {unknown}; known: {list(ROWS)}")
    lr = args.lr or TrainerConfig.lr
    report: dict[str, Any] = {"seeds": seeds, "lr": lr, "batch_size": 64, "rows": {}}
    for key in wanted:
        row = ROWS[key]
        per_seed = []
        for seed in seeds:
            t0 = time.monotonic()
            base = drift_scenario(args.quick, seed) if row.drift else learning_scenario(args.quick, False, seed)
            scenario = dataclasses.replace(base, attribution_rate=row.attribution_rate)
            cfg = _Config(lr=lr, batch_size=64, seed=seed, credit_impute=row.credit_impute)
            res = run_offline(scenario, cfg)
            per_seed.append({"seed": seed, **measure(res, scenario), "wall_s": time.monotonic() - t0})
            print(f"{key} seed {seed}: {json.dumps(per_seed[-1])}", flush=True)
        figures = mean_of([{k: v for k, v in s.items() if k not in ("seed", "wall_s")} for s in per_seed])
        report["rows"][key] = {"name": row.name, **dataclasses.asdict(row), "per_seed": per_seed, "mean": figures}
    return report


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _cell(seeds: list[dict[str, Any]], mean: float | None, fmt: Any) -> str:
    return " / ".join("–" if s is None else fmt(s) for s in seeds) + f" → **{'–' if mean is None else fmt(mean)}**"


def table(report: dict[str, Any]) -> str:
    """Markdown tables: seeds in order, then the mean (bold)."""
    sim = [
        "| row | leak (served) | recall (served) | utility (served) | steps to 90% of final recall |",
        "|---|---|---|---|---|",
    ]
    drift = ["| drift row | correct, last day before | correct, last day | last day / before |", "|---|---|---|---|"]
    for key, row in report["rows"].items():
        ps, m = row["per_seed"], row["mean"]
        if ROWS[key].drift:
            cells = [_cell([s[f] for s in ps], m[f], _pct) for f in ("before", "last_day", "ratio")]
            drift.append(f"| {row['name']} | " + " | ".join(cells) + " |")
        else:
            cells = [_cell([s[f] for s in ps], m[f], _pct) for f in ("leak", "recall")]
            cells.append(_cell([s["utility"] for s in ps], m["utility"], lambda v: f"{v:+.3f}"))
            steps = [s["steps_to_90pct_recall"] for s in ps]
            cells.append(_cell(steps, m["steps_to_90pct_recall"], lambda v: f"{v:,.0f}"))
            sim.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    return "\n\n".join("\n".join(t) for t in (sim, drift) if len(t) > 2)


def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0
