"""``causalmem bench gate``: is the promotion gate calibrated? Measured on the simulator.

In process, no broker. The simulator's memories have known per-memory values φ (need ×
role effect), and a step's utility is the mean φ of its selection plus noise, so the true
value of any policy *as served* (:class:`~models.serving.params.ServingParams`: the mixture of
the serving and the exploration temperature, with the hard drop) is
mean_x θ_π(x)ᵀφ(x)/k, with θ_π the exact Plackett–Luce inclusion probabilities over the
full candidate lists, averaged over a large fresh sample of queries.

A serving policy (it knows half of the memories' roles) logs ``--window`` retrievals in
two ways:

* **exploratory**: every request at T = 1.0 (the issue's exploratory client);
* **near-greedy**: as the learner's serving parameters do (T = 0.05, 10% at T = 0.25 by
  default; ``CAUSALMEM_SERVE_*`` variables change them, and candidates are judged as served
  by the same parameters).

``--methods`` and ``--logs`` run a subset of the estimators and kinds of logs.

Candidates are many policies, better and worse: moves toward the true best, toward the
harmful memories, noisy perturbations, and *greedy traps* (drop the harmful memories but
boost irrelevant look-alikes above the helpful ones: they help a near-uniform policy and
hurt the near-greedy one). Each estimator judges every candidate on every log with the
gate's rule (:func:`pipeline.learner.promotion_gate.judge_log`), and the bench reports per
estimator and log: the coverage of the 95% intervals of the candidate's value and of its
gain over serving, the false-promotion rate (true gain < −ε and promoted; target ≤ 5%),
the missed-promotion rate (true gain > ε, not below similarity-only, and not promoted)
and the share left undecided. docs/benchmarks.md records the figures. ``--cost`` times
one judgement instead.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from causalmem_lab.roles import HARMFUL, HELPFUL
from causalmem_lab.simulator import Environment, Scenario
from models.offpolicy.logged import TOPK, LoggedDecisions, Served, component_logits
from models.offpolicy.served import SlateLog
from models.offpolicy.slate import MomentCache, inclusion
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from models.serving.rule import plackett_luce_logprob
from pipeline.config import Settings
from pipeline.learner.conservative import trust_region_step
from pipeline.learner.promotion_gate import PESSIMISM, judge, judge_log

METHODS = ("ips", "snips", "pi", "dr", "dr-pi", "set-ips", "set-snips", "set-dr", "dr-set", "auto")
DEFAULT = "auto"  # the gate's default estimator (Settings.gate_method)
LOG_KINDS = ("exploratory", "near-greedy")


def logs_for(served: ServingParams) -> dict[str, ServingParams]:
    """The kinds of logs: every request at T = 1.0, and as ``served`` (near-greedy at the defaults).

    >>> logs_for(ServingParams())["near-greedy"].components()
    ((0.9, 0.05), (0.1, 0.25))
    """
    return {"exploratory": ServingParams(temperature=1.0, explore_rate=0.0), "near-greedy": served}


def served_params() -> ServingParams:
    """How the learner's configuration serves candidates: its defaults, or ``CAUSALMEM_SERVE_*``."""
    return Settings.from_env().serving()


