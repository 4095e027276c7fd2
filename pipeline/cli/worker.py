"""``causalmem worker``: join, active learning and drift (a faust worker)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pipeline.cli.common import model_options, prepare_cluster, resolve_bootstrap, settings_from, start_metrics
from pipeline.metrics import Metrics
from pipeline.probes import HEARTBEAT_INTERVAL_S, Probes, Progress, total
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
    probes = Probes()
    metrics = start_metrics("worker", settings, probes)
    watch_worker(probes, metrics)
    print(
        f"worker: broker {bootstrap}, D={settings.embedding_dim}, S={settings.slots}, {settings.partitions} partitions",
        flush=True,
    )
    worker = Worker(settings.worker(), bootstrap, metrics, web_port=args.web_port)

    async def heartbeat() -> None:
        probes.beat()

    worker.app.timer(interval=HEARTBEAT_INTERVAL_S)(heartbeat)  # beats on faust's event loop
    worker.faust_worker(loglevel=args.log_level).execute_from_commandline()
    return 0


def watch_worker(probes: Probes, metrics: Metrics) -> None:
    """A worker is ready when it owns input partitions, is caught up within a bound and not stale.

    Caught up: the join's consumer lag (summed over its input topics) is at most
    :data:`pipeline.probes.MAX_LAG` messages. Not stale: while input waits, messages keep
    being read (``causalmem_events_in_total`` grows) within
    :data:`pipeline.probes.STALE_AFTER_S`. A replica beyond the partition count owns
    nothing and stays not ready (docs/operations.md).
    """

    def owns_partitions() -> str | None:
        if total(metrics.partitions_owned, stage="join") > 0:
            return None
        return "no input partitions assigned (rebalance pending, or more replicas than partitions)"

    probes.check(owns_partitions)
    probes.check(Progress("join", lambda: total(metrics.consumer_lag), lambda: total(metrics.events_in)))
