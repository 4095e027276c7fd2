"""``causalmem bench promise``: is what the promotion gate serves ever worse than similarity-only?

The Seldonian check of the promotion rule on the real-data world, in one process
(:func:`causalmem_lab.offline.run_offline`: the product's retriever, trainer, logging
probabilities and promotion decisions, without Kafka). Two clients written from
docs/contract.md (required fields only: no ``candidate_probs``, no canary):

- ``t1``: serves every request at T = 1 (``explore_rate`` 1), feedback the step's utility only
  (12,000 events);
- ``manifest``: serves as the manifest asks (T = 0.05, 10% at T = 0.1), per-memory credit on a
  quarter of the steps as the evaluator gives it (36,000 events);

and ``retriever``, :class:`~pipeline.client.retriever.CausalRetriever` as the manifest asks, which
also logs ``candidate_probs`` and serves the canary (36,000 events, credit on a quarter);

each with the gate (``gate``: the promotion rule, :mod:`pipeline.learner.promotion`) and without
(``none``: every checkpoint served).

Every version a client was told to serve is measured afterwards, as its manifest says to serve
it (temperature, hard drop and exploration share: :func:`as_asked`), on the world's questions
against the LM's cached utilities. A run is **unsafe** when any version served during it, the
first policy included, was below similarity-only (plain top-k) by more than ε; the report gives
the unsafe share over runs with its 95% Wilson interval, the worst served version against
similarity-only, and the share of the similarity → oracle gap the version served at the end
closes (mean and worst over seeds; and its mean without the exploration share).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.bench import finish, lmlearning
from causalmem_lab.bench.lmlearning import base_of
from causalmem_lab.lmdata import lm_utilities
from causalmem_lab.lmworld import LMScenario, LMWorld, policy_slots
from causalmem_lab.offline import PRODUCT, OfflineConfig, run_offline


@dataclass(frozen=True)
class Client:
    """How a contract client serves and what feedback it sends."""

    description: str
    events: int
    attribution_rate: float = 0.0
    explore_rate: float | None = None  # None: as the manifest asks
    explore_temperature: float | None = None
    minimal: bool = True  # required fields only, no canary; False: CausalRetriever, which serves the canary


CLIENTS = {  # the first two are the contract clients: required fields only, no canary
    "t1": Client("contract client, every request at T = 1, step reward only", 12_000, 0.0, 1.0, 1.0),
    "manifest": Client("contract client serving as the manifest asks, per-memory credit on 25%", 36_000, 0.25),
    "retriever": Client(
        "CausalRetriever (candidate_probs, the canary), per-memory credit on 25%", 36_000, 0.25, minimal=False
    ),
}
RULES = ("none", "gate")
# Draws per question for each of a version's two measures (without exploration, exploratory draws
# alone): at 16 the first policy's cost reads 0.0145 to 0.0171 where 64 draws give 0.016.
DRAWS = 16


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n.

    >>> [round(x, 3) for x in wilson(0, 20)]
    [0.0, 0.161]
    """
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def world_of(data: Any, u: Any, client: Client, seed: int, events: int) -> tuple[LMScenario, LMWorld]:
    """The real-data world a client's run sends its traffic from."""
    scenario = LMScenario(
        seed=seed,
        events=events,
        attribution_rate=client.attribution_rate,
        n_candidates=int(u.candidates.shape[1]),
        slots=policy_slots(len(data.texts)),
    )
    return scenario, LMWorld(scenario, data, u)


def config(client: Client, gate: bool, seed: int, epsilon: float, drop: str, restart_at: int = 0) -> OfflineConfig:
    """The loop's settings for a client's run: the product's defaults but the client's serving
    (``restart_at``: the step of a learner restart, 0 none)."""
    return OfflineConfig(
        restart_at=restart_at,
        gate=gate,
        gate_epsilon=epsilon,
        minimal_client=client.minimal,
        drop=drop,
        explore_rate=client.explore_rate,
        explore_temperature=client.explore_temperature,
        seed=seed,
    )


