"""``causalmem worker``: join, active learning and drift (a faust worker)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pipeline.cli.common import model_options, prepare_cluster, resolve_bootstrap, settings_from, start_metrics
from pipeline.worker.app import Worker


def add_options(p: argparse.ArgumentParser) -> None:
    model_options(p)
    p.add_argument("--web-port", type=int, help="faust web port on loopback (default: web server off)")
    p.add_argument("--join-window", dest="join_window_s", type=float, help="join window in event-time seconds")
    p.add_argument("--al-threshold", type=float, help="utility below which an experience is an error candidate")
    p.add_argument("--al-uncertainty-budget", type=float, help="max fraction of experiences queued as uncertain")
    p.add_argument(
        "--page-hinkley",
        dest="drift_page_hinkley",
        action="store_const",
        const=True,
        help="also run the Page-Hinkley drift detector",
    )
    p.add_argument("--drift-min-pairs", type=int, help="minimum (U_query, rating) pairs before the trigger acts")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)
    try:
        asyncio.run(prepare_cluster(bootstrap, settings))
    except RuntimeError as exc:  # wrong partition counts break the partition-local join
        print(exc, file=sys.stderr)
        return 2
    metrics = start_metrics("worker", settings)
    print(
        f"worker: broker {bootstrap}, D={settings.embedding_dim}, S={settings.slots}, {settings.partitions} partitions",
        flush=True,
    )
    worker = Worker(settings.worker(), bootstrap, metrics, web_port=args.web_port)
    worker.faust_worker(loglevel=args.log_level).execute_from_commandline()
    return 0
