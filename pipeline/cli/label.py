"""``causalmem label``: label queued samples, interactively or from a JSONL file; --stats for agreement."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import orjson

from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.labeling.terminal import FileAnswer, from_file, interactive, load_answers, render_stats, stats


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--labeler", help="your identity, carried on every label (default: $USER)")
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
    from rich.console import Console

    from pipeline import kafka
    from pipeline.labeling.queue import LabelQueue

    settings = settings_from(args)
    console = Console(highlight=False)
    labeler = ""
    answers: dict[str, FileAnswer] = {}
    if not args.stats:
        labeler = (args.labeler if args.labeler is not None else os.environ.get("USER", "")).strip()
        if not labeler:
            print("causalmem label: a labeler identity is required: pass --labeler NAME (or set USER)", file=sys.stderr)
            return 2
        if args.answers:
            answers = load_answers(args.answers)  # before connecting: a bad file fails fast
    if args.max_samples is not None and args.max_samples < 1:
        raise ValueError("--max must be at least 1")
    bootstrap = resolve_bootstrap(settings)

    async def main() -> int:
        await kafka.wait_for_broker(bootstrap, settings)
        # Subscribing to a missing topic would auto-create it with the wrong partition count.
        await kafka.create_topics(bootstrap, settings)
        if args.stats:
            result = await stats(bootstrap, settings)
            if args.json:
                sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
            else:
                console.print(render_stats(result))
            return 0
        group = f"{settings.topic_prefix}{args.group}" if args.group else None
        queue = LabelQueue(bootstrap, settings, labeler, group=group)
        console.print(f"labeler {labeler}: joining the queue {queue.group} …", markup=False)
        await queue.start()
        try:
            if args.answers:
                timeout = args.timeout if args.timeout is not None else 10.0
                return await from_file(queue, console, answers, timeout, args.max_samples)
            return await interactive(queue, console, args.timeout, args.max_samples)
        finally:
            await queue.stop()

    return asyncio.run(main())
