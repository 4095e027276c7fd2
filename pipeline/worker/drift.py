"""The drift stage: the correlation of U_query and ratings, and the reset trigger.

Reads ``rating-pairs`` (one partition, so one worker owns the stage). Each new pair
enters the correlation window of ``window_days`` of event time
(:class:`models.drift.DriftMonitor`); when a detector fires, a ``reset`` goes to the
learner on ``control`` (unless resets are off). The pairs and the trigger's state live in
tables, so a worker that takes the stage over rebuilds the window from them; the status
reaches every worker through the global ``drift-status`` table. See docs/learning.md.
"""

from __future__ import annotations

import logging
from typing import Any

from models.drift import DriftMonitor
from pipeline.config import DriftConfig
from pipeline.metrics import Metrics
from pipeline.worker.records import DriftPair, DriftStatus, TriggerState
from pipeline.worker.tables import Outputs, Tables
from topics.fields import Limits, Rejected, encode
from topics.internal import Control, RatingPair, decode_rating_pair

log = logging.getLogger(__name__)

DAY_S = 86400.0
PRUNE_EVERY = 500  # pairs between two prunings of the stored pairs


class DriftStage:
    """The ``rating-pairs`` agent."""

    def __init__(self, config: DriftConfig, tables: Tables, outputs: Outputs, metrics: Metrics, limits: Limits) -> None:
        self.config = config
        self.tables = tables
        self.outputs = outputs
        self.metrics = metrics
        self.limits = limits
        self.monitor = DriftMonitor(
            days=config.window_days,
            drop=config.drop,
            min_pairs=config.min_pairs,
            cooldown_s=config.cooldown_s,
            page_hinkley=config.page_hinkley,
        )
        self._built = False
        self._since_prune = 0

    async def agent(self, stream: Any) -> None:
        async for value in stream:
            try:
                pair = decode_rating_pair(value, self.limits)
            except Rejected as exc:
                log.error("drift: unreadable pair skipped (%s)", exc)
                continue
            await self.on_pair(pair)

    def _rebuild(self) -> None:
        """After a start or takeover: rebuild the window from the stored pairs, not from pickles."""
        stored = [(p.t, p.u, p.r) for p in self.tables.drift_pairs.values() if p is not None]
        trigger: TriggerState | None = self.tables.drift_state.get(b"trigger")
        self.monitor.rebuild(stored, trigger.state() if trigger is not None else None)
        self._built = True
        log.info("drift: rebuilt from %d stored pairs", len(stored))

    async def on_pair(self, pair: RatingPair) -> None:
        if not self._built:
            self._rebuild()
        key = pair.id.encode()
        if self.tables.drift_pairs.get(key) is not None:
            return  # a pair sent again (after a takeover of the labels or outcomes stage)
        t, m = pair.t, self.monitor
        self.tables.drift_pairs[key] = DriftPair(t=t, u=pair.u_query, r=pair.rating)
        self._prune(t)
        fired = m.update(t, pair.u_query, pair.rating)
        self.tables.drift_state[b"trigger"] = TriggerState.of(m.trigger)
        corr, n = m.window.get(), m.window.pairs
        self.tables.drift_status[b"status"] = DriftStatus(
            correlation=corr,
            pairs=n,
            reference=m.trigger.reference,
            t=t,
            resets=m.trigger.resets,
            last_fired_by=m.last_fired_by,
        )
        self.metrics.correlation.set(corr)
        self.metrics.correlation_pairs.set(n)
        if m.trigger.reference is not None:
            self.metrics.correlation_reference.set(m.trigger.reference)
        if not fired:
            return
        if not self.config.reset:
            log.warning(
                "drift: %s detector fired at event time %.0f (correlation %.3f); resets are off", fired, t, corr
            )
            return
        ctl = Control(
            command="reset",
            ts=t,
            reason=f"drift:{fired}",
            id=f"reset-{pair.id}-{t}",
            details={"correlation": corr, "pairs": n, "detector": fired, "since_ts": m.trigger.change_t},
        )
        await self.outputs.control.send(value=encode(ctl.to_dict()), partition=0)
        self.metrics.drift_triggers.labels(detector=fired).inc()
        log.warning("drift: %s detector fired at event time %.0f (correlation %.3f); reset sent", fired, t, corr)

    def _prune(self, t: float) -> None:
        """Keep the stored pairs to the correlation window (inside the agent: an event context)."""
        self._since_prune += 1
        if self._since_prune < PRUNE_EVERY:
            return
        self._since_prune = 0
        horizon = t - self.config.window_days * DAY_S
        table = self.tables.drift_pairs
        for key in [k for k, v in list(table.items()) if v is None or v.t < horizon]:
            del table[key]
