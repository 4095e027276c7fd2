"""The worker: a faust app with the join stage and the stateful label stages.

``causalmem worker`` runs one of these; run several on more machines to scale out (the
input topics' partitions are split between them). Stages:

- **join** (:mod:`pipeline.worker.join`): batched aiokafka consumer inside the worker process;
- **outcomes** agent: keeps per-query utility (``U_query``) and the active-learning
  candidates in faust tables, keyed by query id and co-partitioned with ``human-labels``;
- **labels** agent: validates human labels, joins verdicts with error candidates into
  ActiveLearningSamples (either arrival order, once per (query_id, step)), pairs ratings
  with ``U_query``, and turns answers to queued samples into label experiences;
- **drift** agent (one partition, so one owner): the 7-day correlation and the reset
  trigger; its status is shared with every worker through a global table.

Tables live in memory and are rebuilt from their changelog topics on start or takeover
(faust ``memory://`` store). Entries older than ``label_window_s`` of event time are
pruned, which bounds memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import faust
import mode
import orjson

from models.drift import DriftMonitor
from models.health import health_score
from models.serving_rule import first_draw_probs
from pipeline.config import Settings
from pipeline.kafka import ClusterWatch, faust_credentials
from pipeline.metrics import Metrics
from pipeline.service import restart_process
from pipeline.worker.join import JoinStage
from topics.events import RetrievalEvent, retrieval_event_from_obj
from topics.fields import SCHEMA_RATING_PAIR, Rejected, encode, loads_object
from topics.internal import Control, Experience, dead_letter_value
from topics.labels import ActiveLearningSample, HumanLabel, decode_human_label

log = logging.getLogger(__name__)

MAX_STEPS_PER_QUERY = 256
TOP_SLOTS = 5


def sample_id_for(query_id: str, step: int) -> str:
    """Deterministic, so that a repeated emission is recognisably the same sample."""
    return hashlib.sha256(f"{query_id}\x00{step}".encode()).hexdigest()[:24]


def top_slots(event: RetrievalEvent, n: int = TOP_SLOTS) -> list[dict[str, float]]:
    """The serving policy's most likely candidates (first-draw probabilities)."""
    if event.candidate_probs is not None and len(event.candidate_probs) == len(event.candidates):
        probs = event.candidate_probs
    elif event.candidates:
        probs = first_draw_probs(event.scores / event.temperature)
    else:
        return []
    order = sorted(range(len(event.candidates)), key=lambda i: -float(probs[i]))[:n]
    return [{"slot": int(event.candidates[i]), "prob": round(float(probs[i]), 6)} for i in order]


def make_sample(event: RetrievalEvent, utility: float, reason: str, ts: float) -> ActiveLearningSample:
    return ActiveLearningSample(
        sample_id=sample_id_for(event.query_id, event.step),
        query_id=event.query_id,
        step=event.step,
        ts=ts,
        reason=reason,
        utility=utility,
        policy_version=event.policy_version,
        features=event.features,
        candidates=event.candidates,
        selected=event.selected,
        top_slots=top_slots(event),
        query_text=event.query_text,
        memory_texts=event.memory_texts,
        scores=event.scores,
        temperature=event.temperature,
        policy=event.policy,
    )


def label_experience(label: HumanLabel, sample: dict[str, Any], limits: Any) -> Experience:
    """An answered sample as a learner input (kind ``label``)."""
    event = retrieval_event_from_obj(
        {
            "schema": "retrieval_event/v1",
            "event_id": sample["sample_id"],
            "query_id": sample["query_id"],
            "step": sample["step"],
            "ts": sample["ts"],
            "policy": sample.get("policy", "default"),
            "policy_version": sample["policy_version"],
            "features": sample["features"],
            "candidates": sample["candidates"],
            "scores": sample.get("scores") or [0.0] * len(sample["candidates"]),
            "selected": [s for s in sample["selected"] if s in sample["candidates"]],
            "temperature": sample.get("temperature") or 1.0,
            "logprob": 0.0,
            "fallback": False,
        },
        limits,
    )
    return Experience(
        id=label.event_id, kind="label", event=event, utility=0.0, correct_memories=label.correct_memories
    )


