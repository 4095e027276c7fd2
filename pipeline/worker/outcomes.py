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
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from pipeline import kafka
from pipeline.config import Connection
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

    def __init__(
        self,
        tables: Tables,
        outputs: Outputs,
        metrics: Metrics,
        limits: Limits,
        sent_before: Callable[[], Awaitable[set[str]]] | None = None,
    ) -> None:
        self.tables = tables
        self.outputs = outputs
        self.metrics = metrics
        self.limits = limits
        # The sample ids already on ``active-learning`` when this process started (read once,
        # at the first sample): a sample acknowledged just before a crash whose ``al-sent``
        # write was lost is recorded, not sent again. None: not checked (unit tests).
        self._sent_before = sent_before
        self._on_topic: set[str] | None = None

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
        sid = sample_id_for(qid, step)
        # Recorded only once the broker has the sample: recorded first, the record could
        # reach the changelog without the sample reaching the topic. A worker killed in
        # between finds the sample on the topic at its next start (``sent_before``).
        if not await self._already_on_topic(sid):
            ack = await self.outputs.active_learning.send(key=qk, value=sample.encode())
            await ack
            self.metrics.al_samples.labels(reason=reason).inc()
        self.tables.al_sent[qk] = sent
        stored: StoredSamples | None = self.tables.al_samples.get(qk)
        samples = {**(stored.samples if stored is not None else {}), sid: sample}
        self.tables.al_samples[qk] = StoredSamples(samples=samples, ts=max(ts, stored.ts if stored else ts))

    async def _already_on_topic(self, sid: str) -> bool:
        if self._sent_before is None:
            return False
        if self._on_topic is None:
            self._on_topic = await self._sent_before()
        return sid in self._on_topic

    async def emit_pair(self, qid: str, q: QueryUtility, rating: Rating) -> None:
        """Send the query's (U_query, rating) pair to the drift stage and mark the rating paired."""
        qk = qid.encode()
        self.tables.ratings[qk] = Rating(rating=rating.rating, ts=rating.ts, paired=True)
        pair = RatingPair(id=qid, t=q.ts, u_query=q.u_query, rating=float(rating.rating))
        await self.outputs.rating_pairs.send(key=qk, value=encode(pair.to_dict()), partition=0)


SENT_TAIL = 500  # the last samples per partition read at start: far more than a crash leaves unrecorded


async def sent_sample_ids(bootstrap: str, conn: Connection, tail: int = SENT_TAIL) -> set[str]:
    """The ``sample_id`` of the last ``tail`` samples of each ``active-learning`` partition.

    A sample's ``al-sent`` record is written after the broker acknowledged the sample, so a
    crash can lose the record of the last few sent (those whose changelog write was still
    in flight), never more than a producer batch or so.
    """
    spec = conn.topics.active_learning
    ids: set[str] = set()
    for p in range(spec.partitions):
        end = await kafka.high_watermark(bootstrap, conn, spec.name, p)
        if end == 0:
            continue
        for m in await kafka.read_all(bootstrap, conn, spec.name, partitions=[p], start={p: max(0, end - tail)}):
            try:
                sid = orjson.loads(m.value).get("sample_id")
            except (orjson.JSONDecodeError, AttributeError, TypeError):
                continue  # not a sample: the labeling queue dead-letters it
            if isinstance(sid, str):
                ids.add(sid)
    return ids
