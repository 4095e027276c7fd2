"""``causalmem learner``: the single writer of the policy."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from pipeline import kafka
from pipeline.allocator import pin_malloc
from pipeline.cli.common import (
    default_of,
    model_options,
    prepare_cluster,
    resolve_bootstrap,
    run_until_signal,
    settings_from,
    start_metrics,
)
from pipeline.learner.loop import Learner
from pipeline.learner.supervise import supervise
from pipeline.metrics import Metrics
from pipeline.modeltopic import unsigned_warning
from pipeline.probes import HEARTBEAT_INTERVAL_S, Probes, Progress, total
from pipeline.service import restart_process


def add_options(p: argparse.ArgumentParser) -> None:
    model_options(p)
    p.add_argument("--lr", type=float, help=f"Adam learning rate ({default_of('lr')})")
    p.add_argument("--batch-size", type=int, help=f"micro-batch size ({default_of('batch_size')})")
    p.add_argument(
        "--checkpoint-interval",
        dest="checkpoint_interval_s",
        type=float,
        help=f"seconds between checkpoints at most ({default_of('checkpoint_interval_s')})",
    )
    p.add_argument("--device", help=f"cpu, cuda, or auto ({default_of('device')})")
    p.add_argument("--seed", type=int, help="seed of the initial policy")
    p.add_argument(
        "--no-gate",
        dest="gate",
        action="store_const",
        const=False,
        help="publish every checkpoint as serving (no promotion gate; for experiments)",
    )
    # How clients serve the policy: written in each manifest, followed by CausalRetriever,
    # and what the promotion gate judges candidates under.
    p.add_argument("--serve-temperature", type=float, help=f"serving temperature T ({default_of('serve_temperature')})")
    p.add_argument(
        "--explore-rate",
        dest="serve_explore_rate",
        type=float,
        help=f"share of requests explored ({default_of('serve_explore_rate')})",
    )
    p.add_argument(
        "--explore-temperature",
        dest="serve_explore_temperature",
        type=float,
        help=f"T of explored requests ({default_of('serve_explore_temperature')})",
    )
    p.add_argument(
        "--serve-drop", choices=["dynamic", "fixed", "none"], help=f"hard drop rule ({default_of('serve_drop')})"
    )
    p.add_argument(
        "--canary-rate",
        dest="serve_canary_rate",
        type=float,
        help=f"share of requests serving the canary ({default_of('serve_canary_rate')}; 0: off)",
    )
    p.add_argument(
        "--canary-coupled",
        dest="serve_canary_coupled",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="canary requests draw both slates alike, the canary serving half of those that differ (default off)",
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)
    # Outside the embedded broker an unsigned model topic serves whatever any producer writes:
    # signing is on by default there, and publishing unsigned takes an explicit setting.
    warning = unsigned_warning("learner", settings.signing_key(), bootstrap, settings.security.security_protocol)
    if warning and not settings.checkpoint_unsigned_ok:
        print(f"{warning}\nlearner: not started; or set CAUSALMEM_CHECKPOINT_UNSIGNED_OK=true", file=sys.stderr)
        return 2
    pin_malloc()  # a step's large temporaries reused, not faulted in again (pipeline/allocator.py)

    async def main(stop: asyncio.Event) -> int:
        await prepare_cluster(bootstrap, settings, strict=False)
        probes = Probes()
        metrics = start_metrics("learner", settings, probes)
        print(
            f"learner: broker {bootstrap}, policy {settings.policy!r}, D={settings.embedding_dim}, "
            f"S={settings.slots}, lr={settings.lr}, batch={settings.batch_size}, device={settings.torch_device()}",
            flush=True,
        )
        config = settings.learner()
        if warning:
            logging.getLogger("pipeline.learner").warning(warning)
        learner = Learner(config, bootstrap, metrics)
        failures: list[BaseException] = []

        def failed(exc: BaseException) -> None:
            if not stop.is_set():  # a training task that ends while stopping is the normal end
                failures.append(exc)
                stop.set()

        task, heartbeat = await start_watched(learner, probes, metrics)
        supervise(task, failed, "training", stopping=stop.is_set)
        # After a cluster reset (an embedded broker restart) a fresh start restores from the
        # local checkpoint, republishes it and reads every input from the beginning.
        watch = kafka.ClusterWatch(
            bootstrap,
            settings,
            [t.name for t in settings.topics().all()],
            on_reset=lambda missing: restart_process("learner: the Kafka cluster lost its topics"),
            metrics=metrics,
            marker_seen=True,  # prepare_cluster made sure of it
        )
        await watch.start()
        await stop.wait()
        await watch.stop()

        if failures:
            print(f"learner: the training task failed ({failures[0]!r}); exiting to be restarted", flush=True)
        else:
            print("learner: stopping (publishing a shutdown checkpoint if the policy changed)", flush=True)
        await learner.stop(publish=not failures)
        for t in (task, heartbeat):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        return 1 if failures else 0

    return run_until_signal(main)


async def start_watched(
    learner: Learner, probes: Probes, metrics: Metrics, interval_s: float = HEARTBEAT_INTERVAL_S
) -> tuple[asyncio.Task[None], asyncio.Task[None]]:
    """Start the learner, its training task and the heartbeat that checks them; return both tasks."""
    training: list[asyncio.Task[None]] = []
    watch_learner(probes, metrics, learner, training)
    heartbeat = asyncio.create_task(probes.run(interval_s))
    await learner.start()
    task = asyncio.create_task(learner.run())
    training.append(task)
    probes.vital("training", task)
    return task, heartbeat


def watch_learner(probes: Probes, metrics: Metrics, learner: Learner, training: list[asyncio.Task[None]]) -> None:
    """A learner is ready when its training task runs, it is the elected writer, caught up and not stale.

    - training: the task running :meth:`Learner.run` has not ended (an ended one also
      fails ``/healthz``: only a restart brings it back); exported as
      ``causalmem_learner_training_alive``;
    - elected: this learner won the election and restored (a standby is alive, not
      ready); exported as ``causalmem_learner_elected``;
    - caught up and not stale: the experiences lag is at most
      :data:`pipeline.probes.MAX_LAG`, and while experiences wait the read position
      advances within :data:`pipeline.probes.STALE_AFTER_S`.
    """
    exp_topic = learner.exp_tp.topic

    def training_runs() -> str | None:
        alive = bool(training) and not training[0].done()
        metrics.training_alive.set(1.0 if alive else 0.0)
        return None if training else "training task not started yet"  # an ended one: Probes.vital

    def elected() -> str | None:
        active = learner.active.is_set()
        metrics.elected.set(1.0 if active else 0.0)
        return None if active else "not the elected writer (standby, or election and restore pending)"

    probes.check(training_runs)
    probes.check(elected)
    probes.check(
        Progress("experiences", lambda: total(metrics.consumer_lag, topic=exp_topic), lambda: learner.inbox.position)
    )
