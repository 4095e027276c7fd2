"""The join stage: RetrievalEvent ⋈ LLMFeedback on (query_id, step), batched.

This is the hot path (Decision Service's "join"). It reads both input topics with one
aiokafka consumer group in batches (``getmany``): a per-event faust agent reaches only
~5% of raw consume speed on one core (docs/architecture.md, "Why not a faust agent?"),
so the volume stage is batched and the faust stages downstream get one message per batch
and partition (a few when it would exceed ``max_outcomes_bytes``).

Per input partition it keeps the events still waiting for their other half, in either
arrival order, for ``join_window_s`` of that partition's own event time
(:mod:`pipeline.worker.partitions`); unmatched events are then evicted and counted. An
event or feedback whose ``ts`` is more than ``max_future_skew_s`` ahead of the wall clock
goes to dead-letter (``ts_in_future``) and never reaches the join state. A message whose
``event_id`` was seen is a retransmission, counted in ``causalmem_duplicates_total`` and
skipped; one whose ``event_id`` is new but whose ``(query_id, step)`` another event of its
topic already holds (joined, or waiting) goes to dead-letter (``step_reused``, a client
reusing query ids after a restart: :func:`step_verdict`) and is never joined. Each partition's
state (pending halves and remembered ids) is also bounded in bytes, its share of
``join_state_max_bytes``: past it the oldest entries are shed as each message arrives,
counted in ``causalmem_join_shed_total{buffer,reason}`` and logged at most every
:data:`SHED_LOG_EVERY_S` seconds (:class:`ShedReport`), never dead-lettered: a shed half
was valid input, skipped like one past the window (as the count caps always did).

State is not checkpointed anywhere: the committed offset of each input partition is the
offset of its oldest still-pending event, so a worker that takes a partition over (after
a crash or a rebalance) rebuilds the pending state by re-reading from there. Offsets are
committed only as far as the broker has acknowledged every output of the inputs before
them (experiences, outcomes, dead letters); after a failed send the stage forgets its
state and re-reads from there. Joins re-emitted by a re-read carry the retrieval event's
id, and every consumer downstream applies an id once (at-least-once delivery, idempotent
processing).

Outputs, acknowledged before the input offsets are committed:

- ``experiences`` (1 partition): each joined, non-fallback step with its utility, for
  the learner;
- ``outcomes`` (co-partitioned by query_id): per batch and partition, messages of at most
  ``max_outcomes_bytes`` with a compact record per joined step (:class:`~topics.internal.Outcome`: utility, and
  the encoded ActiveLearningSample when the step is a candidate under
  :mod:`pipeline.worker.active_learning`), for the faust stages;
- ``dead-letter``: every rejected message with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiokafka import ConsumerRebalanceListener, TopicPartition
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter
from river import stats, utils

from pipeline import kafka
from pipeline.config import JoinConfig
from pipeline.deadletter import DeadLetterWriter
from pipeline.metrics import ROLES, Metrics
from pipeline.service import Service
from pipeline.worker.active_learning import CandidateRule
from pipeline.worker.partitions import JoinedStep, PartitionState, event_clock, hold
from topics.convert import make_sample
from topics.events import RetrievalEvent, decode_retrieval_event
from topics.feedback import LLMFeedback, decode_llm_feedback
from topics.fields import Rejected, encode
from topics.internal import Outcome, experience_bytes, outcomes_messages
from topics.principal import Keyring

log = logging.getLogger(__name__)


COMMIT_INTERVAL_S = 1.0
REWIND_PAUSE_S = 1.0  # after a failed send, before re-reading
SHED_LOG_EVERY_S = 5.0  # at most one shedding warning per this many seconds (the rest are summed into it)


def step_verdict(event_id: str, seen: bool, holder: str | None) -> str:
    """What the join does with a valid message of one topic for a ``(query_id, step)``.

    ``seen``: its ``event_id`` is among the ids remembered for the topic; ``holder``: the id
    of the event of the same topic that holds the step (joined, or waiting for its other
    half), None when none does. ``"duplicate"``: a retransmission (at-least-once delivery),
    counted and skipped silently; ``"step_reused"``: a new event for a step another event
    holds, dead-lettered and never joined (docs/contract.md §2); ``"new"``: joined or held.

    >>> step_verdict("e1", seen=True, holder="e1"), step_verdict("e1", seen=False, holder="e1")
    ('duplicate', 'duplicate')
    >>> step_verdict("e2", seen=False, holder="e1"), step_verdict("e2", seen=False, holder=None)
    ('step_reused', 'new')
    """
    if seen or holder == event_id:
        return "duplicate"
    return "new" if holder is None else "step_reused"


def step_reused_detail(query_id: str, step: int, event_id: str, holder: str, how: str) -> str:
    """The dead letter's detail: why first (what a log line shows), then the ids (at most 64 characters each)."""
    return (
        "a new event_id for a step another event holds: query ids must be unique across restarts "
        f"(docs/contract.md §2); step {step} of query {query_id[:64]!r} is held by event {holder[:64]!r} "
        f"({how}), not by this event {event_id[:64]!r}"
    )


