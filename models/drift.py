"""Drift detection on the utility–rating correlation (seed 000 §4.3 level 3; docs/learning.md, "Drift reset").

``U_query`` (mean utility of a query's steps) and the human ``rating`` of how much the
query needed memory should agree while the policy identifies memory utility. The
correlation is kept over the last 7 days of *event time* with river's
``TimeRolling(PearsonCorr)``. :class:`DriftTrigger` fires when it falls more than
``drop`` below its reference (its value once the window first held ``min_pairs`` pairs
after the start or the last reset), outside a cool-down. :class:`AgreementDetector` is a
second, independent detector: river's Page–Hinkley test in "down" mode on the per-pair
agreement (the product of the standardised pair, whose mean is the correlation).

>>> w = CorrelationWindow(days=7)
>>> for i in range(5):
...     _ = w.update(float(i), float(i % 6), t=86400.0 * i)

>>> round(w.get(), 6), w.pairs
(1.0, 5)
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from river import drift, stats, utils

EPOCH = dt.datetime(1970, 1, 1)


def naive_utc(t: float) -> dt.datetime:
    """Seconds since the epoch → naive UTC datetime (river's TimeRolling needs naive)."""
    return EPOCH + dt.timedelta(seconds=t)


class CorrelationWindow:
    """Pearson correlation of (U_query, rating) over the last ``days`` of event time."""

    def __init__(self, days: float = 7.0) -> None:
        self.days = days
        self._rolling: Any = utils.TimeRolling(stats.PearsonCorr, period=dt.timedelta(days=days))
        self.latest_t = 0.0

    def update(self, u_query: float, rating: float, t: float) -> bool:
        """Add a pair; a pair already older than the window (a late backfill) is ignored."""
        if self.latest_t and t < self.latest_t - self.days * 86400:
            return False
        self._rolling.update(float(u_query), float(rating), t=naive_utc(t))
        self.latest_t = max(self.latest_t, t)
        return True

    def get(self) -> float:
        value = self._rolling.get()
        return float(value) if value is not None and math.isfinite(value) else 0.0

    @property
    def pairs(self) -> int:
        return int(self._rolling.obj.var_x.n)


@dataclass
class DriftTrigger:
    """Reference, threshold, minimum pairs and cool-down; ``update`` (once per pair) says when to reset.

    The reference is taken once ``min_pairs`` pairs have entered the window since the
    start or the last reset (and the window holds at least that many).

    >>> trig = DriftTrigger(drop=0.15, min_pairs=3, cooldown_s=100.0)
    >>> [trig.update(c, n, t) for c, n, t in [(0.8, 2, 0), (0.8, 3, 1), (0.7, 4, 2), (0.6, 5, 3), (0.5, 6, 4)]]
    [False, False, False, False, True]
    """

    drop: float = 0.15
    min_pairs: int = 50
    cooldown_s: float = 86400.0
    reference: float | None = None
    last_reset_t: float | None = None
    resets: int = 0
    since_reset: int = 0
    peak: float | None = None  # highest correlation since the reference was taken
    peak_t: float | None = None  # ... and when
    change_t: float | None = None  # estimated start of the last drift that fired

    def update(self, correlation: float, window_pairs: int, t: float) -> bool:
        self.since_reset += 1
        if window_pairs < self.min_pairs or self.since_reset < self.min_pairs:
            return False
        if self.peak is None or correlation > self.peak:
            self.peak, self.peak_t = correlation, t
        if self.reference is None:
            self.reference = correlation
            return False
        if self.last_reset_t is not None and t - self.last_reset_t < self.cooldown_s:
            return False
        return correlation < self.reference - self.drop

    def in_cooldown(self, t: float) -> bool:
        return self.last_reset_t is not None and t - self.last_reset_t < self.cooldown_s

    def fire(self, t: float, change_t: float | None = None) -> None:
        # Where the drift probably began: the given estimate, else the correlation's peak.
        self.change_t = change_t if change_t is not None else self.peak_t if self.peak_t is not None else t
        self.last_reset_t = t
        self.reference = None
        self.since_reset = 0
        self.peak = self.peak_t = None
        self.resets += 1

    STATE_FIELDS = ("reference", "last_reset_t", "resets", "since_reset", "peak", "peak_t")

    def state(self) -> dict[str, float | int | None]:
        """What :meth:`load` takes back: the fields of :data:`STATE_FIELDS`."""
        return {name: getattr(self, name) for name in self.STATE_FIELDS}

    def load(self, state: dict[str, Any]) -> None:
        self.reference = state.get("reference")
        self.last_reset_t = state.get("last_reset_t")
        self.resets = int(state.get("resets", 0))
        self.since_reset = int(state.get("since_reset", 0))
        self.peak = state.get("peak")
        self.peak_t = state.get("peak_t")


class AgreementDetector:
    """Page–Hinkley ("down", river) on the per-pair agreement, with a change-point estimate.

    The agreement of a pair is the sign of ``(u − ū)·(r − r̄)``: +1 when U_query and the
    rating sit on the same side of their recent means, −1 otherwise. Its mean is the
    quadrant correlation; it is bounded, so a few extreme pairs cannot raise a false
    alarm the way the raw product z_u·z_r (heavy-tailed) does. The means are exponentially
    weighted (``mean_fading``, ~100 pairs): after a change every U_query may move to a new
    level, and against an all-time mean all of them would sit on one side, hiding whether
    U_query still ranks queries the way people do.

    ``change_t`` estimates when the agreement began to fall: the time at which the
    Page–Hinkley sum ``U_t = Σ (x_i − x̄_i + δ)`` was highest (it climbs by δ per pair
    while nothing changes and falls once the agreement drops).
    """

    # Set by reset(); river's detectors are untyped.
    change_t: float | None
    _ph: Any
    _mean: Any
    _sum: float
    _max_sum: float

    def __init__(
        self, threshold: float = 25.0, delta: float = 0.2, min_instances: int = 100, mean_fading: float = 0.01
    ) -> None:
        self._args = (threshold, delta, min_instances)
        self._u = stats.EWMean(fading_factor=mean_fading)
        self._r = stats.EWMean(fading_factor=mean_fading)
        self._seen = 0
        self.reset()

    def update(self, u_query: float, rating: float, t: float = 0.0) -> bool:
        mu, mr = self._u.get(), self._r.get()
        self._u.update(float(u_query))
        self._r.update(float(rating))
        self._seen += 1
        if self._seen < 10:  # the means need a few pairs first
            return False
        agreement = float(np.sign((u_query - mu) * (rating - mr)))
        self._mean.update(agreement)
        self._sum += agreement - self._mean.get() + self._args[1]
        if self._sum >= self._max_sum:
            self._max_sum, self.change_t = self._sum, t
        self._ph.update(agreement)
        return bool(self._ph.drift_detected)

    def reset(self) -> None:
        """Forget the agreement history (after a reset); keep the standardisation."""
        threshold, delta, min_instances = self._args
        self._ph = drift.PageHinkley(min_instances=min_instances, delta=delta, threshold=threshold, mode="down")
        self._mean = stats.Mean()
        self._sum = 0.0
        self._max_sum = 0.0
        self.change_t = None


class DriftMonitor:
    """The worker's drift stage without Kafka: window + trigger (+ Page–Hinkley).

    Rebuildable from stored pairs (never from pickled river objects). ``update`` returns
    the detector that fired (``"correlation"`` or ``"page_hinkley"``) or None; after a
    firing, ``trigger.change_t`` estimates when the drift began.

    >>> m = DriftMonitor(min_pairs=3, cooldown_s=10.0)
    >>> [m.update(float(i), float(i), float(i % 6)) for i in range(3)]
    [None, None, None]
    """

    def __init__(
        self,
        days: float = 7.0,
        drop: float = 0.15,
        min_pairs: int = 50,
        cooldown_s: float = 86400.0,
        page_hinkley: bool = False,
    ) -> None:
        self.days = days
        self.window = CorrelationWindow(days=days)
        self.trigger = DriftTrigger(drop=drop, min_pairs=min_pairs, cooldown_s=cooldown_s)
        self.agreement = AgreementDetector()  # always on: it estimates the change point
        self.page_hinkley = page_hinkley
        self.last_fired_by: str | None = None

    def rebuild(self, pairs: list[tuple[float, float, float]], trigger_state: dict[str, Any] | None) -> None:
        """Replay stored (t, u, rating) pairs in event-time order; restore the trigger."""
        self.window = CorrelationWindow(days=self.days)
        self.agreement = AgreementDetector()
        for t, u, r in sorted(pairs):
            self.window.update(u, r, t)
            self.agreement.update(u, r, t)
        if trigger_state:
            self.trigger.load(trigger_state)

    def update(self, t: float, u: float, rating: float) -> str | None:
        self.window.update(u, rating, t)
        ph = self.agreement.update(u, rating, t)
        corr, pairs = self.window.get(), self.window.pairs
        fired = None
        if self.trigger.update(corr, pairs, t):
            fired = "correlation"
        elif self.page_hinkley and ph and self._armed(t, pairs):
            fired = "page_hinkley"
        if fired:
            self.trigger.fire(t, self.agreement.change_t)
            self.agreement.reset()
            self.last_fired_by = fired
        return fired

    def _armed(self, t: float, pairs: int) -> bool:
        """Page–Hinkley may act under the same conditions as the correlation trigger: enough
        pairs in the window and since the last reset, and outside the cool-down (a policy
        that was just reset needs time to recover before it is judged again)."""
        trig = self.trigger
        return pairs >= trig.min_pairs and trig.since_reset >= trig.min_pairs and not trig.in_cooldown(t)
