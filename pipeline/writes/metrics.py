"""The write gate's own Prometheus metrics (``causalmem_writes_*``, listed in docs/operations.md).

They live on the registry of the process's :class:`~pipeline.metrics.Metrics` (role
``writes``), next to the shared input metrics (messages read, dead letters, lag).

>>> from pipeline.metrics import Metrics
>>> m = WritesMetrics(Metrics(role="writes").registry)
>>> m.decisions.labels(decision="rejected").inc()
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Every decision about a proposal; "invalid" ones also go to dead-letter with their reason.
DECISIONS = ("admitted_success", "admitted_pitfall", "rejected", "invalid")
# A producer's claimed expected reward against the gate's own (more than θ apart: disagrees).
CLAIMS = ("agrees", "disagrees")


class WritesMetrics:
    """Decisions by kind, the RPE of judged proposals, partitions owned and the time a batch takes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "causalmem_writes_decisions_total",
            "Proposed memories judged by the write gate, by decision",
            ["decision"],
            registry=registry,
        )
        for decision in DECISIONS:  # every decision exported from the start (0 until it happens)
            self.decisions.labels(decision=decision)
        self.rpe = Histogram(
            "causalmem_writes_rpe",
            "Reward-prediction error (reward − expected reward) of judged proposals",
            registry=registry,
            buckets=(-2, -1, -0.5, -0.3, -0.1, 0, 0.1, 0.3, 0.5, 1, 2),
        )
        self.estimates = Counter(
            "causalmem_writes_expected_total",
            "Where the gate's expected reward for a judged proposal came from (cluster, global, prior)",
            ["estimate"],
            registry=registry,
        )
        self.claims = Counter(
            "causalmem_writes_claims_total",
            "Judged proposals that sent their own expected_reward (which decides nothing), by whether it "
            "was within theta of the gate's expectation",
            ["claim"],
            registry=registry,
        )
        for claim in CLAIMS:
            self.claims.labels(claim=claim)
        self.clusters = Gauge(
            "causalmem_writes_topics", "Query topics (clusters) the gate keeps a running reward for", registry=registry
        )
        self.partitions_owned = Gauge(
            "causalmem_writes_partitions_owned", "Partitions of memory-writes this gate owns", registry=registry
        )
        self.batch_seconds = Histogram(
            "causalmem_writes_batch_seconds",
            "Time to judge one batch and have its outputs acknowledged",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
