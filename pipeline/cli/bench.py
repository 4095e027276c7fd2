"""``causalmem bench``: benchmarks: throughput, learning, soak."""

from __future__ import annotations

import argparse
import importlib

from pipeline.cli.common import settings_from
from pipeline.lab.bench import BENCHES


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("--events", type=int, help="throughput: events (default 20,000)")
    p.add_argument(
        "--rate", type=float, help="soak: input pairs (RetrievalEvent + LLMFeedback) per second (default 300)"
    )
    p.add_argument("--duration", type=float, help="soak: seconds of the steady phase (default 120)")
    p.add_argument(
        "--find-max",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="soak: then search the maximum sustainable rate (default on; --no-find-max skips it)",
    )
    p.add_argument("--step-seconds", type=float, help="soak: seconds per max-rate search phase (default 20)")
    p.add_argument("--max-phases", type=int, help="soak: at most this many search phases (default 10)")

    p.add_argument("--quick", action="store_true", help="learning: the small size (used by the tests)")
    p.add_argument("--scenario", help="learning: scenario name or YAML file")
    p.add_argument("--text", action="store_true", help="learning: the text flavour (MiniLM embeddings)")
    p.add_argument("--rows", help="learning: comma-separated rows to run (default: all; --quick: similarity,dynamic)")

    p.add_argument("--out", help="write the results as JSON here (and plots next to it)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    args.settings = settings_from(args)
    module = importlib.import_module(BENCHES[args.which])
    return int(module.main(args) or 0)
