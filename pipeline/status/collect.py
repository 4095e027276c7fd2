"""What ``causalmem status`` collects: the operator's view of a running pipeline (docs/operations.md).

What it shows, and where each number comes from:

- **checkpoints** — the model topic (read from the beginning, as every reader of it does,
  docs/architecture.md; then only what is new at each ``--watch`` refresh): the serving
  and candidate manifests of the policy (version, reason, age, baseline, the learner's
  counters recorded in the manifest), and the learner's update rate between the two
  newest manifests: ``Δupdates / Δcreated_ts``; and, while candidates newer than the serving
  version wait, why serving has not moved (:mod:`pipeline.status.freeze`): "serving v1 for 12m
  while 20 candidates waited: <the gate's last reason>";
- **active-learning queue depth** — per partition, the fetch high watermark minus the
  labeler group's committed offset (``{prefix}causalmem-labelers``); high watermarks
  come from fetch responses, never from ``end_offsets`` (wrong on the embedded broker);
- **dead letters** — the ``dead-letter`` topic, counted by ``reason`` (and source topic);
- **do not use** — the memories operators suppressed and the audit trail (the newest
  manifest), and labelers' open proposals (``human-labels``): :mod:`pipeline.status.suppression`;
- **principals** — from the newest manifest (contract 1.15): each shown principal's share of
  the learner's window, its weight, whether its utilities disagree with the others' (flagged)
  and the quarantined ones: :mod:`pipeline.status.principals`;
- **learner lag** — the experiences topic's end (fetch high watermark) minus the input
  offset recorded in the policy's newest manifest: what no checkpoint covers yet, read
  from the topics and not from the learner's own gauge (a learner whose training task
  died stops updating it). The learner is **stalled** when experiences wait and the
  newest manifest is older than ``stall_after_s`` (or there is none);
- **live metrics** (optional) — the ``/metrics`` endpoints given with ``--worker URL`` and
  ``--learner URL`` (repeatable): health score and band, the 7-day correlation and its
  pairs, join and update rates (two scrapes ``--rate-interval`` seconds apart, or the
  counters' change between ``--watch`` refreshes), the live baseline and consumer lag
  (the views: :mod:`pipeline.status.live`).

``--watch [SECONDS]`` refreshes the view until Ctrl-C; ``--json`` prints one JSON object
(one per refresh, one per line, with ``--watch``) instead of tables (drawn by
:mod:`pipeline.status.render`). The verb only reads: it creates no topic, commits no
offset and joins no consumer group.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.config import Connection, Settings
from pipeline.labeling.queue import labeler_group
from pipeline.modeltopic import ModelTopicIndex
from pipeline.promtext import scrape
from pipeline.status.freeze import freeze_view
from pipeline.status.live import (
    LEARNER_RATES,
    WORKER_RATES,
    counter_rates,
    health_summary,
    learner_view,
    strip_prefix,
    worker_view,
)
from pipeline.status.principals import principals_view
from pipeline.status.suppression import ProposalTally, suppression_view
from topics.manifest import Manifest

# An incremental read ends at its first fetch answer's high watermark (within the fetch wait even
# when nothing is new); the limit is for a broker that does not answer, not for a slow answer.
READ_IDLE_S = 5.0

# --------------------------------------------------------------------------- helpers


def _scalars(d: dict[str, Any]) -> dict[str, Any]:
    """The scalar entries of a manifest's ``metrics`` (nested state is left out)."""
    return {
        k: v
        for k, v in d.items()
        if isinstance(v, bool | int | float | str) and not (isinstance(v, float) and not math.isfinite(v))
    }


# --------------------------------------------------------------------------- sources


