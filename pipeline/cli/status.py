"""``causalmem status``: operator view: checkpoint version and age, rates, health, queue depth, dead letters."""

from __future__ import annotations

import argparse
import asyncio

from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.promtext import metrics_url
from pipeline.status.collect import StatusCollector
from pipeline.status.render import show


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--worker",
        dest="worker_urls",
        action="append",
        default=[],
        metavar="URL",
        help="a worker's Prometheus endpoint, e.g. http://127.0.0.1:9100/metrics (repeatable)",
    )
    p.add_argument(
        "--learner",
        dest="learner_urls",
        action="append",
        default=[],
        metavar="URL",
        help="a learner's Prometheus endpoint (repeatable)",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=5.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 5) until Ctrl-C",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (one per refresh with --watch)")
    p.add_argument(
        "--rate-interval",
        type=float,
        default=1.0,
        help="seconds between the two scrapes that give live rates in a one-shot view (default 1)",
    )
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the broker (default 15)")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    collector = StatusCollector(
        resolve_bootstrap(settings),
        settings.connection(),
        [metrics_url(u) for u in args.worker_urls],
        [metrics_url(u) for u in args.learner_urls],
        rate_interval=max(0.0, args.rate_interval),
    )
    watch = None if args.watch is None else max(0.5, args.watch)
    try:
        return asyncio.run(show(collector, as_json=args.json, watch=watch, broker_timeout=args.timeout))
    except KeyboardInterrupt:
        return 0
