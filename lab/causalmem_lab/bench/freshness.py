"""``causalmem bench freshness``: how soon a published pair reaches a serving checkpoint a client has loaded.

On a real broker, for each checkpoint configuration (the previous defaults, 10 s cadence
and full snapshots only; the product's defaults now), with the promotion gate on and
optionally off, one run of:

- a ``causalmem worker`` and a ``causalmem learner`` (child processes, fresh topics);
- the simulator's agent (:mod:`causalmem_lab.simulator`) serving with a ``CausalRetriever``
  that a :class:`~pipeline.client.subscriber.PolicySubscriber` keeps up to date, and
  publishing ``rate`` pairs (retrieval event + LLM feedback) per second for ``seconds``.

For every pair: *freshness* = the time from its feedback's publication to the first moment
the client has loaded a serving checkpoint that covers it, i.e. whose manifest's
``input_offsets`` for the experiences topic are past the offset of the pair's joined
experience (read back from the experiences topic at the end). A pair no serving checkpoint
covered by the end of the run (``tail`` seconds after the traffic stops) counts as never
fresh: its freshness is infinite, which the median and p90 include (``median_s_covered``
and ``p90_s_covered`` leave them out: how fresh a pair is when a checkpoint covering it does
serve). With the gate on, only promoted candidates (and checkpoints served at once) serve:
pairs wait for a promotion, and once the policy has converged the gate may hold every
candidate (no evidence that it is better), so that later pairs are never served.

The first ``warmup`` seconds of traffic are left out of the figures (the gate's window is
filling and its first decisions lack data); the report also gives them over every pair.

    causalmem bench freshness --seconds 60 --ungated --out freshness.json

Figures and the command that produced them: docs/benchmarks.md, "Freshness".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.simulator import Scenario, scenario_retriever
from pipeline.config import Settings

OLD = {"checkpoint_interval_s": 10.0, "checkpoint_full_every": 1}  # the defaults before contract 1.3's deltas were on
TARGET_MEDIAN_S = 5.0


@dataclass
class Run:
    """One configuration's figures."""

    name: str
    gate: bool
    interval_s: float
    full_every: int
    pairs: int = 0
    covered: int = 0
    freshness_s: list[float] = field(default_factory=list)  # per pair (after the warm-up), inf: never
    all_freshness_s: list[float] = field(default_factory=list)  # per pair, the warm-up included
    loads: list[dict[str, Any]] = field(default_factory=list)  # serving checkpoints the client loaded
    gate_decisions: dict[str, float] = field(default_factory=dict)
    checkpoints: float = 0.0
    traffic_s: float = 0.0  # wall seconds of traffic (the achieved rate is pairs / traffic_s)
    # The learner's gate metrics at the end: the certified lower bound of each promotion's gain
    # (sum, count) and the candidates refused as worse (a guardrail rollback is not one).
    refused: float = 0.0
    gain_sum: float = 0.0
    gain_count: float = 0.0

    def summary(self) -> dict[str, Any]:
        def q(values: list[float], p: float) -> float | None:
            if not values:
                return None
            v = float(np.percentile(np.array(values), p, method="higher"))
            return v if math.isfinite(v) else None  # None: that share of the pairs was never fresh

        return {
            "name": self.name,
            "gate": self.gate,
            "checkpoint_interval_s": self.interval_s,
            "full_every": self.full_every,
            "pairs": self.pairs,
            "pairs_per_s": self.pairs / self.traffic_s if self.traffic_s else None,
            "pairs_measured": len(self.freshness_s),
            "never_fresh_share": float(np.mean([not math.isfinite(v) for v in self.freshness_s]))
            if self.freshness_s
            else None,
            "median_s": q(self.freshness_s, 50),
            "p90_s": q(self.freshness_s, 90),
            # among the pairs some serving checkpoint covered: how fresh when the gate promotes
            "median_s_covered": q([v for v in self.freshness_s if math.isfinite(v)], 50),
            "p90_s_covered": q([v for v in self.freshness_s if math.isfinite(v)], 90),
            "median_s_with_warmup": q(self.all_freshness_s, 50),
            "p90_s_with_warmup": q(self.all_freshness_s, 90),
            "serving_loads": len(self.loads),
            "delta_loads": sum(1 for x in self.loads if x["delta"]),
            "checkpoints_published": self.checkpoints,
            "gate_decisions": self.gate_decisions,
            "promotions_per_min": 60.0 * self.gate_decisions.get("promoted", 0.0) / self.traffic_s
            if self.traffic_s
            else None,
            "certified_gain_per_promotion": self.gain_sum / self.gain_count if self.gain_count else None,
            "refused": self.refused,
            "freshness_s": [v if math.isfinite(v) else None for v in self.all_freshness_s],  # None: never
            "warmup_pairs": len(self.all_freshness_s) - len(self.freshness_s),
        }