@dataclass
class _BatchTally:
    """What one fetched batch saw, recorded in the metrics at once."""

    retrievals: int = 0
    kept: int = 0
    dropped: int = 0
    fallbacks: int = 0
    intervention: list[float] = field(default_factory=list)
    mask_max: list[float] = field(default_factory=list)
    utilities: list[float] = field(default_factory=list)
    shed: Counter[tuple[str, str]] = field(default_factory=Counter)  # (buffer, reason) -> entries


class JoinStats:
    """Rolling retrieval statistics for the health score (river rolling weighted means).

    Updated once per batch with the batch's mean, weighted by its size; the window is the
    last ``window`` batches.
    """

    def __init__(self, window: int = 50) -> None:
        # river's Rolling forwards to its wrapped statistic, which mypy cannot see.
        self.intervention: Any = utils.Rolling(stats.Mean, window_size=window)
        self.fallback: Any = utils.Rolling(stats.Mean, window_size=window)
        self.utility: Any = utils.Rolling(stats.Mean, window_size=window)
        self.utility_nonneg: Any = utils.Rolling(stats.Mean, window_size=window)


class JoinStateMetrics:
    """Entries shed by buffer and reason, and the bytes the join's state is counted for.

    ``causalmem_join_shed_total{buffer,reason}``: an entry dropped for a cap, not for the
    join window (that is ``causalmem_join_expired_total``); ``buffer`` is ``retrieval`` or
    ``feedback`` (pending halves, never joined) or ``seen_retrieval``, ``seen_feedback``,
    ``joined`` (remembered ids and steps, which no longer stop a duplicate or a reused
    step); ``reason`` is ``max_bytes`` or ``max_count``. ``causalmem_join_state_bytes``: what the owned
    partitions are counted for. Like the evaluator's and the write gate's own metrics they
    live on the registry of the process's :class:`~pipeline.metrics.Metrics` (when its role
    exports the worker's), one set per ``Metrics`` (:func:`join_state_metrics`).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.shed = PromCounter(
            "causalmem_join_shed_total",
            "Join state entries dropped over a cap (pending halves never joined, remembered ids), by buffer and reason",
            ["buffer", "reason"],
            registry=registry,
        )
        for buffer in ("retrieval", "feedback"):  # exported from the start (0 until it happens)
            self.shed.labels(buffer=buffer, reason="max_bytes")
        self.state_bytes = Gauge(
            "causalmem_join_state_bytes",
            "Bytes the join's state is counted for (pending halves and remembered ids), owned partitions",
            registry=registry,
        )


_BY_METRICS: weakref.WeakKeyDictionary[Metrics, JoinStateMetrics] = weakref.WeakKeyDictionary()


def join_state_metrics(metrics: Metrics) -> JoinStateMetrics:
    """The join state's metrics of ``metrics``' process (made once, exported when its role has the worker's)."""
    own = _BY_METRICS.get(metrics)
    if own is None:
        exported = "worker" in ROLES.get(metrics.role, set())
        own = JoinStateMetrics(metrics.registry if exported else CollectorRegistry())
        _BY_METRICS[metrics] = own
    return own


class ShedReport:
    """Counts what was shed and logs a warning at most every ``every_s`` seconds (the sum since the last).

    >>> clock = iter([100.0, 101.0, 106.0]).__next__
    >>> r = ShedReport(join_state_metrics(Metrics()), cap_bytes=1024, every_s=5.0, clock=clock)
    >>> r.record(Counter({("retrieval", "max_bytes"): 3}))  # logged
    >>> r.record(Counter({("retrieval", "max_bytes"): 2}))  # summed, 1 s later
    >>> r.unlogged
    2
    >>> r.record(Counter({("seen_feedback", "max_count"): 1}))  # logged with the 2 before
    >>> r.unlogged
    0
    """

    def __init__(
        self,
        metrics: JoinStateMetrics,
        cap_bytes: int,
        every_s: float = SHED_LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.cap_bytes = cap_bytes
        self.every_s = every_s
        self._clock = clock
        self._last_log: float | None = None
        self._since: Counter[tuple[str, str]] = Counter()

    @property
    def unlogged(self) -> int:
        return sum(self._since.values())

    def record(self, shed: Counter[tuple[str, str]]) -> None:
        """Count ``shed`` ((buffer, reason) → entries) and log it unless a warning went out recently."""
        if not shed:
            return
        for (buffer, reason), n in shed.items():
            self.metrics.shed.labels(buffer=buffer, reason=reason).inc(n)
        self._since.update(shed)
        now = self._clock()
        if self._last_log is not None and now - self._last_log < self.every_s:
            return
        what = ", ".join(f"{n} {buffer} ({reason})" for (buffer, reason), n in sorted(self._since.items()))
        # Counts only: never an id or a value, which clients wrote.
        log.warning(
            "join: shed the oldest entries of its state over the caps (%d bytes per partition): %s "
            "(causalmem_join_shed_total; docs/operations.md, 'Worker memory')",
            self.cap_bytes,
            what,
        )
        self._last_log = now
        self._since.clear()


class JoinStage(Service):
    """Batched join with an explicit lifecycle (``start`` / ``run`` / ``stop``, or ``async with``)."""

    def __init__(self, config: JoinConfig, bootstrap: str, metrics: Metrics, group_id: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.bootstrap = bootstrap
        self.metrics = metrics
        self.topics = config.connection.topics
        self.limits = config.connection.limits
        self.group_id = group_id or config.group_id
        self._kind = {self.topics.retrieval_events.name: "retrieval", self.topics.llm_feedback.name: "feedback"}
        self.state: dict[int, PartitionState] = {}
        # Offsets whose inputs' outputs the broker has acknowledged: the only ones committed.
        self.acked: dict[TopicPartition, int] = {}
        self.stats = JoinStats()
        self.rule = CandidateRule(config.active_learning)
        # Contract 1.16: the principals whose values must be signed (None: every name is a claim).
        self.keyring = Keyring.load(config.principal_keys) if config.principal_keys else None
        self.joined_total = 0
        self.max_bytes = config.partition_max_bytes  # per input partition (pending halves and remembered ids)
        self.state_metrics = join_state_metrics(metrics)
        self.shed = ShedReport(self.state_metrics, self.max_bytes)
        self._consumer: Any = None
        self._producer: Any = None
        self._dead: DeadLetterWriter | None = None
        self._stopping = asyncio.Event()
        self._last_commit = 0.0
        self.ready = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def _start(self) -> None:
        conn = self.config.connection
        self._stopping.clear()
        self._producer = await kafka.start_producer(self.bootstrap, conn, linger_ms=kafka.BULK_LINGER_MS)
        self._dead = DeadLetterWriter(self._producer, self.topics.dead_letter.name, self.metrics)
        self._consumer = kafka.consumer(
            self.bootstrap, conn, group_id=self.group_id, max_poll_records=self.config.batch
        )
        self._consumer.subscribe(
            [self.topics.retrieval_events.name, self.topics.llm_feedback.name], listener=_Rebalance(self)
        )
        await self._consumer.start()

    async def _stop(self) -> None:
        self._stopping.set()
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._flush_and_commit(force=True)
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def run(self) -> None:
        """Consume until :meth:`stop`. Never raises on bad input."""
        assert self._consumer is not None
        while not self._stopping.is_set():
            try:
                batch = await self._consumer.getmany(timeout_ms=200, max_records=self.config.batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker hiccups: keep going, report once per failure
                log.warning("join: fetch failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            if self._consumer.assignment():
                self.ready.set()
            if batch:
                t0 = time.perf_counter()
                try:
                    await self.process(batch)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # outputs not acknowledged: nothing past them is committed
                    log.error("join: sending outputs failed (%r); re-reading from the acknowledged offsets", exc)
                    await asyncio.sleep(REWIND_PAUSE_S)
                    await self.rewind()
                    continue
                self.metrics.join_batch_seconds.observe(time.perf_counter() - t0)
            await self._flush_and_commit()
            self._export_lag()

    # ------------------------------------------------------------------ processing
    async def process(self, batch: dict[TopicPartition, list[Any]]) -> None:
        """Validate, join and emit one fetched batch (public for tests and benchmarks).

        Returns once the broker has acknowledged every output of the batch; only then do
        its input offsets become committable (:attr:`acked`). Raises if a send fails.
        """
        experiences: list[bytes] = []
        outcomes: dict[int, list[Outcome]] = {}
        tally = _BatchTally()
        now = time.time()
        latest = now + self.config.max_future_skew_s  # the latest ts accepted in this batch
        for tp, messages in batch.items():
            kind = self._kind.get(tp.topic)
            if kind is None:
                continue
            st = self.state.setdefault(tp.partition, PartitionState())
            self.metrics.events_in.labels(topic=tp.topic).inc(len(messages))
            for msg in messages:
                st.position[kind] = msg.offset + 1
                try:
                    value = (
                        decode_retrieval_event(msg.value, self.limits, msg.key)
                        if kind == "retrieval"
                        else decode_llm_feedback(msg.value, self.limits, msg.key)
                    )
                    if self.keyring is not None:
                        value.principal = self.keyring.proven(value.principal, msg.value, msg.headers)
                except Rejected as rej:
                    assert self._dead is not None
                    self._dead.send(msg, rej.reason, rej.detail)
                    continue
                if value.ts > latest:  # would move this partition's clock: never reaches the state
                    assert self._dead is not None
                    skew = self.config.max_future_skew_s
                    ahead = f"ts {value.ts:.3f} is {value.ts - now:.0f} s ahead of the worker's clock (max {skew:g} s)"
                    self._dead.send(msg, "ts_in_future", ahead)
                    continue
                seen = st.seen_retrieval if kind == "retrieval" else st.seen_feedback
                key = (value.query_id, value.step)
                held = st.holder(kind, key)
                verdict = step_verdict(value.event_id, value.event_id in seen, None if held is None else held[0])
                if verdict == "duplicate":
                    self.metrics.duplicates.labels(topic=tp.topic).inc()
                    continue
                if verdict == "step_reused":  # changes no state: neither remembered nor joined
                    assert self._dead is not None and held is not None
                    detail = step_reused_detail(value.query_id, value.step, value.event_id, *held)
                    self._dead.send(msg, "step_reused", detail)
                    continue
                seen.put(value.event_id, value.ts)
                st.advance(value.ts)
                if isinstance(value, RetrievalEvent):
                    self._observe_retrieval(value, tally)
                    other = st.feedback.pop(key)
                    if other is None:
                        st.retrieval.put(key, hold(value, msg.offset))
                        self._bound(st, tally)
                        continue
                    event, feedback = value, other.value
                else:
                    other = st.retrieval.pop(key)
                    if other is None:
                        st.feedback.put(key, hold(value, msg.offset))
                        self._bound(st, tally)
                        continue
                    event, feedback = other.value, value
                st.joined.put(key, JoinedStep(max(event.ts, feedback.ts), event.event_id, feedback.event_id))
                self._bound(st, tally)
                self._emit(event, feedback, experiences, outcomes, tally, tp.partition)
        self._record(tally)
        self._evict(tally)
        await self._send(experiences, outcomes)
        if self._dead is not None:
            await self._dead.flush()
        self.acked = self.commit_offsets()

    def _bound(self, st: PartitionState, tally: _BatchTally) -> None:
        """Keep the partition within its bytes as each message arrives, not only after the batch."""
        if st.held_bytes() > self.max_bytes:
            for buffer, n in st.shed(self.max_bytes).items():
                tally.shed[(buffer, "max_bytes")] += n

    def _observe_retrieval(self, e: RetrievalEvent, tally: _BatchTally) -> None:
        tally.retrievals += 1
        tally.kept += len(e.candidates)
        dropped = len(e.dropped or ())
        tally.dropped += dropped
        if dropped + len(e.candidates):
            tally.intervention.append(dropped / (dropped + len(e.candidates)))
        tally.fallbacks += e.fallback
        if e.mask_max is not None:
            tally.mask_max.append(e.mask_max)

    def _record(self, tally: _BatchTally) -> None:
        """Metrics and rolling statistics once per batch (per event they cost ~10% of the join)."""
        m, st = self.metrics, self.stats
        if tally.retrievals:
            m.retrievals.inc(tally.retrievals)
            m.candidates_kept.inc(tally.kept)
            m.candidates_dropped.inc(tally.dropped)
            m.fallbacks.inc(tally.fallbacks)
            for v in tally.mask_max:
                m.mask_max.observe(v)
            if tally.intervention:
                st.intervention.update(float(np.mean(tally.intervention)), w=len(tally.intervention))
            st.fallback.update(tally.fallbacks / tally.retrievals, w=tally.retrievals)
            m.intervention_rate.set(st.intervention.get())
            m.fallback_rate.set(st.fallback.get())
        if tally.utilities:
            m.joins.inc(len(tally.utilities))
            for u in tally.utilities:
                m.utility.observe(u)
            st.utility.update(float(np.mean(tally.utilities)), w=len(tally.utilities))
            st.utility_nonneg.update(float(np.mean([u >= 0 for u in tally.utilities])), w=len(tally.utilities))
            m.utility_mean.set(st.utility.get())

    def _emit(
        self,
        event: RetrievalEvent,
        feedback: LLMFeedback,
        experiences: list[bytes],
        outcomes: dict[int, list[Outcome]],
        tally: _BatchTally,
        partition: int,
    ) -> None:
        u = feedback.utility
        ts = max(event.ts, feedback.ts)
        self.joined_total += 1
        tally.utilities.append(u)
        if not event.fallback:  # fallback steps feed metrics and U_query, not the gradient
            effects = feedback.slot_effects(event.selected)
            # Contract 1.15: the experience names both halves' principals (the event's travels with it).
            experiences.append(experience_bytes(event, u, effects, feedback_principal=feedback.principal))
        reason = self.rule.classify(event, u)
        # A candidate's sample is built and encoded here, once: the outcomes stage forwards
        # these bytes to active-learning as they are.
        sample = encode(make_sample(event, u, reason, ts).to_dict()).decode() if reason else None
        # Producers key by query_id with Kafka's murmur2 partitioner (the contract), so the input
        # partition is the key's partition, where the query's table state lives.
        outcomes.setdefault(partition, []).append(
            Outcome(event.query_id, event.step, ts, u, event.fallback, event.policy, al=reason, sample=sample)
        )

    def _evict(self, tally: _BatchTally) -> None:
        """Expire each partition's halves by its own event time (one partition cannot age another's),
        shed what is over the caps, and report both."""
        pending = held = 0
        for st in self.state.values():
            dropped = st.evict(self.config.window_s, self.max_bytes)
            for side, n in dropped.expired.items():
                self.metrics.join_expired.labels(side=side).inc(n)
            tally.shed.update(dropped.shed)
            pending += st.pending()
            held += st.held_bytes()
        self.shed.record(tally.shed)
        self.metrics.join_pending.set(pending)
        self.state_metrics.state_bytes.set(held)

    def event_clock(self) -> float | None:
        """The slowest owned partition's watermark (None before any event): the clock for table pruning."""
        return event_clock(self.state)

    async def _send(self, experiences: list[bytes], outcomes: dict[int, list[Outcome]]) -> None:
        p = self._producer
        futures = []
        # Experiences go in explicit record batches: one produce call per ~256 KiB instead
        # of one per experience (aiokafka's per-send overhead was ~10% of the join).
        batch = p.create_batch()
        for value in experiences:
            if batch.append(key=None, value=value, timestamp=None) is None:
                futures.append(await p.send_batch(batch, self.topics.experiences.name, partition=0))
                batch = p.create_batch()
                batch.append(key=None, value=value, timestamp=None)
        if batch.record_count():
            futures.append(await p.send_batch(batch, self.topics.experiences.name, partition=0))
        # Split by size: a burst of feedback for many pending events must not become one
        # message over the broker's limit.
        for partition, records in outcomes.items():
            for body in outcomes_messages(records, self.config.max_outcomes_bytes):
                futures.append(await p.send(self.topics.outcomes.name, body, partition=partition))
        if futures:
            await asyncio.gather(*futures)

    # ------------------------------------------------------------------ offsets
    async def _flush_and_commit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_commit < COMMIT_INTERVAL_S:
            return
        self._last_commit = now
        assigned = self._consumer.assignment() if self._consumer else set()
        offsets = {tp: off for tp, off in self.acked.items() if tp in assigned}
        if offsets:
            try:
                await self._consumer.commit(offsets)
            except Exception as exc:  # rebalance in progress: the next commit catches up
                log.info("join: commit skipped: %r", exc)

    def commit_offsets(self) -> dict[TopicPartition, int]:
        """The offsets the current state allows (committed once its outputs are acknowledged)."""
        out: dict[TopicPartition, int] = {}
        assigned = self._consumer.assignment() if self._consumer else set()
        for tp in assigned:
            st = self.state.get(tp.partition)
            kind = self._kind[tp.topic]
            offset = st.commit_offset(kind) if st else None
            if offset is not None:
                out[tp] = offset
        return out

    def _export_lag(self) -> None:
        c = self._consumer
        if c is None:  # stopped meanwhile
            return

        lags: dict[str, int] = {}
        for tp in c.assignment():
            hw = c.highwater(tp)
            pos = self.state.get(tp.partition, PartitionState()).position.get(self._kind[tp.topic])
            if hw is not None and pos is not None:
                lags[tp.topic] = lags.get(tp.topic, 0) + max(0, hw - pos)
        for topic, lag in lags.items():
            self.metrics.consumer_lag.labels(topic=topic).set(lag)

    async def rewind(self) -> None:
        """Forget the join state and re-read every owned partition from its acknowledged offset.

        Used after a failed send: the state had moved past inputs whose outputs the broker
        never acknowledged. What is re-read and joined again is deduplicated downstream.
        """
        c = self._consumer
        self.state.clear()
        if self._dead is not None:  # drop what the failed batch left in flight: it is re-read
            with contextlib.suppress(Exception):
                await self._dead.flush()
        if c is None:  # stopped meanwhile: the next owner re-reads from the committed offsets
            return
        for tp in c.assignment():
            offset = self.acked.get(tp)
            if offset is None:
                offset = await c.committed(tp)
            if offset is None:
                await c.seek_to_beginning(tp)
            else:
                c.seek(tp, offset)

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        try:
            await self._flush_and_commit(force=True)
        except Exception as exc:
            log.info("join: commit on revoke failed: %r", exc)
        for tp in revoked:
            # Its new owner rebuilds this state by re-reading from the committed offset.
            self.state.pop(tp.partition, None)
            self.acked.pop(tp, None)

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        parts = {tp.partition for tp in assigned}
        self.metrics.partitions_owned.labels(stage="join").set(len(parts))
        log.info("join: assigned partitions %s", sorted(parts))


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, stage: JoinStage) -> None:
        self.stage = stage

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.stage.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.stage.on_assigned(set(assigned))
