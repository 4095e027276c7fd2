"""``causalmem demo``: the main job, end to end on one machine.

Starts the embedded broker (unless ``--bootstrap``), a worker and a learner (real
``causalmem`` processes), then a simulated agent that serves queries with
:class:`CausalRetriever` under the latest hot-loaded checkpoint and publishes retrieval
events, LLM feedback, ratings and verdicts; an automatic labeler answers the samples the
pipeline queues, from the ground truth. 14 simulated days run in a few minutes, with a
drift on day 8. The run ends with a summary of what the pipeline did and learnt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.cli import options, verb

log = logging.getLogger(__name__)

DAY = 86400.0


@dataclass
class DemoResult:
    tally: Any
    env: Any
    published: dict[str, int]
    worker_metrics: dict[str, float]
    learner_metrics: dict[str, float]
    corr_series: list[tuple[float, float, int]]  # (event time, correlation, pairs)
    resets: list[dict[str, Any]]  # control messages (event time, details)
    versions_loaded: int
    labels_answered: int
    wall_s: float = 0.0


def _demo_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="default", help="scenario name or YAML file (pipeline/scenarios/)")
    p.add_argument("--days", type=float, help="simulated days (default 14)")
    p.add_argument("--queries-per-day", type=int, help="simulated queries per day (default 500)")
    p.add_argument("--rate", type=float, default=120.0, help="retrieval steps per wall-clock second (default 120)")
    p.add_argument("--no-reset", action="store_true", help="measure the drift without resetting the policy")
    p.add_argument("--no-drift", action="store_true", help="no environment change")
    p.add_argument("--no-labels", action="store_true", help="no automatic labeler (to see what labels add)")
    p.add_argument("--plot", help="write a PNG of correlation and utility over event time")
    p.add_argument("--checkpoint-interval", type=float, default=2.0, help="learner checkpoint cadence (s)")

    p.add_argument("--keep-logs", help="directory for the worker/learner/broker logs (default: a temp dir)")
    p.add_argument("--seed", type=int, help="scenario seed")


@verb("demo", "the main job: embedded broker + worker + learner + simulated agent, 14 days with a drift")
@options(_demo_opts)
def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.simulator import Scenario

    scenario = Scenario.load(args.scenario).replace(
        days=args.days, queries_per_day=args.queries_per_day, seed=args.seed
    )
    if args.no_drift:
        scenario = dataclasses.replace(scenario, drift_day=None)
    result = asyncio.run(run_demo(scenario, args))
    print_summary(result, scenario, reset_enabled=not args.no_reset)
    if args.plot:
        plot_demo(result, scenario, args.plot)
        print(f"plot written to {args.plot}")
    return 0


async def run_demo(scenario: Any, args: argparse.Namespace) -> DemoResult:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from pipeline import kafka
    from pipeline.broker import EmbeddedBroker
    from pipeline.checkpoints import PolicySubscriber
    from pipeline.config import Settings
    from pipeline.labeler import LabelQueue, run_queue_until
    from pipeline.procs import Child, metric, scrape
    from pipeline.publisher import EventPublisher
    from pipeline.retriever import CausalRetriever
    from pipeline.simulator import Environment, Tally
    from topics.codec import HumanLabel, LLMFeedback, decode_control

    console = Console(stderr=True)
    logging.getLogger("pipeline.checkpoints").setLevel(logging.WARNING)  # one line per hot-load is noise here
    t_start = time.monotonic()
    logdir = Path(args.keep_logs or tempfile.mkdtemp(prefix="causalmem-demo-"))
    logdir.mkdir(parents=True, exist_ok=True)
    state_dir = Path(tempfile.mkdtemp(prefix="causalmem-demo-state-"))
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        broker = EmbeddedBroker(log_path=logdir / "broker.log")
        bootstrap = broker.start()
        console.print(f"[bold]demo[/]: embedded broker on {bootstrap} (memory only); logs in {logdir}")
    prefix = args.topic_prefix or ("" if broker else f"demo-{uuid.uuid4().hex[:6]}.")
    env_vars = {
        "CAUSALMEM_TOPIC_PREFIX": prefix,
        "CAUSALMEM_EMBEDDING_DIM": str(scenario.embedding_dim),
        "CAUSALMEM_SLOTS": str(scenario.slots),
        "CAUSALMEM_STATE_DIR": str(state_dir),
        "CAUSALMEM_CHECKPOINT_INTERVAL_S": str(args.checkpoint_interval),
        # Event time runs ~10,000× faster than wall time here: a 10-minute join window
        # would be 60 ms of wall time. One simulated day is ~6 s.
        "CAUSALMEM_JOIN_WINDOW_S": str(DAY),
        "CAUSALMEM_DRIFT_MIN_PAIRS": "1000",
        "CAUSALMEM_DRIFT_PAGE_HINKLEY": "1",
        "CAUSALMEM_DRIFT_COOLDOWN_S": str(2 * DAY),
        "CAUSALMEM_DRIFT_RESET": "0" if args.no_reset else "1",
        "CAUSALMEM_LABEL_WINDOW_S": str(2 * DAY),
    }
    settings = Settings.from_env({**os.environ, **env_vars}, bootstrap=bootstrap)
    await kafka.wait_for_broker(bootstrap, settings)
    await kafka.create_topics(bootstrap, settings)
    worker = Child("worker", bootstrap, env_vars, log_path=logdir / "worker.log")
    learner = Child("learner", bootstrap, env_vars, log_path=logdir / "learner.log")
    env = Environment(scenario)
    retriever = CausalRetriever(
        env.memory,
        texts=env.texts,
        k=scenario.k,
        n_candidates=scenario.n_candidates,
        temperature=scenario.temperature,
        seed=scenario.seed,
        explore_rate=scenario.explore_rate,
        explore_temperature=scenario.explore_temperature,
    )
    tally = Tally()

    published = {"retrieval-events": 0, "llm-feedback": 0, "human-labels": 0}
    corr_series: list[tuple[float, float, int]] = []
    versions = {"n": 0}
    intents: dict[str, int] = {}
    now_ts = {"t": scenario.start_ts}

    def on_update(loaded: Any) -> None:
        retriever.set_policy(loaded)
        versions["n"] += 1

    answered = {"n": 0}

    def answer(sample: Any) -> tuple[list[int] | None, int | None]:
        intent = intents.get(sample.query_id)
        if intent is None:
            return None, None
        good = [s for s in sample.candidates if s in set(env.helpful(intent))]
        answered["n"] += 1
        rating = round(
            5 * (env.need[intent] - scenario.need_range[0]) / (scenario.need_range[1] - scenario.need_range[0])
        )
        return (good or None), rating

    try:
        with console.status("starting worker and learner…"):
            for child in (worker, learner):
                await _wait(lambda c=child: bool(c.metrics()) or not c.alive(), 60, f"{child.verb} metrics")
                if not child.alive():
                    raise RuntimeError(f"{child.verb} exited:\n{child.log_tail()}")
            await _wait(
                lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0,
                60,
                "the worker's join stage to own partitions",
            )
        async with (
            PolicySubscriber(bootstrap, settings.policy, settings, on_update=on_update) as sub,
            EventPublisher(bootstrap, settings) as pub,
            LabelQueue(bootstrap, settings, "auto-labeler") as queue,
        ):
            await sub.wait_for_policy(timeout=60)
            stop_labeler = asyncio.Event()
            labeler_task = asyncio.create_task(
                asyncio.sleep(0) if args.no_labels else run_queue_until(queue, stop_labeler, answer)
            )

            sampler_stop = asyncio.Event()

            async def sample_correlation() -> None:
                while not sampler_stop.is_set():
                    values = await asyncio.to_thread(scrape, worker.url)
                    if values:
                        corr_series.append(
                            (
                                now_ts["t"],
                                metric(values, "causalmem_utility_rating_correlation"),
                                int(metric(values, "causalmem_utility_rating_pairs")),
                            )
                        )
                    await asyncio.sleep(0.5)

            sampler = asyncio.create_task(sample_correlation())
            total = scenario.total_queries
            progress = Progress(
                TextColumn("[bold]simulated agent[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "day {task.fields[day]:>4.1f}  policy v{task.fields[v]}  "
                    "leak {task.fields[leak]:.0%}  recall {task.fields[recall]:.0%}"
                ),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            wall0 = time.monotonic()
            steps_done = 0
            with progress:
                task = progress.add_task("agent", total=total, day=0.0, v=0, leak=0.0, recall=0.0)
                for qi in range(total):
                    q = env.next_query()
                    intents[q.query_id] = q.intent
                    now_ts["t"] = q.ts
                    for step in range(q.steps):
                        st = env.step_features(q, step)
                        res = retriever.retrieve(
                            st.embedding,
                            q.query_id,
                            step,
                            st.last_step_loss,
                            st.last_step_entropy,
                            query_text=q.text,
                            ts=st.ts,
                        )
                        true_u, nll_with, nll_without = env.feedback(q.intent, res.slots)
                        q.utilities.append(nll_without - nll_with)
                        tally.add(
                            env.leak(q.intent, res.slots),
                            env.recall(q.intent, res.slots),
                            not res.slots,
                            true_u,
                            st.ts,
                            res.event.policy_version,
                        )
                        fb = LLMFeedback(
                            uuid.uuid4().hex,
                            q.query_id,
                            step,
                            st.ts + 1.0,
                            nll_without - nll_with,
                            nll_with=nll_with,
                            nll_without=nll_without,
                        )
                        await pub.publish(res.event)
                        await pub.publish(fb)
                        published["retrieval-events"] += 1
                        published["llm-feedback"] += 1
                        steps_done += 1
                    u_query = float(np.mean(q.utilities))
                    end_ts = q.ts + 5.0 * q.steps + 30.0
                    rating = env.rating(q.intent)
                    if rating is not None:
                        await pub.publish(
                            HumanLabel(uuid.uuid4().hex, q.query_id, end_ts, "rater", "rating", rating=rating)
                        )
                        published["human-labels"] += 1
                    verdict = env.verdict(u_query)
                    if verdict is not None:
                        await pub.publish(
                            HumanLabel(uuid.uuid4().hex, q.query_id, end_ts, "rater", "verdict", answer_correct=verdict)
                        )
                        published["human-labels"] += 1
                    if qi % 25 == 0:
                        recent = tally.window(max(0.0, 1 - 300 / max(1, len(tally.leak))), 1.0)
                        progress.update(
                            task,
                            completed=qi + 1,
                            day=env.day_of(q.ts),
                            v=sub.current.version if sub.current else 0,
                            leak=recent["leak"],
                            recall=recent["recall"],
                        )
                        ahead = steps_done / args.rate - (time.monotonic() - wall0)
                        await asyncio.sleep(max(0.0, ahead))
                progress.update(task, completed=total)
            await pub.flush()
            with console.status("draining: waiting for the pipeline to apply the last events…"):
                await _drain(worker, learner, published["retrieval-events"], timeout=90)
                await asyncio.sleep(args.checkpoint_interval + 1.0)
            stop_labeler.set()
            sampler_stop.set()
            await asyncio.gather(labeler_task, sampler, return_exceptions=True)
        worker_metrics, learner_metrics = worker.metrics(), learner.metrics()
        resets = []
        for msg in await kafka.read_all(bootstrap, settings, settings.topics().control.name, partitions=[0]):
            with contextlib.suppress(Exception):
                ctl = decode_control(msg.value, settings.limits())
                resets.append({"ts": ctl.ts, **ctl.details, "reason": ctl.reason})
        return DemoResult(
            tally,
            env,
            published,
            worker_metrics,
            learner_metrics,
            corr_series,
            resets,
            versions["n"],
            queue.done,
            time.monotonic() - t_start,
        )
    finally:
        for child in (worker, learner):
            child.stop()
        if broker is not None:
            broker.stop()


async def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(pred):
            return
        await asyncio.sleep(0.3)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


async def _drain(worker: Any, learner: Any, steps: int, timeout: float) -> None:
    from pipeline.procs import metric

    deadline = time.monotonic() + timeout
    last = -1.0
    stable = 0
    while time.monotonic() < deadline:
        w, lm = await asyncio.to_thread(worker.metrics), await asyncio.to_thread(learner.metrics)
        joins = metric(w, "causalmem_joins_total")
        applied = metric(lm, "causalmem_learner_experiences_total", kind="feedback")
        fallbacks = metric(w, "causalmem_fallbacks_total")
        if joins >= steps and applied >= joins - fallbacks:
            return
        stable = stable + 1 if applied == last else 0
        last = applied
        if stable > 40:  # nothing moved for ~12 s
            return
        await asyncio.sleep(0.3)


def print_summary(r: DemoResult, scenario: Any, reset_enabled: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from pipeline.procs import metric

    c = Console()
    w, lm, t = r.worker_metrics, r.learner_metrics, r.tally
    start = scenario.start_ts
    drift_ts = None
    if scenario.drift_day is not None and scenario.drift_day < scenario.days:
        drift_ts = start + scenario.drift_day * DAY
    c.rule("[bold]causalmem demo: summary")
    runs = Table(show_header=False, box=None)
    runs.add_row("simulated", f"{scenario.days:g} days, {len(t.leak):,} retrieval steps, {r.wall_s:.0f} s wall clock")
    runs.add_row("published", ", ".join(f"{n:,} {k}" for k, n in r.published.items()))
    runs.add_row(
        "worker",
        f"{metric(w, 'causalmem_joins_total'):,.0f} joins, "
        f"{metric(w, 'causalmem_join_expired_total'):,.0f} expired, "
        f"{metric(w, 'causalmem_dead_letter_total'):,.0f} dead-lettered, "
        f"{metric(w, 'causalmem_duplicates_total'):,.0f} duplicates",
    )
    runs.add_row(
        "learner",
        f"{metric(lm, 'causalmem_learner_updates_total'):,.0f} updates on "
        f"{metric(lm, 'causalmem_learner_experiences_total'):,.0f} experiences, "
        f"{metric(lm, 'causalmem_learner_skipped_total', reason='non_finite'):,.0f} non-finite skipped",
    )
    reasons = {
        k.split("reason=")[1].rstrip("}"): v
        for k, v in lm.items()
        if k.startswith("causalmem_checkpoint_publishes_total{")
    }
    runs.add_row(
        "checkpoints",
        f"{sum(reasons.values()):,.0f} published ("
        + ", ".join(f"{n:.0f} {k}" for k, n in sorted(reasons.items()))
        + f"); the agent hot-loaded "
        f"{r.versions_loaded}",
    )
    runs.add_row(
        "active learning",
        f"{metric(w, 'causalmem_al_samples_total'):,.0f} samples queued, "
        f"{r.labels_answered:,} answered by the auto-labeler, "
        f"{metric(lm, 'causalmem_learner_labels_applied_total'):,.0f} labels applied (last layer)",
    )
    c.print(runs)

    table = Table(title="what the agent got (ground truth)", title_justify="left")
    for col in ("period", "harmful leak", "helpful recall@k", "empty results", "mean true utility"):
        table.add_column(col, justify="right" if col != "period" else "left")

    def row(name: str, m: dict[str, float]) -> None:
        table.add_row(name, f"{m['leak']:.1%}", f"{m['recall']:.1%}", f"{m['empty']:.1%}", f"{m['utility']:+.3f}")

    row("first tenth of the run", t.window(0.0, 0.1))
    if drift_ts is not None:
        row("last day before the drift", t.between(drift_ts - DAY, drift_ts))
        row("first day after the drift", t.between(drift_ts, drift_ts + DAY))
    row("last tenth of the run", t.window(0.9, 1.0))
    c.print(table)

    if drift_ts is not None:

        def corr_at(ts: float) -> str:
            pts = [(abs(x - ts), v, n) for x, v, n in r.corr_series if x <= ts]
            if not pts:
                return "n/a"
            _, v, n = min(pts)
            return f"{v:+.3f} ({n} pairs)"

        d = Table(
            title="drift (7-day correlation of U_query with human ratings)", title_justify="left", show_header=False
        )
        d.add_row("drift (environment change)", f"day {scenario.drift_day:g}")
        d.add_row("correlation just before the drift", corr_at(drift_ts))
        if r.resets:
            first = r.resets[0]
            reset_day = (first["ts"] - start) / DAY
            d.add_row(
                "reset sent",
                f"day {reset_day:.2f} ({first.get('detector', '?')} detector, "
                f"correlation {first.get('correlation', float('nan')):+.3f})",
            )
            d.add_row("correlation at the reset", corr_at(first["ts"]))
            after = t.between(first["ts"], first["ts"] + DAY)
            d.add_row(
                "first day after the reset",
                f"leak {after['leak']:.1%}, recall {after['recall']:.1%}, utility {after['utility']:+.3f}",
            )
        else:
            d.add_row("reset sent", "none" + ("" if reset_enabled else " (--no-reset)"))
        d.add_row("correlation at the end", corr_at(start + scenario.days * DAY))
        d.add_row("resets applied by the learner", f"{metric(lm, 'causalmem_learner_resets_total'):.0f}")
        c.print(d)
    first, last = t.window(0.0, 0.1), t.window(0.9, 1.0)
    verdict = "learnt" if last["leak"] < first["leak"] and last["recall"] > first["recall"] else "did NOT learn"
    c.print(
        f"[bold]the policy {verdict}[/]: harmful leak {first['leak']:.1%} → {last['leak']:.1%}, "
        f"helpful recall {first['recall']:.1%} → {last['recall']:.1%}"
    )


def plot_demo(r: DemoResult, scenario: Any, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = scenario.start_ts
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    if r.corr_series:
        xs = [(x - start) / DAY for x, _, n in r.corr_series if n > 0]
        ys = [v for _, v, n in r.corr_series if n > 0]
        ax1.plot(xs, ys, label="7-day correlation(U_query, rating)")
    ax1.set_ylabel("correlation")
    days = (np.asarray(r.tally.ts) - start) / DAY
    bins = np.arange(0, scenario.days + 0.25, 0.25)
    idx = np.digitize(days, bins)
    util = np.asarray(r.tally.utility)
    leak = np.asarray(r.tally.leak, float)
    centers = [(bins[i - 1] + bins[i]) / 2 for i in range(1, len(bins)) if (idx == i).any()]
    ax2.plot(
        centers, [util[idx == i].mean() for i in range(1, len(bins)) if (idx == i).any()], label="mean true utility"
    )
    ax2.plot(centers, [leak[idx == i].mean() for i in range(1, len(bins)) if (idx == i).any()], label="harmful leak")
    for ax in (ax1, ax2):
        if scenario.drift_day is not None:
            ax.axvline(scenario.drift_day, color="red", ls="--", label="drift")
        for reset in r.resets:
            ax.axvline((reset["ts"] - start) / DAY, color="green", ls=":", label="reset")
        ax.legend(loc="lower left", fontsize=8)
        ax.grid(alpha=0.3)
    ax2.set_xlabel("event time (days)")
    fig.suptitle("causalmem demo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