def manifest_view(m: Manifest, now: float) -> dict[str, Any]:
    return {
        "version": m.version,
        "reason": m.reason,
        "created_ts": m.created_ts,
        "age_s": round(now - m.created_ts, 3),
        "baseline": m.baseline,
        "alpha": m.alpha,
        "size": m.size,
        "chunks": m.chunks,
        "arch": dict(m.arch),
        "metrics": _scalars(m.metrics),
        # Contract 1.17: not certified yet; clients serve their own ranking but the explored share.
        "incumbent": bool((m.serving or {}).get("incumbent")),
        # Contract 1.23: a probe over this certified version, which clients serve but on the explored share.
        "base": (m.serving or {}).get("base"),
    }


def manifest_rate(manifests: list[Manifest]) -> dict[str, Any] | None:
    """Learner rates between the two newest manifests (by version) with distinct times."""
    ordered = sorted(manifests, key=lambda m: m.version)
    if len(ordered) < 2:
        return None
    new = ordered[-1]
    old = next((m for m in reversed(ordered[:-1]) if m.created_ts < new.created_ts), None)
    if old is None:
        return None
    dt = new.created_ts - old.created_ts
    out: dict[str, Any] = {"from_version": old.version, "to_version": new.version, "seconds": round(dt, 3)}
    for key, name in (("updates", "updates_per_s"), ("experiences", "experiences_per_s")):
        a, b = old.metrics.get(key), new.metrics.get(key)
        out[name] = None
        # A rollback republishes older weights (and their counters): no rate across it.
        if isinstance(a, int | float) and isinstance(b, int | float) and b >= a:
            out[name] = (b - a) / dt
    return out


class ModelTopicFollower:
    """The model topic's manifests, read from the beginning once and then incrementally."""

    def __init__(self) -> None:
        self.index = ModelTopicIndex()
        self.next_offset = 0

    async def update(self, bootstrap: str, conn: Connection, now: float) -> dict[str, Any]:
        topic = conn.topics.policy_checkpoints.name
        start = {0: self.next_offset} if self.next_offset else None
        for msg in await kafka.read_all(bootstrap, conn, topic, partitions=[0], start=start, idle_s=READ_IDLE_S):
            if msg.offset >= self.next_offset:
                self.index.observe(msg.offset, msg.key, msg.value)
                self.next_offset = msg.offset + 1
        return checkpoint_view(self.index, conn.policy, now)


def checkpoint_view(index: ModelTopicIndex, policy: str, now: float) -> dict[str, Any]:
    # Full snapshots and deltas alike (contract 1.3): the newest serving and candidate versions.
    serving, candidate = index.serving_head(policy), index.candidate_head(policy)
    mine = index.links(policy)
    return {
        "policy": policy,
        "serving": manifest_view(serving, now) if serving else None,
        "candidate": manifest_view(candidate, now) if candidate else None,
        "canary": manifest_view(canary, now) if (canary := index.canary.get(policy)) else None,  # contract 1.4
        "update_rate": manifest_rate(mine),
        "manifests_seen": len(mine),
        "other_policies": sorted({p for (p, _) in [*index.manifests, *index.deltas] if p != policy}),
        "rejected_manifests": index.rejected_total,
        "freeze": freeze_view(index, policy, now),  # why serving has not moved, if candidates wait
    }


async def _partitions(c: Any, topic: str) -> list[int]:
    parts = c.partitions_for_topic(topic)
    if parts is None:
        await c._client.force_metadata_update()
        parts = c.partitions_for_topic(topic) or set()
    return sorted(parts)


