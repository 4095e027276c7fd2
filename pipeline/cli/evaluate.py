"""``causalmem evaluate``: off-policy estimates of the serving, candidate, similarity and uniform policies as served.

``--shadow``: shadow mode's estimate of the policy's gain over the incumbent, and the
optional automatic cut-over (:mod:`pipeline.policy_evaluation.shadow`).

``--json`` writes strict JSON (RFC 8259): an estimate that does not exist (no decision the
policy could have served, a self-normalised estimator whose weights sum to 0, an empty
bootstrap) is ``null``, never the ``NaN`` that Python's :mod:`json` writes and ``jq`` or
orjson reject.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace
from typing import Any

import orjson

from pipeline.cli.answers import who_asks
from pipeline.cli.common import default_of, resolve_bootstrap, settings_from
from pipeline.config import Settings, ShadowConfig
from pipeline.policy_evaluation.evaluate import METHODS, WINDOW, evaluate_window, print_report
from pipeline.policy_evaluation.shadow import format_report, shadow_report, watch


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        help=f"the last N joined experiences (default {WINDOW})",
    )
    p.add_argument("--method", choices=[*METHODS, "all"], default="all")
    p.add_argument(
        "--json",
        action="store_true",
        help="one strict JSON object instead of a table; an estimate that cannot be computed (NaN, ±inf) is null",
    )
    p.add_argument("--embedding-dim", type=int, help=f"D ({default_of('embedding_dim')})")
    p.add_argument("--slots", type=int, help=f"S ({default_of('slots')})")
    g = p.add_argument_group("shadow mode (docs/byo-retriever.md)")
    g.add_argument(
        "--shadow", action="store_true", help="the serving policy's gain over the incumbent, with an interval"
    )
    g.add_argument("--level", type=float, default=ShadowConfig.level, help="the interval's level (default %(default)s)")
    g.add_argument(
        "--cutover-after",
        type=float,
        metavar="SECONDS",
        help="keep estimating; cut over once the lower bound has stayed above 0 this long",
    )
    g.add_argument("--watch", type=float, default=30.0, metavar="SECONDS", help="estimate every N s (default 30)")
    g.add_argument(
        "--min-decisions",
        type=int,
        default=ShadowConfig.min_decisions,
        help="exploration steps the cut-over needs (default %(default)s)",
    )
    g.add_argument("--timeout", type=float, metavar="SECONDS", help="stop watching after N s (default: never)")


def strict_json(report: dict[str, Any], *, indent: bool = False) -> str:
    """``report`` as strict JSON: NaN and ±inf become ``null`` (orjson's rule), numpy scalars numbers.

    >>> strict_json({"value": float("nan"), "low": float("-inf"), "ess": 0.0})
    '{"value":null,"low":null,"ess":0.0}'
    """
    option = orjson.OPT_SERIALIZE_NUMPY | (orjson.OPT_INDENT_2 if indent else 0)
    return orjson.dumps(report, option=option).decode()


def run_shadow(args: argparse.Namespace, settings: Settings, bootstrap: str) -> int:
    config = replace(
        settings.shadow(),
        method="snips" if args.method == "all" else args.method,
        level=args.level,
        min_decisions=args.min_decisions,
        cutover_period_s=args.cutover_after,
    )

    def show(report: dict[str, Any]) -> None:
        print(strict_json(report) if args.json else format_report(report), flush=True)

    if args.cutover_after is None:
        report = asyncio.run(shadow_report(bootstrap, settings.connection(), args.window, config))
        show(report)
    else:
        conn = settings.connection()
        by, key = who_asks(conn, None), settings.operator_key()  # the cut-over is an operator's command
        shown = watch(bootstrap, conn, args.window, config, args.watch, show, args.timeout, by=by, key=key)
        report = asyncio.run(shown)
    return 0 if report["gain"] is not None or report["mode"] == "policy" else 1


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)
    if args.shadow:
        return run_shadow(args, settings, bootstrap)
    report = asyncio.run(
        evaluate_window(
            bootstrap, settings.connection(), args.window, METHODS if args.method == "all" else (args.method,)
        )
    )
    if args.json:
        print(strict_json(report, indent=True))
    else:
        print_report(report)
    return 0 if report["decisions"] else 1