def freshness(published: list[tuple[float, int]], loads: list[tuple[float, int]]) -> list[float]:
    """Per pair (publication time, experience offset): the time until the first load (time, covered
    offset: everything below it) at or after its publication that covers it; ``inf`` when none does.

    >>> freshness([(0.0, 5), (1.0, 9), (2.0, 30)], [(0.5, 6), (3.0, 10), (4.0, 12)])
    [0.5, 2.0, inf]
    """
    ordered = sorted(loads)
    out = []
    for t, offset in published:
        hit = next((lt for lt, covered in ordered if lt >= t and covered > offset), None)
        out.append(hit - t if hit is not None else math.inf)
    return out


async def one_run(
    bootstrap: str,
    base: Settings,
    scenario: Scenario,
    run: Run,
    seconds: float,
    rate: float,
    warmup: float,
    logdir: Path,
    minimal_client: bool = False,
) -> Run:
    """Worker + learner + client for ``seconds`` of traffic at ``rate`` pairs/s; fills ``run``.

    ``minimal_client``: the client sends each event with the contract's required fields only
    (:func:`causalmem_lab.minimal_client.required_only`) and serves no canary."""
    from causalmem_lab.minimal_client import required_only
    from causalmem_lab.procs import Child
    from causalmem_lab.simrun import RunSpec, pipeline_env
    from causalmem_lab.simulator import Environment, serve
    from pipeline import kafka
    from pipeline.client.publisher import EventPublisher
    from pipeline.client.subscriber import PolicySubscriber
    from pipeline.promtext import metric
    from topics.feedback import LLMFeedback
    from topics.internal import decode_experience

    logdir.mkdir(parents=True, exist_ok=True)
    spec = RunSpec(checkpoint_interval=run.interval_s, reset=False)
    env_vars = pipeline_env(scenario, spec, f"fresh-{uuid.uuid4().hex[:6]}.", logdir / "state")
    env_vars.update(
        CAUSALMEM_CHECKPOINT_FULL_EVERY=str(run.full_every),
        CAUSALMEM_GATE="1" if run.gate else "0",
        CAUSALMEM_HIDDEN=str(base.hidden),
    )
    settings = Settings.from_env({**os.environ, **env_vars}, bootstrap=bootstrap)
    await kafka.create_topics(bootstrap, settings)
    exp_key = f"{settings.topics().experiences.name}:0"
    world = Environment(scenario)
    retriever = scenario_retriever(world, scenario)
    loads: list[tuple[float, int]] = []

    def on_update(loaded: Any) -> None:
        loads.append((time.monotonic(), int(loaded.manifest.input_offsets.get(exp_key, 0))))
        retriever.set_policy(loaded)
        run.loads.append(
            {"version": loaded.version, "reason": loaded.manifest.reason, "delta": hasattr(loaded.manifest, "rows")}
        )

    worker = Child("worker", bootstrap, env_vars, log_path=logdir / "worker.log")
    learner = Child("learner", bootstrap, env_vars, log_path=logdir / "learner.log")
    sent: dict[str, float] = {}  # event id -> feedback publication time
    try:
        for child in (worker, learner):
            deadline = time.monotonic() + 90
            while not child.metrics() and child.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
            if not child.alive():
                raise RuntimeError(f"{child.verb} exited:\n{child.log_tail()}")
        async with (
            PolicySubscriber(
                bootstrap,
                settings.policy,
                settings,
                on_update=on_update,
                on_canary=None if minimal_client else retriever.set_canary,
            ) as sub,
            EventPublisher(bootstrap, settings) as pub,
        ):
            await sub.wait_for_policy(timeout=90)
            t0 = time.monotonic()
            n = 0
            while time.monotonic() - t0 < seconds:
                q = world.next_query()
                for step in range(q.steps):
                    st = world.step_features(q, step)
                    res = serve(retriever, st, with_texts=False)
                    _, nll_with, nll_without, per_slot = world.feedback(q.intent, res.slots)
                    await pub.publish(required_only(res.event) if minimal_client else res.event)
                    sent[res.event.event_id] = time.monotonic()
                    fb = LLMFeedback(
                        uuid.uuid4().hex,
                        q.query_id,
                        step,
                        st.ts + 1.0,
                        nll_without - nll_with,
                        nll_with=nll_with,
                        nll_without=nll_without,
                        nll_without_slot=per_slot,
                    )
                    await pub.publish(fb)
                    n += 1
                    if n % 10 == 0:
                        await pub.flush()
                        await asyncio.sleep(max(0.0, n / rate - (time.monotonic() - t0)))
            await pub.flush()
            run.traffic_s = time.monotonic() - t0
            tail = 2 * run.interval_s + 10.0
            await asyncio.sleep(tail)
        values = learner.metrics()
        run.gate_decisions = {
            d: metric(values, "causalmem_gate_decisions_total", decision=d)
            for d in ("promoted", "refused", "insufficient")
        }
        run.checkpoints = metric(values, "causalmem_checkpoint_publishes_total")
        run.gain_sum = metric(values, "causalmem_gate_promoted_gain_sum")
        run.gain_count = metric(values, "causalmem_gate_promoted_gain_count")
        run.refused = metric(values, "causalmem_gate_actions_total", kind="refuse", path="worse")
        offsets: dict[str, int] = {}
        for msg in await kafka.read_all(bootstrap, settings, settings.topics().experiences.name, partitions=[0]):
            try:
                exp = decode_experience(msg.value, settings.limits())
            except Exception:  # a record this bench does not measure
                continue
            if exp.kind == "feedback":
                offsets[exp.event.event_id] = msg.offset
    finally:
        for child in (worker, learner):
            child.stop()
    pairs = sorted((t, offsets[e]) for e, t in sent.items() if e in offsets)
    run.pairs = len(sent)
    fresh = freshness(pairs, loads)
    run.all_freshness_s = fresh
    run.freshness_s = [v for (t, _), v in zip(pairs, fresh, strict=True) if t - t0 >= warmup]
    run.covered = sum(math.isfinite(v) for v in fresh)
    return run