async def queue_depth(bootstrap: str, conn: Connection, topic: str, group: str, timeout: float = 5.0) -> dict[str, Any]:
    """Samples the labeler group has not committed: Σ (fetch high watermark − committed).

    The consumer carries the group id only to read the group's committed offsets: it is
    manually assigned, never joins the group and never commits.
    """
    c = kafka.consumer(bootstrap, conn, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in await _partitions(c, topic)]
        if not tps:
            return {"topic": topic, "group": group, "depth": None, "partitions": {}, "missing": True}
        c.assign(tps)
        committed = {tp: await c.committed(tp) for tp in tps}
        beginning = await c.beginning_offsets(tps)
        for tp in tps:
            if committed[tp] is not None:
                c.seek(tp, committed[tp])
            else:
                await c.seek_to_beginning(tp)
        # High watermarks arrive with fetch responses (an empty partition's too).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(c.highwater(tp) is None for tp in tps) and loop.time() < deadline:
            await c.getmany(*tps, timeout_ms=200, max_records=1)
        parts: dict[str, Any] = {}
        depth: int | None = 0
        queued = 0
        for tp in tps:
            hw = c.highwater(tp)
            start = max(committed[tp] or 0, beginning.get(tp, 0) or 0)
            d = None if hw is None else max(0, hw - start)
            parts[str(tp.partition)] = {"high_watermark": hw, "committed": committed[tp], "depth": d}
            if d is None or depth is None:
                depth = None
            else:
                depth += d
            queued += hw or 0
        return {
            "topic": topic,
            "group": group,
            "depth": depth,
            "queued_total": queued,
            "committed_partitions": sum(v is not None for v in committed.values()),
            "partitions": parts,
        }
    finally:
        await c.stop()


@dataclass
class DeadLetterTally:
    """Counts of the dead-letter topic by reason, read incrementally across refreshes."""

    prefix: str = ""
    next_offset: int = 0
    total: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    by_topic: dict[str, int] = field(default_factory=dict)
    last_ts: float | None = None

    async def update(self, bootstrap: str, conn: Connection, topic: str) -> dict[str, Any]:
        start = {0: self.next_offset} if self.next_offset else None
        for msg in await kafka.read_all(bootstrap, conn, topic, partitions=[0], start=start, idle_s=READ_IDLE_S):
            if msg.offset < self.next_offset:
                continue
            self.next_offset = msg.offset + 1
            reason, source = "unreadable", "?"
            try:
                body = orjson.loads(msg.value) if msg.value is not None else None
            except orjson.JSONDecodeError:
                body = None
            if isinstance(body, dict):
                reason = str(body.get("reason") or "unknown")
                src = body.get("source")
                if isinstance(src, dict) and src.get("topic"):
                    source = strip_prefix(str(src["topic"]), self.prefix)
                if isinstance(body.get("ts"), int | float):
                    self.last_ts = max(self.last_ts or 0.0, float(body["ts"]))
            self.total += 1
            self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
            self.by_topic[source] = self.by_topic.get(source, 0) + 1
        return {
            "total": self.total,
            "by_reason": dict(sorted(self.by_reason.items(), key=lambda kv: (-kv[1], kv[0]))),
            "by_topic": dict(sorted(self.by_topic.items())),
            "last_ts": self.last_ts,
        }


async def high_watermark(bootstrap: str, conn: Connection, topic: str, start: int, timeout: float = 5.0) -> int | None:
    """Partition 0's end offset, from a fetch response at ``start`` (never ``end_offsets``)."""
    c = kafka.consumer(bootstrap, conn, group_id=None, enable_auto_commit=False)
    await c.start()
    try:
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        first = (await c.beginning_offsets([tp])).get(tp, 0) or 0
        c.seek(tp, max(start, first))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while c.highwater(tp) is None and loop.time() < deadline:
            await c.getmany(tp, timeout_ms=200, max_records=1)
        hw = c.highwater(tp)
        return None if hw is None else int(hw)
    finally:
        await c.stop()


