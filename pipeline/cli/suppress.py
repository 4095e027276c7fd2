"""``causalmem suppress`` / ``causalmem unsuppress``: an operator's "do not use" for memories, and its undo."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.labeling.queue import labeler_identity, principal
from pipeline.policy_evaluation.suppress import change_suppression


def add_options(p: argparse.ArgumentParser) -> None:
    # Not ``dest="slots"``: that is the setting S (Settings.slots), which settings_from() reads from the
    # namespace; the memories a command names are another thing and must not overwrite it.
    p.add_argument(
        "--slots",
        dest="memory_slots",
        metavar="SLOT",
        type=int,
        nargs="+",
        required=True,
        help="the memories (slots); at most suppress_max_slots",
    )
    p.add_argument("--reason", default="", help="why: recorded in the audit trail (checkpoint metrics, status)")
    p.add_argument(
        "--by", default=None, help="who asks (the audit trail); the SASL user when authenticated, else $USER"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the learner's checkpoint")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    conn = settings.connection()
    asked = args.by if args.by is not None else (None if principal(conn) else os.environ.get("USER"))
    try:
        by = labeler_identity(conn, asked)  # an authenticated operator cannot name someone else
    except ValueError as exc:
        print(f"causalmem {args.verb}: {exc}", file=sys.stderr)
        return 2
    if not by:
        print(f"causalmem {args.verb}: who asks is required: pass --by NAME (or set USER)", file=sys.stderr)
        return 2
    bootstrap = resolve_bootstrap(settings)
    return asyncio.run(
        change_suppression(
            bootstrap,
            conn,
            args.verb,
            args.memory_slots,
            by=by,
            reason=args.reason,
            timeout=args.timeout,
            max_slots=settings.suppress_max_slots,
            per_hour=settings.suppress_checkpoints_per_hour,
        )
    )