def as_asked(client: Client) -> bool | tuple[float, float]:
    """How a version is measured: as its manifest asks, its exploration share included (what the
    promise is about); for a client that explores otherwise (``t1``), as the product's manifest
    asks (the lab's manifest then says what that client does)."""
    if client.explore_rate is None and client.explore_temperature is None:
        return True
    return PRODUCT.serve_explore_rate, PRODUCT.serve_explore_temperature


def run_one(
    data: Any,
    u: Any,
    client: Client,
    rule: str,
    seed: int,
    events: int,
    epsilon: float,
    drop: str = PRODUCT.serve_drop,
    restart_at: int = 0,
) -> dict[str, Any]:
    """One run: the versions served and their values, the worst against similarity-only, the end."""
    scenario, world = world_of(data, u, client, seed, events)
    cfg = config(client, rule == "gate", seed, epsilon, drop, restart_at)
    t0 = time.monotonic()
    res = run_offline(scenario, cfg, env=world)
    seconds = time.monotonic() - t0
    test = world.test
    similarity = lmlearning.measure(u, data, test)["value"]
    best = lmlearning.oracle(u, data, test)["value"]
    served = sorted({int(v) for v in res.tally.version})  # the versions that served a request
    policies = {v: res.served_versions[v] for v in served if v in res.served_versions}
    assert res.served is not None
    explore = as_asked(client)
    values = {
        v: lmlearning.measure(u, data, test, p, DRAWS, seed, explore, base=res.served_versions.get(base_of(p)))["value"]
        for v, p in policies.items()
    }
    final = values.get(res.served.version)
    end_base = res.served_versions.get(base_of(res.served))
    if final is None:  # published too late to serve a request: the end, not a version served
        final = lmlearning.measure(u, data, test, res.served, DRAWS, seed, explore, base=end_base)["value"]
    unexplored = lmlearning.measure(u, data, test, res.served, DRAWS, seed, base=end_base)["value"]
    worst = min(values.values()) - similarity if values else 0.0
    # The promise's other half for a probe over a certified version (contract 1.23): as served,
    # not worse than the version it names by more than ε (measured too where a probe replaced it
    # before it served a request).
    bases = {b for p in policies.values() if (b := base_of(p)) in res.served_versions}
    named = {
        b: values[b]
        if b in values
        else lmlearning.measure(u, data, test, res.served_versions[b], DRAWS, seed, explore)["value"]
        for b in bases
    }
    over_base = [values[v] - named[b] for v, p in policies.items() if (b := base_of(p)) in named]
    return {
        "seed": seed,
        "seconds": round(seconds, 1),
        "versions_served": len(values),
        "final_version": res.served.version,
        "final_gap_closed": lmlearning.gap_closed(final, similarity, best),
        "final_gap_closed_unexplored": lmlearning.gap_closed(unexplored, similarity, best),
        "worst_vs_similarity": worst,
        "unsafe": worst < -epsilon,
        "probes_over_certified": len(over_base),
        # Promotions clients refused, older than a probe published since (they kept the probe).
        "promotions_refused_as_older": len(res.refused_older),
        "worst_probe_vs_base": min(over_base) if over_base else None,
        "actions": {k: sum(1 for _, kind, _, _ in res.actions if kind == k) for k in {a[1] for a in res.actions}},
        # The steps of the promotions (and rollbacks) and of a learner restart: what came after it.
        "promotions": [(step, v) for step, kind, v, _ in res.actions if kind == "promote"],
        "restarted": res.restarted,
    }


def bank(args: argparse.Namespace, default: str) -> tuple[str, Any, Any]:
    """(its name, the bank, its LM utilities) of the real-data world ``args`` name (:func:`world_options`)."""
    name = args.data or default
    build, c = lmlearning.DATA[name]
    data = build()
    u = lm_utilities(data, c=args.candidates or c, cache_dir=Path(args.cache_dir) if args.cache_dir else None, model="")
    return name, data, u


