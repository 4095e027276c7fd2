"""What every verb shares: the common flags, settings from flags and environment, the broker, logging, signals."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.config import Settings

if TYPE_CHECKING:  # imported when a verb starts its metrics (prometheus_client is not light)
    from pipeline.metrics import Metrics
    from pipeline.probes import Probes


def default_of(name: str) -> str:
    """``"default X"`` for a flag's help: the setting's one declared default (pipeline/config.py).

    >>> default_of("partitions"), default_of("serve_temperature")
    ('default 8', 'default 0.05')
    """
    return f"default {getattr(Settings, name)}"


def common_parser() -> argparse.ArgumentParser:
    """The flags every verb takes (a parent parser): broker, topics, policy, state, logging, security."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common")
    g.add_argument("--bootstrap", help="Kafka bootstrap HOST:PORT (default: start or reuse the embedded broker)")
    g.add_argument("--prefix", dest="topic_prefix", help="prefix for every topic name")
    g.add_argument(
        "--partitions", type=int, help=f"partitions of the co-partitioned input topics ({default_of('partitions')})"
    )
    g.add_argument("--policy", help=f"policy name (default '{Settings.policy}')")
    g.add_argument("--state-dir", help=f"local state directory ({default_of('state_dir')})")
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


def metrics_port(text: str) -> int:
    """``--metrics-port``: a port number, or ``none``/``off`` (-1: serve nothing).

    >>> metrics_port("9100"), metrics_port("none"), metrics_port("-1")
    (9100, -1, -1)
    """
    if text.strip().lower() in ("none", "off"):
        return -1
    return int(text)


def model_options(p: argparse.ArgumentParser) -> None:
    """The model's shape and the metrics port, for the verbs that run a policy (worker, learner)."""
    p.add_argument("--embedding-dim", type=int, help=f"D, the query embedding length ({default_of('embedding_dim')})")
    p.add_argument("--slots", type=int, help=f"S, memory slots of the policy ({default_of('slots')})")
    p.add_argument(
        "--metrics-port",
        type=metrics_port,
        help="port of /metrics, /healthz and /readyz (default: worker 9100, learner 9101, else any free port; "
        "0: any free port; -1 or 'none': off)",
    )


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
    "serve_temperature",
    "serve_explore_rate",
    "serve_explore_temperature",
    "serve_drop",
    "serve_canary_rate",
    "serve_canary_coupled",
)


def settings_from(args: argparse.Namespace, **extra: Any) -> Settings:
    """Settings from defaults, then ``CAUSALMEM_*`` variables, then the flags given (and ``extra``)."""
    overrides = {k: getattr(args, k) for k in SETTING_KEYS if getattr(args, k, None) is not None}
    overrides.update({k: v for k, v in extra.items() if v is not None})
    return Settings.from_env(**overrides)


def resolve_bootstrap(settings: Settings) -> str:
    """``--bootstrap`` when given, else the embedded broker (started, or reused when running)."""
    if settings.bootstrap:
        return settings.bootstrap
    from pipeline.broker import ensure_broker

    return ensure_broker(settings.state_path())


def setup_logging(level: str) -> None:
    """Log to stderr at ``level``; the Kafka and stream libraries only from warnings up."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    floor = max(logging.WARNING, logging.getLogger().level)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(floor)
    # Some libraries set their own logger's level when first imported (bm25s sets DEBUG),
    # after this ran: a filter on the handlers holds them to the floor whatever they do.
    for handler in logging.getLogger().handlers:
        handler.addFilter(_QuietLibraries(floor))


NOISY_LOGGERS = ("aiokafka", "faust", "mode", "kafka", "faiss", "bm25s", "matplotlib")


class _QuietLibraries(logging.Filter):
    """Drops records below ``floor`` from the libraries in :data:`NOISY_LOGGERS`."""

    def __init__(self, floor: int) -> None:
        super().__init__()
        self.floor = floor

    def filter(self, record: logging.LogRecord) -> bool:
        top = record.name.split(".", 1)[0]
        return record.levelno >= self.floor or top not in NOISY_LOGGERS


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


async def prepare_cluster(bootstrap: str, settings: Settings, strict: bool = True) -> None:
    """Wait for the broker and create (or repair) the product's topics.

    A topic problem (e.g. a wrong partition count that cannot be repaired) raises when
    ``strict``; otherwise it is logged. The worker is strict: its join is partition-local
    and wrong counts break it. The learner is not: it reads one-partition topics only, and
    after a cluster reset it must come up to republish its checkpoint even while the
    broker's auto-created topics are still being repaired.
    """
    from pipeline import kafka

    await kafka.wait_for_broker(bootstrap, settings)
    created = await kafka.create_topics(bootstrap, settings)
    wrong = {k: v for k, v in created.items() if v not in ("created", "exists", "repaired")}
    if wrong and strict:
        raise RuntimeError(f"topic problems: {wrong}")
    if wrong:
        logging.getLogger("causalmem").warning("topic problems (continuing): %s", wrong)


# Default metrics ports per role (docs/operations.md): distinct, so that a worker and a
# learner on one machine do not collide; a taken default falls back to any free port.
DEFAULT_METRICS_PORTS = {"worker": 9100, "learner": 9101, "evaluator": 9102, "writes": 9103}


def start_metrics(role: str, settings: Settings, probes: Probes | None = None) -> Metrics:
    """The process's Prometheus metrics, served with ``/healthz`` and ``/readyz`` (:mod:`pipeline.probes`).

    ``metrics_port`` unset: the role's default port, or any free port when it is taken;
    0: any free port; negative: nothing served. An explicit port that is taken is an
    error (exit 1): a scrape configuration names it. With ``probes``, each heartbeat sets
    ``causalmem_ready`` and ``causalmem_heartbeat_timestamp_seconds``.
    """
    from pipeline.metrics import Metrics, serve
    from pipeline.probes import Probes

    metrics = Metrics(role=role)
    probes = probes if probes is not None else Probes()

    def on_beat(problems: list[str]) -> None:
        metrics.ready.set(0.0 if problems else 1.0)
        metrics.heartbeat.set(time.time())

    probes.on_beat = on_beat
    port, host = settings.metrics_port, settings.metrics_host
    if port is not None and port < 0:
        print("metrics: off (--metrics-port none)", flush=True)
        return metrics
    wanted = DEFAULT_METRICS_PORTS.get(role, 0) if port is None else port
    try:
        bound = serve(metrics, wanted, host, probes)
    except OSError as exc:
        if port is not None:
            raise SystemExit(f"metrics: cannot serve on {host}:{port}: {exc.strerror or exc}") from exc
        bound = serve(metrics, 0, host, probes)
        print(f"metrics: default port {wanted} is taken; using a free port", flush=True)
    print(f"metrics: http://{host}:{bound}/metrics (alive: /healthz, ready: /readyz)", flush=True)
    return metrics
