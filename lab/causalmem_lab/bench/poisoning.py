"""``causalmem bench poisoning``: one principal's lies against everyone else's service (contract 1.15).

On the simulator's default world (12 intents, each with helpful, harmful and similar memories;
no drift), in one process, with the product's retriever and learner parts: the trainer, and the
learner's book of principals (:class:`pipeline.learner.principals.PrincipalBook`: the
influence cap, the disagreement flag and quarantine, as ``Learner.apply`` uses them). Honest
traffic comes from eight honest principals; a **liar** sends a share of all traffic (6, 12 or
25 %), its events honest but its feedback inverted (``u → −u``: the harmful memories "help"),
either **spread** over every intent or **concentrated** on one intent (its queries all of
intent 0). Checkpoints are served every ``--refresh-every`` steps (no promotion gate: the gate
weighs its evidence without the cap, so it adds no defence here).

Each lying run is made three ways:

- ``none``: no bound (``influence_cap`` 1: every weight 1, as before contract 1.15);
- ``cap``: the product's default bound (``influence_cap`` 0.2), the liar never quarantined;
- ``quarantine``: the bound, and the liar quarantined as soon as the learner flags it (what an
  operator does on the ``status`` line; the run says when that was).

The measure is the **honest clients' harmful-read rate**: the share of their retrievals, as
served (not exploratory), that read a harmful memory, over the last third of the run; against
the honest-only run on the same seed (the same honest queries, no liar). A run is 9,000 honest
queries by default: past the learning phase (the first ~3,000), so the last third measures what
the liar moves once honest-only has settled, not how fast learning goes. The report gives each
configuration's mean over seeds, its mean and worst excess over the honest-only run, and whether
(and after how many liar steps) the liar was flagged; the target is an excess within 5 points.
Single runs wander: at the default learning rate on step rewards the learner's harmful-read rate
moves by several points over thousands of queries. So each seed also has a second honest-only
run with another initialisation of the network, whose excess is the noise under every row.
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
DEFENCES = ("none", "cap", "quarantine")
NOISE_SEED = 1000  # trainer seeds of the honest-only replicates: NOISE_SEED + seed


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
    book = PrincipalBook(cap, PRODUCT.influence_window, PRODUCT.disagreement_tolerance, PRODUCT.disagreement_min_n)
    quarantined: list[str] = []
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
                weights = book.weigh(pending, quarantined)
                kept = weights > 0
                batch = [e for e, k in zip(pending, kept, strict=True) if k]
                if batch:
                    trainer.update(batch, None if (weights[kept] == 1.0).all() else weights[kept])
                pending = []
                if flagged_at is None and book.disagreement.verdict(LIAR).flagged:
                    flagged_at = liar_steps
                    if defence == "quarantine":
                        quarantined = [LIAR]
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    seeds = [int(s) for s in (args.seeds or "0,1,2").split(",") if s.strip()]
    shares = [float(s) for s in (args.shares or ",".join(map(str, SHARES))).split(",") if s.strip()]
    modes = [m.strip() for m in (args.modes or ",".join(MODES)).split(",") if m.strip()]
    defences = [d.strip() for d in (args.defences or ",".join(DEFENCES)).split(",") if d.strip()]
    unknown = [m for m in modes if m not in MODES] + [d for d in defences if d not in DEFENCES]
    if unknown:
        raise ValueError(f"unknown modes or defences {unknown}; modes {list(MODES)}, defences {list(DEFENCES)}")
    opts = {"queries": args.queries, "refresh_every": args.refresh_every}
    report: dict[str, Any] = {"seeds": seeds, "queries": args.queries, "baseline": {}, "noise": {}, "rows": {}}
    t0 = time.time()
    for seed in seeds:
        base = run_one(seed, 0.0, "spread", "none", **opts)
        report["baseline"][seed] = base
        print(f"honest only, seed {seed}: {json.dumps(base)} ({time.time() - t0:.0f} s)", flush=True)
        # The same traffic with another initialisation of the network: how far two honest-only
        # runs differ on a seed, the floor under any liar's excess.
        again = run_one(seed, 0.0, "spread", "none", trainer_seed=NOISE_SEED + seed, **opts)
        again["excess"] = again["harmful_read_rate"] - base["harmful_read_rate"]
        report["noise"][seed] = again
        print(f"honest only, another initialisation, seed {seed}: {json.dumps(again)} ({time.time() - t0:.0f} s)")
    for share in shares:
        for mode in modes:
            for defence in defences:
                runs = []
                for seed in seeds:
                    r = run_one(seed, share, mode, defence, **opts)
                    r["excess"] = r["harmful_read_rate"] - report["baseline"][seed]["harmful_read_rate"]
                    runs.append(r)
                    print(f"{share:.0%} {mode} {defence} seed {seed}: {json.dumps(r)} ({time.time() - t0:.0f} s)")
                report["rows"][f"{share:.0%}/{mode}/{defence}"] = {
                    "runs": runs,
                    "harmful_read_rate": float(np.mean([r["harmful_read_rate"] for r in runs])),
                    "mean_excess": float(np.mean([r["excess"] for r in runs])),
                    "worst_excess": max(r["excess"] for r in runs),
                    "flagged": sum(r["flagged_after_liar_steps"] is not None for r in runs),
                    "honest_flagged": sum(len(r["honest_flagged"]) for r in runs),
                }
    return report


def table(report: dict[str, Any]) -> str:
    base = [b["harmful_read_rate"] for b in report["baseline"].values()]
    noise = [r["excess"] for r in report.get("noise", {}).values()]
    lines = [
        f"honest only: harmful-read rate {np.mean(base):.3f} (seeds: {', '.join(f'{b:.3f}' for b in base)})",
        f"honest only, another initialisation of the network: excess {np.mean(noise):+.3f} on the mean "
        f"(seeds: {', '.join(f'{x:+.3f}' for x in noise)}): the noise under every row"
        if noise
        else "",
        "",
        "| liar share / where / defence | honest harmful-read rate | excess over honest-only: mean, worst "
        "| liar flagged (runs) | honest principals flagged |",
        "|---|---|---|---|---|",
    ]
    for name, row in report["rows"].items():
        n = len(row["runs"])
        lines.append(
            f"| {name} | {row['harmful_read_rate']:.3f} | {row['mean_excess']:+.3f}, {row['worst_excess']:+.3f} "
            f"| {row['flagged']}/{n} "
            f"| {row['honest_flagged']} |"
        )
    return "\n".join(lines)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--shares", help="the liar's shares of the traffic (default 0.06,0.12,0.25)")
    p.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default both)")
    p.add_argument("--defences", help=f"comma-separated, of {', '.join(DEFENCES)} (default all)")
    p.add_argument(
        "--queries", type=int, default=9000, help="honest queries per run (default 9000: past the learning phase)"
    )
    p.add_argument("--refresh-every", type=int, default=300, help="steps between checkpoints (default 300)")
    p.add_argument("--out", help="write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    report = run(args)
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0
