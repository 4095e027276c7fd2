"""The evaluator's own Prometheus metrics (``causalmem_evaluator_*``, listed in docs/operations.md).

They live on the registry of the process's :class:`~pipeline.metrics.Metrics` (role
``evaluator``), next to the shared input metrics (messages read, dead letters, lag).

>>> from pipeline.metrics import Metrics
>>> m = EvaluatorMetrics(Metrics(role="evaluator").registry)
>>> m.skipped.labels(reason="no_answer").inc()
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.lm_evaluator.plan import SKIP_REASONS


class EvaluatorMetrics:
    """Evaluations, skips by reason, tokens scored, partitions owned and the time a batch takes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.evaluations = Counter(
            "causalmem_evaluator_evaluations_total",
            "Retrieval events scored and answered with LLM feedback",
            registry=registry,
        )
        self.attributed = Counter(
            "causalmem_evaluator_attributed_total",
            "Evaluations that also scored leave-one-out prompts (nll_without_slot)",
            registry=registry,
        )
        self.attribution_capped = Counter(
            "causalmem_evaluator_attribution_capped_total",
            "Attributed evaluations that selected more memories than evaluator_max_attributed: "
            "leave-one-out scored on a hashed subset of them",
            registry=registry,
        )
        self.skipped = Counter(
            "causalmem_evaluator_skipped_total",
            "Retrieval events not scored, by reason",
            ["reason"],
            registry=registry,
        )
        for reason in SKIP_REASONS:  # every reason exported from the start (0 until it happens)
            self.skipped.labels(reason=reason)
        self.prompts = Counter(
            "causalmem_evaluator_prompts_total", "Distinct (prompt, answer) pairs scored", registry=registry
        )
        self.tokens = Counter(
            "causalmem_evaluator_tokens_total", "Tokens run through the model (prompt + answer)", registry=registry
        )
        self.partitions_owned = Gauge(
            "causalmem_evaluator_partitions_owned",
            "Partitions of retrieval-events this evaluator owns",
            registry=registry,
        )
        self.batch_seconds = Histogram(
            "causalmem_evaluator_batch_seconds",
            "Time to score one batch and have its feedback acknowledged",
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
