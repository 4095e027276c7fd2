"""Running a batch stage (the evaluator, the write gate) as a process: probes, the loop, a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from pipeline.batchstage import BatchStage
from pipeline.metrics import Metrics
from pipeline.probes import Probes, Progress, total


def watch_stage(probes: Probes, metrics: Metrics, stage: BatchStage, unassigned: str) -> None:
    """Ready: owns input partitions (else ``unassigned`` says why not), caught up within a bound, not stale."""

    def owns_partitions() -> str | None:
        return None if total(stage.partitions_owned) > 0 else unassigned

    probes.check(owns_partitions)
    topic = stage.input_topic
    probes.check(
        Progress(stage.name, lambda: total(metrics.consumer_lag, topic=topic), lambda: total(metrics.events_in))
    )


async def serve_stage(stage: BatchStage, probes: Probes, stop: asyncio.Event, verb: str, work: str) -> int:
    """Start ``stage``, run it until ``stop`` is set or its loop dies (exit 1: the probes and the
    exit status tell), then stop it. ``work`` names the loop in the probes and in the error."""
    heartbeat = asyncio.create_task(probes.run())
    await stage.start()
    task = asyncio.create_task(stage.run())
    probes.vital(work, task)
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    failed = task.done() and not stop.is_set()  # run() never returns on its own: it crashed
    if failed:
        print(f"causalmem {verb}: the {work} task ended: {task.exception()!r}", file=sys.stderr)
    print(f"{stage.name}: stopping", flush=True)
    await stage.stop()
    for t in (task, heartbeat, stopped):
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    return 1 if failed else 0
