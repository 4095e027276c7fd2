"""Drift detection (models/drift.py; docs/learning.md, drift reset): the 7-day event-time correlation,
the reset trigger, the Page–Hinkley agreement detector and the monitor that combines them."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest

from models.drift import AgreementDetector, CorrelationWindow, DriftMonitor, DriftTrigger, naive_utc

DAY = 86400.0


def _stream(seed: int, n: int, days: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n pairs over ``days`` of event time; the relation flips sign halfway, so including
    pairs older than the window changes the correlation a lot."""
    rng = np.random.default_rng(seed)
    t = np.sort(rng.uniform(0, days * DAY, size=n))
    u = rng.normal(size=n)
    sign = np.where(t < days * DAY / 2, -1.0, 1.0)
    r = sign * u + 0.5 * rng.normal(size=n)
    return t, u, r


def test_naive_utc() -> None:
    assert naive_utc(0.0).isoformat() == "1970-01-01T00:00:00"
    assert naive_utc(86400.0 * 365 + 1.5).isoformat() == "1971-01-01T00:00:01.500000"


def test_correlation_window_equals_numpy_over_last_7_days() -> None:
    t, u, r = _stream(seed=1, n=300, days=20)
    w = CorrelationWindow(days=7)
    checked = 0
    for i in range(len(t)):
        w.update(u[i], r[i], t[i])
        if i % 25 == 24 or i == len(t) - 1:
            keep = t[: i + 1] > t[i] - 7 * DAY
            assert w.pairs == int(keep.sum())
            if keep.sum() >= 3:
                expected = np.corrcoef(u[: i + 1][keep], r[: i + 1][keep])[0, 1]
                assert w.get() == pytest.approx(expected, abs=1e-9)
                checked += 1
            # the old pairs really matter: the all-time correlation is different
            if i == len(t) - 1:
                everything = np.corrcoef(u, r)[0, 1]
                assert abs(everything - w.get()) > 0.3
                assert keep.sum() < len(t) / 2
    assert checked >= 10
    assert w.latest_t == t[-1]


def test_correlation_window_drops_pairs_older_than_7_days() -> None:
    w = CorrelationWindow(days=7)
    # three pairs that perfectly disagree, then 8 days later pairs that perfectly agree
    for i, (x, y) in enumerate([(0.0, 3.0), (1.0, 2.0), (2.0, 1.0)]):
        w.update(x, y, t=i * 3600.0)
    assert w.get() == pytest.approx(-1.0)
    for i, (x, y) in enumerate([(0.0, 1.0), (1.0, 2.0), (2.0, 4.0)]):
        w.update(x, y, t=8 * DAY + i * 3600.0)
    assert w.pairs == 3
    assert w.get() == pytest.approx(np.corrcoef([0, 1, 2], [1, 2, 4])[0, 1], abs=1e-12)


def test_correlation_window_empty_and_constant_give_zero() -> None:
    w = CorrelationWindow(days=7)
    assert w.get() == 0.0 and w.pairs == 0
    for i in range(5):
        w.update(1.0, float(i), t=i)  # u constant: correlation undefined
    assert w.get() == 0.0 and math.isfinite(w.get())


def test_correlation_window_accepts_late_pairs_inside_the_window() -> None:
    w = CorrelationWindow(days=7)
    pts = [(0.0, 0.5, 5 * DAY), (1.0, 1.7, 6 * DAY), (2.0, 1.9, 4 * DAY), (3.0, 3.5, 6.5 * DAY)]
    for x, y, t in pts:
        w.update(x, y, t)
    assert w.pairs == 4
    assert w.get() == pytest.approx(np.corrcoef([p[0] for p in pts], [p[1] for p in pts])[0, 1], abs=1e-12)
    assert w.latest_t == 6.5 * DAY


def test_late_pair_older_than_the_window_is_excluded() -> None:
    w = CorrelationWindow(days=7)
    for i, (x, y) in enumerate([(0.0, 0.1), (1.0, 1.2), (2.0, 1.9), (3.0, 3.2)]):
        w.update(x, y, t=10 * DAY + i)
    before = (w.get(), w.pairs)
    w.update(5.0, -5.0, t=1 * DAY)  # nine days older than the newest pair
    assert (w.get(), w.pairs) == pytest.approx(before)


# --------------------------------------------------------------------------- DriftTrigger