class JoinService(mode.Service):
    """Runs the join stage inside the faust worker's lifecycle."""

    def __init__(self, stage: JoinStage, watch: ClusterWatch | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = stage
        self.watch = watch

    async def on_start(self) -> None:
        await self.stage.start()
        if self.watch is not None:
            await self.watch.start()

    async def on_stop(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        await self.stage.stop()

    @mode.Service.task
    async def _run(self) -> None:
        await self.stage.run()


class Worker:
    """Builds the faust app and its stages for one worker process."""

    def __init__(self, settings: Settings, bootstrap: str, metrics: Metrics, web_port: int | None = None) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.metrics = metrics
        self.topics = settings.topics()
        self.limits = settings.limits()
        self.join = JoinStage(settings, bootstrap, metrics)
        self.drift = DriftMonitor(
            days=settings.drift_window_days,
            drop=settings.drift_drop,
            min_pairs=settings.drift_min_pairs,
            cooldown_s=settings.drift_cooldown_s,
            page_hinkley=settings.drift_page_hinkley,
        )
        self._drift_built = False
        self._pairs_since_prune = 0
        self.app = self._build_app(web_port)

    def _build_app(self, web_port: int | None) -> faust.App:
        s, t = self.settings, self.topics
        app = faust.App(
            f"{s.topic_prefix}causalmem-worker",
            broker=[f"kafka://{b}" for b in self.bootstrap.split(",")],
            broker_credentials=faust_credentials(s.security),
            store="memory://",
            topic_partitions=s.partitions,
            # DESIGN §8: the embedded broker holds JoinGroup for session_timeout/2.
            broker_session_timeout=6,
            broker_heartbeat_interval=1,
            web_enabled=web_port is not None,
            web_bind="127.0.0.1",
            web_port=web_port or 6066,
            producer_acks=-1,
            consumer_auto_offset_reset="earliest",
            processing_guarantee="at_least_once",
            autodiscover=False,
            table_cleanup_interval=30.0,
            worker_redirect_stdouts=False,
            # Table files (if any) live in the state directory, not in the current one.
            datadir=str(s.state_path() / "faust"),
        )

        raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
        outcomes = app.topic(t.outcomes.name, partitions=t.outcomes.partitions, **raw)
        labels = app.topic(t.human_labels.name, partitions=t.human_labels.partitions, **raw)
        pairs = app.topic(t.rating_pairs.name, partitions=1, **raw)
        self.al_topic = app.topic(t.active_learning.name, partitions=t.active_learning.partitions, **raw)
        self.exp_topic = app.topic(t.experiences.name, partitions=1, **raw)
        self.dead_topic = app.topic(t.dead_letter.name, partitions=1, **raw)
        self.pairs_topic = pairs
        # The stage inputs whose backlog is lag; the tables' changelog partitions are also
        # assigned to this consumer but are only read during recovery (their position stays put).
        self.stage_topics = frozenset({t.outcomes.name, t.human_labels.name, t.rating_pairs.name})
        self.control_topic = app.topic(t.control.name, partitions=1, **raw)

        # Tables keyed by query id and partitioned like the inputs (murmur2 of the raw key).
        def qtable(name: str) -> Any:
            return app.Table(name, default=None, key_type=bytes, use_partitioner=True, partitions=s.partitions)

        self.query_util = qtable("query-utility")  # qid -> {"sum", "n", "steps", "ts", "p"}
        self.verdicts = qtable("verdicts")  # qid -> {"correct": bool, "ts"}
        self.al_pending = qtable("al-pending")  # qid -> {step: {"event", "utility", "ts"}}
        self.al_sent = qtable("al-sent")  # qid -> {step: ts}
        self.al_samples = qtable("al-samples")  # qid -> {sample_id: sample dict}
        self.ratings = qtable("ratings")  # qid -> {"rating", "ts", "paired": bool}
        self.labels_seen = qtable("labels-seen")  # qid -> {event_id: ts}
        self.drift_pairs = app.Table("drift-pairs", default=None, key_type=bytes, partitions=1)  # id -> [t, u, r]
        self.drift_state = app.Table("drift-state", default=None, key_type=bytes, partitions=1)
        self.drift_status = app.GlobalTable("drift-status", default=None, key_type=bytes, partitions=1)

        app.agent(outcomes, name="outcomes")(self._outcomes_agent)
        app.agent(labels, name="labels")(self._labels_agent)
        app.agent(pairs, name="drift")(self._drift_agent)
        app.timer(interval=5.0)(self._health_timer)
        app.timer(interval=30.0)(self._prune_timer)
        return app

    # ------------------------------------------------------------------ outcomes
    async def _outcomes_agent(self, stream: Any) -> None:
        async for value in stream:
            try:
                body = orjson.loads(value)
                records = body["records"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                log.error("outcomes: unreadable internal message skipped")
                continue
            by_query: dict[str, list[dict[str, Any]]] = {}
            for rec in records:
                by_query.setdefault(rec["query_id"], []).append(rec)
            for qid, recs in by_query.items():
                await self._on_query_outcomes(qid, recs)

    async def _on_query_outcomes(self, qid: str, recs: list[dict[str, Any]]) -> None:
        """One query's joined steps of a batch: one table write, however many steps."""
        qk = qid.encode()  # table keys are the raw Kafka keys: same partitioner as the inputs
        q = self.query_util.get(qk) or {"sum": 0.0, "n": 0, "steps": [], "ts": 0.0}
        fresh = []
        for rec in recs:
            step = int(rec["step"])
            if step in q["steps"]:
                continue  # a join re-emitted after a takeover: counted once
            q["sum"] += float(rec["utility"])
            q["n"] += 1
            q["steps"] = ([*q["steps"], step])[-MAX_STEPS_PER_QUERY:]
            q["ts"] = max(q["ts"], float(rec["ts"]))
            fresh.append(rec)
        if not fresh:
            return
        self.query_util[qk] = q
        rating = self.ratings.get(qk)
        if rating and not rating.get("paired"):
            await self._emit_pair(qid, q, rating)
        for rec in fresh:
            if rec.get("al") is not None:
                await self._on_candidate(qid, qk, rec)

    async def _on_candidate(self, qid: str, qk: bytes, rec: dict[str, Any]) -> None:
        step, ts, u, reason = int(rec["step"]), float(rec["ts"]), float(rec["utility"]), rec["al"]
        if reason == "uncertain":
            await self._emit_sample(qid, step, rec["event"], u, "uncertain", ts)
            return
        verdict = self.verdicts.get(qk)
        if verdict is not None and verdict["correct"] is False:
            await self._emit_sample(qid, step, rec["event"], u, "error", ts)
        elif verdict is None:
            pending = self.al_pending.get(qk) or {}
            pending[str(step)] = {"event": rec["event"], "utility": u, "ts": ts}
            self.al_pending[qk] = pending

    async def _emit_sample(self, qid: str, step: int, event_obj: dict, u: float, reason: str, ts: float) -> None:
        qk = qid.encode()
        sent = self.al_sent.get(qk) or {}
        if str(step) in sent:
            return
        try:
            event = retrieval_event_from_obj(event_obj, self.limits)
        except Rejected as exc:
            log.error("outcomes: internal event failed validation (%s)", exc)
            return
        sample = make_sample(event, u, reason, ts)
        body = sample.to_dict()
        # Record before sending: a crash in between loses at most a duplicate, and the
        # deterministic sample_id lets labelers recognise it.
        sent[str(step)] = ts
        self.al_sent[qk] = sent
        stored = self.al_samples.get(qk) or {}
        stored[sample.sample_id] = orjson.loads(encode(body))
        self.al_samples[qk] = stored
        await self.al_topic.send(key=qid.encode(), value=encode(body))
        self.metrics.al_samples.labels(reason=reason).inc()

    # ------------------------------------------------------------------ labels
    async def _labels_agent(self, stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            try:
                label = decode_human_label(event.value, self.limits, event.key)
            except Rejected as rej:
                await self._dead_letter(msg, rej.reason, rej.detail)
                continue
            await self._on_label(label)

    async def _on_label(self, label: HumanLabel) -> None:
        qid = label.query_id
        qk = qid.encode()
        seen = self.labels_seen.get(qk) or {}
        if label.event_id in seen:
            self.metrics.duplicates.labels(topic=self.topics.human_labels.name).inc()
            return
        seen[label.event_id] = label.ts
        self.labels_seen[qk] = seen
        self.metrics.labels.labels(kind=label.kind).inc()
        if label.kind == "verdict":
            self.verdicts[qk] = {"correct": bool(label.answer_correct), "ts": label.ts}
            pending = self.al_pending.get(qk)
            if pending:
                if label.answer_correct is False:
                    for step, item in sorted(pending.items(), key=lambda kv: int(kv[0])):
                        await self._emit_sample(qid, int(step), item["event"], item["utility"], "error", item["ts"])
                del self.al_pending[qk]
        elif label.kind == "memory_choice":
            stored = (self.al_samples.get(qk) or {}).get(label.sample_id or "")
            if stored is None:
                self.metrics.labels_expired.labels(kind="memory_choice").inc()
            elif label.correct_memories:
                exp = label_experience(label, stored, self.limits)
                await self.exp_topic.send(value=encode(exp.to_dict()), partition=0)
        if label.rating is not None:
            self.ratings[qk] = {"rating": label.rating, "ts": label.ts, "paired": False}
            q = self.query_util.get(qk)
            if q and q["n"]:
                await self._emit_pair(qid, q, self.ratings.get(qk))

    async def _emit_pair(self, qid: str, q: dict[str, Any], rating: dict[str, Any]) -> None:
        qk = qid.encode()
        u_query = q["sum"] / q["n"]
        body = {"schema": SCHEMA_RATING_PAIR, "id": qid, "t": q["ts"], "u_query": u_query, "rating": rating["rating"]}
        rating = dict(rating, paired=True)
        self.ratings[qk] = rating
        await self.pairs_topic.send(key=qid.encode(), value=encode(body), partition=0)

    async def _dead_letter(self, msg: Any, reason: str, detail: str) -> None:
        self.metrics.rejected.labels(topic=msg.topic, reason=reason).inc()
        self.metrics.dead_letters.inc()
        value = dead_letter_value(msg.value, reason, detail, msg.topic, msg.partition, msg.offset, time.time())
        await self.dead_topic.send(key=msg.key, value=encode(value), partition=0)

    # ------------------------------------------------------------------ drift
    async def _drift_agent(self, stream: Any) -> None:
        async for value in stream:
            try:
                pair = loads_object(value, self.limits)
                pid, t, u, r = str(pair["id"]), float(pair["t"]), float(pair["u_query"]), float(pair["rating"])
            except (Rejected, KeyError, TypeError, ValueError):
                log.error("drift: unreadable pair skipped")
                continue
            if not self._drift_built:
                # After a start or takeover: rebuild from the stored pairs, not from pickles.
                stored = [tuple(v) for v in self.drift_pairs.values() if v]
                self.drift.rebuild(stored, self.drift_state.get(b"trigger"))  # type: ignore[arg-type]
                self._drift_built = True
                log.info("drift: rebuilt from %d stored pairs", len(stored))
            if self.drift_pairs.get(pid.encode()) is not None:
                continue
            self.drift_pairs[pid.encode()] = [t, u, r]
            self._prune_drift_pairs(t)
            fired = self.drift.update(t, u, r)
            self.drift_state[b"trigger"] = self.drift.trigger.state()
            corr, n = self.drift.window.get(), self.drift.window.pairs
            self.drift_status[b"status"] = {
                "correlation": corr,
                "pairs": n,
                "reference": self.drift.trigger.reference,
                "t": t,
                "resets": self.drift.trigger.resets,
                "last_fired_by": self.drift.last_fired_by,
            }
            self.metrics.correlation.set(corr)
            self.metrics.correlation_pairs.set(n)
            if self.drift.trigger.reference is not None:
                self.metrics.correlation_reference.set(self.drift.trigger.reference)
            if fired and not self.settings.drift_reset:
                log.warning(
                    "drift: %s detector fired at event time %.0f (correlation %.3f); resets are off", fired, t, corr
                )
            elif fired:
                ctl = Control(
                    command="reset",
                    ts=t,
                    reason=f"drift:{fired}",
                    id=f"reset-{pid}-{t}",
                    details={
                        "correlation": corr,
                        "pairs": n,
                        "detector": fired,
                        "since_ts": self.drift.trigger.change_t,
                    },
                )
                await self.control_topic.send(value=encode(ctl.to_dict()), partition=0)
                self.metrics.drift_triggers.labels(detector=fired).inc()
                log.warning(
                    "drift: %s detector fired at event time %.0f (correlation %.3f); reset sent", fired, t, corr
                )

    def _prune_drift_pairs(self, t: float) -> None:
        """Keep the stored pairs to the correlation window (inside the agent: an event context)."""
        self._pairs_since_prune += 1
        if self._pairs_since_prune < 500:
            return
        self._pairs_since_prune = 0
        horizon = t - self.settings.drift_window_days * 86400
        for key in [k for k, v in list(self.drift_pairs.items()) if v is None or v[0] < horizon]:
            del self.drift_pairs[key]

    # ------------------------------------------------------------------ timers
    async def _health_timer(self) -> None:
        status = self.drift_status.get(b"status") or {}
        st = self.join.stats
        corr = float(status.get("correlation", 0.0))
        pairs = int(status.get("pairs", 0))
        self.metrics.correlation.set(corr)
        self.metrics.correlation_pairs.set(pairs)
        score, band = health_score(
            correlation=corr,
            pairs=pairs,
            min_pairs=self.settings.drift_min_pairs,
            nonnegative_share=st.utility_nonneg.get() if self.join.joined_total else 1.0,
            intervention_rate=st.intervention.get(),
            fallback_rate=st.fallback.get(),
        )
        self.metrics.set_health(score, band)
        await self._export_stage_lag()

    async def _export_stage_lag(self) -> None:
        """Lag of the faust stages' inputs (human-labels, outcomes, rating pairs) per topic."""
        consumer = self.app.consumer
        lags: dict[str, int] = {}
        try:
            for tp in consumer.assignment():
                if tp.topic not in self.stage_topics:
                    continue
                hw = consumer.highwater(tp)
                pos = await consumer.position(tp)
                if hw is not None and pos is not None:
                    lags[tp.topic] = lags.get(tp.topic, 0) + max(0, hw - pos)
        except Exception as exc:  # during a rebalance: next time
            log.debug("stage lag: %r", exc)
            return
        for topic, lag in lags.items():
            self.metrics.consumer_lag.labels(topic=topic).set(lag)

    async def _prune_timer(self) -> None:
        """Bound the tables: by event time (``label_window_s``) and by count.

        The count caps matter at high rates: per-query state for a day of traffic, and a
        whole retrieval event per error candidate waiting for a verdict, would otherwise
        grow with rate × window. The oldest entries go first.
        """
        s = self.settings
        horizon = self.join.watermark - s.label_window_s
        removed = 0
        for table, ts_of, cap in (
            (self.query_util, lambda v: v["ts"], s.query_state_max),
            (self.verdicts, lambda v: v["ts"], s.query_state_max),
            (self.ratings, lambda v: v["ts"], s.query_state_max),
            (self.al_pending, lambda v: max(i["ts"] for i in v.values()) if v else 0.0, s.al_pending_max),
            (self.al_sent, lambda v: max(v.values()) if v else 0.0, s.query_state_max),
            (self.al_samples, lambda v: max(i["ts"] for i in v.values()) if v else 0.0, s.al_pending_max),
            (self.labels_seen, lambda v: max(v.values()) if v else 0.0, s.query_state_max),
        ):
            aged = sorted(((ts_of(v) if v else 0.0, k) for k, v in list(table.items())), key=lambda x: x[0])
            excess = max(0, len(aged) - cap)
            for i, (ts, key) in enumerate(aged):
                if i >= excess and ts >= horizon:
                    break
                del table[key]
                removed += 1
            await asyncio.sleep(0)
        if removed:
            log.info("pruned %d table entries (older than the label window, or beyond the caps)", removed)

    def faust_worker(self, loglevel: str = "warning", restart_on_reset: bool = True) -> faust.Worker:
        """The faust worker running every stage; on a cluster reset it restarts this process."""
        watch = None
        if restart_on_reset:
            watch = ClusterWatch(
                self.bootstrap,
                self.settings,
                [t.name for t in self.topics.all()],
                on_reset=lambda missing: restart_process("worker: the Kafka cluster lost its topics"),
                metrics=self.metrics,
                marker_seen=True,  # the worker verb created the topics (and the marker) first
            )
        return faust.Worker(
            self.app,
            JoinService(self.join, watch),
            loglevel=loglevel,
            quiet=True,
            redirect_stdouts=False,
        )
