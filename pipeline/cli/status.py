"""``causalmem status``: operator view: checkpoint version and age, rates, health, queue depth, dead letters.

``--shadow`` adds shadow mode's line: the mode and the policy's estimated gain over the incumbent.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.policy_evaluation.evaluate import WINDOW
from pipeline.policy_evaluation.shadow import format_report, shadow_report
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
    p.add_argument(
        "--shadow",
        action="store_true",
        help="also shadow mode's mode and estimate of the policy's gain over the incumbent (reads the logs)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        help=f"with --shadow: the last N joined steps (default {WINDOW})",
    )


class ShadowStatusCollector(StatusCollector):
    """Status with shadow mode's line (docs/byo-retriever.md): the mode and the gain estimate."""

    def __init__(self, *args: Any, window: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = window

    async def snapshot(self) -> dict[str, Any]:
        s = await super().snapshot()
        try:
            report = await shadow_report(self.bootstrap, self.conn, self.window)
            s["shadow"] = {**report, "line": format_report(report)}
        except Exception as exc:  # the rest of the view stands without it
            s["errors"].append(f"shadow estimate: {exc!r}")
        return s


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    extra: dict[str, Any] = {"window": args.window} if args.shadow else {}
    collector = (ShadowStatusCollector if args.shadow else StatusCollector)(
        resolve_bootstrap(settings),
        settings.connection(),
        [metrics_url(u) for u in args.worker_urls],
        [metrics_url(u) for u in args.learner_urls],
        rate_interval=max(0.0, args.rate_interval),
        **extra,
    )
    watch = None if args.watch is None else max(0.5, args.watch)
    try:
        return asyncio.run(show(collector, as_json=args.json, watch=watch, broker_timeout=args.timeout))
    except KeyboardInterrupt:
        return 0