def _drive(trig: DriftTrigger, corrs: list[float], t0: float = 0.0, dt: float = 60.0, pairs: int = 10_000) -> list[int]:
    """Feed correlations one pair at a time, firing like DriftMonitor does; return firing indices."""
    fired = []
    for i, c in enumerate(corrs):
        t = t0 + i * dt
        if trig.update(c, pairs, t):
            trig.fire(t)
            fired.append(i)
    return fired


def test_no_reset_before_min_pairs() -> None:
    trig = DriftTrigger(drop=0.15, min_pairs=50, cooldown_s=0.0)
    # the window holds enough pairs, but fewer than min_pairs have entered since the start
    assert not any(trig.update(c, 10_000, float(i)) for i, c in enumerate([0.9] * 10 + [0.0] * 38))
    assert trig.reference is None
    # ... and the window itself must hold min_pairs, whatever has been seen
    trig2 = DriftTrigger(drop=0.15, min_pairs=5, cooldown_s=0.0)
    assert not any(trig2.update(c, 4, float(i)) for i, c in enumerate([0.9] * 10 + [0.0] * 10))
    assert trig2.reference is None


def test_reference_taken_once_window_holds_min_pairs() -> None:
    trig = DriftTrigger(drop=0.15, min_pairs=5, cooldown_s=0.0)
    for i in range(4):
        assert not trig.update(0.1 * i, 100, float(i))
        assert trig.reference is None
    assert not trig.update(0.8, 100, 4.0)
    assert trig.reference == 0.8
    assert not trig.update(0.66, 100, 5.0)  # 0.14 below: not enough
    assert trig.update(0.64, 100, 6.0)  # 0.16 below: fires


def test_exactly_one_reset_for_a_single_step_drop() -> None:
    trig = DriftTrigger(drop=0.15, min_pairs=20, cooldown_s=3600.0)
    corrs = [0.8] * 200 + [0.5] * 400
    fired = _drive(trig, corrs, dt=60.0)
    assert fired == [200]
    assert trig.resets == 1
    assert trig.last_reset_t == 200 * 60.0
    # the reference was re-taken after the reset, at the new level
    assert trig.reference == 0.5


def test_reference_retaken_after_reset_allows_a_second_drop() -> None:
    trig = DriftTrigger(drop=0.15, min_pairs=10, cooldown_s=100.0)
    corrs = [0.8] * 50 + [0.5] * 50 + [0.2] * 50
    fired = _drive(trig, corrs, dt=60.0)
    assert fired == [50, 100]
    assert trig.resets == 2


def test_reference_is_none_right_after_reset() -> None:
    trig = DriftTrigger(drop=0.15, min_pairs=3, cooldown_s=0.0)
    _drive(trig, [0.8, 0.8, 0.8, 0.6])
    assert trig.resets == 1 and trig.reference is None and trig.since_reset == 0
    _drive(trig, [0.6, 0.6])
    assert trig.reference is None
    _drive(trig, [0.55])
    assert trig.reference == 0.55


def test_no_reset_inside_the_cooldown() -> None:
    cooldown = 10 * 3600.0
    trig = DriftTrigger(drop=0.15, min_pairs=5, cooldown_s=cooldown)
    # drop at i=20, new reference at 0.5, second drop to 0.2 at i=40 (t = 40 min: inside the cool-down)
    corrs = [0.8] * 20 + [0.5] * 20 + [0.2] * 1000
    fired = _drive(trig, corrs, dt=60.0)
    assert fired[0] == 20
    assert len(fired) == 2
    # the second reset waits until the cool-down has passed
    assert fired[1] * 60.0 - fired[0] * 60.0 >= cooldown
    assert fired[1] == 20 + cooldown / 60.0


def test_in_cooldown() -> None:
    trig = DriftTrigger(cooldown_s=100.0)
    assert not trig.in_cooldown(0.0)
    trig.fire(1000.0)
    assert trig.in_cooldown(1050.0) and not trig.in_cooldown(1100.0)


def test_fire_records_change_point() -> None:
    trig = DriftTrigger(drop=0.15, min_pairs=3, cooldown_s=0.0)
    assert _drive(trig, [0.5, 0.6, 0.7, 0.9, 0.8, 0.5], dt=10.0) == [5]
    # fired at i=5 (0.5 < 0.7 − 0.15); the correlation's peak 0.9 was at t=30
    assert trig.resets == 1 and trig.change_t == 30.0
    trig.fire(500.0, change_t=123.0)
    assert trig.change_t == 123.0


