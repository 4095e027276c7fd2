"""``causalmem bench learning``: does the policy identify memory utility?

The same scenario (known ground truth: helpful, harmful and irrelevant-but-similar
memories per query intent) runs through the real pipeline — broker, worker, learner,
checkpoints, subscriber — once per policy, and one table compares them with the seed's
claims. Every row is a fresh worker and learner on its own topic prefix; rows differ in
one setting each (:class:`causalmem_lab.simrun.RunSpec`). The automatic labeler is off, so
rows measure the learning rule itself.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.bench import finish, inprocess, lmlearning
from causalmem_lab.simrun import RunResult, RunSpec, run_scenario
from causalmem_lab.simulator import DAY, Scenario

NO_GATE = {"CAUSALMEM_GATE": "0"}
ROWS: dict[str, RunSpec] = {
    "similarity": RunSpec("similarity-only (faiss top-k)", use_policy=False, labels=False),
    "similarity_t": RunSpec(
        "similarity-only at the serving temperature (m = 0)", use_policy=False, greedy=False, labels=False
    ),
    "dmem": RunSpec("D-MEM re-ranking (similarity + β·δ)", use_policy=False, dmem=True, labels=False),
    "soft": RunSpec("causal, soft intervention (no drop)", drop="none", labels=False, pipeline_env=NO_GATE),
    "fixed": RunSpec("causal, hard drop, fixed threshold 0.5", drop=0.5, labels=False, pipeline_env=NO_GATE),
    "dynamic": RunSpec("causal, hard drop, dynamic threshold", labels=False, pipeline_env=NO_GATE),
    "nobaseline": RunSpec(
        "causal, dynamic, without the baseline", labels=False, pipeline_env={**NO_GATE, "CAUSALMEM_BASELINE": "none"}
    ),
    "gated": RunSpec("causal, dynamic, promotion gate (shipped default)", labels=False),
    "credit": RunSpec(
        "causal, dynamic, per-memory credit on every step", labels=False, attribution_rate=1.0, pipeline_env=NO_GATE
    ),
    "credit25": RunSpec(
        "causal, dynamic, per-memory credit on 25% of steps", labels=False, attribution_rate=0.25, pipeline_env=NO_GATE
    ),
    "norevive": RunSpec(
        "causal, dynamic, dropped candidates never revived", labels=False, explore_revive=0.0, pipeline_env=NO_GATE
    ),
    "hot": RunSpec(
        "causal, lr 3e-2 (too high), no gate", labels=False, pipeline_env={**NO_GATE, "CAUSALMEM_LR": "0.03"}
    ),
    "hotgated": RunSpec("causal, lr 3e-2 (too high), gated", labels=False, pipeline_env={"CAUSALMEM_LR": "0.03"}),
    # A client written from docs/contract.md's required fields (no candidate_probs, no
    # candidate_masks, no canary), exploring every request at T = 1, the learner at its defaults.
    "minimal_t1": RunSpec(
        "minimal contract client (required fields only), every request at T = 1, gated (the defaults)",
        labels=False,
        explore_rate=1.0,
        explore_temperature=1.0,
        minimal_client=True,
    ),
}
DRIFT_ROWS: dict[str, RunSpec] = {
    "reset": RunSpec("drift, with reset", labels=False, pipeline_env=NO_GATE),
    "noreset": RunSpec("drift, without reset", labels=False, reset=False, pipeline_env=NO_GATE),
    "reset_norevive": RunSpec(
        "drift, with reset, dropped candidates never revived", labels=False, explore_revive=0.0, pipeline_env=NO_GATE
    ),
    "reset_credit": RunSpec(
        "drift, with reset, per-memory credit on 25% of steps",
        labels=False,
        attribution_rate=0.25,
        pipeline_env=NO_GATE,
    ),
    "reset_credit100": RunSpec(
        "drift, with reset, per-memory credit on every step", labels=False, attribution_rate=1.0, pipeline_env=NO_GATE
    ),
}
QUICK_ROWS = ("similarity", "dynamic")

SEED_CLAIMS = {
    "hard_leak": "≤ 1.7% harmful leak with hard intervention (soft: 23%)",
    "dynamic_empty": "≤ 0.3% empty results with the dynamic threshold (fixed: 12%)",
    "baseline_speed": "baseline converges ≥ 3× faster than no baseline",
    "drift_drop": "accuracy drop after drift ≤ 2.3% with reset (17% without)",
    "credit_leak": "per-memory credit: harmful leak ≤ 1.7%",
    "credit_speed": "per-memory credit: fewer steps to 90% of the final recall than the step reward",
    "drift_recovery": "drift: correct on the last day ≥ 90% of the last day before the drift",
}


def learning_scenario(quick: bool, text: bool, seed: int, name: str | None = None) -> Scenario:
    base = Scenario.load(name or "default")
    days, per_day = (2.0, 400) if quick else (6.0, 500)
    return dataclasses.replace(base, drift_day=None, seed=seed, text=text, days=days, queries_per_day=per_day)


def drift_scenario(quick: bool, seed: int) -> Scenario:
    base = Scenario.load("default")
    days, per_day, drift_day = (6.0, 300, 3.0) if quick else (12.0, 500, 6.0)
    return dataclasses.replace(base, seed=seed, days=days, queries_per_day=per_day, drift_day=drift_day)


# --------------------------------------------------------------------------- measures


def correct(r: RunResult) -> np.ndarray:
    """A retrieval is correct when it reads no harmful memory and at least one helpful one."""
    return (~np.asarray(r.tally.leak)) & (np.asarray(r.tally.recall) > 0)


def summarise(r: RunResult, final_share: float = 0.3) -> dict[str, Any]:
    t = r.tally
    n = len(t.leak)
    tail = slice(int(n * (1 - final_share)), n)
    recall = np.asarray(t.recall)
    final_recall = float(recall[tail].mean())
    rolling = np.convolve(recall, np.ones(300) / 300, mode="valid") if n >= 300 else recall
    reach = np.nonzero(rolling >= 0.9 * final_recall)[0]
    return {
        "name": r.spec.name,
        "steps": n,
        "leak": float(np.mean(np.asarray(t.leak)[tail])),
        "recall": final_recall,
        "empty": float(np.mean(np.asarray(t.empty)[tail])),
        "utility": float(np.mean(np.asarray(t.utility)[tail])),
        # The served policy itself: the requests not served at the exploration temperature.
        "utility_served": served_utility(t, tail),
        # Leak and recall of the policy as served (requests not served at the exploration T).
        "leak_served": served_mean(t.leak, t, tail),
        "recall_served": served_mean(t.recall, t, tail),
        "events_to_90pct_recall": int(reach[0] + 300) if len(reach) else None,
        "checkpoints_loaded": r.versions_loaded,
        "wall_s": r.wall_s,
    }


def minimal_client(r: RunResult, scenario: Scenario) -> dict[str, Any]:
    """A minimal client's row (``RunSpec.minimal_client``): the in-process rows' measures
    (:func:`causalmem_lab.bench.inprocess.measure`: the first version's leak, the requests
    until the leak is halved, the leak at the end), over every request since such a client
    explores them all, with the version served at the end and the learner's promotions."""
    from pipeline.promtext import metric

    if not r.spec.minimal_client:
        return {}
    m = inprocess.measure(r, scenario, explores_all=True)
    promoted = metric(r.learner_metrics, "causalmem_gate_decisions_total", decision="promoted")
    # Flat keys, so that the mean over seeds (mean_row) averages them too.
    return {
        "minimal_leak_start": m["leak_start"],
        "minimal_requests_to_half_leak": m["requests_to_half_leak"],
        "minimal_leak_end": m["leak"],
        "minimal_served_version": float(r.policy.version if r.policy is not None else 0),
        "minimal_promoted": float(promoted),
    }