def learner_lag_view(
    index: ModelTopicIndex, policy: str, topic: str, end: int | None, now: float, stall_after_s: float
) -> dict[str, Any]:
    """Experiences no manifest covers yet, and whether the learner is stalled.

    >>> learner_lag_view(ModelTopicIndex(), "default", "experiences", 200, 1000.0, 300.0)["stalled"]
    True
    """
    newest = max((m for (p, _), m in index.manifests.items() if p == policy), key=lambda m: m.version, default=None)
    applied = newest.input_offsets.get(f"{topic}:0", 0) if newest is not None else 0
    lag = None if end is None else max(0, end - applied)
    age = None if newest is None else round(now - newest.created_ts, 3)
    stalled = bool(lag) and (age is None or age > stall_after_s)
    why = None
    if stalled:
        since = (
            "no checkpoint yet"
            if age is None
            else f"newest checkpoint v{newest.version if newest else 0} is {age:.0f} s old"
        )
        why = f"{lag} experiences wait and {since} (bound {stall_after_s:.0f} s)"
    return {
        "topic": topic,
        "end": end,
        "applied_offset": applied,
        "lag": lag,
        "manifest_version": newest.version if newest is not None else None,
        "manifest_age_s": age,
        "stall_after_s": stall_after_s,
        "stalled": stalled,
        "why": why,
    }


# --------------------------------------------------------------------------- collector

STALL_AFTER_S = 300.0  # experiences waiting and no new manifest for this long: a stalled learner


