"""``causalmem bench``: benchmarks of the real code paths.

- ``throughput``: raw aiokafka consumption vs the pipeline end to end (worker + learner
  processes on the same broker), and the learner's update vs a bare torch step;
- ``learning``: what each policy learns on a scenario with known ground truth;
- ``soak``: a steady input rate for a set time, with lag and memory sampled.

Figures are ratios measured side by side in one run, since absolute times on shared
machines vary; ``docs/benchmarks.md`` records the latest ones with their commands.
"""

from __future__ import annotations

import argparse
import importlib

from pipeline.cli import options, verb

BENCHES = {
    "throughput": "pipeline.bench.throughput",
    "learning": "pipeline.bench.learning",
    "soak": "pipeline.bench.soak",
}


def _bench_opts(p: argparse.ArgumentParser) -> None:
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


@verb("bench", "benchmarks: throughput, learning, soak")
@options(_bench_opts)
def cmd_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHES[args.which])
    return int(module.main(args) or 0)
