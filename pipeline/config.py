"""Configuration: one dataclass, filled from defaults, ``CAUSALMEM_*`` variables and flags.

Configuration is passed into every component; nothing reads the environment deep inside.

>>> s = Settings.from_env({"CAUSALMEM_SLOTS": "64", "CAUSALMEM_EMBEDDING_DIM": "16"})
>>> (s.slots, s.embedding_dim, s.partitions)
(64, 16, 8)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.serving import ServingParams
from topics.fields import Limits
from topics.names import Topics

if TYPE_CHECKING:  # models.trainer imports torch: only Settings.trainer() loads it
    from models.trainer import TrainerConfig


@dataclass
class KafkaSecurity:
    """SASL/TLS settings passed through to every Kafka client (aiokafka and faust).

    Secrets are never logged: :meth:`redacted` is what the processes print.
    """

    security_protocol: str = "PLAINTEXT"  # PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL
    sasl_mechanism: str | None = None  # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)  # never printed

    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def redacted(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out.get("sasl_password"):
            out["sasl_password"] = "***"
        return out


# -- component configurations ----------------------------------------------------------
# Each component takes its own small configuration; Settings builds them (see below).


@dataclass(frozen=True)
class Connection:
    """What every Kafka client of the product needs: topic names, message limits, SASL/TLS, the policy.

    The client library (publisher, subscriber, retriever) takes only this.
    """

    topics: Topics
    limits: Limits
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    policy: str = "default"

    @staticmethod
    def of(source: Connection | Settings | None) -> Connection:
        """A Connection from a Connection, a whole Settings (its part), or None (the defaults).

        >>> Connection.of(Settings(topic_prefix="t-", policy="p")).topics.control.name, Connection.of(None).policy
        ('t-control', 'default')
        """
        if isinstance(source, Connection):
            return source
        return (source or Settings()).connection()


# (client)
# The client library (publisher, subscriber, retriever) needs only the Connection above.


# (learner)


@dataclass(frozen=True)
class GateConfig:
    """The promotion gate's rule (pipeline/learner/gate.py, docs/learning.md)."""

    window: int = 2000  # the last logged experiences a candidate is judged on
    epsilon: float = 0.02  # promote when the gain's lower bound is above −epsilon
    min_ess: float = 50.0  # effective sample size of the importance weights a decision needs
    method: str = "dr-pi"  # dr-pi | dr | pi | snips | ips (models/slate.py)


@dataclass(frozen=True)
class LearnerConfig:
    """The learner's configuration (pipeline/learner/); ``Settings.learner()`` builds it."""

    connection: Connection
    trainer: TrainerConfig
    gate: GateConfig | None = field(default_factory=GateConfig)  # None: every checkpoint serves at once
    serving: ServingParams = field(default_factory=ServingParams)  # written in each manifest; the gate judges by it
    state_dir: Path = Path("~/.causalmem")  # the learner keeps its local checkpoints below it
    batch_size: int = 64
    reorder_s: float = 0.0  # >0: apply in event-time order, after this much reordering slack
    checkpoint_interval_s: float = 10.0
    keep_versions: int = 3  # checkpoint versions left on the model topic
    replay_window_s: float = 7 * 86400.0  # event time of experience kept for warm-ups and the gate
    replay_max: int = 50_000  # experiences kept at most
    warmup_epochs: int = 2
    warmup_half_life_s: float = 86400.0
    torch_threads: int = 1

    @property
    def policy(self) -> str:
        return self.connection.policy


# (worker)


@dataclass(frozen=True)
class ActiveLearningConfig:
    """When a joined step becomes an active-learning sample (docs/architecture.md, "Stream stages")."""

    threshold: float = -0.3  # utility below which a step is an error candidate
    uncertainty_budget: float = 0.0  # at most this fraction of joined steps as uncertain; 0: off
    uncertainty_margin: float = 0.05  # top-2 first-draw probability margin below which a step is uncertain


@dataclass(frozen=True)
class JoinConfig:
    """The batched join: its clients, its window of event time and its batch size."""

    connection: Connection
    group_id: str = "causalmem-join"
    window_s: float = 600.0
    batch: int = 2000
    active_learning: ActiveLearningConfig = field(default_factory=ActiveLearningConfig)
    max_future_skew_s: float = 300.0  # inputs with ts beyond wall time + this are dead-lettered (ts_in_future)
    max_outcomes_bytes: int = 900 * 1024  # each outcomes message stays under this (Kafka's default limit is 1 MB)


@dataclass(frozen=True)
class DriftConfig:
    """The drift stage: the correlation window and the reset trigger."""

    window_days: float = 7.0
    drop: float = 0.15
    min_pairs: int = 50
    cooldown_s: float = 86400.0
    page_hinkley: bool = False
    reset: bool = True  # False: measure and report, never reset


