"""Prometheus metrics (listed in docs/operations.md), one registry per process, served on ``/metrics``
(with ``/healthz`` and ``/readyz``, :mod:`pipeline.probes`).

Names follow Prometheus conventions (``_total`` counters, units in names); labels are of
low cardinality only (topic, reason, kind; never a query id). The metrics are created on
an explicit registry so that several components can live in one test process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    disable_created_metrics,
)

from pipeline.probes import Probes, ProbeServer

if TYPE_CHECKING:
    from models.memory.stats import MemoryStats

# The *_created series double the exposition for no use here.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated

log = logging.getLogger(__name__)

HEALTH_BANDS = ("efficient", "healthy", "warning", "critical")


ROLES = {
    "worker": {"process", "input", "worker", "broker"},
    "learner": {"process", "input", "learner", "broker"},
    "evaluator": {"process", "input", "broker"},  # and its own causalmem_evaluator_* (pipeline/lm_evaluator/metrics.py)
    "writes": {"process", "input", "broker"},  # and its own causalmem_writes_* (pipeline/writes/metrics.py)
    "all": {"process", "input", "worker", "learner", "broker"},
}


class Metrics:
    """Every metric of the product; a process exports those of its role.

    All attributes exist in every process (code paths may touch any of them), but only the
    role's groups are registered on :attr:`registry`, the one served on ``/metrics``: a
    learner does not export a worker's health score as a misleading 0.
    """

    def __init__(self, registry: CollectorRegistry | None = None, role: str = "all") -> None:
        self.registry = registry or CollectorRegistry()
        self.role = role
        self._groups = ROLES[role]
        self._unexported = CollectorRegistry()
        self.port: int | None = None  # where /metrics is served (None: not served)
        # ---- process (what /healthz and /readyz answer, for alerts and dashboards)
        self.ready = Gauge(
            "causalmem_ready", "1 while /readyz answers ready (set at each heartbeat)", registry=self._reg("process")
        )
        self.heartbeat = Gauge(
            "causalmem_heartbeat_timestamp_seconds",
            "Wall time of the event loop's last heartbeat",
            registry=self._reg("process"),
        )
        # ---- input and validation
        self.events_in = Counter(
            "causalmem_events_in_total", "Messages read from input topics", ["topic"], registry=self._reg("input")
        )
        self.rejected = Counter(
            "causalmem_events_rejected_total",
            "Messages sent to dead-letter, by reason",
            ["topic", "reason"],
            registry=self._reg("input"),
        )
        self.duplicates = Counter(
            "causalmem_duplicates_total", "Repeated event_ids applied once", ["topic"], registry=self._reg("input")
        )
        self.dead_letters = Counter(
            "causalmem_dead_letter_total", "Messages written to dead-letter", registry=self._reg("input")
        )
        self.consumer_lag = Gauge(
            "causalmem_consumer_lag_messages",
            "High watermark minus position, summed over partitions",
            ["topic"],
            registry=self._reg("input"),
        )
        # ---- join
        self.joins = Counter(
            "causalmem_joins_total", "Retrieval events joined with their feedback", registry=self._reg("worker")
        )
        self.join_expired = Counter(
            "causalmem_join_expired_total",
            "Unmatched events evicted after the join window",
            ["side"],
            registry=self._reg("worker"),
        )
        self.join_pending = Gauge(
            "causalmem_join_pending", "Events waiting for their other half", registry=self._reg("worker")
        )
        self.join_batch_seconds = Histogram(
            "causalmem_join_batch_seconds",
            "Time to process one fetched batch in the join stage",
            registry=self._reg("worker"),
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.partitions_owned = Gauge(
            "causalmem_partitions_owned", "Input partitions this worker owns", ["stage"], registry=self._reg("worker")
        )
        # ---- retrieval behaviour (from retrieval events)
        self.retrievals = Counter("causalmem_retrievals_total", "Retrieval events seen", registry=self._reg("worker"))
        self.fallbacks = Counter(
            "causalmem_fallbacks_total", "Retrievals whose hard drop left nothing", registry=self._reg("worker")
        )
        self.candidates_kept = Counter(
            "causalmem_candidates_kept_total", "Candidates kept by the hard drop", registry=self._reg("worker")
        )
        self.candidates_dropped = Counter(
            "causalmem_candidates_dropped_total", "Candidates removed by the hard drop", registry=self._reg("worker")
        )
        self.intervention_rate = Gauge(
            "causalmem_intervention_rate",
            "Share of candidates the mask dropped (recent events)",
            registry=self._reg("worker"),
        )
        self.fallback_rate = Gauge(
            "causalmem_fallback_rate",
            "Share of retrievals that fell back (recent events)",
            registry=self._reg("worker"),
        )
        self.mask_max = Histogram(
            "causalmem_mask_max",
            "Largest mask value over a retrieval's candidates",
            registry=self._reg("worker"),
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
        )
        self.utility = Histogram(
            "causalmem_utility",
            "Utility u = nll_without - nll_with of joined steps",
            registry=self._reg("worker"),
            buckets=(-2, -1, -0.5, -0.3, -0.1, 0, 0.1, 0.3, 0.5, 1, 2),
        )
        self.utility_mean = Gauge(
            "causalmem_utility_mean", "Mean utility over recent joined steps", registry=self._reg("worker")
        )
        self.health_score = Gauge(
            "causalmem_memory_health_score", "Memory health score 0-100 (seed 000 §6.1)", registry=self._reg("worker")
        )
        self.health_band = Gauge(
            "causalmem_memory_health_band", "1 for the current health band", ["band"], registry=self._reg("worker")
        )
        # ---- active learning and labels
        self.al_samples = Counter(
            "causalmem_al_samples_total", "Samples queued for labelers", ["reason"], registry=self._reg("worker")
        )
        self.labels = Counter("causalmem_labels_total", "Human labels received", ["kind"], registry=self._reg("worker"))
        self.labels_expired = Counter(
            "causalmem_labels_expired_total",
            "Labels whose query was not seen within the label window",
            ["kind"],
            registry=self._reg("worker"),
        )
        self.do_not_use_proposals = Counter(
            "causalmem_do_not_use_proposals_total",
            "Labelers' 'do not use' marks: proposals for an operator (causalmem status lists them), never applied",
            registry=self._reg("worker"),
        )
        # ---- drift
        self.correlation = Gauge(
            "causalmem_utility_rating_correlation",
            "Pearson correlation of U_query and rating, last 7 days",
            registry=self._reg("worker"),
        )
        self.correlation_reference = Gauge(
            "causalmem_utility_rating_correlation_reference",
            "Reference correlation for the drift trigger",
            registry=self._reg("worker"),
        )
        self.correlation_pairs = Gauge(
            "causalmem_utility_rating_pairs",
            "(U_query, rating) pairs in the 7-day window",
            registry=self._reg("worker"),
        )
        self.drift_triggers = Counter(
            "causalmem_drift_triggers_total",
            "Reset commands sent to the learner",
            ["detector"],
            registry=self._reg("worker"),
        )
        # ---- learner
        self.experiences_applied = Counter(
            "causalmem_learner_experiences_total",
            "Experiences the learner applied to the policy (feedback, label)",
            ["kind"],
            registry=self._reg("learner"),
        )
        self.learner_skipped = Counter(
            "causalmem_learner_skipped_total",
            "Experiences or updates skipped, by reason",
            ["reason"],
            registry=self._reg("learner"),
        )
        self.updates = Counter(
            "causalmem_learner_updates_total", "Optimizer steps applied", ["kind"], registry=self._reg("learner")
        )
        self.batch_size = Histogram(
            "causalmem_learner_batch_size",
            "Experiences per micro-batch",
            registry=self._reg("learner"),
            buckets=(1, 4, 8, 16, 32, 64, 128, 256, 512),
        )
        self.loss = Gauge("causalmem_learner_loss", "Loss of the last micro-batch", registry=self._reg("learner"))
        self.grad_norm = Histogram(
            "causalmem_learner_grad_norm",
            "Gradient norm before clipping",
            registry=self._reg("learner"),
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 100),
        )
        self.importance_weight = Histogram(
            "causalmem_learner_importance_weight",
            "Clipped importance weights w",
            registry=self._reg("learner"),
            buckets=(0.01, 0.1, 0.5, 0.8, 1, 1.25, 2, 5, 10),
        )
        self.baseline = Gauge("causalmem_learner_baseline", "Moving baseline b", registry=self._reg("learner"))
        self.advantage = Histogram(
            "causalmem_learner_advantage",
            "Advantages A = u - b",
            registry=self._reg("learner"),
            buckets=(-2, -1, -0.5, -0.1, 0, 0.1, 0.5, 1, 2),
        )
        self.update_seconds = Histogram(
            "causalmem_learner_update_seconds",
            "Wall time of one micro-batch update",
            registry=self._reg("learner"),
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )
        self.resets = Counter(
            "causalmem_learner_resets_total", "Last-layer resets applied", registry=self._reg("learner")
        )
        self.suppressions = Counter(
            "causalmem_learner_suppression_commands_total",
            "Operators' suppress/unsuppress commands, by verdict (apply, unchanged, refused)",
            ["command", "verdict"],
            registry=self._reg("learner"),
        )
        # ---- per principal (contract 1.15, docs/learning.md "Influence per principal"): at most
        # pipeline.learner.principals.SHOWN principals are labelled (the flagged and quarantined first)
        self.principal_share = Gauge(
            "causalmem_principal_share",
            "Share of the learner's recent window of feedback experiences, per principal",
            ["principal"],
            registry=self._reg("learner"),
        )
        self.principal_weight = Gauge(
            "causalmem_principal_weight",
            "Sample weight of each of a principal's experiences (1: within influence_cap; 0: quarantined)",
            ["principal"],
            registry=self._reg("learner"),
        )
        self.principal_flagged = Gauge(
            "causalmem_principal_flagged",
            "1 when a principal's utilities disagree with the other principals' for the same memories",
            ["principal"],
            registry=self._reg("learner"),
        )
        self.principal_residual = Gauge(
            "causalmem_principal_residual",
            "Mean residual of a principal's utilities against the other principals' (bound: mean, low, high)",
            ["principal", "bound"],
            registry=self._reg("learner"),
        )
        self.quarantines = Counter(
            "causalmem_learner_quarantine_commands_total",
            "Operators' quarantine/unquarantine commands, by verdict (apply, unchanged, refused)",
            ["command", "verdict"],
            registry=self._reg("learner"),
        )
        self.quarantined_experiences = Counter(
            "causalmem_learner_quarantined_experiences_total",
            "Feedback experiences of quarantined principals, given weight 0",
            ["principal"],
            registry=self._reg("learner"),
        )
        self.held_experiences = Counter(
            "causalmem_learner_held_experiences_total",
            "Feedback experiences of flagged principals, given weight 0 while their utilities disagree",
            registry=self._reg("learner"),
        )
        self.last_update = Gauge(
            "causalmem_learner_last_update_timestamp_seconds",
            "Wall time of the last applied micro-batch (staleness alerts)",
            registry=self._reg("learner"),
        )

        self.training_alive = Gauge(
            "causalmem_learner_training_alive",
            "1 while the learner's training task runs (0: it ended; the process needs a restart)",
            registry=self._reg("learner"),
        )
        self.elected = Gauge(
            "causalmem_learner_elected",
            "1 while this learner is the elected writer of its policy (0: standby or not yet elected)",
            registry=self._reg("learner"),
        )
        self.labels_applied = Counter(
            "causalmem_learner_labels_applied_total", "Labels applied by fine-tuning", registry=self._reg("learner")
        )
        # ---- per-memory statistics (per-memory credit): the N most harmful and most helpful only
        self.memory_effect = Gauge(
            "causalmem_memory_effect",
            "Mean measured effect of a memory (nll_without_slot - nll_with; > 0 helped), top-N each side",
            ["slot", "side", "bound"],
            registry=self._reg("learner"),
        )
        self.memory_reads = Gauge(
            "causalmem_memory_reads",
            "Reads of a memory shown in causalmem_memory_effect, and how many had a measured effect",
            ["slot", "side", "kind"],
            registry=self._reg("learner"),
        )
        self.memories_measured = Gauge(
            "causalmem_memories_measured",
            "Memories with at least one measured effect since the learner started (or its last reset)",
            registry=self._reg("learner"),
        )
        # ---- checkpoints
        self.checkpoint_version = Gauge(
            "causalmem_checkpoint_version", "Version of the newest checkpoint", ["role"], registry=self._reg("learner")
        )
        self.checkpoint_timestamp = Gauge(
            "causalmem_checkpoint_timestamp_seconds",
            "Creation time of the newest checkpoint",
            ["role"],
            registry=self._reg("learner"),
        )
        self.checkpoint_publishes = Counter(
            "causalmem_checkpoint_publishes_total",
            "Checkpoints published, by reason",
            ["reason"],
            registry=self._reg("learner"),
        )
        self.checkpoint_bytes = Gauge(
            "causalmem_checkpoint_bytes", "Size of the newest checkpoint blob", registry=self._reg("learner")
        )
        self.gate_decisions = Counter(
            "causalmem_gate_decisions_total", "Promotion gate decisions", ["decision"], registry=self._reg("learner")
        )
        self.gate_estimate = Gauge(
            "causalmem_gate_estimate", "Gate's estimated mean utility", ["policy"], registry=self._reg("learner")
        )
        self.gate_last_decision = Gauge(
            "causalmem_gate_decision",
            "The gate's last decision (1 on its label: promoted, refused or insufficient)",
            ["decision"],
            registry=self._reg("learner"),
        )
        self.gate_ess = Gauge(
            "causalmem_gate_ess", "Effective sample size of the gate's last judgement", registry=self._reg("learner")
        )
        self.gate_ess_needed = Gauge(
            "causalmem_gate_ess_needed", "Effective sample size a gate decision needs", registry=self._reg("learner")
        )
        # A learner that trains and publishes while serving never moves (the gate cannot decide
        # its candidates) looks busy: these two say it is not (pipeline/learner/freeze.py).
        self.seconds_since_promotion = Gauge(
            "causalmem_learner_seconds_since_promotion",
            "Seconds since the serving version last changed (a promotion, or a checkpoint served at once)",
            registry=self._reg("learner"),
        )
        self.candidates_waiting = Gauge(
            "causalmem_learner_candidates_waiting",
            "Candidates published since the serving version last changed",
            registry=self._reg("learner"),
        )
        self.gate_logging_probs = Counter(
            "causalmem_gate_logging_probs_total",
            "Events the promotion gate judged, by where their logging probabilities came from "
            "(client, recomputed, version_not_held, unrecomputable)",
            ["source"],
            registry=self._reg("learner"),
        )
        self.gate_logging_mismatch = Counter(
            "causalmem_gate_logging_mismatch_total",
            "Events whose logprob or candidate_probs disagree with the serving rule recomputed by the learner "
            "(left out of the promotion gate)",
            ["field"],
            registry=self._reg("learner"),
        )
        # A summary, not a histogram: a bound may be negative (down to −ε), and a histogram with
        # negative buckets exposes no sum, which the mean gain per promotion needs.
        self.gate_promoted_gain = Summary(
            "causalmem_gate_promoted_gain",
            "The certified lower bound of each promoted version's gain over the anchor it was tested against",
            registry=self._reg("learner"),
        )
        self.gate_actions = Counter(
            "causalmem_gate_actions_total",
            "The promotion rule's actions (pipeline/learner/promotion.py), by kind and path",
            ["kind", "path"],
            registry=self._reg("learner"),
        )
        self.cluster_resets = Counter(
            "causalmem_broker_resets_detected_total",
            "Broker resets (lost topics) detected",
            registry=self._reg("broker"),
        )

    def _reg(self, group: str) -> CollectorRegistry:
        return self.registry if group in self._groups else self._unexported

    def export_memory_stats(self, stats: MemoryStats, n: int = 10) -> None:
        """The ``n`` most harmful and ``n`` most helpful memories (at most 2n slots, so the
        label cardinality stays bounded; the previous set is cleared)."""
        self.memory_effect.clear()
        self.memory_reads.clear()
        self.memories_measured.set(stats.measured)
        for side, harmful in (("harmful", True), ("helpful", False)):
            for st in stats.top(n, harmful=harmful):
                if (st.mean < 0) != harmful:
                    continue  # a "helpful" memory with a negative mean is not shown as one
                slot = str(st.slot)
                for bound, v in (("mean", st.mean), ("low", st.low), ("high", st.high)):
                    self.memory_effect.labels(slot=slot, side=side, bound=bound).set(v)
                self.memory_reads.labels(slot=slot, side=side, kind="reads").set(st.reads)
                self.memory_reads.labels(slot=slot, side=side, kind="effects").set(st.effects)

    def export_principals(self, view: dict[str, dict[str, Any]]) -> None:
        """The principals of ``view`` (:meth:`pipeline.learner.principals.PrincipalBook.view`, bounded);
        the previous set is cleared."""
        for gauge in (self.principal_share, self.principal_weight, self.principal_flagged, self.principal_residual):
            gauge.clear()
        for name, p in view.items():
            self.principal_share.labels(principal=name).set(p["share"])
            self.principal_weight.labels(principal=name).set(p["weight"])
            self.principal_flagged.labels(principal=name).set(1.0 if p["flagged"] else 0.0)
            for bound in ("residual", "low", "high"):
                if p[bound] is not None:
                    label = "mean" if bound == "residual" else bound
                    self.principal_residual.labels(principal=name, bound=label).set(p[bound])

    def set_health(self, score: float, band: str) -> None:
        self.health_score.set(score)
        for b in HEALTH_BANDS:
            self.health_band.labels(band=b).set(1.0 if b == band else 0.0)


def serve(metrics: Metrics, port: int | None, host: str = "127.0.0.1", probes: Probes | None = None) -> int | None:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` (:mod:`pipeline.probes`); return the bound port.

    ``port`` 0 binds any free port; None serves nothing. Without ``probes`` nothing beats:
    ``/healthz`` and ``/readyz`` answer 503 (never a ready the process did not establish).
    """
    if port is None:
        return None
    server = ProbeServer(metrics.registry, probes or Probes(), port, host)
    metrics.port = server.port
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    return server.port
