"""``causalmem evaluate``: off-policy estimates of the serving, candidate, similarity and uniform policies as served."""

from __future__ import annotations

import argparse
import asyncio
import json

from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.evaluation.evaluate import METHODS, evaluate_window, print_report


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=2000, help="the last N joined experiences (default 2000)")
    p.add_argument("--method", choices=[*METHODS, "all"], default="all")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--embedding-dim", type=int, help="D (default 384)")
    p.add_argument("--slots", type=int, help="S (default 1024)")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)
    report = asyncio.run(
        evaluate_window(
            bootstrap, settings.connection(), args.window, METHODS if args.method == "all" else (args.method,)
        )
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["decisions"] else 1