class StatusCollector:
    """Builds status snapshots; keeps what rates and incremental reads need between them."""

    def __init__(
        self,
        bootstrap: str,
        conn: Connection | Settings,
        worker_urls: list[str] | None = None,
        learner_urls: list[str] | None = None,
        rate_interval: float = 1.0,
        stall_after_s: float = STALL_AFTER_S,
    ) -> None:
        self.bootstrap = bootstrap
        self.stall_after_s = stall_after_s
        self.conn = Connection.of(conn)
        self.topics = self.conn.topics
        self.worker_urls = list(worker_urls or [])
        self.learner_urls = list(learner_urls or [])
        self.rate_interval = rate_interval
        self.dead = DeadLetterTally(prefix=self.topics.prefix)
        self.model = ModelTopicFollower()
        self.proposals = ProposalTally()
        self._prev: dict[str, tuple[float, dict[str, float]]] = {}

    async def _scrape_all(self) -> dict[str, tuple[float, dict[str, float]]]:
        urls = [*self.worker_urls, *self.learner_urls]
        results = await asyncio.gather(*(asyncio.to_thread(scrape, u) for u in urls))
        t = time.monotonic()
        return {u: (t, v) for u, v in zip(urls, results, strict=True)}

    async def _existing_topics(self) -> set[str]:
        client = kafka.admin(self.bootstrap, self.conn)
        await client.start()
        try:
            return set(await client.list_topics())
        finally:
            await client.close()

    async def snapshot(self) -> dict[str, Any]:
        """One view of the deployment (the JSON ``causalmem status --json`` prints)."""
        first: dict[str, tuple[float, dict[str, float]]] = {}
        if (self.worker_urls or self.learner_urls) and not self._prev:
            first = await self._scrape_all()  # the rates' first point; Kafka reads overlap the wait
        t_start = time.monotonic()
        now = time.time()
        errors: list[str] = []
        existing = await self._existing_topics()
        ckpt, depth, dead = await self._topics_view(now, errors, existing)
        lag = await self._learner_lag(now, errors, existing)
        do_not_use = await self._do_not_use(errors, existing)
        workers, learners = await self._live_view(first, t_start, errors)
        return {
            "schema": "causalmem_status/v1",
            "ts": now,
            "bootstrap": self.bootstrap,
            "prefix": self.topics.prefix,
            "policy": self.conn.policy,
            "checkpoints": ckpt,
            "active_learning": depth,
            "dead_letter": dead,
            "learner_lag": lag,
            "do_not_use": do_not_use,
            "principals": principals_view(self.model.index, self.conn.policy),
            "health": health_summary(workers),
            "workers": workers,
            "learners": learners,
            "errors": errors,
        }

    async def _topics_view(self, now: float, errors: list[str], existing: set[str]) -> list[dict[str, Any] | None]:
        """Checkpoints, queue depth and dead letters, read concurrently; a failing source is an error line."""
        t = self.topics

        async def read(name: str, topic: str, fetch: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any] | None:
            if topic not in existing:
                return {"topic": topic, "missing": True}
            try:
                return await fetch()
            except Exception as exc:  # one failing source must not hide the others
                errors.append(f"{name}: {exc!r}")
                return None

        return list(
            await asyncio.gather(
                read(
                    "checkpoints", t.policy_checkpoints.name, partial(self.model.update, self.bootstrap, self.conn, now)
                ),
                read(
                    "active-learning",
                    t.active_learning.name,
                    partial(queue_depth, self.bootstrap, self.conn, t.active_learning.name, labeler_group(self.conn)),
                ),
                read(
                    "dead-letter",
                    t.dead_letter.name,
                    partial(self.dead.update, self.bootstrap, self.conn, t.dead_letter.name),
                ),
            )
        )

    async def _learner_lag(self, now: float, errors: list[str], existing: set[str]) -> dict[str, Any] | None:
        """The learner's lag against the newest manifest (after the model topic was read)."""
        topic = self.topics.experiences.name
        if topic not in existing:  # reading it could auto-create it: status only reads
            return {"topic": topic, "missing": True}
        newest = learner_lag_view(self.model.index, self.conn.policy, topic, None, now, self.stall_after_s)
        try:
            end = await high_watermark(self.bootstrap, self.conn, topic, newest["applied_offset"])
        except Exception as exc:  # one failing source must not hide the others
            errors.append(f"learner-lag: {exc!r}")
            return None
        return learner_lag_view(self.model.index, self.conn.policy, topic, end, now, self.stall_after_s)

    async def _do_not_use(self, errors: list[str], existing: set[str]) -> dict[str, Any]:
        """Suppressed memories and their audit (after the model topic was read), and open proposals."""
        view = suppression_view(self.model.index, self.conn.policy)
        topic = self.topics.human_labels.name
        if topic not in existing:
            view["proposals"] = None
            return view
        try:
            view["proposals"] = await self.proposals.update(self.bootstrap, self.conn, topic, view["suppressed"])
        except Exception as exc:  # one failing source must not hide the others
            errors.append(f"human-labels: {exc!r}")
            view["proposals"] = None
        return view

    async def _live_view(
        self, first: dict[str, tuple[float, dict[str, float]]], t_start: float, errors: list[str]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The workers' and learners' metrics, with rates against the previous scrape."""
        workers: list[dict[str, Any]] = []
        learners: list[dict[str, Any]] = []
        if not (self.worker_urls or self.learner_urls):
            return workers, learners
        if first:
            self._prev = first
            wait = self.rate_interval - (time.monotonic() - t_start)
            if wait > 0:
                await asyncio.sleep(wait)
        current = await self._scrape_all()
        prefix = self.topics.prefix
        for u in self.worker_urls:
            tc, values = current[u]
            workers.append(worker_view(u, values, counter_rates(values, self._prev.get(u), tc, WORKER_RATES), prefix))
        for u in self.learner_urls:
            tc, values = current[u]
            learners.append(
                learner_view(u, values, counter_rates(values, self._prev.get(u), tc, LEARNER_RATES), prefix)
            )
        self._prev = {u: v for u, v in current.items() if v[1]} or self._prev
        errors.extend(f"{w['url']}: no metrics (unreachable)" for w in [*workers, *learners] if not w["up"])
        return workers, learners


async def collect(
    bootstrap: str,
    conn: Connection | Settings,
    worker_urls: list[str] | None = None,
    learner_urls: list[str] | None = None,
    rate_interval: float = 1.0,
    stall_after_s: float = STALL_AFTER_S,
) -> dict[str, Any]:
    """One status snapshot (what ``causalmem status --json`` prints)."""
    return await StatusCollector(bootstrap, conn, worker_urls, learner_urls, rate_interval, stall_after_s).snapshot()
