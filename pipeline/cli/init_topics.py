"""``causalmem init-topics``: create the product's topics."""

from __future__ import annotations

import argparse
import asyncio

from pipeline import kafka
from pipeline.cli.common import resolve_bootstrap, settings_from


def add_options(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)

    async def main() -> int:
        await kafka.wait_for_broker(bootstrap, settings)
        result = await kafka.create_topics(bootstrap, settings)
        bad = 0
        for spec in settings.topics().all():
            state = result.get(spec.name, "?")
            bad += state not in ("created", "exists", "repaired")
            print(f"{spec.name:<40} {spec.partitions:>3} partitions  {state}")
        return 1 if bad else 0

    return asyncio.run(main())
