"""``causalmem``: the command line.

Every verb takes ``--bootstrap HOST:PORT``; without it the verb starts or reuses the
embedded broker. Configuration comes from flags, then ``CAUSALMEM_*`` environment
variables, then defaults (see ``docs/configuration.md``).

Each verb is a module of this package with ``add_options(parser)`` and ``run(args)``.
The table below names them; only the chosen verb's module is imported (torch and faust
are slow to import), and nothing outside this package imports the CLI.

Other distributions add verbs through the ``causalmem.verbs`` entry-point group: the lab
(``lab/`` in the source checkout, not in this package's wheel) adds ``demo`` and ``bench``.
A plugin verb's module also has ``HELP``, its one-line help; it is imported only when
``causalmem`` lists or runs its verbs, never by ``import pipeline``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from pipeline.cli.common import common_parser, setup_logging
from pipeline.extras import MissingExtra, require

# verb -> (module under pipeline.cli, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "broker": ("broker", "run the embedded (memory-only) Tansu broker in the foreground"),
    "init-topics": ("init_topics", "create the product's topics (co-partitioned inputs, 1-partition model topic)"),
    "worker": ("worker", "run a worker: join, active learning, drift (faust)"),
    "learner": ("learner", "run the learner: the single writer of the policy"),
    "evaluator": ("evaluator", "score retrieval events with a local causal LM and publish LLM feedback"),
    "writes": ("writes", "the write gate: admit proposed memories by reward-prediction error (success/pitfall, δ)"),
    "publish": ("publish", "publish events from a JSONL file, reporting what was rejected and why"),
    "label": ("label", "label queued samples, interactively or from a JSONL file; --stats for agreement"),
    "status": ("status", "operator view: checkpoint version and age, rates, health, queue depth, dead letters"),
    "evaluate": (
        "evaluate",
        "off-policy estimates (IPS, SNIPS, DR) of the serving, candidate, similarity and uniform policies",
    ),
    "rollback": ("rollback", "serve an earlier checkpoint again (republished under a new version, reason rollback)"),
    "suppress": ("suppress", "operator: 'do not use' for memories, served at once (capped, rate-limited, audited)"),
    "unsuppress": ("suppress", "operator: undo suppress (the memories get neutral rows again), served at once"),
    "quarantine": ("quarantine", "operator: learn nothing more from a principal (its feedback weighs 0), audited"),
    "unquarantine": ("quarantine", "operator: undo quarantine (the principal's feedback counts again)"),
    "ui": ("ui", "the web app: label queued samples, agreement, each memory's record, health"),
    "keygen": ("keygen", "an Ed25519 key pair: the learner signs checkpoints, readers verify them"),
}


# Optional packages a verb needs, checked before its module is imported: (module, extra).
NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "label": (("rich", "cli"),),
    "status": (("rich", "cli"),),
    "evaluate": (("rich", "cli"),),
    "evaluator": (("transformers", "lm"), ("gguf", "lm")),
    "ui": tuple((m, "ui") for m in ("starlette", "jinja2", "uvicorn", "python_multipart", "itsdangerous")),
}
# A service that cannot run without its extra exits 2, as for a missing model (other verbs: 1).
MISSING_EXTRA_EXIT = {"evaluator": 2}

PLUGIN_GROUP = "causalmem.verbs"
# Verbs the source checkout's lab adds; named here only to say where they come from when absent.
LAB_VERBS = ("demo", "bench")
LAB_MISSING = "'{verb}' comes with the lab, which is not installed: from the source checkout, pip install -e ./lab"
PLUGIN_NEEDS = "this needs {module}, which the lab requires: from the source checkout, pip install -e ./lab"


def plugin_verbs() -> dict[str, str]:
    """Verb → module of the installed plugins (entry points of :data:`PLUGIN_GROUP`); built-in verbs win."""
    return {ep.name: ep.value for ep in entry_points(group=PLUGIN_GROUP) if ep.name not in VERBS}


def _chosen_verb(argv: Sequence[str]) -> str | None:
    """The first argument that names a verb (flags before it are only -h/--help)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in VERBS or arg in plugin_verbs() else None
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """Every verb is listed; only the chosen one's options are loaded."""
    parser = argparse.ArgumentParser(
        prog="causalmem",
        description="Causal Memory Policy: online learning of a retrieval intervention policy from Kafka traffic.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    common = common_parser()
    chosen = _chosen_verb(argv)
    helps = {name: help_text for name, (_module, help_text) in VERBS.items()}
    for name in plugin_verbs():
        # A plugin's help needs its module: imported only to list the verbs, not to run another one.
        helps[name] = str(getattr(verb_module(name), "HELP", "")) if chosen is None else ""
    for name, help_text in helps.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        if name == chosen:
            verb_module(name).add_options(p)
    return parser


def verb_module(name: str) -> Any:
    """Import a verb's module; a missing optional package raises :class:`MissingExtra` naming its extra."""
    for module, extra in NEEDS.get(name, ()):
        require(module, extra)
    if name in VERBS:
        return importlib.import_module(f"pipeline.cli.{VERBS[name][0]}")
    try:
        return importlib.import_module(plugin_verbs()[name])
    except ModuleNotFoundError as exc:
        raise MissingExtra(PLUGIN_NEEDS.format(module=(exc.name or "?").split(".")[0])) from exc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    if first in LAB_VERBS and first not in plugin_verbs():
        print(f"causalmem: {LAB_MISSING.format(verb=first)}", file=sys.stderr)
        return 2
    try:
        parser = build_parser(argv)
    except MissingExtra as exc:
        chosen = _chosen_verb(argv)
        print(f"causalmem {chosen}: {exc}", file=sys.stderr)
        return MISSING_EXTRA_EXIT.get(chosen or "", 1)
    args = parser.parse_args(argv)
    if not args.verb:
        parser.print_help()
        return 2
    setup_logging(args.log_level)
    try:
        return int(verb_module(args.verb).run(args))
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        # A plugin's own dependency, imported when its verb runs: one line, as for an extra.
        if args.verb not in plugin_verbs() or not exc.name:
            raise
        print(f"causalmem {args.verb}: {PLUGIN_NEEDS.format(module=exc.name.split('.')[0])}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError) as exc:
        print(f"causalmem {args.verb}: {exc}", file=sys.stderr)
        return 1
