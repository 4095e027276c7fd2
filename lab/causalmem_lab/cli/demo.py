"""``causalmem demo``: the main job: embedded broker + worker + learner + simulated agent, 14 days with a drift."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib

HELP = "the main job: embedded broker + worker + learner + simulated agent, 14 days with a drift"


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="default", help="scenario name or YAML file (lab/causalmem_lab/scenarios/)")
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


def run(args: argparse.Namespace) -> int:
    from causalmem_lab.demo import plot_demo, print_summary, run_demo
    from causalmem_lab.simulator import Scenario

    # before any process starts: the lab extra, for the summary tables and the plot
    for module in ("yaml", "rich", *(["matplotlib"] if args.plot else [])):
        importlib.import_module(module)
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