def world_options(p: argparse.ArgumentParser, default: str) -> None:
    """The flags that choose the real-data world (read by :func:`bank`)."""
    p.add_argument("--data", choices=list(lmlearning.DATA), help=f"the bank (default {default})")
    p.add_argument("--candidates", type=int, help="candidates scored per question, C (default: the bank's)")
    p.add_argument("--cache-dir", help="where LM utilities are cached (default ~/.cache/causalmem/lm-utilities)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    data_name, data, u = bank(args, "fanout")
    seeds = [int(s) for s in (args.seeds or "0,1,2").split(",") if s.strip()]
    clients = [c.strip() for c in (args.clients or ",".join(CLIENTS)).split(",") if c.strip()]
    rules = [r.strip() for r in (args.rules or ",".join(RULES)).split(",") if r.strip()]
    unknown = [c for c in clients if c not in CLIENTS] + [r for r in rules if r not in RULES]
    if unknown:
        raise ValueError(f"unknown clients or rules {unknown}; clients {list(CLIENTS)}, rules {list(RULES)}")
    drop = args.drop or PRODUCT.serve_drop
    report: dict[str, Any] = {
        "data": data_name,
        "epsilon": args.epsilon,
        "drop": drop,
        "restart_at": args.restart_at,
        "seeds": seeds,
        "rows": {},
    }
    for cname in clients:
        client = CLIENTS[cname]
        events = args.events or client.events
        for rule in rules:
            runs = []
            for seed in seeds:
                r = run_one(data, u, client, rule, seed, events, args.epsilon, drop, args.restart_at)
                runs.append(r)
                print(f"{cname}/{rule} seed {seed}: {json.dumps(r)}", flush=True)
            unsafe = sum(r["unsafe"] for r in runs)
            gaps = np.array([r["final_gap_closed"] for r in runs])
            unexplored = np.array([r["final_gap_closed_unexplored"] for r in runs])
            report["rows"][f"{cname}/{rule}"] = {
                "client": client.description,
                "events": events,
                "runs": runs,
                "unsafe": unsafe,
                "unsafe_interval": wilson(unsafe, len(runs)),
                "worst_vs_similarity": min(r["worst_vs_similarity"] for r in runs),
                "worst_probe_vs_base": min(
                    (r["worst_probe_vs_base"] for r in runs if r["worst_probe_vs_base"] is not None), default=None
                ),
                "gap_closed_mean": float(gaps.mean()),
                "gap_closed_worst": float(gaps.min()),
                "gap_closed_unexplored_mean": float(unexplored.mean()),
            }
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        "| client / rule | runs | unsafe (95% interval) | worst served − similarity | worst probe − its base "
        "| gap closed at the end (mean, worst) | without exploration (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in report["rows"].items():
        lo, hi = row["unsafe_interval"]
        probe = row["worst_probe_vs_base"]
        lines.append(
            f"| {name} | {len(row['runs'])} | {row['unsafe']} ({lo:.0%}–{hi:.0%}) | {row['worst_vs_similarity']:+.3f} "
            f"| {'none' if probe is None else f'{probe:+.3f}'} "
            f"| {row['gap_closed_mean']:.0%}, {row['gap_closed_worst']:.0%} | {row['gap_closed_unexplored_mean']:.0%} |"
        )
    return "\n".join(lines)


def add_options(p: argparse.ArgumentParser) -> None:
    world_options(p, "fanout")
    p.add_argument("--clients", help=f"comma-separated (default all of {', '.join(CLIENTS)})")
    p.add_argument("--rules", help=f"comma-separated: with the gate or without (default both of {', '.join(RULES)})")
    p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--events", type=int, help="steps of traffic per run (default: the client's)")
    p.add_argument("--epsilon", type=float, default=PRODUCT.gate_epsilon, help="the margin (default: the gate's)")
    p.add_argument("--drop", choices=("dynamic", "none"), help="the hard drop clients serve (default: the product's)")
    p.add_argument(
        "--restart-at",
        type=int,
        default=0,
        help="restart the learner's promotion rule after this many steps (as a restarted learner: a new epoch)",
    )
    p.add_argument("--out", help="write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    return finish(run(args), table, args.out)
