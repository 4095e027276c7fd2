"""``causalmem bench guardrail``: how many decisions the guardrail takes to roll back a served
version that is worse than similarity-only.

The promotion rule's guardrail (docs/promotion.md, rule 6) compares what clients serve with
similarity-only, on the decisions they log, and rolls back to the last certified version (or the
first policy) once the served one is shown worse by more than ε. This bench serves such a version
and counts the decisions until the rollback, on the real-data world, in one process
(:func:`causalmem_lab.offline.run_offline`: the product's retriever, trainer, logging
probabilities and promotion decisions, without Kafka), at the product's defaults.

Each run sends a client's traffic (``causalmem bench promise``'s clients) for ``--at`` steps;
at the next checkpoint an operator's cut-over serves, at once, as configured and without a trial
(as shadow mode's cut-over does), the learner's weights *mirrored*: every memory's mask reflected
around the neutral 1, by ``--severity`` (1: what the learner learnt to read is avoided and what
it learnt to avoid is read; 0.5: every mask 1, plain similarity ranking; 0: unchanged). The run
goes on for ``--watch`` steps. Reported per run: the mirrored version's value as its manifest
says to serve it (the exploration share included, as the promise and the guardrail count it),
against similarity-only (measured afterwards on the world's questions), the decisions it served
until the guardrail rolled it back (counted from its checkpoint to the look that rolled back;
the lab's loop looks at every checkpoint, every 300 decisions) or "never"; the decisions until a
certified version was promoted over it, where that came first (its own trial against the anchor;
it ends the harm as a rollback does), with that version's value as served; and how many other
versions the guardrail rolled back in the run (a probe whose exploration share, as the client
served it, was worse is one). Over the runs in which the served
version was worse than similarity-only by more than ε: the share rolled back within the watch,
with its 95% Wilson interval, and the median and largest number of decisions; and the share no
longer served at the end of the watch, either way, with the most decisions one served.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from causalmem_lab.bench import finish, lmlearning
from causalmem_lab.bench.lmlearning import base_of
from causalmem_lab.bench.promise import CLIENTS, bank, config, wilson, world_of, world_options
from causalmem_lab.offline import PRODUCT, OfflineConfig, run_offline
from models.policy.network import NEUTRAL_BIAS, PolicyNetwork
from pipeline.learner.gate import copy_of

AT, WATCH = 6_000, 12_000


def mirror(severity: float) -> Any:
    """A change to a policy's output layer: each memory's mask logit reflected around the neutral
    one (softplus⁻¹(1)) by ``severity`` — 1 mirrors it, 0.5 makes every mask 1, 0 keeps it.

    >>> net = PolicyNetwork(embedding_dim=2, slots=3, hidden=4)
    >>> with torch.no_grad():
    ...     _ = net.out.bias.copy_(torch.tensor([NEUTRAL_BIAS + 2.0, NEUTRAL_BIAS, NEUTRAL_BIAS - 2.0]))
    ...     _ = net.out.weight.zero_()
    >>> mirror(1.0)(net)
    >>> [round(float(b - NEUTRAL_BIAS), 3) for b in net.out.bias.detach()]
    [-2.0, 0.0, 2.0]
    """

    def change(net: PolicyNetwork) -> None:
        scale = 1.0 - 2.0 * severity
        with torch.no_grad():
            net.out.weight.mul_(scale)
            net.out.bias.sub_(NEUTRAL_BIAS).mul_(scale).add_(NEUTRAL_BIAS)

    return change


def served_until(
    actions: list[tuple[int, str, int, str]], served: tuple[int, int]
) -> tuple[int | None, int | None, int | None, int]:
    """What ended the served version's serving, from a run's actions ``(step, kind, version,
    path)``: (decisions from its checkpoint to its rollback, None if never; decisions to a
    certified version promoted over it, None if none came first; that version; how many other
    versions were rolled back). Either ends what it costs clients.

    >>> acts = [(300, "rollback", 4, "guardrail"), (900, "rollback", 7, "guardrail"), (1500, "promote", 9, "improved")]
    >>> served_until(acts, (600, 7)), served_until(acts, (1200, 8))
    ((300, None, None, 1), (None, 300, 9, 2))
    """
    step, version = served
    others = sum(1 for _, kind, v, _ in actions if kind == "rollback" and v != version)
    for s, kind, v, _ in actions:
        if s > step and kind == "rollback" and v == version:
            return s - step, None, None, others
        if s > step and kind == "promote" and v != version:
            return None, s - step, v, others
    return None, None, None, others


def run_one(
    data: Any,
    u: Any,
    client: str,
    severity: float,
    seed: int,
    at: int,
    watch: int,
    epsilon: float,
    restart_at: int = 0,
) -> dict[str, Any]:
    """One run: the client's traffic, the mirrored version served at ``at``, ``watch`` steps more
    (``restart_at``: the learner restarted at that step before, 0 never)."""
    c = CLIENTS[client]
    scenario, world = world_of(data, u, c, seed, at + watch)
    t0 = time.monotonic()
    cfg = config(c, True, seed, epsilon, PRODUCT.serve_drop, restart_at)
    res = run_offline(scenario, cfg, env=world, operator=(at, mirror(severity)))
    assert res.operator is not None  # run() checked that a checkpoint falls in the run after ``at``
    step, version = res.operator
    test = world.test
    similarity = lmlearning.measure(u, data, test)["value"]
    served = res.served_versions[version]
    # As its manifest says to serve it, the exploration share included: what the promise and the
    # guardrail are about; and without that share (what ``bench promise`` reports).
    value = lmlearning.measure(u, data, test, served, draws=4, seed=seed, explore=True)["value"]
    greedy = lmlearning.measure(u, data, test, served, draws=4, seed=seed)["value"]
    decisions, replaced_after, replaced_by, others = served_until(res.actions, res.operator)
    replaced = None
    if replaced_by is not None:  # what clients were served instead: the certified version, as served
        # Served itself, or (promoted after a newer probe) as the copy that carries its weights.
        instead = res.served_versions.get(replaced_by) or next(
            p for p in res.served_versions.values() if copy_of(p.manifest) == replaced_by
        )
        base = res.served_versions.get(base_of(instead))  # a probe over the certified version (1.23)
        replaced = lmlearning.measure(u, data, test, instead, 4, seed, True, base)["value"] - similarity
    return {
        "seed": seed,
        "seconds": round(time.monotonic() - t0, 1),
        "served_at": step,
        "version": version,
        "vs_similarity": value - similarity,
        "vs_similarity_unexplored": greedy - similarity,
        "worse": value - similarity < -epsilon,
        "decisions_to_rollback": decisions,
        # A certified version promoted over it (its own trial against the anchor) ends it too.
        "decisions_to_replaced": replaced_after,
        "replaced_by": replaced_by,
        "replaced_vs_similarity": replaced,
        "replaced_worse": replaced is not None and replaced < -epsilon,  # then the harm did not end
        "watched": (at + watch) // cfg.refresh_every * cfg.refresh_every - step,  # to the run's last look
        "other_rollbacks": others,
        "restarted": res.restarted,  # the step of the learner restart, if any
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    data_name, data, u = bank(args, "fanout-lookalike")
    seeds = [int(s) for s in (args.seeds or "0,1,2,3,4").split(",") if s.strip()]
    clients = [c.strip() for c in (args.clients or "retriever,manifest").split(",") if c.strip()]
    severities = [float(s) for s in (args.severities or "1").split(",") if s.strip()]
    unknown = [c for c in clients if c not in CLIENTS]
    if unknown:
        raise ValueError(f"unknown clients {unknown}; clients {list(CLIENTS)}")
    at = AT if args.at is None else args.at
    watch = args.watch or WATCH
    every = OfflineConfig.refresh_every
    restart_at = args.restart_at or 0
    if restart_at and restart_at >= at:
        raise ValueError(f"--restart-at {restart_at} must come before --at {at}")
    if (at + watch) // every * every < max(at, every):
        raise ValueError(f"--at {at} --watch {watch}: no checkpoint (every {every} steps) falls after step {at}")
    runs: list[dict[str, Any]] = []
    for client in clients:
        for severity in severities:
            for seed in seeds:
                r = {
                    "client": client,
                    "severity": severity,
                    **run_one(data, u, client, severity, seed, at, watch, args.epsilon, restart_at),
                }
                runs.append(r)
                print(f"guardrail {json.dumps(r)}", flush=True)
    report = {"data": data_name, "epsilon": args.epsilon, "at": at, "watch": watch, "restart_at": restart_at}
    return {**report, "runs": runs, "rows": summarise(runs)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per client: over the runs whose served version was worse than similarity-only by more than
    ε, the share rolled back within the watch (with its interval) and the decisions it took; and
    the share no longer served by the end of the watch, rolled back or replaced by a certified
    version not itself worse than similarity-only by more than ε, and the decisions it served.

    >>> rows = summarise([{"client": "c", "worse": True, "decisions_to_rollback": 600, "vs_similarity": -0.2,
    ...                    "decisions_to_replaced": None, "other_rollbacks": 0},
    ...                   {"client": "c", "worse": True, "decisions_to_rollback": None, "vs_similarity": -0.1,
    ...                    "decisions_to_replaced": 3900, "other_rollbacks": 0}])
    >>> rows["c"]["harmful"], rows["c"]["rolled_back"], rows["c"]["median_decisions"], rows["c"]["ended"]
    (2, 1, 600.0, 2)
    >>> rows["c"]["ended_decisions"]
    [600, 3900]
    """
    out: dict[str, dict[str, Any]] = {}
    for client in dict.fromkeys(r["client"] for r in runs):
        mine = [r for r in runs if r["client"] == client]
        harmful = [r for r in mine if r["worse"]]
        taken = [r["decisions_to_rollback"] for r in harmful if r["decisions_to_rollback"] is not None]
        ended = [
            r["decisions_to_rollback"] if r["decisions_to_rollback"] is not None else r["decisions_to_replaced"]
            for r in harmful
            if r["decisions_to_rollback"] is not None
            or (r.get("decisions_to_replaced") is not None and not r.get("replaced_worse"))
        ]
        out[client] = {
            "runs": len(mine),
            "harmful": len(harmful),
            "rolled_back": len(taken),
            "rolled_back_interval": wilson(len(taken), len(harmful)),
            "median_decisions": float(np.median(taken)) if taken else None,
            "max_decisions": max(taken) if taken else None,
            "ended": len(ended),
            "ended_interval": wilson(len(ended), len(harmful)),
            "ended_decisions": sorted(ended),
            "vs_similarity": [round(r["vs_similarity"], 3) for r in mine],
            "other_rollbacks": sum(r["other_rollbacks"] for r in mine),
        }
    return out


