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
import importlib
import logging
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.simulator import DAY

log = logging.getLogger(__name__)


async def run_demo(scenario: Any, args: argparse.Namespace) -> Any:
    Console = importlib.import_module("rich.console").Console
    from causalmem_lab.simrun import RunSpec, run_scenario
    from pipeline.broker import own_broker

    console = Console(stderr=True)
    logging.getLogger("pipeline.client.subscriber").setLevel(logging.WARNING)  # one line per hot-load is noise here
    # A temporary log directory (~70 MB of logs and state) is removed after a successful run
    # and kept, with its path printed, after a failure; --keep-logs DIR always keeps it.
    keep = bool(args.keep_logs)
    logdir = Path(args.keep_logs or tempfile.mkdtemp(prefix="causalmem-demo-"))
    logdir.mkdir(parents=True, exist_ok=True)
    bootstrap, broker = own_broker(args.bootstrap, logdir / "broker.log")
    where = f"logs in {logdir}" + ("" if keep else " (removed after a successful run; --keep-logs DIR keeps them)")
    console.print("[bold]demo[/]: " + (f"embedded broker on {bootstrap} (memory only); " if broker else "") + where)
    spec = RunSpec(
        name="demo",
        labels=not args.no_labels,
        reset=not args.no_reset,
        rate=args.rate,
        checkpoint_interval=args.checkpoint_interval,
    )
    try:
        prefix = args.topic_prefix or ("" if broker else f"demo-{uuid.uuid4().hex[:6]}.")
        result = await run_scenario(scenario, spec, bootstrap, logdir, console, prefix=prefix)
    except BaseException:
        console.print(f"[bold red]demo failed[/]: the logs are kept in {logdir}")
        raise
    finally:
        if broker is not None:
            broker.stop()
    if not keep:
        shutil.rmtree(logdir, ignore_errors=True)
    return result


def print_summary(r: Any, scenario: Any, reset_enabled: bool) -> None:
    from pipeline.promtext import metric

    Console = importlib.import_module("rich.console").Console
    Table = importlib.import_module("rich.table").Table

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
        + f"); the agent hot-loaded {r.versions_loaded}",
    )
    gate = {
        k.split("decision=")[1].rstrip("}"): v for k, v in lm.items() if k.startswith("causalmem_gate_decisions_total{")
    }
    if gate:
        runs.add_row("promotion gate", ", ".join(f"{n:.0f} {k}" for k, n in sorted(gate.items())))
    runs.add_row(
        "active learning",
        f"{metric(w, 'causalmem_al_samples_total'):,.0f} samples queued, "
        f"{r.labels_answered:,} answered by the auto-labeler, "
        f"{metric(lm, 'causalmem_learner_labels_applied_total'):,.0f} labels applied (last layer)",
    )
    effect = r.label_effect
    if effect:
        runs.add_row(
            "effect of labels",
            f"on the {effect['labelled_samples']:.0f} answered samples the policy put "
            f"{effect['mass_when_answered']:.0%} of its first-draw probability on the labelled memories "
            f"when they were answered, {effect['mass_final']:.0%} at the end",
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
    first = t.window(0.0, 0.1)
    learnt = t.between(drift_ts - DAY, drift_ts) if drift_ts is not None else t.window(0.9, 1.0)
    when = "the last day before the drift" if drift_ts is not None else "the last tenth"
    verdict = "learnt" if learnt["leak"] < first["leak"] and learnt["recall"] > first["recall"] else "did NOT learn"
    c.print(
        f"[bold]the policy {verdict}[/]: harmful leak {first['leak']:.1%} → {learnt['leak']:.1%}, "
        f"helpful recall {first['recall']:.1%} → {learnt['recall']:.1%} (first tenth → {when})"
    )
    if drift_ts is not None:
        after, end = t.between(drift_ts, drift_ts + DAY), t.window(0.9, 1.0)
        c.print(
            f"[bold]after the drift[/]: mean true utility {after['utility']:+.3f} on its first day → "
            f"{end['utility']:+.3f} in the last tenth (leak {after['leak']:.1%} → {end['leak']:.1%}, "
            f"recall {after['recall']:.1%} → {end['recall']:.1%})"
        )


def plot_demo(r: Any, scenario: Any, path: str) -> None:
    matplotlib = importlib.import_module("matplotlib")
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