class World:
    """The simulator's memory bank, its queries and the true per-memory values."""

    def __init__(self, scenario: Scenario, n_candidates: int = 20) -> None:
        self.env = Environment(scenario)
        self.s = scenario
        self.n_candidates = n_candidates
        self.effect = {HELPFUL: scenario.helpful_effect, HARMFUL: scenario.harmful_effect}

    def queries(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        qs = [self.env.next_query() for _ in range(n)]
        return np.array([q.intent for q in qs]), np.stack([q.embedding for q in qs])

    def candidates(self, emb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sims = emb @ self.env.memory.T
        top = np.argsort(-sims, axis=1)[:, : self.n_candidates]
        return top.astype(np.int64), np.take_along_axis(sims, top, axis=1).astype(np.float64)

    def phi(self, intents: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """True per-memory values need·effect(role), [N, C] (the utility is their mean over S)."""
        out = np.zeros(slots.shape)
        for i, (intent, row) in enumerate(zip(intents, slots, strict=True)):
            roles = self.env.roles[int(intent)]
            out[i] = [self.effect.get(roles.get(int(s), -1), 0.0) for s in row]
        scaled: np.ndarray = out * self.env.need[intents][:, None]
        return scaled

    def bias_best(self) -> np.ndarray:
        """Per-slot mask biases of the true best policy: keep helpful high, drop harmful."""
        b = np.zeros(self.s.slots)
        for roles in self.env.roles:
            for slot, role in roles.items():
                b[slot] = 2.0 if role == HELPFUL else (-6.0 if role == HARMFUL else 0.0)
        return b

    def irrelevant(self) -> np.ndarray:
        out = np.zeros(self.s.slots, bool)
        for roles in self.env.roles:
            for slot, role in roles.items():
                out[slot] = role not in (HELPFUL, HARMFUL)
        return out


def policy_with(bias: np.ndarray, dim: int, alpha: float = 1.0) -> PolicyNetwork:
    """A network whose mask is softplus(bias[slot]) whatever the query."""
    net = PolicyNetwork(dim, bias.shape[0], hidden=8, alpha=alpha)
    with torch.no_grad():
        net.out.weight.zero_()
        net.out.bias.copy_(torch.as_tensor(bias, dtype=torch.float32))
    return net.eval()


def full_decisions(slots: np.ndarray, scores: np.ndarray, emb: np.ndarray, k: int) -> LoggedDecisions:
    """Every candidate list as a decision (selection: the first k), to compute policies on."""
    n = slots.shape[0]
    return LoggedDecisions.from_lists(
        slots.tolist(), scores.tolist(), slots[:, :k].tolist(), [1.0] * n, [0.0] * n, [0.0] * n, embedding=emb
    )


def value_of(policy: PolicyNetwork | str, params: ServingParams, full: LoggedDecisions, phi: np.ndarray) -> float:
    """mean θᵀφ/k: the exact value of a served policy on these queries."""
    k = int(full.n_selected[0])
    v = 0.0
    for weight, z, kept, uniform in component_logits(full, Served(policy, params)):
        zz = np.where(kept, np.zeros_like(z) if uniform else z, -np.inf)
        p = np.exp(zz - zz.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        q, _ = inclusion(p, k, second=False)
        v += weight * float(((q * phi).sum(axis=1) / k).mean())
    return v


def make_log(
    world: World, logger: PolicyNetwork, params: ServingParams, n: int, rng: np.random.Generator, effects: float
) -> LoggedDecisions:
    """``n`` retrievals served by ``logger`` under ``params``, as the events would log them."""
    k = world.s.k
    intents, emb = world.queries(n)
    slots, scores = world.candidates(emb)
    full = full_decisions(slots, scores, emb, k)
    comps = component_logits(full, Served(logger, ServingParams(1.0, 0.0, 1.0, params.drop, params.drop_ratio)))
    _, adjusted, kept, _ = comps[0]  # score·(1 + α·m) over the kept candidates (T = 1)
    phi = world.phi(intents, slots)
    explore = rng.random(n) < params.explore_rate
    temps = np.where(explore, params.explore_temperature, params.temperature)
    cands, cscores, sel, lps, probs, utils = [], [], [], [], [], []
    effs: list[dict[int, float] | None] = []
    for i in range(n):
        pos_kept = np.flatnonzero(kept[i])
        z = adjusted[i, pos_kept] / temps[i]
        keys = z + rng.gumbel(size=z.shape)
        order = [int(j) for j in np.argsort(-keys, kind="stable")[:k]]
        e = np.exp(z - z.max())
        cands.append(slots[i, pos_kept].tolist())
        cscores.append(scores[i, pos_kept])
        sel.append([int(slots[i, pos_kept[j]]) for j in order])
        lps.append(plackett_luce_logprob(z, order))
        probs.append(e / e.sum())
        values = phi[i, pos_kept[order]]
        utils.append(float(values.sum() / world.s.k + world.s.utility_noise * rng.normal()))
        if rng.random() < effects:  # per-memory credit: each memory's own effect, measured with noise
            noise = world.s.utility_noise * rng.normal(size=len(order))
            effs.append({s: float(v / world.s.k + n_) for s, v, n_ in zip(sel[-1], values, noise, strict=True)})
        else:
            effs.append(None)
    return LoggedDecisions.from_lists(
        cands, cscores, sel, temps.tolist(), lps, utils, embedding=emb, first_probs=probs, effects=effs
    )


def candidate_biases(
    world: World, serving: np.ndarray, rng: np.random.Generator, n: int
) -> list[tuple[str, np.ndarray]]:
    """Named candidate policies (mask biases), better and worse than ``serving``."""
    best = world.bias_best()
    irr = world.irrelevant()
    out: list[tuple[str, np.ndarray]] = []
    for lam in (0.5, 1.0):
        for sigma in (0.0, 0.5, 1.5):
            out.append((f"best λ{lam} σ{sigma}", serving + lam * (best - serving) + sigma * rng.normal(size=best.size)))
    for lam in (0.3, 0.7, 1.0):
        out.append((f"harm λ{lam}", serving - lam * best))
    for sigma in (1.0, 2.0, 3.0):
        out.append((f"noise σ{sigma}", serving + sigma * rng.normal(size=best.size)))
    for boost in (1.0, 2.5, 4.0):  # greedy traps: harmful dropped, look-alikes above the helpful
        trap = np.where(best < 0, -6.0, 0.0) + np.where(irr, boost, 0.0)
        out.append((f"trap β{boost}", trap))
    out.append(("similarity-like", np.zeros(best.size)))
    while len(out) < n:
        lam, sigma = rng.uniform(-0.6, 1.0), rng.uniform(0.0, 2.0)
        out.append((f"mix λ{lam:.2f} σ{sigma:.2f}", serving + lam * best + sigma * rng.normal(size=best.size)))
    return out[:n]


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.time()
    scenario = Scenario(embedding_dim=args.dim, slots=512, drift_day=None, seed=args.seed)
    world = World(scenario)
    rng = np.random.default_rng(args.seed)
    served = served_params()
    all_logs = logs_for(served)
    eps = args.epsilon
    methods = [m.strip() for m in (args.methods or ",".join(METHODS)).split(",") if m.strip()]
    logs = [g.strip() for g in (args.logs or ",".join(LOG_KINDS)).split(",") if g.strip()]
    unknown = sorted(set(methods) - set(METHODS)) + sorted(set(logs) - set(LOG_KINDS))
    if unknown:
        raise ValueError(f"unknown estimators or logs {unknown}; known: {list(METHODS)}, {list(LOG_KINDS)}")
    best = world.bias_best()
    known = rng.random(best.size) < 0.5
    serving_bias = np.where(known, best, 0.0)
    serving = policy_with(serving_bias, args.dim)
    intents, emb = world.queries(args.truth_queries)
    slots, scores = world.candidates(emb)
    full = full_decisions(slots, scores, emb, scenario.k)
    phi = world.phi(intents, slots)
    cands = [
        (name, policy_with(b, args.dim)) for name, b in candidate_biases(world, serving_bias, rng, args.candidates)
    ]
    # similarity-only: plain top-k, as the gate compares with (pipeline/learner/promotion_gate.py)
    truth = {"serving": value_of(serving, served, full, phi), "similarity": value_of(TOPK, served, full, phi)}
    greedy_t1 = ServingParams(temperature=1.0, explore_rate=0.0)
    serving_t1 = value_of(serving, greedy_t1, full, phi)
    best_k = float((np.sort(phi, axis=1)[:, ::-1][:, : scenario.k].sum(axis=1) / scenario.k).mean())
    rows = []
    for name, net in cands:
        v = value_of(net, served, full, phi)
        v1 = value_of(net, greedy_t1, full, phi)
        rows.append({"name": name, "value": v, "gain": v - truth["serving"], "gain_t1": v1 - serving_t1})
    results: dict[str, dict[str, list[dict[str, Any]]]] = {log: {m: [] for m in methods} for log in logs}
    for rep in range(args.repeats):
        for log_name in logs:
            log_params = all_logs[log_name]
            d = make_log(world, serving, log_params, args.window, rng, args.effects)
            slogs = {
                "moments": SlateLog.prepare(d, prior_quantile=PESSIMISM, seed=rep),
                "plain": SlateLog.prepare(d, prior_quantile=PESSIMISM, seed=rep, moments=False),
            }
            for method in methods:
                slog = slogs["plain" if method in ("ips", "snips") else "moments"]
                for row, (_, net) in zip(rows, cands, strict=True):
                    decision, _, est = judge_log(
                        slog, net, serving, eps, args.min_ess, method, served, n_boot=args.boot, seed=rep
                    )
                    results[log_name][method].append(
                        {
                            "candidate": row["name"],
                            "decision": decision,
                            "value": [est["candidate"].value, est["candidate"].low, est["candidate"].high],
                            "gain": [est["gain"].value, est["gain"].low, est["gain"].high],
                            "ess": est["gain"].ess,
                            "true_value": row["value"],
                            "true_gain": row["gain"],
                            "better": bool(row["gain"] > eps and row["value"] >= truth["similarity"] - eps),
                            "worse": bool(row["gain"] < -eps),
                        }
                    )
                    if args.conservative and decision == "insufficient":
                        gate = partial(judge, epsilon=eps, min_ess=args.min_ess, method=method, n_boot=args.boot)
                        step = trust_region_step(
                            d, net, serving, partial(gate, params=served), params=served, radius=args.trust_region
                        )
                        true_step = value_of(step.net, served, full, phi) - truth["serving"] if step.net else None
                        results[log_name][method][-1]["step"] = {
                            "decision": step.decision,
                            "alpha": step.alpha,
                            "gain": [step.estimates["gain"].value, step.estimates["gain"].low]
                            if "gain" in step.estimates
                            else None,
                            "true_gain": true_step,
                            "worse": true_step is not None and true_step < -eps,  # the gate's promise broken
                        }
            print(f"bench gate: repeat {rep + 1}/{args.repeats}, {log_name} log done ({time.time() - t0:.0f} s)")
    summary = {log: {m: summarise(results[log][m]) for m in methods} for log in logs}
    traps = sum(1 for r in rows if r["gain"] < -eps and r["gain_t1"] > eps)
    return {
        "config": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
        "truth": {**truth, "best_top_k": best_k, "candidates": rows},
        "candidates_better": sum(1 for r in rows if r["gain"] > eps),
        "candidates_worse": sum(1 for r in rows if r["gain"] < -eps),
        "greedy_traps": traps,
        "summary": summary,
        "results": results,
        "seconds": time.time() - t0,
    }


def summarise(rs: list[dict[str, Any]]) -> dict[str, float | int]:
    """Coverage, false/missed promotion and undecided shares of one estimator on one kind of log."""

    def share(xs: list[bool]) -> float:
        return float(np.mean(xs)) if xs else float("nan")

    worse = [r for r in rs if r["worse"]]
    better = [r for r in rs if r["better"]]
    return {
        "judgements": len(rs),
        "value_coverage": share([r["value"][1] <= r["true_value"] <= r["value"][2] for r in rs]),
        "gain_coverage": share([r["gain"][1] <= r["true_gain"] <= r["gain"][2] for r in rs]),
        "false_promotion": share([r["decision"] == "promoted" for r in worse]),
        "missed_promotion": share([r["decision"] != "promoted" for r in better]),
        "undecided": share([r["decision"] == "insufficient" for r in rs]),
        "worse": len(worse),
        "better": len(better),
        "median_ess": float(np.median([r["ess"] for r in rs])) if rs else 0.0,
        **steps_summary(rs),
    }


def steps_summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """``--conservative``: of the undecided candidates, how many got a step promoted, and how good it truly is."""
    looked = [r["step"] for r in rs if "step" in r]
    done = [s for s in looked if s["decision"] == "promoted"]
    if not looked:
        return {}
    gains = [s["true_gain"] for s in done]
    return {
        "steps_looked": len(looked),
        "steps_promoted": len(done),
        "steps_worse_than_eps": sum(1 for s in done if s["worse"]),
        "steps_true_gain_mean": float(np.mean(gains)) if gains else float("nan"),
        "steps_true_gain_min": float(np.min(gains)) if gains else float("nan"),
        "steps_certified_low_mean": float(np.mean([s["gain"][1] for s in done])) if done else float("nan"),
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        "| log | estimator | value coverage | gain coverage | false promotion | missed promotion "
        "| undecided | median ESS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for log, per in report["summary"].items():
        for m, s in per.items():
            lines.append(
                f"| {log} | {m} | {s['value_coverage']:.1%} | {s['gain_coverage']:.1%} | {s['false_promotion']:.1%} "
                f"| {s['missed_promotion']:.1%} | {s['undecided']:.1%} | {s['median_ess']:,.0f} |"
            )
    for log, per in report["summary"].items():
        for m, s in per.items():
            if "steps_looked" in s:
                lines.append(
                    f"{log} / {m}: conservative steps promoted for {s['steps_promoted']} of {s['steps_looked']} "
                    f"undecided candidates; true step gain mean {s['steps_true_gain_mean']:+.4f}, "
                    f"min {s['steps_true_gain_min']:+.4f}; worse than serving by > ε: {s['steps_worse_than_eps']}"
                )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = list(report["summary"])
    methods = list(report["summary"][logs[0]])
    shown = [log for log in logs if DEFAULT in report["results"][log]]
    fig, axes = plt.subplots(1, 1 + len(shown), figsize=(5 * (1 + len(shown)) + 3, 4.4), squeeze=False)
    axes = axes[0]
    x = np.arange(len(methods))
    width = 0.6 / len(logs)
    ax = axes[0]
    for j, (key, label) in enumerate(
        (("gain_coverage", "gain 95% coverage"), ("false_promotion", "false promotion"), ("missed_promotion", "missed"))
    ):
        for i, log in enumerate(logs):
            vals = [report["summary"][log][m][key] for m in methods]
            offset = j * len(logs) + i - (3 * len(logs) - 1) / 2
            ax.bar(x + offset * width / 1.4, vals, width / 1.4, label=f"{label} ({log})")
    ax.axhline(0.9, color="k", lw=0.5, ls="--")
    ax.axhline(0.05, color="r", lw=0.5, ls="--")
    ax.set_xticks(x, methods, rotation=45, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=6)
    ax.set_title("calibration per estimator")
    for ax, log in zip(axes[1:], shown, strict=True):
        rs = report["results"][log][DEFAULT]
        tg = np.array([r["true_gain"] for r in rs])
        g = np.array([r["gain"] for r in rs])
        colors = {"promoted": "tab:green", "refused": "tab:red", "insufficient": "tab:gray"}
        for dec, col in colors.items():
            sel = np.array([r["decision"] == dec for r in rs])
            if sel.any():
                ax.errorbar(
                    tg[sel],
                    g[sel, 0],
                    yerr=[g[sel, 0] - g[sel, 1], g[sel, 2] - g[sel, 0]],
                    fmt="o",
                    ms=3,
                    color=col,
                    alpha=0.6,
                    label=dec,
                    elinewidth=0.5,
                )
        lim = [min(tg.min(), g[:, 1].min()), max(tg.max(), g[:, 2].max())]
        ax.plot(lim, lim, "k-", lw=0.5)
        ax.axvline(-report["config"]["epsilon"], color="r", lw=0.5, ls="--")
        ax.set_xlabel("true gain over serving (as served)")
        ax.set_ylabel(f"gate's estimate ({DEFAULT}), 95% interval")
        ax.set_title(f"the gate on the {log} log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a small run (used by the tests)")
    p.add_argument("--methods", help=f"comma-separated estimators (default: all of {', '.join(METHODS)})")
    p.add_argument("--logs", help=f"comma-separated kinds of logs (default: all of {', '.join(LOG_KINDS)})")
    p.add_argument("--window", type=int, default=2000, help="logged retrievals per log (the gate's window)")
    p.add_argument("--candidates", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3, help="fresh logs per kind of logging")
    p.add_argument("--effects", type=float, default=0.0, help="share of steps with per-memory credit")
    p.add_argument("--epsilon", type=float, default=0.02)
    p.add_argument("--min-ess", type=float, default=None, help="the gate's minimum ESS (default: the Settings')")
    p.add_argument("--boot", type=int, default=200)
    p.add_argument("--truth-queries", type=int, default=4000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--plot", help="write the calibration plot (PNG) here")
    p.add_argument("--cost", action="store_true", help="only time one judgement on a near-greedy --window log")
    p.add_argument(
        "--conservative",
        action="store_true",
        help="also judge the largest step within the trust region toward each undecided candidate "
        "(pipeline/learner/conservative.py)",
    )
    p.add_argument(
        "--trust-region",
        type=float,
        default=Settings.gate_trust_region,
        help="--conservative: the steps' bound on the mean served total variation (default: the Settings')",
    )


def judgement_cost(args: argparse.Namespace, runs: int = 3) -> str:
    """CPU seconds of one gate judgement (:func:`pipeline.learner.promotion_gate.judge`) on a near-greedy
    log of ``--window`` steps: the first on a window, and one after an earlier judgement
    filled the moment cache (as the learner's gate judges its sliding window)."""
    world = World(Scenario(embedding_dim=args.dim, slots=512, drift_day=None, seed=args.seed))
    rng = np.random.default_rng(args.seed)
    best = world.bias_best()
    serving = policy_with(np.where(rng.random(best.size) < 0.5, best, 0.0), args.dim)
    candidate = policy_with(0.5 * best, args.dim)
    d = make_log(world, serving, served_params(), args.window, rng, 0.0)

    def cpu(cache: MomentCache | None) -> float:
        t0 = time.process_time()
        judge(d, candidate, serving, args.epsilon, args.min_ess, cache=cache)
        return time.process_time() - t0

    cpu(None)  # warm-up
    first = sorted(cpu(None) for _ in range(runs))[runs // 2]
    cache = MomentCache()
    cpu(cache)
    again = sorted(cpu(cache) for _ in range(runs))[runs // 2]
    return f"one judgement, {args.window} steps: {first:.2f} s CPU; with the moments cached: {again:.2f} s CPU"


def main(args: argparse.Namespace) -> int:
    from pipeline.config import Settings

    if args.min_ess is None:
        args.min_ess = Settings().gate_min_ess
    if args.quick:
        args.window, args.candidates, args.repeats, args.truth_queries, args.boot = 400, 8, 1, 500, 100
    if args.cost:
        print(judgement_cost(args))
        return 0
    report = run(args)
    print(table(report))
    print(
        f"{report['candidates_better']} candidates better than serving by > ε, {report['candidates_worse']} worse; "
        f"{report['greedy_traps']} help at T = 1 but hurt as served; {report['seconds']:.0f} s"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    return 0