WORKER_STORES = ("rocksdb", "memory")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process: the faust app, its tables' bounds, the join and the drift stage."""

    connection: Connection
    join: JoinConfig
    drift: DriftConfig = field(default_factory=DriftConfig)
    app_id: str = "causalmem-worker"
    state_dir: Path = Path("~/.causalmem/faust")  # faust's data directory (tables under tables/<app_id>/)
    store: str = "rocksdb"  # rocksdb: tables on local disk, kept across restarts | memory: rebuilt on every start
    label_window_s: float = 86400.0  # event time a verdict/rating can wait for its query
    query_state_max: int = 500_000  # per-query table entries a worker keeps at most, per table
    al_pending_max: int = 20_000  # error candidates waiting for a verdict, at most, per table
    query_state_max_bytes: int = 128 * 1024 * 1024  # encoded bytes of all per-query state but the samples
    al_pending_max_bytes: int = 128 * 1024 * 1024  # encoded bytes of the samples held or sent (al-pending, al-samples)

    def __post_init__(self) -> None:
        if self.store not in WORKER_STORES:
            raise ValueError(f"worker store {self.store!r}: expected one of {', '.join(WORKER_STORES)}")

    @property
    def partitions(self) -> int:
        """The co-partitioned topics' partition count (the tables use it too)."""
        return self.connection.topics.outcomes.partitions


