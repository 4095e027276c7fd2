"""``causalmem publish FILE.jsonl``: publish events from a file, reporting what was rejected and why."""

from __future__ import annotations

import argparse
import asyncio

from pipeline.cli.common import default_of, resolve_bootstrap, settings_from
from pipeline.client.publish_file import publish_file


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="JSONL file: one RetrievalEvent, LLMFeedback or HumanLabel per line")
    p.add_argument("--embedding-dim", type=int, help=f"D used to validate ({default_of('embedding_dim')})")
    p.add_argument("--slots", type=int, help=f"S used to validate ({default_of('slots')})")
    p.add_argument("--no-validate", action="store_true", help="send every line as-is (to test dead-lettering)")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)
    return asyncio.run(publish_file(args.file, bootstrap, settings, validate=not args.no_validate))
