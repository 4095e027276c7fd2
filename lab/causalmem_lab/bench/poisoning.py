"""``causalmem bench poisoning``: one principal's lies against everyone else's service (contract 1.15).

On the simulator's default world (12 intents, each with helpful, harmful and similar memories;
no drift), in one process, with the product's retriever and learner parts: the trainer, and the
learner's book of principals (:class:`pipeline.learner.principals.PrincipalBook`: the
influence cap, the disagreement flag and the hold, as ``Learner.apply`` uses them). Honest
traffic comes from eight honest principals; a **liar** sends a share of all traffic (6, 12 or
25 %), its events honest but its feedback inverted (``u → −u``: the harmful memories "help"),
either **spread** over every intent or **concentrated** on one intent (its queries all of
intent 0). Checkpoints are served every ``--refresh-every`` steps (no promotion gate: the gate
weighs its evidence without the cap, so it adds no defence here).

Each lying run is made three ways:

- ``none``: no bound (``influence_cap`` 1: every weight 1, as before contract 1.15);
- ``cap``: the bound alone (``influence_cap`` 0.2), a flagged principal keeping its weight;
- ``default``: the product's defaults: the bound, and a flagged principal held at weight 0
  (:meth:`PrincipalBook.held`) while its utilities disagree.

Each micro-batch is stepped as ``Learner.apply`` steps it: the experiences of weight 0 left out,
the step scaled by the weight the batch carries.

The measure is the **honest clients' harmful-read rate**: the share of their retrievals, as
served (not exploratory), that read a harmful memory, over the last third of the run; against
the honest-only run on the same seed (the same honest queries, no liar). A run is 3,000 honest
queries by default: its last third is late in learning, while the policy still reads harmful
memories often enough for lies about them to move it. (At 9,000 queries, once it has settled and
rarely reads them, even an unbounded liar was within the noise: the measure no longer tells the
defences apart.)

Single runs wander: two honest-only runs on the same traffic that differ only in the network's
initialisation differed by 7.9 points (standard deviation over nine seeds, 2026-12-06), more than
the 5-point target. So a seed's rate is the mean over ``--inits`` initialisations (default 3),
and the report states the standard error this noise leaves on each mean excess. It gives each
configuration's mean over seeds, its mean and worst excess over honest-only, and how many runs
flagged the liar; the target is an excess within 5 points.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.offline import PRODUCT, OfflineConfig, _snapshot
from causalmem_lab.simulator import Environment, Scenario, scenario_retriever, serve
from models.policy.trainer import PolicyTrainer
from pipeline.learner.principals import PrincipalBook
from topics.internal import Experience

HONEST = [f"client-{i}" for i in range(8)]
LIAR = "liar"
SHARES = (0.06, 0.12, 0.25)
MODES = ("spread", "intent")
DEFENCES = ("none", "cap", "default")
NOISE_SEED = 1000  # trainer seeds of a seed's initialisations: seed + k·NOISE_SEED


def run_one(
    seed: int,
    share: float,
    mode: str,
    defence: str,
    *,
    queries: int,
    refresh_every: int,
    tail: float = 1 / 3,
    world: dict[str, Any] | None = None,
    hidden: int | None = None,
    trainer_seed: int | None = None,
) -> dict[str, Any]:
    """One run: ``queries`` honest queries (and the liar's on top, ``share`` of all); the honest
    clients' harmful-read rate over the last ``tail`` of their served retrievals. ``world``:
    changes to the default scenario (a smaller world in tests); ``hidden``: the policy's width;
    ``trainer_seed``: the network's initialisation (``seed`` unless given)."""
    scenario = Scenario(seed=seed, drift_day=None, days=queries / 500, queries_per_day=500, **(world or {}))
    env = Environment(scenario)
    liar_env = Environment(scenario)  # the same world; the liar's own stream of queries
    cfg = OfflineConfig(
        gate=False, seed=seed if trainer_seed is None else trainer_seed, hidden=hidden or PRODUCT.hidden
    )
    retriever = scenario_retriever(
        env,
        scenario,
        drop=cfg.drop,
        explore_rate=scenario.explore_rate,
        explore_temperature=scenario.explore_temperature,
        canary_rate=0.0,
    )
    trainer = PolicyTrainer(cfg.trainer(scenario))
    cap = 1.0 if defence == "none" else PRODUCT.influence_cap
    book = PrincipalBook(
        cap,
        PRODUCT.influence_window,
        PRODUCT.disagreement_tolerance,
        PRODUCT.disagreement_min_n,
        hold=defence == "default",
    )
    rng = np.random.default_rng(1000 + seed)
    version = 1
    retriever.set_policy(_snapshot(trainer, version))
    pending: list[Experience] = []
    honest_leak: list[bool] = []
    steps = liar_steps = 0
    flagged_at: int | None = None
    honest_done = 0
    while honest_done < queries:
        liar = share > 0 and rng.random() < share
        if liar:
            q = liar_env.next_query()
            while mode == "intent" and q.intent != 0:
                q = liar_env.next_query()
            principal = LIAR
        else:
            q = env.next_query()
            honest_done += 1
            principal = HONEST[int(rng.integers(len(HONEST)))]
        source = liar_env if liar else env
        for step in range(q.steps):
            st = source.step_features(q, step)
            res = serve(retriever, st, with_texts=False)
            _, nll_with, nll_without, _ = source.feedback(q.intent, res.slots)
            u = nll_without - nll_with
            q.utilities.append(u)
            if not liar and res.event.temperature == retriever.temperature:
                honest_leak.append(source.leak(q.intent, res.slots))
            reported = -u if liar else u
            liar_steps += liar
            if not res.event.fallback:
                pending.append(
                    Experience(res.event.event_id, "feedback", res.event, reported, feedback_principal=principal)
                )
            if len(pending) >= cfg.batch_size:
                weights = book.weigh(pending)
                kept = weights > 0
                batch = [e for e, k in zip(pending, kept, strict=True) if k]
                if batch:
                    carried = float(weights.sum()) / len(pending)  # as Learner.apply steps
                    trainer.update(batch, None if (weights[kept] == 1.0).all() else weights[kept], carried)
                pending = []
                if flagged_at is None and book.disagreement.verdict(LIAR).flagged:
                    flagged_at = liar_steps
            steps += 1
            if steps % refresh_every == 0:
                version += 1
                retriever.set_policy(_snapshot(trainer, version))
    n = len(honest_leak)
    tail_leak = honest_leak[int(n * (1 - tail)) :]
    verdict = book.disagreement.verdict(LIAR)
    honest_flagged = [p for p in HONEST if book.disagreement.verdict(p).flagged]
    return {
        "seed": seed,
        "trainer_seed": cfg.seed,
        "share": share,
        "mode": mode,
        "defence": defence,
        "harmful_read_rate": float(np.mean(tail_leak)) if tail_leak else float("nan"),
        "honest_retrievals": len(tail_leak),
        "liar_steps": liar_steps,
        "liar_share_of_steps": liar_steps / max(1, steps),
        "flagged_after_liar_steps": flagged_at,
        "liar_residual": verdict.mean if verdict.n else None,
        "honest_flagged": honest_flagged,
    }


def run_seed(seed: int, share: float, mode: str, defence: str, *, inits: int, **opts: Any) -> dict[str, Any]:
    """One seed's measure: the mean over ``inits`` initialisations of the network (trainer seeds
    ``seed``, ``seed + NOISE_SEED``, …) on the same world and traffic. A single run wanders by
    several points (the learner's own noise at the default learning rate on step rewards); the
    mean over initialisations is what a liar's excess is measured on."""
    runs = [run_one(seed, share, mode, defence, trainer_seed=seed + k * NOISE_SEED, **opts) for k in range(inits)]
    rates = [r["harmful_read_rate"] for r in runs]
    return {
        "seed": seed,
        "harmful_read_rate": float(np.mean(rates)),
        "sd_between_inits": float(np.std(rates, ddof=1)) if inits > 1 else None,
        "flagged": sum(r["flagged_after_liar_steps"] is not None for r in runs),
        "honest_flagged": sum(len(r["honest_flagged"]) for r in runs),
        "runs": runs,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    seeds = [int(s) for s in (args.seeds or "0,1,2").split(",") if s.strip()]
    shares = [float(s) for s in (args.shares or ",".join(map(str, SHARES))).split(",") if s.strip()]
    modes = [m.strip() for m in (args.modes or ",".join(MODES)).split(",") if m.strip()]
    defences = [d.strip() for d in (args.defences or ",".join(DEFENCES)).split(",") if d.strip()]
    unknown = [m for m in modes if m not in MODES] + [d for d in defences if d not in DEFENCES]
    if unknown:
        raise ValueError(f"unknown modes or defences {unknown}; modes {list(MODES)}, defences {list(DEFENCES)}")
    if args.inits < 1:
        raise ValueError("--inits must be at least 1")
    opts = {"queries": args.queries, "refresh_every": args.refresh_every, "inits": args.inits}
    report: dict[str, Any] = {
        "seeds": seeds,
        "queries": args.queries,
        "inits": args.inits,
        "baseline": {},
        "rows": {},
    }
    t0 = time.time()

    def said(name: str, r: dict[str, Any]) -> None:
        short = {k: v for k, v in r.items() if k != "runs"}
        print(f"{name} seed {r['seed']}: {json.dumps(short)} ({time.time() - t0:.0f} s)", flush=True)

    for seed in seeds:
        report["baseline"][seed] = base = run_seed(seed, 0.0, "spread", "none", **opts)
        said("honest only", base)
    for share in shares:
        for mode in modes:
            for defence in defences:
                per_seed = []
                for seed in seeds:
                    r = run_seed(seed, share, mode, defence, **opts)
                    r["excess"] = r["harmful_read_rate"] - report["baseline"][seed]["harmful_read_rate"]
                    per_seed.append(r)
                    said(f"{share:.0%} {mode} {defence}", r)
                report["rows"][f"{share:.0%}/{mode}/{defence}"] = {
                    "seeds": per_seed,
                    "standard_error": standard_error(per_seed, [report["baseline"][s] for s in seeds], args.inits),
                    "harmful_read_rate": float(np.mean([r["harmful_read_rate"] for r in per_seed])),
                    "mean_excess": float(np.mean([r["excess"] for r in per_seed])),
                    "worst_excess": max(r["excess"] for r in per_seed),
                    "flagged": sum(r["flagged"] for r in per_seed),
                    "honest_flagged": sum(r["honest_flagged"] for r in per_seed),
                }
    return report


def standard_error(runs: list[dict[str, Any]], baseline: list[dict[str, Any]], inits: int) -> float | None:
    """The standard error of a mean excess over seeds from the learner's own noise: each seed's
    spread between initialisations, the lying runs' and honest-only's (None with one each)."""
    if inits < 2:
        return None
    var = np.mean([r["sd_between_inits"] ** 2 for r in runs]) + np.mean([b["sd_between_inits"] ** 2 for b in baseline])
    return float(np.sqrt(var / inits / len(runs)))


def table(report: dict[str, Any]) -> str:
    base = [b["harmful_read_rate"] for b in report["baseline"].values()]
    n_runs = len(report["seeds"]) * report["inits"]
    lines = [
        f"honest only: harmful-read rate {np.mean(base):.3f} (seeds: {', '.join(f'{b:.3f}' for b in base)}; "
        f"each the mean of {report['inits']} initialisations)",
        "",
        "| liar share / where / defence | honest harmful-read rate | excess over honest-only: mean "
        "(standard error), worst seed | liar flagged (runs) | honest principals flagged |",
        "|---|---|---|---|---|",
    ]
    for name, row in report["rows"].items():
        se = f" ({row['standard_error']:.3f})" if row["standard_error"] is not None else ""
        lines.append(
            f"| {name} | {row['harmful_read_rate']:.3f} | {row['mean_excess']:+.3f}{se}, {row['worst_excess']:+.3f} "
            f"| {row['flagged']}/{n_runs} | {row['honest_flagged']} |"
        )
    return "\n".join(lines)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--shares", help="the liar's shares of the traffic (default 0.06,0.12,0.25)")
    p.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default both)")
    p.add_argument("--defences", help=f"comma-separated, of {', '.join(DEFENCES)} (default all)")
    p.add_argument("--queries", type=int, default=3000, help="honest queries per run (default 3000)")
    p.add_argument("--inits", type=int, default=3, help="initialisations of the network per seed, averaged (default 3)")
    p.add_argument("--refresh-every", type=int, default=300, help="steps between checkpoints (default 300)")
    p.add_argument("--out", help="write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0
