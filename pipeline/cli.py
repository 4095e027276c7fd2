"""``causalmem``: the command line (DESIGN §6).

Every verb takes ``--bootstrap HOST:PORT``; without it the verb starts or reuses the
embedded broker. Configuration comes from flags, then ``CAUSALMEM_*`` environment
variables, then defaults (see ``docs/configuration.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from pipeline.config import Settings

log = logging.getLogger("causalmem")

VERBS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def verb(name: str, help_text: str) -> Callable:
    def register(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        VERBS[name] = (help_text, getattr(func, "_options", lambda p: None), func)
        return func

    return register


def options(add: Callable[[argparse.ArgumentParser], None]) -> Callable:
    def wrap(func: Callable) -> Callable:
        func._options = add  # type: ignore[attr-defined]
        return func

    return wrap


def common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common")
    g.add_argument("--bootstrap", help="Kafka bootstrap HOST:PORT (default: start or reuse the embedded broker)")
    g.add_argument("--prefix", dest="topic_prefix", help="prefix for every topic name")
    g.add_argument("--partitions", type=int, help="partitions of the co-partitioned input topics (default 8)")
    g.add_argument("--policy", help="policy name (default 'default')")
    g.add_argument("--state-dir", help="local state directory (default ~/.causalmem)")
    g.add_argument("--log-level", default="info", help="debug, info, warning, error")
    g.add_argument(
        "--security-protocol",
        dest="kafka_security_protocol",
        help="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (password: CAUSALMEM_KAFKA_SASL_PASSWORD)",
    )
    g.add_argument("--sasl-mechanism", dest="kafka_sasl_mechanism")
    g.add_argument("--sasl-username", dest="kafka_sasl_username")
    g.add_argument("--ssl-cafile", dest="kafka_ssl_cafile")
    return p


def model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--embedding-dim", type=int, help="D, the query embedding length (default 384)")
    p.add_argument("--slots", type=int, help="S, memory slots of the policy (default 1024)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this loopback port (0: any)")


SETTING_KEYS = (
    "bootstrap",
    "topic_prefix",
    "partitions",
    "policy",
    "state_dir",
    "embedding_dim",
    "slots",
    "metrics_port",
    "kafka_security_protocol",
    "kafka_sasl_mechanism",
    "kafka_sasl_username",
    "kafka_ssl_cafile",
    "lr",
    "batch_size",
    "checkpoint_interval_s",
    "device",
    "seed",
    "join_window_s",
    "al_threshold",
    "al_uncertainty_budget",
    "drift_page_hinkley",
    "drift_min_pairs",
    "gate",
)


def settings_from(args: argparse.Namespace, **extra: Any) -> Settings:
    overrides = {k: getattr(args, k) for k in SETTING_KEYS if getattr(args, k, None) is not None}
    overrides.update({k: v for k, v in extra.items() if v is not None})
    return Settings.from_env(**overrides)


def resolve_bootstrap(settings: Settings) -> str:
    if settings.bootstrap:
        return settings.bootstrap
    from pipeline.broker import ensure_broker

    return ensure_broker(settings.state_path())


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("aiokafka", "faust", "mode", "kafka", "faiss", "faiss.loader", "bm25s", "matplotlib"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def run_until_signal(main: Callable[[asyncio.Event], Any]) -> int:
    """Run ``main(stop_event)`` with SIGINT/SIGTERM setting the event (graceful stop)."""

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        result = await main(stop)
        return int(result or 0)

    return asyncio.run(runner())


# --------------------------------------------------------------------------- verbs


def _broker_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=None, help="loopback port (default 19092)")
    p.add_argument("--stop", action="store_true", help="stop the shared embedded broker started by another verb")


@verb("broker", "run the embedded (memory-only) Tansu broker in the foreground")
@options(_broker_opts)
def cmd_broker(args: argparse.Namespace) -> int:
    from pipeline.broker import DEFAULT_PORT, run_foreground, stop_recorded_broker

    settings = settings_from(args)
    if args.stop:
        print(stop_recorded_broker(settings.state_path()))
        return 0
    return run_foreground(settings.state_path(), args.port or DEFAULT_PORT)


@verb("init-topics", "create the product's topics (co-partitioned inputs, 1-partition model topic)")
def cmd_init_topics(args: argparse.Namespace) -> int:
    from pipeline import kafka

    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)

    async def main() -> int:
        await kafka.wait_for_broker(bootstrap, settings)
        result = await kafka.create_topics(bootstrap, settings)
        bad = 0
        for spec in settings.topics().all():
            state = result.get(spec.name, "?")
            bad += state not in ("created", "exists", "repaired")
            print(f"{spec.name:<40} {spec.partitions:>3} partitions  {state}")
        return 1 if bad else 0

    return asyncio.run(main())


def _worker_opts(p: argparse.ArgumentParser) -> None:
    model_options(p)
    p.add_argument("--web-port", type=int, help="faust web port on loopback (default: web server off)")
    p.add_argument("--join-window", dest="join_window_s", type=float, help="join window in event-time seconds")
    p.add_argument("--al-threshold", type=float, help="utility below which an experience is an error candidate")
    p.add_argument("--al-uncertainty-budget", type=float, help="max fraction of experiences queued as uncertain")
    p.add_argument(
        "--page-hinkley",
        dest="drift_page_hinkley",
        action="store_const",
        const=True,
        help="also run the Page-Hinkley drift detector",
    )
    p.add_argument("--drift-min-pairs", type=int, help="minimum (U_query, rating) pairs before the trigger acts")


@verb("worker", "run a worker: join, active learning, drift (faust)")
@options(_worker_opts)
def cmd_worker(args: argparse.Namespace) -> int:
    from pipeline import kafka
    from pipeline.metrics import Metrics, serve
    from pipeline.worker import Worker

    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)
    asyncio.run(kafka.wait_for_broker(bootstrap, settings))
    created = asyncio.run(kafka.create_topics(bootstrap, settings))
    wrong = {k: v for k, v in created.items() if v not in ("created", "exists", "repaired")}
    if wrong:
        print(f"topic problems: {wrong}", file=sys.stderr)
        return 2
    metrics = Metrics(role="worker")
    port = serve(metrics, settings.metrics_port, settings.metrics_host)
    if port is not None:
        print(f"metrics: http://{settings.metrics_host}:{port}/metrics", flush=True)
    print(
        f"worker: broker {bootstrap}, D={settings.embedding_dim}, S={settings.slots}, {settings.partitions} partitions",
        flush=True,
    )
    worker = Worker(settings, bootstrap, metrics, web_port=args.web_port)
    worker.faust_worker(loglevel=args.log_level).execute_from_commandline()
    return 0


def _learner_opts(p: argparse.ArgumentParser) -> None:
    model_options(p)
    p.add_argument("--lr", type=float, help="Adam learning rate (default 1e-3)")
    p.add_argument("--batch-size", type=int, help="micro-batch size (default 64)")
    p.add_argument(
        "--checkpoint-interval",
        dest="checkpoint_interval_s",
        type=float,
        help="seconds between checkpoints at most (default 10)",
    )
    p.add_argument("--device", help="cpu, cuda, or auto (default)")
    p.add_argument("--seed", type=int, help="seed of the initial policy")
    p.add_argument(
        "--no-gate",
        dest="gate",
        action="store_const",
        const=False,
        help="publish every checkpoint as serving (no promotion gate; for experiments)",
    )


@verb("learner", "run the learner: the single writer of the policy")
@options(_learner_opts)
def cmd_learner(args: argparse.Namespace) -> int:
    from pipeline import kafka
    from pipeline.learner import Learner
    from pipeline.metrics import Metrics, serve
    from pipeline.procs import restart_process

    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)

    async def main(stop: asyncio.Event) -> int:
        await kafka.wait_for_broker(bootstrap, settings)
        await kafka.create_topics(bootstrap, settings)
        metrics = Metrics(role="learner")
        port = serve(metrics, settings.metrics_port, settings.metrics_host)
        if port is not None:
            print(f"metrics: http://{settings.metrics_host}:{port}/metrics", flush=True)
        print(
            f"learner: broker {bootstrap}, policy {settings.policy!r}, D={settings.embedding_dim}, "
            f"S={settings.slots}, lr={settings.lr}, batch={settings.batch_size}, device={settings.torch_device()}",
            flush=True,
        )
        learner = Learner(settings, bootstrap, metrics)
        await learner.start()
        task = asyncio.create_task(learner.run())
        # After a cluster reset (an embedded broker restart) a fresh start restores from the
        # local checkpoint, republishes it and reads every input from the beginning.
        watch = kafka.ClusterWatch(
            bootstrap,
            settings,
            [t.name for t in settings.topics().all()],
            on_reset=lambda missing: restart_process("learner: the Kafka cluster lost its topics"),
            metrics=metrics,
            marker_seen=True,  # create_topics above made sure of it
        )
        await watch.start()
        await stop.wait()
        await watch.stop()

        print("learner: stopping (publishing a shutdown checkpoint if the policy changed)", flush=True)
        await learner.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return 0

    return run_until_signal(main)


def _publish_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="JSONL file: one RetrievalEvent, LLMFeedback or HumanLabel per line")
    p.add_argument("--embedding-dim", type=int, help="D used to validate (default 384)")
    p.add_argument("--slots", type=int, help="S used to validate (default 1024)")
    p.add_argument("--no-validate", action="store_true", help="send every line as-is (to test dead-lettering)")


@verb("publish", "publish events from a JSONL file, reporting what was rejected and why")
@options(_publish_opts)
def cmd_publish(args: argparse.Namespace) -> int:
    from pipeline.publish_file import publish_file

    settings = settings_from(args)
    bootstrap = resolve_bootstrap(settings)
    return asyncio.run(publish_file(args.file, bootstrap, settings, validate=not args.no_validate))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="causalmem",
        description="Causal Memory Policy: online learning of a retrieval intervention policy from Kafka traffic.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    common = common_parser()
    for name, (help_text, add_options, _) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        add_options(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    _register_late_verbs()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verb:
        parser.print_help()
        return 2
    setup_logging(args.log_level)
    try:
        return VERBS[args.verb][2](args)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError) as exc:
        print(f"causalmem {args.verb}: {exc}", file=sys.stderr)
        return 1


def _register_late_verbs() -> None:
    """Verbs defined in their own modules register themselves on import."""
    import importlib

    for module in VERB_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a missing dependency inside the module is a real error
                raise


# Modules that define verbs with @verb (imported lazily: torch and faust are slow to import).
VERB_MODULES = (
    "pipeline.demo",
    "pipeline.label_cli",
    "pipeline.status",
    "pipeline.evaluate",
    "pipeline.rollback",
    "pipeline.bench",
)


if __name__ == "__main__":
    # Run through the imported module, not __main__: the verb modules register on
    # ``pipeline.cli.VERBS``, which under ``python -m pipeline.cli`` is another module object.
    from pipeline import cli as _cli

    sys.exit(_cli.main())
