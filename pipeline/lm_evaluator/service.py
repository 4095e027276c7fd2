"""``causalmem evaluator``: retrieval events in, LLM feedback out, scored by a local causal LM.

The evaluator reads ``retrieval-events`` in its own consumer group (partitions shared
among the evaluators of a deployment, as the worker's join shares them), gathers up to
``batch_size`` events (waiting ``linger_s`` at most for a partial batch), scores every
prompt of the batch in one :meth:`AnswerScorer.nll` call (:mod:`pipeline.lm_evaluator.plan`
lists them) and publishes one :class:`~topics.feedback.LLMFeedback` per scored event to
``llm-feedback``, keyed by its query id.

- Events without a query text, an answer, the texts of their selected memories, or with
  nothing selected are skipped and counted (``causalmem_evaluator_skipped_total{reason}``),
  not failed: the join evicts them unanswered, like any event without feedback.
- Messages that do not decode go to ``dead-letter`` with their reason.
- Offsets are committed only after the broker acknowledged the batch's feedback and dead
  letters (at-least-once). After a crash the batch is scored again and its feedback sent
  again under the same ids (``fb-<event id>``): the join applies one feedback per event
  id and per (query_id, step) and counts the rest in ``causalmem_duplicates_total``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import numpy as np
from aiokafka import TopicPartition

from pipeline.batchstage import BatchStage
from pipeline.config import EvaluatorConfig, private_key
from pipeline.lm_evaluator.metrics import EvaluatorMetrics
from pipeline.lm_evaluator.plan import Plan, feedback, plan
from pipeline.metrics import Metrics
from topics.events import decode_retrieval_event
from topics.feedback import LLMFeedback
from topics.fields import Rejected, encode
from topics.principal import principal_signature

log = logging.getLogger(__name__)


class Scorer(Protocol):
    """What the evaluator needs of :class:`~pipeline.lm_evaluator.scoring.AnswerScorer` (tests pass a fake)."""

    tokens_scored: int

    def nll(self, prompts: list[str], answers: list[str]) -> np.ndarray: ...


def score_plans(scorer: Scorer, plans: list[Plan]) -> list[LLMFeedback | None]:
    """Score every prompt of ``plans`` in one call; ``None`` where the answer scored NaN (no tokens)."""
    prompts = [p for pl in plans for p in pl.prompts]
    answers = [pl.answer for pl in plans for _ in pl.prompts]
    nlls = scorer.nll(prompts, answers) if prompts else np.empty(0)
    out: list[LLMFeedback | None] = []
    at = 0
    for pl in plans:
        row = nlls[at : at + len(pl.prompts)]
        at += len(pl.prompts)
        out.append(feedback(pl, [float(x) for x in row]) if np.all(np.isfinite(row)) else None)
    return out


class Evaluator(BatchStage):
    """The evaluator's consume → score → publish loop (``start`` / ``run`` / ``stop``, or ``async with``).

    Parameters
    ----------
    config
        Topics, consumer group, attribution rate and batching (:class:`EvaluatorConfig`).
    bootstrap
        Kafka bootstrap ``HOST:PORT``.
    metrics
        The process's metrics (role ``evaluator``); the ``causalmem_evaluator_*`` ones are
        added to its registry.
    scorer
        An :class:`~pipeline.lm_evaluator.scoring.AnswerScorer` (loaded before ``start``).
    """

    def __init__(self, config: EvaluatorConfig, bootstrap: str, metrics: Metrics, scorer: Scorer) -> None:
        own = EvaluatorMetrics(metrics.registry)
        topic = config.connection.topics.retrieval_events.name
        super().__init__(config, bootstrap, metrics, "evaluator", topic, own.partitions_owned, own.batch_seconds)
        self.config = config
        self.own = own
        self.scorer = scorer
        self.evaluated = 0
        # Contract 1.18: the key that signs its feedback as causalmem-evaluator (None: unsigned).
        self.principal_key = private_key(config.key_file, "evaluator_key_file")

    # ------------------------------------------------------------------ processing
    async def process(self, records: list[Any]) -> int:
        """Decode, score and publish one batch; commit its offsets once the outputs are acknowledged.

        Returns the number of feedback messages sent. Raises when scoring or a send fails
        (the caller re-reads from the committed offsets).
        """
        assert self._dead is not None
        plans: list[Plan] = []
        ends: dict[TopicPartition, int] = {}
        for msg in records:
            tp = TopicPartition(msg.topic, msg.partition)
            ends[tp] = max(ends.get(tp, 0), msg.offset + 1)
            self.metrics.events_in.labels(topic=msg.topic).inc()
            try:
                event = decode_retrieval_event(msg.value, self.limits, msg.key)
            except Rejected as rej:
                self._dead.send(msg, rej.reason, rej.detail)
                continue
            p = plan(event, self.config.attribution_rate, max_attributed=self.config.max_attributed)
            if isinstance(p, str):
                self.own.skipped.labels(reason=p).inc()
                log.debug("evaluator: skipped %s: %s", event.event_id, p)
                continue
            plans.append(p)
        tokens0 = self.scorer.tokens_scored
        results = await asyncio.to_thread(score_plans, self.scorer, plans) if plans else []
        self.own.tokens.inc(max(0, self.scorer.tokens_scored - tokens0))
        self.own.prompts.inc(sum(len(p.prompts) for p in plans))
        futures = []
        for pl, fb in zip(plans, results, strict=True):
            if fb is None:  # the answer has no tokens: nothing to measure
                self.own.skipped.labels(reason="no_answer").inc()
                continue
            value = encode(fb.to_dict())
            # Contract 1.18: signed as causalmem-evaluator where a key is configured (1.16's header).
            key = self.principal_key
            headers = [principal_signature(value, key)] if key is not None else None
            futures.append(
                await self._producer.send(
                    self.topics.llm_feedback.name, value, key=fb.query_id.encode("utf-8"), headers=headers
                )
            )
            if pl.loo_slots:
                self.own.attributed.inc()
            if pl.capped:
                self.own.attribution_capped.inc()
        if futures:
            await asyncio.gather(*futures)
        await self._dead.flush()
        self.own.evaluations.inc(len(futures))
        self.evaluated += len(futures)
        await self.commit(ends)
        return len(futures)