def served_mean(values: Any, t: Any, tail: slice) -> float:
    exploit = ~np.asarray(t.explore, bool)[tail]
    v = np.asarray(values, float)[tail][exploit]
    return float(v.mean()) if v.size else float("nan")


def served_utility(t: Any, tail: slice) -> float:
    exploit = ~np.asarray(t.explore, bool)[tail]
    u = np.asarray(t.utility)[tail][exploit]
    return float(u.mean()) if u.size else float("nan")


def drift_drop(r: RunResult, scenario: Scenario) -> dict[str, float | int | None]:
    """Correct-retrieval rate on the last day before the drift vs the days after it."""
    ts = np.asarray(r.tally.ts)
    ok = correct(r)
    drift = scenario.start_ts + (scenario.drift_day or 0) * DAY
    before = ok[(ts >= drift - DAY) & (ts < drift)].mean()
    after = ok[ts >= drift].mean()
    last = ok[ts >= scenario.start_ts + (scenario.days - 1) * DAY].mean()
    return {
        "before": float(before),
        "after": float(after),
        "drop": float(before - after),
        "last_day": float(last),
        "resets": len(r.resets),
        "reset_day": (r.resets[0]["ts"] - scenario.start_ts) / DAY if r.resets else None,
    }


# --------------------------------------------------------------------------- running


