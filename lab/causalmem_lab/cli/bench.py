"""``causalmem bench throughput|learning|soak|evaluator|gate|coldstart|scale|freshness|promise|serving|poisoning``: the
benchmarks, one subcommand each with its own flags.

Each benchmark is a module of :mod:`causalmem_lab.bench` with ``add_options(parser)`` and
``main(args)``; only the chosen one is imported (they pull in torch), and only when its
subcommand is parsed or its help shown.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

from causalmem_lab.bench import BENCHES
from pipeline.cli.common import common_parser, settings_from

HELP = (
    "benchmarks: throughput, learning, soak, evaluator, gate, coldstart, scale, freshness, promise, serving, poisoning"
)

BENCH_HELP = {
    "throughput": "raw aiokafka vs the pipeline end to end; the learner's update vs a bare torch step",
    "learning": "what each policy learns on a scenario with known ground truth",
    "soak": "a steady input rate with lag and memory sampled; then the maximum sustainable rate",
    "evaluator": "evaluations/s and tokens/s of the evaluator's LM scoring (attribution rates, batch sizes)",
    "gate": "the promotion gate's calibration on the simulator: coverage, false and missed promotions",
    "coldstart": "learner steps a new helpful memory needs to enter the served top-k: kNN rows vs fresh rows",
    "scale": "learner step rate and RSS, policy+faiss vs plain faiss latency at S = 10^3, 10^5, 10^6",
    "freshness": "seconds from a pair's publication to a serving checkpoint covering it, loaded by a client",
    "promise": "on real data: whether a version the gate served was ever below similarity-only by more than ε",
    "guardrail": "on real data: decisions until the guardrail rolls back a served version below similarity-only",
    "serving": "latency a request pays for the product: retriever, LangChain adapter, publishing with the broker away",
    "poisoning": "a principal lying at 6-25% of the traffic: honest clients' harmful reads; is the liar flagged",
}


class _BenchParser(argparse.ArgumentParser):
    """A bench's parser whose options come from its module, loaded on first use."""

    def __init__(self, *args: Any, module: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module = module

    def _load(self) -> None:
        if self._module:
            module, self._module = self._module, ""
            importlib.import_module(module).add_options(self)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._load()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._load()
        return super().format_help()


def add_options(p: argparse.ArgumentParser) -> None:
    # Any: typeshed ties the parents' type to parser_class
    sub: Any = p.add_subparsers(dest="which", metavar="BENCH", required=True, parser_class=_BenchParser)
    # The common flags are accepted before or after the bench's name. After it they have no
    # defaults, so that a flag given only before it is not reset by the bench's own parser.
    common = common_parser()
    for action in common._actions:
        action.default = argparse.SUPPRESS
    for name in BENCHES:
        sub.add_parser(
            name, help=BENCH_HELP[name], description=BENCH_HELP[name], parents=[common], module=BENCHES[name]
        )


def run(args: argparse.Namespace) -> int:
    args.settings = settings_from(args)
    module = importlib.import_module(BENCHES[args.which])
    return int(module.main(args) or 0)
