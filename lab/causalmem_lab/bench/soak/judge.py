"""The soak's judgement of a phase and the plan of its max-rate search (pure: no I/O).

For each lag series: the worker's lag (input messages), the learner's lag (experiences)
and the end-to-end backlog (pairs produced minus experiences applied):

- **bounded** when its mean over the last third of the phase is at most
  ``max(2 × its mean over the first third, floor)``, where the floor is two seconds of that
  stage's input. Means, not maxima: a checkpoint or a GC pause holds a stage for a few
  seconds and makes a one-sample spike that recovers at once (a 150 s run that drained in
  1.2 s failed a max-based rule on one such spike), while a stage that falls behind raises
  the whole last third. A 20 s phase detects a deficit above ~12 % of the input this way
  (the bisection's resolution is of that order); a 120 s phase ~2 %;
- the phase **drains** when, after the producer stops, ``applied ≥ keep_up × produced``
  within the drain limit (steady phase: ``keep_up`` = 100 % and the lag gauges at 0, within
  30 s; search phases: 99 % within 5 s);
- the **rate** is reached when the achieved input rate is at least 95 % of the target (else
  the producer in this process, sharing the CPUs, was the limit);
- a phase is **sustainable** when the rate is reached, every lag is bounded and it drains.

RSS slopes are least-squares fits (``numpy.polyfit``) in MB/min, over the whole phase and
over its second half. A process's RSS is **flat** when, after the first third of the phase
(warm-up: tables, caches and buffers filling), every sample is within ±10 % of their mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

STEADY_DRAIN_S = 30.0
SEARCH_KEEP_UP = 0.99
SEARCH_RESOLUTION = 0.10
SEARCH_MAX_RATE = 50_000.0
SEARCH_MIN_RATE = 5.0
GROWTH = 2.0
FLOOR_S = 2.0
RATE_TOLERANCE = 0.05
PROCESSES = ("broker", "worker", "learner")
WARMUP_FRACTION = 1 / 3  # of the phase, before RSS is judged flat or not
FLAT_TOLERANCE = 0.10

LAG_SERIES = {
    # name: (sample field, unit, input messages per pair reaching that stage)
    "worker_lag": ("worker_lag", "input messages", 2.0),
    "learner_lag": ("learner_lag", "experiences", 1.0),
    "backlog": ("backlog", "pairs", 1.0),
}


def slope_per_min(t_s: Sequence[float], values: Sequence[float]) -> float | None:
    """Least-squares slope of ``values`` against time in seconds, per minute (None: < 3 points)."""
    if len(t_s) < 3 or len(set(t_s)) < 2:
        return None
    return float(np.polyfit(np.asarray(t_s, dtype=float), np.asarray(values, dtype=float), 1)[0] * 60.0)


def spread(values: Sequence[float]) -> float | None:
    """The largest deviation from the mean, as a fraction of the mean (None: no values).

    >>> spread([90.0, 100.0, 110.0])
    0.1
    """
    if not values:
        return None
    mean = float(np.mean(values))
    return float(max(abs(v - mean) for v in values) / mean) if mean else None


def _backlog(s: dict[str, Any]) -> float:
    return float(s.get("backlog", s["produced"] - s["applied"]))


def caught_up(s: dict[str, Any], produced: float, keep_up: float) -> bool:
    if s["applied"] < keep_up * produced:
        return False
    if keep_up >= 1.0:
        return bool(s["worker_lag"] <= 0 and s["learner_lag"] <= 0)
    return True


def judge_phase(
    samples: Sequence[dict[str, Any]],
    duration: float,
    rate: float | None = None,
    *,
    growth: float = GROWTH,
    floor_s: float = FLOOR_S,
    drain_limit_s: float = STEADY_DRAIN_S,
    keep_up: float = 1.0,
    rate_tolerance: float = RATE_TOLERANCE,
) -> dict[str, Any]:
    """Judge one phase from its samples.

    Each sample: ``t`` (s since the producer started), ``produced`` (pairs sent so far in the
    phase), ``joined`` and ``applied`` (this phase), ``worker_lag``, ``learner_lag`` and
    optionally ``rss_mb`` (``{process: MB}``). Samples with ``t <= duration`` are the load,
    later ones the drain. ``rate`` is the target in pairs/s (None: judge the achieved rate only).
    """
    load = [s for s in samples if s["t"] <= duration + 1e-9]
    drain = [s for s in samples if s["t"] > duration + 1e-9]
    if not load:
        raise ValueError("no samples during the load")
    produced = max(float(s["produced"]) for s in samples)
    achieved = produced / duration if duration > 0 else 0.0
    target = rate if rate is not None else achieved
    rate_ok = rate is None or achieved >= (1.0 - rate_tolerance) * rate
    reasons: list[str] = []
    if not rate_ok:
        reasons.append(f"achieved {achieved:,.1f} pairs/s < {(1 - rate_tolerance):.0%} of {rate:,.1f}")

    first = [s for s in load if s["t"] < duration / 3.0]
    last = [s for s in load if s["t"] >= 2.0 * duration / 3.0]
    stages: dict[str, dict[str, Any]] = {}
    for name, (_field, unit, per_pair) in LAG_SERIES.items():

        def value(s: dict[str, Any], name: str = name) -> float:
            return _backlog(s) if name == "backlog" else float(s[name])

        vals = [value(s) for s in load]
        first_vals = [value(s) for s in first] or [0.0]
        last_vals = [value(s) for s in last] or [0.0]
        first_mean, last_mean = float(np.mean(first_vals)), float(np.mean(last_vals))
        floor = floor_s * per_pair * target
        limit = max(growth * first_mean, floor)
        bounded = last_mean <= limit
        slope = slope_per_min([s["t"] for s in load], vals)
        stages[name] = {
            "unit": unit,
            "mean": float(np.mean(vals)),
            "max": float(max(vals)),
            "first_third_mean": first_mean,
            "last_third_mean": last_mean,
            "first_third_max": max(first_vals),
            "last_third_max": max(last_vals),
            "limit": limit,
            "slope_per_s": None if slope is None else slope / 60.0,
            "bounded": bounded,
        }
        if not bounded:
            reasons.append(f"{name} grew: mean {last_mean:,.0f} in the last third > limit {limit:,.0f}")
    lag_bounded = all(st["bounded"] for st in stages.values())

    caught_up_s = None
    for s in [load[-1], *drain]:
        if caught_up(s, produced, keep_up):
            caught_up_s = max(0.0, s["t"] - duration)
            break
    drained = caught_up_s is not None and caught_up_s <= drain_limit_s
    if not drained:
        reasons.append(f"not caught up ({keep_up:.0%} applied) within {drain_limit_s:g} s after the phase")
    end = samples[-1]
    applied_fraction = float(end["applied"]) / produced if produced else 1.0

    rss: dict[str, dict[str, Any]] = {}
    names = sorted({k for s in samples for k in (s.get("rss_mb") or {})}, key=_proc_order)
    for proc in names:
        pts = [(s["t"], s["rss_mb"][proc]) for s in load if (s.get("rss_mb") or {}).get(proc) is not None]
        allv = [s["rss_mb"][proc] for s in samples if (s.get("rss_mb") or {}).get(proc) is not None]
        if not pts:
            continue
        half = [(t, v) for t, v in pts if t >= duration / 2.0]
        after = [v for t, v in pts if t >= duration * WARMUP_FRACTION]
        dev = spread(after)
        rss[proc] = {
            "start_mb": pts[0][1],
            "end_mb": pts[-1][1],
            "max_mb": max(allv),
            "slope_mb_per_min": slope_per_min([t for t, _ in pts], [v for _, v in pts]),
            "slope_second_half_mb_per_min": slope_per_min([t for t, _ in half], [v for _, v in half]),
            "after_warmup_mean_mb": float(np.mean(after)) if after else None,
            "after_warmup_spread": dev,
            "flat": None if dev is None else dev <= FLAT_TOLERANCE,
        }

    return {
        "duration_s": duration,
        "target_pairs_per_s": rate,
        "achieved_pairs_per_s": achieved,
        "achieved_input_per_s": 2.0 * achieved,
        "produced_pairs": produced,
        "rate_ok": rate_ok,
        "lag": stages,
        "lag_bounded": lag_bounded,
        "keep_up": keep_up,
        "drain_limit_s": drain_limit_s,
        "caught_up_s": caught_up_s,
        "drained": drained,
        "applied_fraction": applied_fraction,
        "rss": rss,
        "sustainable": rate_ok and lag_bounded and drained,
        "reasons": reasons,
    }


def _proc_order(name: str) -> tuple[int, str]:
    return (PROCESSES.index(name) if name in PROCESSES else len(PROCESSES), name)


def next_search_rate(
    history: Sequence[tuple[float, bool]],
    start: float,
    *,
    resolution: float = SEARCH_RESOLUTION,
    max_rate: float = SEARCH_MAX_RATE,
    min_rate: float = SEARCH_MIN_RATE,
) -> float | None:
    """The next rate to try given ``(rate, sustainable)`` so far, or None when the search is done.

    Doubling from ``start`` while sustainable (halving while not, when even ``start`` fails),
    then bisecting between the best sustainable rate and the lowest unsustainable one above
    it until they are within ``resolution`` of each other.
    """
    if not history:
        return start
    lo, hi = search_bounds(history)
    if hi is None:
        assert lo is not None
        return None if lo >= max_rate else min(2.0 * lo, max_rate)
    if lo is None:
        nxt = hi / 2.0
        return None if nxt < min_rate else float(round(nxt))
    if (hi - lo) / lo <= resolution:
        return None
    return float(round((lo + hi) / 2.0))


def search_bounds(history: Sequence[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(best sustainable rate, lowest unsustainable rate above it)."""
    ok = [r for r, good in history if good]
    lo = max(ok) if ok else None
    bad = [r for r, good in history if not good and (lo is None or r > lo)]
    return lo, (min(bad) if bad else None)
