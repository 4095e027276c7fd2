"""The worker's timers: the health score, the stream stages' lag, and pruning the tables."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from models.health import health_score
from pipeline.config import WorkerConfig
from pipeline.metrics import Metrics
from pipeline.worker.join import JoinStage
from pipeline.worker.records import DriftStatus
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
        """Bound the per-query tables: by event time (``label_window_s``) and by count.

        The count caps matter at high rates: per-query state for a day of traffic, and a
        whole sample per error candidate waiting for a verdict, would otherwise grow with
        rate × window. The oldest entries go first.

        The event-time clock is the join's slowest partition (:meth:`JoinStage.event_clock`):
        a partition running ahead, or one bad timestamp, cannot move it and delete state
        (docs/architecture.md, "Event time"). Before the join has seen an event only the
        caps apply.
        """
        c, t = self.config, self.tables
        clock = self.join.event_clock()
        horizon = float("-inf") if clock is None else clock - c.label_window_s
        removed = 0
        for table, cap in (
            (t.query_util, c.query_state_max),
            (t.verdicts, c.query_state_max),
            (t.ratings, c.query_state_max),
            (t.al_pending, c.al_pending_max),
            (t.al_sent, c.query_state_max),
            (t.al_samples, c.al_pending_max),
            (t.labels_seen, c.query_state_max),
        ):
            entries = [(v.ts if v is not None else 0.0, k) for k, v in list(table.items())]
            for key in prune_order(entries, cap, horizon):
                del table[key]
                removed += 1
            await asyncio.sleep(0)
        if removed:
            log.info("pruned %d table entries (older than the label window, or beyond the caps)", removed)
