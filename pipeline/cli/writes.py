"""``causalmem writes``: the write gate, proposed memories admitted by reward-prediction error (seed 004)."""

from __future__ import annotations

import argparse
import asyncio

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
from pipeline.metrics import Metrics
from pipeline.probes import Probes
from pipeline.writes.service import WriteGateService


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--theta",
        dest="writes_theta",
        type=float,
        help="admit a proposal when |reward - expected reward| > THETA, in reward units "
        f"({default_of('writes_theta')})",
    )
    p.add_argument(
        "--prior",
        dest="writes_prior",
        type=float,
        help=f"expected reward before any reward was seen ({default_of('writes_prior')})",
    )
    p.add_argument(
        "--rejected-retention-days",
        dest="writes_rejected_retention_days",
        type=float,
        help="how long memory-writes-rejected keeps rejected proposals for review, when it is created "
        f"({default_of('writes_rejected_retention_days')})",
    )
    p.add_argument(
        "--metrics-port",
        type=metrics_port,
        help="port of /metrics, /healthz and /readyz (default 9103, else any free port; 0: any; 'none': off)",
    )


WRITES_KEYS = ("writes_theta", "writes_prior", "writes_rejected_retention_days")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args, **{k: getattr(args, k, None) for k in WRITES_KEYS})
    config = settings.writes()  # a bad theta fails here, before anything connects
    bootstrap = resolve_bootstrap(settings)

    async def main(stop: asyncio.Event) -> int:
        await prepare_cluster(bootstrap, settings, strict=False)
        probes = Probes()
        metrics = start_metrics("writes", settings, probes)
        kept = config.connection.topics.memory_writes_rejected.name
        print(
            f"writes: broker {bootstrap}, theta {config.theta:g}, "
            f"admitted to {config.lifecycle_topic}, rejected kept on {kept}",
            flush=True,
        )
        service = WriteGateService(config, bootstrap, metrics)
        watch_writes(probes, metrics, service)
        return await serve_stage(service, probes, stop, "writes", "judging")

    return run_until_signal(main)


def watch_writes(probes: Probes, metrics: Metrics, service: WriteGateService) -> None:
    """Ready: owns input partitions, caught up within a bound and not stale (like the evaluator)."""
    watch_stage(
        probes,
        metrics,
        service,
        "no memory-writes partitions assigned (rebalance pending, or more replicas than partitions)",
    )