def table(runs: list[Run]) -> str:
    def s(v: float | None) -> str:
        return f"{v:.2f}" if v is not None else "never"

    lines = [
        "config       gate  cadence  full_every  pairs/s  median s  p90 s  never  covered: median  p90  "
        "(with warm-up: median  p90)  loads",
    ]
    for r in runs:
        x = r.summary()
        never = x["never_fresh_share"]
        lines.append(
            f"{r.name:<12} {'on' if r.gate else 'off':<5} {r.interval_s:>5.1f} s  {r.full_every:>10}  "
            f"{x['pairs_per_s'] or 0:>7.1f}  "
            f"{s(x['median_s']):>8}  {s(x['p90_s']):>5}  {(never or 0):>5.1%}  "
            f"{s(x['median_s_covered']):>15}  {s(x['p90_s_covered']):>4}  "
            f"{s(x['median_s_with_warmup']):>22}  {s(x['p90_s_with_warmup']):>4}  {x['serving_loads']:>5}"
        )
    for r in runs:
        x = r.summary()
        if r.gate:
            gain = x["certified_gain_per_promotion"]
            lines.append(
                f"{r.name}: {x['promotions_per_min'] or 0:.1f} promotions/min, certified gain per promotion "
                f"{'–' if gain is None else f'{gain:+.4f}'}, "
                f"{x['refused']:.0f} refused (shown worse)"
            )
    return "\n".join(lines)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="traffic per configuration (default 60)")
    p.add_argument("--rate", type=float, default=100.0, help="pairs per second (default 100)")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of traffic left out of the figures")
    p.add_argument("--ungated", action="store_true", help="also run each configuration with the gate off")
    p.add_argument(
        "--minimal-client",
        action="store_true",
        help="a client written from docs/contract.md's required fields: no candidate_probs, no canary, "
        "every request explored at T = 1",
    )
    p.add_argument("--skip-previous", action="store_true", help="leave out the previous defaults' configuration")
    p.add_argument(
        "--attribution-rate",
        type=float,
        default=0.0,
        help="share of the feedback carrying per-memory credit (nll_without_slot; the LM evaluator's "
        "default is 0.25); 0: the step reward alone (default)",
    )
    p.add_argument(
        "--new-interval", type=float, help="the new configuration's cadence (default: the product's default)"
    )
    p.add_argument("--new-full-every", type=int, help="the new configuration's full_every (default: the product's)")
    p.add_argument(
        "--also-interval",
        type=float,
        action="append",
        default=[],
        metavar="SECONDS",
        help="also measure the new configuration at this cadence (repeatable)",
    )
    p.add_argument("--out", help="write the report as JSON")