async def run_rows(
    rows: dict[str, RunSpec], scenario: Scenario, bootstrap: str, logdir: Path, console: Any, rate: float
) -> dict[str, RunResult]:
    out = {}
    for key, spec in rows.items():
        spec = dataclasses.replace(spec, rate=rate, checkpoint_interval=1.0)
        console.print(f"[bold]{spec.name}[/]")
        out[key] = await run_scenario(
            scenario, spec, bootstrap, logdir / key, console, prefix=f"bench-{key}-", label=key
        )
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """One seed (``--seed``) or several side by side (``--seeds 0,1,2``: rows are the means)."""
    seeds = [int(x) for x in (getattr(args, "seeds", None) or "").split(",") if x.strip()]
    if not seeds:
        return await run_seed(args, args.seed)
    per_seed = {}
    for seed in seeds:
        per_seed[seed] = await run_seed(args, seed)
    first = per_seed[seeds[0]]
    report: dict[str, Any] = {**first, "seeds": seeds, "per_seed": {str(k): _rows_only(v) for k, v in per_seed.items()}}
    for part in ("rows", "drift"):
        if part in first:
            report[part] = {k: mean_row([per_seed[s][part][k] for s in seeds]) for k in first[part]}
    report["wall_s"] = sum(v["wall_s"] for v in per_seed.values())
    report["claims"] = claims(report)
    return report


def _rows_only(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report[k] for k in ("rows", "drift") if k in report}


def mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each number over seeds (``None`` where a seed has none).

    >>> mean_row([{"name": "a", "leak": 0.1, "reach": 100}, {"name": "a", "leak": 0.3, "reach": None}])
    {'name': 'a', 'leak': 0.2, 'reach': None}
    """
    out: dict[str, Any] = {}
    for key, v in rows[0].items():
        vals = [r.get(key) for r in rows]
        nums = [float(x) for x in vals if isinstance(x, (int, float))]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and len(nums) == len(vals):
            m = float(np.mean(nums))
            out[key] = round(m) if isinstance(v, int) else round(m, 12)
        elif isinstance(v, (int, float)) or v is None:
            out[key] = None
        else:
            out[key] = v
    return out


async def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from pipeline.broker import own_broker

    console = importlib.import_module("rich.console").Console(stderr=True)
    logdir = Path(tempfile.mkdtemp(prefix="causalmem-bench-learning-"))
    bootstrap, broker = own_broker(args.bootstrap, logdir / "broker.log")
    wanted = [r.strip() for r in (args.rows or "").split(",") if r.strip()]
    rate = 120.0
    t0 = time.monotonic()
    report: dict[str, Any] = {"quick": args.quick, "text": args.text, "seed": seed}
    try:
        scenario = learning_scenario(args.quick, args.text, seed, getattr(args, "scenario", None))
        keys = wanted or (list(QUICK_ROWS) if args.quick else list(ROWS))
        unknown = [k for k in keys if k not in ROWS and k not in DRIFT_ROWS]
        if unknown:
            raise ValueError(f"unknown rows {unknown}; known: {sorted([*ROWS, *DRIFT_ROWS])}")
        results = await run_rows({k: ROWS[k] for k in keys if k in ROWS}, scenario, bootstrap, logdir, console, rate)
        report["scenario"] = dataclasses.asdict(scenario)
        report["rows"] = {k: {**summarise(r), **minimal_client(r, scenario)} for k, r in results.items()}
        report["curves"] = {k: curves(r) for k, r in results.items()}
        drift_keys = [k for k in (wanted or ([] if args.quick else list(DRIFT_ROWS))) if k in DRIFT_ROWS]
        if drift_keys:
            dsc = drift_scenario(args.quick, seed)
            dres = await run_rows({k: DRIFT_ROWS[k] for k in drift_keys}, dsc, bootstrap, logdir, console, rate)
            report["drift_scenario"] = dataclasses.asdict(dsc)
            report["drift"] = {k: {**summarise(r), **drift_drop(r, dsc)} for k, r in dres.items()}
            report["drift_series"] = {
                k: {"corr": [(x, v, n) for x, v, n in r.corr_series], "resets": r.resets, **curves(r)}
                for k, r in dres.items()
            }
    finally:
        if broker is not None:
            broker.stop()
    # The run's logs, its broker's and its state go once it succeeded; a failure keeps them.
    shutil.rmtree(logdir, ignore_errors=True)
    report["wall_s"] = time.monotonic() - t0
    report["claims"] = claims(report)
    return report


def curves(r: RunResult, points: int = 60) -> dict[str, list[Any]]:
    """Rolling leak and recall along the run (for the plots)."""
    n = len(r.tally.leak)
    w = max(50, n // points)
    idx = list(range(w, n + 1, max(1, n // points)))
    leak = np.asarray(r.tally.leak, float)
    recall = np.asarray(r.tally.recall)
    ts = np.asarray(r.tally.ts)
    return {
        "step": idx,
        "ts": [float(ts[i - 1]) for i in idx],
        "leak": [float(leak[i - w : i].mean()) for i in idx],
        "recall": [float(recall[i - w : i].mean()) for i in idx],
    }


def claims(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = report.get("rows", {})
    out = []

    def add(key: str, measured: str, met: bool | None) -> None:
        out.append({"claim": SEED_CLAIMS[key], "measured": measured, "met": met})

    if "dynamic" in rows and "soft" in rows:
        add(
            "hard_leak",
            f"hard {rows['dynamic']['leak']:.1%} (soft {rows['soft']['leak']:.1%})",
            rows["dynamic"]["leak"] <= 0.017,
        )
    if "dynamic" in rows and "fixed" in rows:
        add(
            "dynamic_empty",
            f"dynamic {rows['dynamic']['empty']:.1%} (fixed {rows['fixed']['empty']:.1%})",
            rows["dynamic"]["empty"] <= 0.003,
        )
    if "dynamic" in rows and "nobaseline" in rows:
        a, b = rows["dynamic"]["events_to_90pct_recall"], rows["nobaseline"]["events_to_90pct_recall"]
        if a and b:
            add("baseline_speed", f"{a:,} vs {b:,} events to 90% of the final recall ({b / a:.1f}×)", b >= 3 * a)
    if "dynamic" in rows:
        for key in ("credit", "credit25"):
            if key in rows:
                add("credit_leak", f"{rows[key]['name']}: {rows[key]['leak']:.1%}", rows[key]["leak"] <= 0.017)
                a, b = rows[key]["events_to_90pct_recall"], rows["dynamic"]["events_to_90pct_recall"]
                if a and b:
                    add("credit_speed", f"{rows[key]['name']}: {a:,} vs {b:,} steps (step reward)", a < b)
    drift = report.get("drift", {})
    for row in drift.values():
        if row.get("resets"):  # rows whose learner was reset
            ok = row["last_day"] >= 0.9 * row["before"]
            add("drift_recovery", f"{row['name']}: {row['last_day']:.1%} vs {row['before']:.1%} before", ok)
    if "reset" in drift and "noreset" in drift:
        add(
            "drift_drop",
            f"with reset {drift['reset']['drop']:.1%}, without {drift['noreset']['drop']:.1%}",
            drift["reset"]["drop"] <= 0.023,
        )
    return out


# --------------------------------------------------------------------------- output


def table(report: dict[str, Any]) -> str:
    lines = [
        "| policy | harmful leak | helpful recall@k | empty results | mean true utility "
        "| utility of the served policy (no exploration) | events to 90% of final recall "
        "| leak / recall as served (no exploration) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report.get("rows", {}).values():
        reach = f"{row['events_to_90pct_recall']:,}" if row["events_to_90pct_recall"] else "–"
        lines.append(
            f"| {row['name']} | {row['leak']:.1%} | {row['recall']:.1%} | {row['empty']:.1%} "
            f"| {row['utility']:+.3f} | {row.get('utility_served', float('nan')):+.3f} | {reach} "
            f"| {row.get('leak_served', float('nan')):.1%} / {row.get('recall_served', float('nan')):.1%} |"
        )
    minimal = [row for row in report.get("rows", {}).values() if "minimal_leak_end" in row]
    if minimal:
        lines += [
            "",
            "| minimal-client row (every request) | leak of the first version served | leak at the end (last 30%) "
            "| requests until the leak is halved | promoted | version served at the end |",
            "|---|---|---|---|---|---|",
        ]
        for row in minimal:
            start = "–" if row["minimal_leak_start"] is None else f"{row['minimal_leak_start']:.1%}"
            half = row["minimal_requests_to_half_leak"]
            lines.append(
                f"| {row['name']} | {start} | {row['minimal_leak_end']:.1%} "
                f"| {'never (on some seed)' if half is None else f'{half:,.0f}'} | {row['minimal_promoted']:.0f} "
                f"| v{row['minimal_served_version']:.0f} |"
            )
    drift = report.get("drift", {})
    if drift:
        lines += [
            "",
            "| drift scenario | correct before | correct after | accuracy drop | correct on the last day "
            "| resets (first) |",
            "|---|---|---|---|---|---|",
        ]
        for row in drift.values():
            first = f"day {row['reset_day']:.2f}" if row.get("reset_day") is not None else "–"
            lines.append(
                f"| {row['name']} | {row['before']:.1%} | {row['after']:.1%} | {row['drop']:+.1%} "
                f"| {row['last_day']:.1%} | {row['resets']} ({first}) |"
            )
    if report.get("claims"):
        lines += ["", "| seed claim | measured | met |", "|---|---|---|"]
        for c in report["claims"]:
            lines.append(f"| {c['claim']} | {c['measured']} | {'yes' if c['met'] else 'no'} |")
    return "\n".join(lines)


def _curves_plot(plt: Any, report: dict[str, Any], out_prefix: str) -> str:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, c in report.get("curves", {}).items():
        name = report["rows"][key]["name"]
        a1.plot(c["step"], c["leak"], label=name)
        a2.plot(c["step"], c["recall"], label=name)
    a1.set_title("harmful leak (rolling)")
    a2.set_title("helpful recall@k (rolling)")
    for a in (a1, a2):
        a.set_xlabel("retrieval steps")
        a.grid(alpha=0.3)
    a2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = f"{out_prefix}-curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(report: dict[str, Any], out_prefix: str) -> list[str]:
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if report.get("curves"):  # only drift rows (--rows reset,...): no curves to draw, no empty plot
        paths.append(_curves_plot(plt, report, out_prefix))
    if report.get("drift_series"):
        sc = report["drift_scenario"]
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        for key, s in report["drift_series"].items():
            name = report["drift"][key]["name"]
            xs = [(x - sc["start_ts"]) / DAY for x, _, n in s["corr"] if n > 0]
            a1.plot(xs, [v for _, v, n in s["corr"] if n > 0], label=name)
            a2.plot([(x - sc["start_ts"]) / DAY for x in s["ts"]], s["leak"], label=name)
            for reset in s["resets"]:
                for a in (a1, a2):
                    a.axvline((reset["ts"] - sc["start_ts"]) / DAY, color="green", ls=":")
        for a in (a1, a2):
            a.axvline(sc["drift_day"], color="red", ls="--")
            a.grid(alpha=0.3)
        a1.set_ylabel("7-day correlation (U_query, rating)")
        a2.set_ylabel("harmful leak (rolling)")
        a2.set_xlabel("event time (days); red: drift, green: reset")
        a1.legend(fontsize=8)
        fig.tight_layout()
        path = f"{out_prefix}-drift.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the small size (used by the tests)")
    p.add_argument("--scenario", help="scenario name or YAML file (default: default)")
    p.add_argument("--text", action="store_true", help="the text flavour (MiniLM embeddings; the 'text' extra)")
    p.add_argument("--rows", help="comma-separated rows to run (default: all; --quick: similarity,dynamic)")
    p.add_argument("--out", help="write the results as JSON here, and plots next to it")
    p.add_argument("--seed", type=int, default=0, help="scenario seed")
    p.add_argument(
        "--seeds", help="several seeds side by side, e.g. 0,1,2 (rows are the means; overrides --seed; --lm: 0,1,2)"
    )
    lmlearning.add_options(p)  # --lm and its flags: the real-LM bench
    p.add_argument("--in-process", action="store_true", help="the rows in one process, without Kafka (--lr applies)")


def main(args: argparse.Namespace) -> int:
    if getattr(args, "lm", False):
        return lmlearning.main(args)
    if getattr(args, "in_process", False):
        return inprocess.main(args)
    for module in ("yaml", "rich", *(["matplotlib"] if args.out else [])):  # before any process starts
        importlib.import_module(module)
    report = asyncio.run(run(args))
    finish(report, table, args.out)
    if args.out:
        prefix = str(Path(args.out).with_suffix(""))
        for p in plot(report, prefix):
            print(f"plot: {p}")
    return 0