@dataclass
class Settings:
    # where
    bootstrap: str | None = None  # None: start or reuse the embedded broker
    topic_prefix: str = ""
    partitions: int = 8
    policy: str = "default"
    state_dir: str = "~/.causalmem"
    metrics_port: int | None = None  # None: the role's default port (docs/operations.md); 0: any free; <0: off
    metrics_host: str = "127.0.0.1"
    # model
    embedding_dim: int = 384
    slots: int = 1024
    hidden: int = 512
    device: str = "auto"  # auto: cuda when present, else cpu
    torch_threads: int = 1  # intra-op threads of the learner; more only help big batches on idle cores

    seed: int = 0
    # learning (defaults tuned by `causalmem bench learning`, see docs/tuning.md)
    lr: float = 1e-3
    batch_size: int = 64
    grad_clip: float = 1.0
    importance_clip: float = 5.0
    baseline: str = "moving"  # moving | cluster | none
    baseline_fading: float = 0.01
    label_lr: float = 1e-2
    reorder_s: float = 0.0  # >0: apply experiences in event-time order, after this much reordering slack
    # checkpoints
    checkpoint_interval_s: float = 10.0
    keep_versions: int = 3
    gate: bool = True  # publish candidates; promote only what the gate accepts (pipeline/learner/gate.py)
    gate_window: int = 2000
    gate_epsilon: float = 0.02
    gate_min_ess: float = 50.0
    gate_method: str = "dr-pi"  # dr-pi | dr | pi | snips | ips
    # serving: how clients serve the policy, recorded in each manifest (models/serving.py)
    serve_temperature: float = 0.05
    serve_explore_rate: float = 0.1  # share of requests served at serve_explore_temperature
    serve_explore_temperature: float = 0.25
    serve_drop: str = "dynamic"  # dynamic | fixed | none
    serve_drop_ratio: float = 0.01  # dynamic: share of the largest mask; fixed: the threshold
    # join and stream stages
    join_window_s: float = 600.0  # event time
    join_batch: int = 2000
    max_future_skew_s: float = 300.0  # wall-clock seconds an input's ts may be ahead; beyond: dead-letter ts_in_future
    max_outcomes_bytes: int = 900 * 1024  # outcomes are split into messages under this size
    label_window_s: float = 86400.0  # event time a verdict/rating can wait for its query
    query_state_max: int = 500_000  # per-query table entries a worker keeps at most
    al_pending_max: int = 20_000  # error candidates (whole events) waiting for a verdict, at most
    query_state_max_bytes: int = 128 * 1024 * 1024  # per-query state (encoded bytes), samples aside
    al_pending_max_bytes: int = 128 * 1024 * 1024  # samples held or sent (encoded bytes)
    worker_store: str = "rocksdb"  # rocksdb | memory: where the worker's tables live

    al_threshold: float = -0.3
    al_uncertainty_budget: float = 0.0  # fraction of experiences; 0 disables the trigger
    al_uncertainty_margin: float = 0.05  # top-2 first-draw probability margin below which a step is uncertain
    # drift
    drift_window_days: float = 7.0
    drift_drop: float = 0.15
    drift_min_pairs: int = 50
    drift_cooldown_s: float = 86400.0
    drift_page_hinkley: bool = False
    drift_reset: bool = True  # False: measure and report, never reset
    warmup_epochs: int = 2
    warmup_half_life_s: float = 86400.0  # event-time age at which a warm-up experience counts half
    replay_max: int = 50_000
    # limits
    max_message_bytes: int = 256 * 1024
    # durability (docs/operations.md, "Durability"): 1 suits the embedded broker's one node
    replication_factor: int = 1  # copies of each partition of the topics the product creates
    min_insync_replicas: int = 1  # copies an acks=all write needs; 1 leaves the broker's default
    security: KafkaSecurity = field(default_factory=KafkaSecurity)

    # -- derived -------------------------------------------------------------------------
    def topics(self) -> Topics:
        return Topics.build(
            prefix=self.topic_prefix,
            partitions=self.partitions,
            replication_factor=self.replication_factor,
            min_insync_replicas=self.min_insync_replicas,
        )

    def limits(self) -> Limits:
        return Limits(embedding_dim=self.embedding_dim, slots=self.slots, max_bytes=self.max_message_bytes)

    def connection(self) -> Connection:
        return Connection(topics=self.topics(), limits=self.limits(), security=self.security, policy=self.policy)

    def join(self) -> JoinConfig:
        return JoinConfig(
            connection=self.connection(),
            group_id=f"{self.topic_prefix}causalmem-join",
            window_s=self.join_window_s,
            batch=self.join_batch,
            active_learning=ActiveLearningConfig(
                threshold=self.al_threshold,
                uncertainty_budget=self.al_uncertainty_budget,
                uncertainty_margin=self.al_uncertainty_margin,
            ),
            max_future_skew_s=self.max_future_skew_s,
            max_outcomes_bytes=self.max_outcomes_bytes,
        )

    def drift(self) -> DriftConfig:
        return DriftConfig(
            window_days=self.drift_window_days,
            drop=self.drift_drop,
            min_pairs=self.drift_min_pairs,
            cooldown_s=self.drift_cooldown_s,
            page_hinkley=self.drift_page_hinkley,
            reset=self.drift_reset,
        )

    def worker(self) -> WorkerConfig:
        join = self.join()
        return WorkerConfig(
            connection=join.connection,
            join=join,
            drift=self.drift(),
            app_id=f"{self.topic_prefix}causalmem-worker",
            state_dir=self.state_path() / "faust",
            store=self.worker_store,
            label_window_s=self.label_window_s,
            query_state_max=self.query_state_max,
            al_pending_max=self.al_pending_max,
            query_state_max_bytes=self.query_state_max_bytes,
            al_pending_max_bytes=self.al_pending_max_bytes,
        )

    def trainer(self) -> TrainerConfig:
        from models.trainer import TrainerConfig

        return TrainerConfig(
            embedding_dim=self.embedding_dim,
            slots=self.slots,
            hidden=self.hidden,
            lr=self.lr,
            grad_clip=self.grad_clip,
            importance_clip=self.importance_clip,
            baseline=self.baseline,
            baseline_fading=self.baseline_fading,
            label_lr=self.label_lr,
            device=self.torch_device(),
            seed=self.seed,
        )

    def serving(self) -> ServingParams:
        """How clients serve the policy (raises ``ValueError`` on values they could not serve)."""
        return ServingParams(
            temperature=self.serve_temperature,
            explore_rate=self.serve_explore_rate,
            explore_temperature=self.serve_explore_temperature,
            drop=self.serve_drop,
            drop_ratio=self.serve_drop_ratio,
        )

    def learner(self) -> LearnerConfig:
        gate = GateConfig(self.gate_window, self.gate_epsilon, self.gate_min_ess, self.gate_method)
        return LearnerConfig(
            connection=self.connection(),
            trainer=self.trainer(),
            gate=gate if self.gate else None,
            serving=self.serving(),
            state_dir=Path(os.path.expanduser(self.state_dir)),
            batch_size=self.batch_size,
            reorder_s=self.reorder_s,
            checkpoint_interval_s=self.checkpoint_interval_s,
            keep_versions=self.keep_versions,
            replay_window_s=self.drift_window_days * 86400.0,
            replay_max=self.replay_max,
            warmup_epochs=self.warmup_epochs,
            warmup_half_life_s=self.warmup_half_life_s,
            torch_threads=self.torch_threads,
        )

    def state_path(self) -> Path:
        path = Path(os.path.expanduser(self.state_dir))
        path.mkdir(parents=True, exist_ok=True)
        return path

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def torch_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    # -- loading -------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``CAUSALMEM_<FIELD>`` variables, then explicit overrides (not None)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "security":
                continue
            raw = env.get("CAUSALMEM_" + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _parse(raw, f.type, f.name)
        security = KafkaSecurity()
        for f in fields(KafkaSecurity):
            raw = env.get("CAUSALMEM_KAFKA_" + f.name.upper())
            if raw:
                setattr(security, f.name, raw)
        values["security"] = security
        for key, value in overrides.items():
            if value is None:
                continue
            if key.startswith("kafka_") and hasattr(security, key[len("kafka_") :]):
                setattr(security, key[len("kafka_") :], value)
            elif key in {f.name for f in fields(cls)}:
                values[key] = value
            else:
                raise TypeError(f"unknown setting {key!r}")
        return cls(**values)


def _parse(raw: str, typ: Any, name: str) -> Any:
    t = str(typ)
    try:
        if t.startswith("bool"):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if t.startswith("int"):
            return int(raw)
        if t.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"CAUSALMEM_{name.upper()}={raw!r} is not a valid {t}") from None
    return raw
