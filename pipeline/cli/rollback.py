"""``causalmem rollback``: serve an earlier checkpoint again (republished under a new version, reason rollback)."""

from __future__ import annotations

import argparse
import asyncio

from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.policy_evaluation.rollback import rollback


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", dest="to_version", type=int, required=True, help="the checkpoint version to serve again")
    p.add_argument("--reason", default="operator rollback", help="recorded in the checkpoint's metrics")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the learner")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)
    return asyncio.run(rollback(bootstrap, settings.connection(), args.to_version, args.reason, args.timeout))
