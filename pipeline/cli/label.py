"""``causalmem label``: label queued samples, interactively or from a JSONL file; --stats for agreement."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.labeling import terminal
from pipeline.labeling.answers import load_answers
from pipeline.labeling.queue import labeler_identity, principal


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--labeler",
        help="your identity, carried on every label (default: the SASL user when authenticated, else $USER); "
        "with SASL it must be the authenticated user",
    )
    p.add_argument("--answers", metavar="FILE.jsonl", help="non-interactive: answer the samples listed in this file")
    p.add_argument("--stats", action="store_true", help="agreement between labelers (Cohen's κ), counts, skip reasons")
    p.add_argument("--json", action="store_true", help="with --stats: print the result as JSON")
    p.add_argument(
        "--timeout",
        type=float,
        help="seconds to wait for a sample before stopping (default: wait on, interactive; 10 s with --answers)",
    )
    p.add_argument("--max", dest="max_samples", type=int, help="stop after N samples")
    p.add_argument(
        "--group",
        help="consumer group (default: the shared labelers' group); another group labels the same samples again, "
        "e.g. to measure agreement (the topic prefix is put in front)",
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    conn = settings.connection()
    labeler = ""
    answers = None
    if not args.stats:
        asked = args.labeler if args.labeler is not None else (None if principal(conn) else os.environ.get("USER"))
        try:
            labeler = labeler_identity(conn, asked)
        except ValueError as exc:
            print(f"causalmem label: {exc}", file=sys.stderr)
            return 2
        if not labeler:
            print("causalmem label: a labeler identity is required: pass --labeler NAME (or set USER)", file=sys.stderr)
            return 2
        if args.answers:
            answers = load_answers(args.answers)  # before connecting: a bad file fails fast
    if args.max_samples is not None and args.max_samples < 1:
        raise ValueError("--max must be at least 1")
    bootstrap = resolve_bootstrap(settings)
    if args.stats:
        return asyncio.run(terminal.show_stats(bootstrap, conn, as_json=args.json))
    group = f"{conn.topics.prefix}{args.group}" if args.group else None
    return asyncio.run(
        terminal.label(
            bootstrap, conn, labeler, answers, group=group, timeout=args.timeout, max_samples=args.max_samples
        )
    )
