"""The outcomes stage: per-query utility (U_query) and the active-learning candidates.

Reads ``outcomes`` (per join batch and partition, messages of at most
``max_outcomes_bytes``). For each query it adds
the steps not counted yet to the ``query-utility`` record (a join re-emitted after a
takeover is counted once), pairs a waiting rating with the new U_query, and hands each
candidate step to the active-learning rule (:mod:`pipeline.worker.active_learning`):
an uncertain one becomes a sample at once, an error one waits for its query's verdict.

Samples and rating pairs are sent from here, for this stage and the labels stage.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.metrics import Metrics
from pipeline.worker.active_learning import first_send, hold, on_candidate
from pipeline.worker.records import MAX_STEPS_PER_QUERY, QueryUtility, Rating, StoredSamples
from pipeline.worker.tables import Outputs, Tables
from topics.convert import sample_id_for
from topics.fields import Limits, Rejected, encode
from topics.internal import Outcome, RatingPair, decode_outcomes

log = logging.getLogger(__name__)


def counted(q: QueryUtility | None, recs: list[Outcome]) -> tuple[QueryUtility, list[Outcome]]:
    """The query's utility record with ``recs`` added, and those that were new.

    >>> o = Outcome("q", 0, 5.0, 0.5, False, "default")
    >>> q, fresh = counted(None, [o, o])
    >>> (q.u_query, q.steps, len(fresh))
    (0.5, [0], 1)
    """
    total, n, ts = (q.sum, q.n, q.ts) if q is not None else (0.0, 0, 0.0)
    steps = list(q.steps) if q is not None else []
    fresh = []
    for rec in recs:
        if rec.step in steps:
            continue  # a join re-emitted after a takeover: counted once
        total += rec.utility
        n += 1
        steps = [*steps, rec.step][-MAX_STEPS_PER_QUERY:]
        ts = max(ts, rec.ts)
        fresh.append(rec)
    return QueryUtility(sum=total, n=n, steps=steps, ts=ts), fresh


class OutcomesStage:
    """The ``outcomes`` agent and the senders of samples and rating pairs."""

    def __init__(self, tables: Tables, outputs: Outputs, metrics: Metrics, limits: Limits) -> None:
        self.tables = tables
        self.outputs = outputs
        self.metrics = metrics
        self.limits = limits

    async def agent(self, stream: Any) -> None:
        async for value in stream:
            try:
                records = decode_outcomes(value, self.limits).records
            except Rejected as exc:
                # Internal, written by the join: a bad value is a bug or an incompatible
                # writer, not user input. Skipped, so that the stage keeps going.
                log.error("outcomes: unreadable internal message skipped (%s)", exc)
                continue
            by_query: dict[str, list[Outcome]] = {}
            for rec in records:
                by_query.setdefault(rec.query_id, []).append(rec)
            for qid, recs in by_query.items():
                await self.on_query(qid, recs)

    async def on_query(self, qid: str, recs: list[Outcome]) -> None:
        """One query's joined steps of a batch: one table write, however many steps."""
        qk = qid.encode()  # table keys are the raw Kafka keys: same partitioner as the inputs
        q, fresh = counted(self.tables.query_util.get(qk), recs)
        if fresh:
            self.tables.query_util[qk] = q
            rating: Rating | None = self.tables.ratings.get(qk)
            if rating is not None and not rating.paired:
                await self.emit_pair(qid, q, rating)
        # Every candidate, counted before or not: a worker killed after its utility reached
        # the changelog may not have sent its sample. ``al_sent`` keeps it to once.
        for rec in recs:
            if rec.al is not None and rec.sample is not None:
                await self._on_candidate(qk, rec, rec.al, rec.sample)

    async def _on_candidate(self, qk: bytes, rec: Outcome, reason: str, sample: str) -> None:
        verdict = None if reason == "uncertain" else self.tables.verdicts.get(qk)
        action = on_candidate(reason, None if verdict is None else bool(verdict.correct))
        if action == "emit":
            await self.emit_sample(rec.query_id, rec.step, sample, reason, rec.ts)
        elif action == "hold":
            self.tables.al_pending[qk] = hold(self.tables.al_pending.get(qk), rec.step, sample, rec.ts)

    async def emit_sample(self, qid: str, step: int, sample: str, reason: str, ts: float) -> None:
        """Send an encoded sample to ``active-learning``, once per (query_id, step)."""
        qk = qid.encode()
        sent = first_send(self.tables.al_sent.get(qk), step, ts)
        if sent is None:
            return
        # Recorded only once the broker has the sample: a worker killed in between sends it
        # again (the same deterministic sample_id), never loses it. Recorded first, the
        # record could reach the changelog without the sample reaching the topic.
        ack = await self.outputs.active_learning.send(key=qk, value=sample.encode())
        await ack
        self.tables.al_sent[qk] = sent
        stored: StoredSamples | None = self.tables.al_samples.get(qk)
        samples = {**(stored.samples if stored is not None else {}), sample_id_for(qid, step): sample}
        self.tables.al_samples[qk] = StoredSamples(samples=samples, ts=max(ts, stored.ts if stored else ts))
        self.metrics.al_samples.labels(reason=reason).inc()

    async def emit_pair(self, qid: str, q: QueryUtility, rating: Rating) -> None:
        """Send the query's (U_query, rating) pair to the drift stage and mark the rating paired."""
        qk = qid.encode()
        self.tables.ratings[qk] = Rating(rating=rating.rating, ts=rating.ts, paired=True)
        pair = RatingPair(id=qid, t=q.ts, u_query=q.u_query, rating=float(rating.rating))
        await self.outputs.rating_pairs.send(key=qk, value=encode(pair.to_dict()), partition=0)
