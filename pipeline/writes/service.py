"""``causalmem writes``: proposed memories in, admitted memories out, by reward-prediction error.

The write gate reads ``memory-writes`` in its own consumer group (partitions shared among
the gates of a deployment) and judges each proposal (:mod:`models.memory.write_gate`):

- ``|reward − expected reward| > θ``: admitted. An ``add`` record goes to
  ``memory-lifecycle`` with ``kind`` ``success`` (positive RPE) or ``pitfall``
  (negative), ``delta`` = RPE and ``source`` ``write-gate``, under the memory id
  :func:`~models.memory.write_gate.memory_id_for` derives from the ``write_id``: a proposal
  judged twice (a replay after a crash) names the same memory, and the compacted
  lifecycle topic keeps one record for it.
- otherwise: rejected, and kept for review on ``memory-writes-rejected`` (compacted by
  ``write_id``, deleted after ``writes_rejected_retention_days``) with the numbers it was
  judged by.
- a value that does not decode (no reward, an embedding of the wrong size, …) goes to
  ``dead-letter`` with its reason.

Each is counted in ``causalmem_writes_decisions_total{decision}``. Offsets are committed
only after the broker acknowledged the batch's outputs (at-least-once; with the derived
memory ids, effectively once for admissions).

The expected reward is always the gate's own running mean per query topic
(:class:`~models.memory.write_gate.RewardEstimator`), never the producer's: a proposal's
``expected_reward`` is compared with it and counted in
``causalmem_writes_claims_total{claim}`` (``agrees``, or ``disagrees`` when more than θ
apart), and kept with a rejection as received, but it decides nothing. That estimate lives
in the process: a restarted gate starts again from ``writes_prior``, and a replayed
proposal is judged against the estimate of the moment, so a replay after a crash may
decide a borderline proposal differently (an admission is never duplicated).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from models.memory.write_gate import Decision, RewardEstimator, WriteGate, memory_id_for
from pipeline.batchstage import BatchStage
from pipeline.config import WritesConfig
from pipeline.metrics import Metrics
from pipeline.writes.metrics import WritesMetrics
from topics.fields import Rejected
from topics.lifecycle import MemoryRecord
from topics.writes import MemoryWrite, RejectedWrite, decode_memory_write

log = logging.getLogger(__name__)

SOURCE = "write-gate"


@dataclass(frozen=True)
class Judged:
    """One proposal and what the gate made of it: a lifecycle record, or a kept rejection."""

    write: MemoryWrite
    decision: Decision
    output: MemoryRecord | RejectedWrite

    @property
    def label(self) -> str:
        return f"admitted_{self.decision.kind}" if self.decision.admitted else "rejected"


class Judge:
    """The gate's decisions with its running estimate, without Kafka (the service wraps it).

    >>> from topics.writes import MemoryWrite
    >>> j = Judge(WriteGate(theta=0.3), RewardEstimator(prior=0.0))
    >>> a = j.judge(MemoryWrite("w1", 1.0, "use the v2 endpoint", "q1", 0, reward=1.0))
    >>> a.label, a.output.kind, a.output.delta, a.output.source
    ('admitted_success', 'success', 1.0, 'write-gate')
    >>> j.judge(MemoryWrite("w2", 2.0, "same again", "q2", 0, reward=0.9)).label  # expected 1.0 now
    'rejected'
    >>> j.judge(MemoryWrite("w3", 3.0, "claims a surprise", "q3", 0, reward=0.9, expected_reward=-5.0)).label
    'rejected'
    """

    def __init__(self, gate: WriteGate, estimator: RewardEstimator) -> None:
        self.gate = gate
        self.estimator = estimator

    def judge(self, write: MemoryWrite, now: float | None = None) -> Judged:
        context = write.query_embedding if write.query_embedding is not None else write.embedding
        # The gate's own expectation decides; the producer's, when sent, is only compared with it.
        decision = self.gate.judge(write.reward, self.estimator.expected(context), write.expected_reward)
        if decision.claim_disagrees:
            log.debug(
                "write %s: claimed expected reward %s, the gate expected %s (%s); judged by the gate's",
                write.write_id,
                decision.claimed_expected_reward,
                decision.expected_reward,
                decision.estimate,
            )
        self.estimator.update(context, write.reward)
        output: MemoryRecord | RejectedWrite
        if decision.admitted:
            output = MemoryRecord(
                op="add",
                memory_id=memory_id_for(write.write_id),
                ts=write.ts,
                text=write.text,
                embedding=write.embedding,
                kind=decision.kind,
                delta=decision.rpe,
                source=SOURCE,
            )
        else:
            output = RejectedWrite(
                write_id=write.write_id,
                ts=time.time() if now is None else now,
                rpe=decision.rpe,
                expected_reward=decision.expected_reward,
                estimate=decision.estimate,
                theta=self.gate.theta,
                write=write,
            )
        return Judged(write, decision, output)


class WriteGateService(BatchStage):
    """The write gate's consume → judge → publish loop (``start`` / ``run`` / ``stop``, or ``async with``).

    Parameters
    ----------
    config
        Topics, consumer group, θ and the estimate's settings (:class:`WritesConfig`).
    bootstrap
        Kafka bootstrap ``HOST:PORT``.
    metrics
        The process's metrics (role ``writes``); the ``causalmem_writes_*`` ones are added
        to its registry.
    """

    def __init__(self, config: WritesConfig, bootstrap: str, metrics: Metrics) -> None:
        own = WritesMetrics(metrics.registry)
        topic = config.connection.topics.memory_writes.name
        super().__init__(config, bootstrap, metrics, "writes", topic, own.partitions_owned, own.batch_seconds)
        self.config = config
        self.own = own
        self.judge = Judge(
            WriteGate(config.theta),
            RewardEstimator(config.prior, config.fading, config.radius, config.min_count),
        )
        self.judged = 0

    # ------------------------------------------------------------------ processing
    async def process(self, records: list[Any]) -> list[Judged]:
        """Decode, judge and publish one batch; commit its offsets once the outputs are acknowledged.

        Returns what was judged. Raises when a send fails (the caller re-reads from the
        committed offsets).
        """
        assert self._dead is not None
        ends: dict[TopicPartition, int] = {}
        judged: list[Judged] = []
        futures = []
        for msg in records:
            tp = TopicPartition(msg.topic, msg.partition)
            ends[tp] = max(ends.get(tp, 0), msg.offset + 1)
            self.metrics.events_in.labels(topic=msg.topic).inc()
            try:
                write = decode_memory_write(msg.value, self.limits, msg.key)
            except Rejected as rej:
                self._dead.send(msg, rej.reason, rej.detail)
                self.own.decisions.labels(decision="invalid").inc()
                continue
            j = self.judge.judge(write)
            judged.append(j)
            out = j.output
            topic = self.config.lifecycle_topic if isinstance(out, MemoryRecord) else self.rejected_topic
            futures.append(await self._producer.send(topic, out.to_bytes(), key=out.key))
        if futures:
            await asyncio.gather(*futures)
        await self._dead.flush()
        for j in judged:  # counted once acknowledged
            self.own.decisions.labels(decision=j.label).inc()
            self.own.rpe.observe(j.decision.rpe)
            self.own.estimates.labels(estimate=j.decision.estimate).inc()
            if j.decision.claimed_expected_reward is not None:
                self.own.claims.labels(claim="disagrees" if j.decision.claim_disagrees else "agrees").inc()
        self.own.clusters.set(self.judge.estimator.n_clusters)
        self.judged += len(judged)
        await self.commit(ends)
        return judged

    @property
    def rejected_topic(self) -> str:
        return str(self.topics.memory_writes_rejected.name)
