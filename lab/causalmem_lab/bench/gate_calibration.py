"""``causalmem bench gate``: do the promotion rule's intervals hold? Measured on the real-data world.

In process (:func:`causalmem_lab.offline.run_offline`: the product's retriever, trainer,
evidence and :func:`pipeline.learner.promotion.decide`, without Kafka), on the world of
``causalmem bench promise`` (FanOutQA's sub-questions, MiniLM embeddings, SmolLM2 utilities
cached on disk), for the clients of that bench. Every candidate that starts a trial is kept;
afterwards each one's value and its anchor's, as served (its manifest's temperature, exploration
and hard drop: what the rule values), are measured on the world's questions against the cached utilities, and
compared with every interval the rule looked at.

The rule's intervals are confidence *sequences*: with probability ≥ 1 − δ_j, trial j's interval
holds at every look at once. So a trial is **covered** when every one of its intervals holds the
true gain, and the bench reports that share over all trials (target ≥ 90%), with its 95% Wilson
interval, beside the share of single looks that hold it; and the rule's decisions against the
truth: **false promotions** (served, and truly worse than the anchor: by more than ε where the
rule promoted within ε of similarity-only, else at all) and **false refusals** (refused as worse,
and truly not).

The true value is measured on a finite sample of the world's questions (``draws`` draws per
question): a trial whose true gain is within ``--tolerance`` of an interval's edge counts as
covered.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from causalmem_lab.bench import finish, lmlearning, promise
from causalmem_lab.bench.promise import CLIENTS, wilson
from causalmem_lab.offline import PRODUCT, OfflineResult, run_offline
from pipeline.learner.promotion import SIMILARITY

TARGET = 0.9


def judge(result: OfflineResult, value: dict[int, float], epsilon: float, tolerance: float = 0.0) -> dict[str, Any]:
    """Each trial's intervals and the rule's decisions against the true values.

    ``value``: the true value of every version the looks name, :data:`SIMILARITY` included.

    >>> from types import SimpleNamespace as NS
    >>> r = NS(looks=[(1, 2, 0, -0.1, 0.3), (2, 2, 0, 0.05, 0.2), (2, 3, 2, -0.5, -0.1)],
    ...        actions=[(2, "promote", 2, "improved"), (2, "refuse", 3, "worse")])
    >>> j = judge(r, {0: 1.0, 2: 1.1, 3: 1.2}, 0.02)
    >>> j["trials"], j["covered"], j["looks"], j["looks_covered"], j["false_refusals"]
    (2, 1, 3, 2, 1)
    """
    intervals: dict[int, list[tuple[int, float, float]]] = {}
    for _, version, anchor, low, high in result.looks:
        intervals.setdefault(version, []).append((anchor, low, high))
    held = {
        v: [value[v] - value[a] >= low - tolerance and value[v] - value[a] <= high + tolerance for a, low, high in seq]
        for v, seq in intervals.items()
    }
    anchors = {v: seq[-1][0] for v, seq in intervals.items()}  # the anchor of its last look
    false_promotions = false_refusals = promotions = refusals = 0
    for _, kind, version, path in result.actions:
        if version not in anchors:
            continue
        gain = value[version] - value[anchors[version]]
        if kind == "promote":
            promotions += 1
            false_promotions += gain < (-epsilon if path == "within-epsilon" else 0.0)
        elif kind == "refuse":
            refusals += 1
            false_refusals += gain >= 0.0
    return {
        "trials": len(held),
        "covered": sum(all(h) for h in held.values()),
        "looks": sum(len(h) for h in held.values()),
        "looks_covered": sum(sum(h) for h in held.values()),
        "promotions": promotions,
        "false_promotions": false_promotions,
        "refusals": refusals,
        "false_refusals": false_refusals,
        "width_median": float(np.median([seq[-1][2] - seq[-1][1] for seq in intervals.values()])) if held else None,
        "gains": {v: value[v] - value[anchors[v]] for v in held},
        "last": {v: intervals[v][-1][1:] for v in held},
    }


def run_one(data: Any, u: Any, cname: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of a client with the gate at the defaults, every trial judged against the truth."""
    client = CLIENTS[cname]
    scenario, world = promise.world_of(data, u, client, seed, args.events or client.events)
    cfg = promise.config(client, True, seed, args.epsilon, args.drop or PRODUCT.serve_drop)
    t0 = time.monotonic()
    result = run_offline(scenario, cfg, env=world)
    seconds = time.monotonic() - t0
    test = world.test
    named = {v for _, v, a, _, _ in result.looks} | {a for _, _, a, _, _ in result.looks}
    versions = {**result.trialled, **result.served_versions}
    value = {
        v: lmlearning.measure(u, data, test, versions[v], draws=args.draws, seed=seed, explore=True)["value"]
        for v in sorted(named - {SIMILARITY})
    }
    value[SIMILARITY] = lmlearning.measure(u, data, test)["value"]
    out = judge(result, value, args.epsilon, args.tolerance)
    out["gains"] = {str(v): round(g, 4) for v, g in out["gains"].items()}
    out["last"] = {str(v): [round(x, 4) for x in b] for v, b in out["last"].items()}
    return {"client": cname, "seed": seed, "seconds": round(seconds, 1), **out}