def log_dir(settings: Settings) -> Path:
    """This run's directory for the child processes' logs, under the (user-expanded) state directory."""
    return settings.state_path() / "bench-freshness" / time.strftime("%Y%m%d-%H%M%S")


def main(args: argparse.Namespace) -> int:
    import torch

    from pipeline import kafka
    from pipeline.broker import own_broker

    torch.set_num_threads(1)  # the agent shares the machine with the worker, the learner and the broker
    base: Settings = args.settings
    defaults = Settings()
    new = {
        "checkpoint_interval_s": args.new_interval or defaults.checkpoint_interval_s,
        "checkpoint_full_every": args.new_full_every or defaults.checkpoint_full_every,
    }
    configs = ([] if args.skip_previous else [("previous", OLD)]) + [("default", new)]
    configs += [(f"every {t:g} s", {**new, "checkpoint_interval_s": t}) for t in args.also_interval]
    gates = [True, False] if args.ungated else [True]
    # No drift inside a short run; the agent explores as the learner's serving settings say
    # (CAUSALMEM_SERVE_EXPLORE_*), so that the gate judges the traffic the clients make; a
    # minimal client explores every request at T = 1 (the contract client).
    explore = (1.0, 1.0) if args.minimal_client else (base.serve_explore_rate, base.serve_explore_temperature)
    scenario = Scenario(
        drift_day=None, explore_rate=explore[0], explore_temperature=explore[1], attribution_rate=args.attribution_rate
    )
    logdir = log_dir(base)
    bootstrap, broker = own_broker(getattr(args, "bootstrap", None), logdir / "broker.log")
    runs: list[Run] = []
    try:
        asyncio.run(kafka.wait_for_broker(bootstrap, base))
        for gate in gates:
            for name, cfg in configs:
                run = Run(name, gate, float(cfg["checkpoint_interval_s"]), int(cfg["checkpoint_full_every"]))
                print(f"bench freshness: {name}, gate {'on' if gate else 'off'} ...", flush=True)
                asyncio.run(
                    one_run(
                        bootstrap,
                        base,
                        scenario,
                        run,
                        args.seconds,
                        args.rate,
                        args.warmup,
                        logdir / f"{name}-{'gated' if gate else 'ungated'}",
                        minimal_client=args.minimal_client,
                    )
                )
                runs.append(run)
                print(table([run]).splitlines()[-1], flush=True)
    finally:
        if broker is not None:
            broker.stop()
    print(table(runs))
    report = {
        "minimal_client": args.minimal_client,
        "attribution_rate": args.attribution_rate,
        "rate": args.rate,
        "seconds": args.seconds,
        "warmup_s": args.warmup,
        "target_median_s": TARGET_MEDIAN_S,
        "runs": [r.summary() for r in runs],
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