def table(report: dict[str, Any]) -> str:
    lines = [
        "| client | runs | served worse than similarity − ε | rolled back (95% interval) | decisions: median, max "
        "| no longer served: rolled back or replaced (95% interval) | decisions served, max "
        "| served − similarity | other rollbacks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for client, row in report["rows"].items():
        lo, hi = row["rolled_back_interval"]
        elo, ehi = row["ended_interval"]
        median = "—" if row["median_decisions"] is None else f"{row['median_decisions']:,.0f}, {row['max_decisions']:,}"
        ends = row["ended_decisions"]
        longest = "never" if row["ended"] < row["harmful"] else f"{max(ends):,}" if ends else "—"
        spread = f"{min(row['vs_similarity']):+.3f} … {max(row['vs_similarity']):+.3f}"
        lines.append(
            f"| {client} | {row['runs']} | {row['harmful']} | {row['rolled_back']} ({lo:.0%}–{hi:.0%}) | {median} "
            f"| {row['ended']} ({elo:.0%}–{ehi:.0%}) | {longest} | {spread} | {row['other_rollbacks']} |"
        )
    return "\n".join(lines)


def add_options(p: argparse.ArgumentParser) -> None:
    world_options(p, "fanout-lookalike")
    p.add_argument("--clients", help=f"comma-separated, of {', '.join(CLIENTS)} (default retriever,manifest)")
    p.add_argument("--severities", help="comma-separated mirror severities, 0..1 (default 1)")
    p.add_argument("--seeds", help="comma-separated seeds (default 0,1,2,3,4)")
    p.add_argument("--at", type=int, help=f"steps before the operator serves the mirrored version (default {AT:,})")
    p.add_argument("--watch", type=int, help=f"steps after it (default {WATCH:,})")
    p.add_argument("--epsilon", type=float, default=PRODUCT.gate_epsilon, help="the margin (default: the gate's)")
    p.add_argument(
        "--restart-at", type=int, help="restart the learner's promotion rule after this many steps, before --at"
    )
    p.add_argument("--out", help="write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    return finish(run(args), table, args.out)