def run(args: argparse.Namespace) -> dict[str, Any]:
    data_name, data, u = promise.bank(args, "fanout-lookalike")
    seeds = [int(s) for s in (args.seeds or "0,1,2").split(",") if s.strip()]
    clients = [c.strip() for c in (args.clients or "retriever,t1").split(",") if c.strip()]
    unknown = [c for c in clients if c not in CLIENTS]
    if unknown:
        raise ValueError(f"unknown clients {unknown}; clients {list(CLIENTS)}")
    runs = []
    for cname in clients:
        for seed in seeds:
            runs.append(run_one(data, u, cname, seed, args))
            print(f"gate {cname} seed {seed}: {json.dumps({k: v for k, v in runs[-1].items() if k != 'last'})}")
    total = {k: sum(r[k] for r in runs) for k in ("trials", "covered", "looks", "looks_covered")}
    total.update({k: sum(r[k] for r in runs) for k in ("promotions", "false_promotions", "refusals", "false_refusals")})
    coverage = total["covered"] / total["trials"] if total["trials"] else None
    return {
        "data": data_name,
        "epsilon": args.epsilon,
        "drop": args.drop or PRODUCT.serve_drop,
        "seeds": seeds,
        "clients": clients,
        "runs": runs,
        "total": total,
        "coverage": coverage,
        "coverage_interval": wilson(total["covered"], total["trials"]),
        "meets_target": coverage is not None and coverage >= TARGET,
    }


def table(report: dict[str, Any]) -> str:
    t = report["total"]
    lo, hi = report["coverage_interval"]
    cov = report["coverage"]
    lines = [
        "| client | seed | trials | covered at every look | looks covered | last interval's width (median) "
        "| promotions (false) | refusals (false) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        width = "–" if r["width_median"] is None else f"{r['width_median']:.3f}"
        lines.append(
            f"| {r['client']} | {r['seed']} | {r['trials']} | {r['covered']} | {r['looks_covered']}/{r['looks']} "
            f"| {width} "
            f"| {r['promotions']} ({r['false_promotions']}) | {r['refusals']} ({r['false_refusals']}) |"
        )
    lines.append(
        f"coverage over {t['trials']} trials: {'–' if cov is None else f'{cov:.0%}'} ({lo:.0%}–{hi:.0%}), "
        f"target ≥ {TARGET:.0%}: {'met' if report['meets_target'] else 'NOT met'}"
    )
    return "\n".join(lines)


def add_options(p: argparse.ArgumentParser) -> None:
    promise.world_options(p, "fanout-lookalike")
    p.add_argument("--clients", help=f"comma-separated, of {', '.join(CLIENTS)} (default retriever,t1)")
    p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--events", type=int, help="steps of traffic per run (default: the client's)")
    p.add_argument("--epsilon", type=float, default=PRODUCT.gate_epsilon, help="the margin (default: the gate's)")
    p.add_argument("--drop", choices=("dynamic", "none"), help="the hard drop clients serve (default: the product's)")
    p.add_argument("--draws", type=int, default=4, help="draws per question of each true value (default 4)")
    p.add_argument(
        "--tolerance", type=float, default=0.0, help="slack of the true gains' own sampling error (default 0)"
    )
    p.add_argument("--out", help="write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    return finish(run(args), table, args.out)
