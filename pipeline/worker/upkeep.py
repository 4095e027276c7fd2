"""The worker's timers: the health score, the stream stages' lag, and pruning the tables (docs/operations.md)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from faust.stores.base import SerializedStore

from models.memory.health import health_score
from pipeline.config import WorkerConfig
from pipeline.metrics import Metrics
from pipeline.worker.join import JoinStage
from pipeline.worker.records import DriftStatus, encoded_size, raw_ts
from pipeline.worker.tables import Tables

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 5.0
PRUNE_INTERVAL_S = 30.0


def prune_order(entries: list[tuple[float, Any]], cap: int, horizon: float) -> list[Any]:
    """The keys to delete: all older than ``horizon``, and the oldest beyond ``cap``.

    >>> prune_order([(5.0, "a"), (1.0, "b"), (9.0, "c")], cap=2, horizon=0.0)
    ['b']
    >>> prune_order([(5.0, "a"), (1.0, "b"), (9.0, "c")], cap=10, horizon=6.0)
    ['b', 'a']
    """
    aged = sorted(entries, key=lambda e: e[0])
    excess = max(0, len(aged) - cap)
    out = []
    for i, (ts, key) in enumerate(aged):
        if i >= excess and ts >= horizon:
            break
        out.append(key)
    return out


def over_bytes(entries: list[tuple[float, int, Any]], max_bytes: int) -> list[Any]:
    """The oldest keys to delete so that the rest hold at most ``max_bytes`` (entries: ts, bytes, key).

    >>> over_bytes([(5.0, 40, "a"), (1.0, 30, "b"), (9.0, 50, "c")], max_bytes=100)
    ['b']
    >>> over_bytes([(5.0, 40, "a"), (1.0, 30, "b"), (9.0, 50, "c")], max_bytes=49)
    ['b', 'a', 'c']
    """
    total = sum(size for _, size, _ in entries)
    out = []
    for _, size, key in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        out.append(key)
        total -= size
    return out


def table_entries(table: Any) -> list[tuple[float, int, bytes]]:
    """``(event time, encoded bytes, key)`` of every entry of a per-query table on this worker.

    From the RocksDB store, the raw bytes (no record is decoded: a prune reads every entry
    of every per-query table); from the memory store, the records and their estimated size.
    """
    store = table.data
    if isinstance(store, SerializedStore):
        return [(raw_ts(v), len(k) + len(v), k) for k, v in store._iteritems()]
    return [(v.ts if v is not None else 0.0, len(k) + encoded_size(v), k) for k, v in list(table.items())]


class Upkeep:
    """The timers of one worker."""

    def __init__(
        self,
        config: WorkerConfig,
        tables: Tables,
        join: JoinStage,
        metrics: Metrics,
        app: Any,
        stage_topics: frozenset[str],
    ) -> None:
        self.config = config
        self.tables = tables
        self.join = join
        self.metrics = metrics
        self.app = app
        # The stage inputs whose backlog is lag; the tables' changelog partitions are also
        # assigned to the app's consumer but are only read during recovery.
        self.stage_topics = stage_topics

    async def health(self) -> None:
        """The health score from the drift status (any worker's) and this worker's join statistics."""
        status: DriftStatus | None = self.tables.drift_status.get(b"status")
        corr = status.correlation if status is not None else 0.0
        pairs = status.pairs if status is not None else 0
        st = self.join.stats
        self.metrics.correlation.set(corr)
        self.metrics.correlation_pairs.set(pairs)
        score, band = health_score(
            correlation=corr,
            pairs=pairs,
            min_pairs=self.config.drift.min_pairs,
            nonnegative_share=st.utility_nonneg.get() if self.join.joined_total else 1.0,
            intervention_rate=st.intervention.get(),
            fallback_rate=st.fallback.get(),
        )
        self.metrics.set_health(score, band)
        await self.export_stage_lag()

    async def export_stage_lag(self) -> None:
        """Lag of the stream stages' inputs (human-labels, outcomes, rating pairs) per topic."""
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

    async def prune(self) -> None:
        """Bound the per-query tables: by event time (``label_window_s``), by count and by bytes.

        The caps matter at high rates: per-query state for a day of traffic, and a whole
        sample per error candidate waiting for a verdict, would otherwise grow with
        rate × window. Counts are per table; bytes (each entry's encoded key and value) are
        per group: the samples (``al-pending``, ``al-samples``) and the rest of the
        per-query state. The oldest entries go first.

        The event-time clock is the join's slowest partition (:meth:`JoinStage.event_clock`):
        a partition running ahead, or one bad timestamp, cannot move it and delete state
        (docs/architecture.md, "Event time"). Before the join has seen an event only the
        caps apply.
        """
        c, t = self.config, self.tables
        clock = self.join.event_clock()
        horizon = float("-inf") if clock is None else clock - c.label_window_s
        removed = 0
        for group, cap, max_bytes in (
            (
                (t.query_util, t.verdicts, t.ratings, t.al_sent, t.labels_seen),
                c.query_state_max,
                c.query_state_max_bytes,
            ),
            ((t.al_pending, t.al_samples), c.al_pending_max, c.al_pending_max_bytes),
        ):
            kept: list[tuple[float, int, tuple[int, bytes]]] = []
            for i, table in enumerate(group):
                entries = table_entries(table)
                doomed = set(prune_order([(ts, k) for ts, _, k in entries], cap, horizon))
                for key in doomed:
                    del table[key]
                removed += len(doomed)
                kept += [(ts, size, (i, k)) for ts, size, k in entries if k not in doomed]
                await asyncio.sleep(0)
            for i, key in over_bytes(kept, max_bytes):
                del group[i][key]
                removed += 1
            await asyncio.sleep(0)
        if removed:
            log.info("pruned %d table entries (older than the label window, or beyond the caps)", removed)
