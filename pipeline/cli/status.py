"""``causalmem status``: operator view: checkpoint version and age, rates, health, queue depth, dead letters."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import orjson

from pipeline import kafka
from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.status.collect import StatusCollector, _url, render


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
    bootstrap = resolve_bootstrap(settings)
    collector = StatusCollector(
        bootstrap,
        settings,
        [_url(u) for u in args.worker_urls],
        [_url(u) for u in args.learner_urls],
        rate_interval=max(0.0, args.rate_interval),
    )

    def emit_json(snap: dict[str, Any]) -> None:
        sys.stdout.write(orjson.dumps(snap, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
        sys.stdout.flush()

    async def once() -> int:
        await kafka.wait_for_broker(bootstrap, settings, timeout=args.timeout)
        snap = await collector.snapshot()
        if args.json:
            emit_json(snap)
        else:
            from rich.console import Console

            Console().print(render(snap))
        return 0

    async def watch(interval: float) -> int:
        await kafka.wait_for_broker(bootstrap, settings, timeout=args.timeout)
        if args.json:
            while True:
                emit_json(await collector.snapshot())
                await asyncio.sleep(interval)
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        console = Console()
        with Live(Text("collecting…"), console=console, refresh_per_second=4, transient=False) as live:
            while True:
                live.update(render(await collector.snapshot()))
                await asyncio.sleep(interval)

    try:
        if args.watch is None:
            return asyncio.run(once())
        return asyncio.run(watch(max(0.5, args.watch)))
    except KeyboardInterrupt:
        return 0
