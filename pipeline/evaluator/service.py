"""``causalmem evaluator``: retrieval events in, LLM feedback out, scored by a local causal LM.

The evaluator reads ``retrieval-events`` in its own consumer group (partitions shared
among the evaluators of a deployment, as the worker's join shares them), gathers up to
``batch_size`` events (waiting ``linger_s`` at most for a partial batch), scores every
prompt of the batch in one :meth:`AnswerScorer.nll` call (:mod:`pipeline.evaluator.plan`
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
import contextlib
import logging
import time
from typing import Any, Protocol

import numpy as np
from aiokafka import ConsumerRebalanceListener, TopicPartition

from pipeline import kafka
from pipeline.component_config import EvaluatorConfig
from pipeline.deadletter import DeadLetterWriter
from pipeline.evaluator.metrics import EvaluatorMetrics
from pipeline.evaluator.plan import Plan, feedback, plan
from pipeline.metrics import Metrics
from pipeline.service import Service
from topics.events import decode_retrieval_event
from topics.feedback import LLMFeedback
from topics.fields import Rejected, encode

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 1.0  # after a failed batch, before reading it again


class Scorer(Protocol):
    """What the evaluator needs of :class:`~pipeline.evaluator.scoring.AnswerScorer` (tests pass a fake)."""

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


class Evaluator(Service):
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
        An :class:`~pipeline.evaluator.scoring.AnswerScorer` (loaded before ``start``).
    """

    def __init__(self, config: EvaluatorConfig, bootstrap: str, metrics: Metrics, scorer: Scorer) -> None:
        super().__init__()
        self.config = config
        self.bootstrap = bootstrap
        self.metrics = metrics
        self.own = EvaluatorMetrics(metrics.registry)
        self.scorer = scorer
        self.topics = config.connection.topics
        self.limits = config.connection.limits
        self.positions: dict[TopicPartition, int] = {}  # next offset to read, per owned partition
        self.evaluated = 0
        self.ready = asyncio.Event()
        self._consumer: Any = None
        self._producer: Any = None
        self._dead: DeadLetterWriter | None = None
        self._stopping = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def _start(self) -> None:
        conn = self.config.connection
        self._stopping.clear()
        self._producer = kafka.producer(self.bootstrap, conn, linger_ms=5)
        await self._producer.start()
        self._dead = DeadLetterWriter(self._producer, self.topics.dead_letter.name, self.metrics)
        self._consumer = kafka.consumer(
            self.bootstrap, conn, group_id=self.config.group_id, max_poll_records=self.config.batch_size
        )
        self._consumer.subscribe([self.topics.retrieval_events.name], listener=_Rebalance(self))
        await self._consumer.start()

    async def _stop(self) -> None:
        self._stopping.set()
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def run(self) -> None:
        """Consume, score and publish until :meth:`stop`. Never raises on bad input."""
        while not self._stopping.is_set() and self._consumer is not None:
            try:
                records = await self._gather()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker hiccups: keep going
                log.warning("evaluator: fetch failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            if records:
                t0 = time.perf_counter()
                try:
                    await self.process(records)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # nothing committed past the batch: read it again
                    log.error("evaluator: batch failed (%r); reading it again from the committed offsets", exc)
                    await asyncio.sleep(RETRY_PAUSE_S)
                    await self.rewind()
                    continue
                self.own.batch_seconds.observe(time.perf_counter() - t0)
            self._export_lag()

    async def _gather(self) -> list[Any]:
        """Up to ``batch_size`` records: what is there, plus ``linger_s`` of waiting for more."""
        c, want = self._consumer, self.config.batch_size
        records: list[Any] = []
        deadline: float | None = None
        while len(records) < want and not self._stopping.is_set():
            wait_s = 0.2 if deadline is None else deadline - time.monotonic()
            if wait_s <= 0:
                break
            got = await c.getmany(timeout_ms=int(wait_s * 1000), max_records=want - len(records))
            if c.assignment():
                self.ready.set()
            for messages in got.values():
                records.extend(messages)
            if records and deadline is None:
                deadline = time.monotonic() + self.config.linger_s
            elif not records:
                break  # nothing waiting: let the caller export lag and check for stop
        return records

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
            p = plan(event, self.config.attribution_rate)
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
            futures.append(
                await self._producer.send(self.topics.llm_feedback.name, value, key=fb.query_id.encode("utf-8"))
            )
            if pl.loo_slots:
                self.own.attributed.inc()
        if futures:
            await asyncio.gather(*futures)
        await self._dead.flush()
        self.own.evaluations.inc(len(futures))
        self.evaluated += len(futures)
        self.positions.update(ends)
        await self._commit(ends)
        return len(futures)

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        owned = self._consumer.assignment() if self._consumer else set()
        offsets = {tp: off for tp, off in offsets.items() if tp in owned}
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except Exception as exc:  # a rebalance in progress: the next owner re-scores; the join dedupes
            log.info("evaluator: commit skipped: %r", exc)

    async def rewind(self) -> None:
        """Read every owned partition again from its committed offset (after a failed batch)."""
        c = self._consumer
        if c is None:
            return
        with contextlib.suppress(Exception):
            assert self._dead is not None
            await self._dead.flush()
        for tp in c.assignment():
            offset = await c.committed(tp)
            if offset is None:
                await c.seek_to_beginning(tp)
            else:
                c.seek(tp, offset)
            self.positions.pop(tp, None)

    def _export_lag(self) -> None:
        c = self._consumer
        if c is None:
            return
        lag = 0
        for tp in c.assignment():
            hw = c.highwater(tp)
            if hw is not None:
                lag += max(0, hw - self.positions.get(tp, hw))
        self.metrics.consumer_lag.labels(topic=self.topics.retrieval_events.name).set(lag)

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.own.partitions_owned.set(len(assigned))
        for tp in set(self.positions) - assigned:
            self.positions.pop(tp, None)
        log.info("evaluator: assigned partitions %s", sorted(tp.partition for tp in assigned))


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Nothing to flush: each batch is committed before the next fetch, where rebalances happen."""

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.evaluator.on_assigned(set(assigned))