def test_trigger_state_round_trip() -> None:
    a = DriftTrigger(drop=0.15, min_pairs=10, cooldown_s=600.0)
    history = [0.8] * 30 + [0.5] * 15
    _drive(a, history, dt=60.0)
    state = a.state()
    state = orjson.loads(orjson.dumps(state))  # it is stored as JSON
    b = DriftTrigger(drop=0.15, min_pairs=10, cooldown_s=600.0)
    b.load(state)
    assert b.state() == a.state()
    future = [0.5] * 20 + [0.2] * 60
    t0 = len(history) * 60.0
    assert _drive(a, future, t0=t0, dt=60.0) == _drive(b, future, t0=t0, dt=60.0)
    assert b.state() == a.state()
    assert a.resets == 2


# --------------------------------------------------------------------------- AgreementDetector


def _pairs(seed: int, n: int, flip_at: int | None) -> list[tuple[float, float]]:
    """U_query ~ N(0,1); rating 0..5 rises with U (falls after the flip)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        u = float(rng.normal())
        sign = -1.0 if flip_at is not None and i >= flip_at else 1.0
        out.append((u, float(np.clip(np.round(2.5 + sign * 1.5 * u + 0.5 * rng.normal()), 0, 5))))
    return out


def _run_detector(pairs: list[tuple[float, float]]) -> list[int]:
    d = AgreementDetector()
    return [i for i, (u, r) in enumerate(pairs) if d.update(u, r, t=float(i))]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_agreement_detector_fires_on_sign_flip(seed: int) -> None:
    fired = _run_detector(_pairs(seed, 700, flip_at=500))
    after = [i for i in fired if i >= 500]
    assert after and after[0] - 500 <= 30


def test_agreement_detector_quiet_on_stationary_stream() -> None:
    # one seeded stationary stream; the false-alarm rate across seeds is checked below
    assert _run_detector(_pairs(3, 1000, flip_at=None)) == []


def test_agreement_detector_false_alarm_rate_is_low() -> None:
    false_alarms = sum(bool(_run_detector(_pairs(seed, 2000, flip_at=None))) for seed in range(20))
    assert false_alarms <= 2


def test_agreement_detector_change_point_estimate() -> None:
    estimates = []
    for seed in range(10):
        d = AgreementDetector()
        fired_at = None
        for i, (u, r) in enumerate(_pairs(seed, 800, flip_at=500)):
            if d.update(u, r, t=float(i)) and i >= 500:
                fired_at = i
                break
        assert fired_at is not None
        assert d.change_t is not None and d.change_t <= 505  # at (or within a few pairs of) the change
        estimates.append(d.change_t)
    assert float(np.median(estimates)) >= 470
    d.reset()
    assert d.change_t is None


def test_agreement_detector_ignores_constant_inputs() -> None:
    d = AgreementDetector(min_instances=1)
    assert not any(d.update(1.0, 3.0) for _ in range(200))


# --------------------------------------------------------------------------- DriftMonitor


def test_monitor_fires_once_on_a_relation_break() -> None:
    m = DriftMonitor(days=7, drop=0.15, min_pairs=50, cooldown_s=30 * DAY, page_hinkley=False)
    pairs = _pairs(5, 1200, flip_at=600)
    fired = [(i, f) for i, (u, r) in enumerate(pairs) if (f := m.update(i * 600.0, u, r))]
    assert len(fired) == 1
    i, by = fired[0]
    assert by == "correlation" and i > 600
    assert m.trigger.resets == 1 and m.last_fired_by == "correlation"
    assert m.trigger.change_t is not None and m.trigger.change_t <= i * 600.0


def test_monitor_quiet_on_stationary_pairs() -> None:
    m = DriftMonitor(days=7, drop=0.15, min_pairs=50, cooldown_s=DAY, page_hinkley=False)
    assert not any(m.update(i * 600.0, u, r) for i, (u, r) in enumerate(_pairs(6, 1500, flip_at=None)))
    assert m.trigger.reference is not None and m.trigger.reference > 0.8


def test_monitor_rebuild_restores_window_and_trigger() -> None:
    pairs = _pairs(7, 300, flip_at=None)
    a = DriftMonitor(min_pairs=20, cooldown_s=DAY)
    stored = []
    for i, (u, r) in enumerate(pairs):
        a.update(i * 600.0, u, r)
        stored.append((i * 600.0, u, r))
    b = DriftMonitor(min_pairs=20, cooldown_s=DAY)
    b.rebuild(list(reversed(stored)), a.trigger.state())
    assert b.window.pairs == a.window.pairs
    assert b.window.get() == pytest.approx(a.window.get(), abs=1e-9)
    assert b.trigger.state() == a.trigger.state()
