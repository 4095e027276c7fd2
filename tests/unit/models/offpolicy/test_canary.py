"""The canary's on-policy comparison (models/offpolicy/canary.py): the confidence sequence, the
covariate adjustment and the rule, on cases computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from models.offpolicy.canary import CanaryArms, confidence_radius, neighbour_covariate, on_policy_gain


def test_the_radius_is_the_normal_mixture_boundary() -> None:
    # se = 0.1, prior se = 0.1: I = I0 = 100; √(2·200/100²·log(√2/0.05)).
    assert confidence_radius(0.1, 0.1, 0.05) == pytest.approx(math.sqrt(0.04 * math.log(math.sqrt(2) / 0.05)))
    assert confidence_radius(0.1, 0.1, 0.05) == pytest.approx(0.36564, abs=1e-5)
    assert confidence_radius(0.0, 0.1) == 0.0
    # Wider than a fixed 95% interval at every information level (the price of looking again and again).
    for se in (0.5, 0.1, 0.02, 0.005):
        assert confidence_radius(se, 0.08) > 1.96 * se


def test_gain_without_a_covariate_is_welch_with_the_sequence_radius() -> None:
    canary = [1.0, 3.0] * 10  # mean 2, sample variance 20/19
    serving = [0.0, 2.0] * 10  # mean 1
    g = on_policy_gain(canary, serving, epsilon=0.02)
    assert g is not None
    se = math.sqrt(2 * (20 / 19) / 20)
    r = confidence_radius(se, 4 * 0.02)
    assert (g.value, g.low, g.high) == pytest.approx((1.0, 1.0 - r, 1.0 + r))
    assert g.n == 20 and g.method == "canary"
    assert on_policy_gain(canary[:19], serving, epsilon=0.02) is None  # too few canary decisions


def test_the_covariate_narrows_without_moving_the_difference() -> None:
    rng = np.random.default_rng(3)
    n_c, n_s = 300, 2700
    xc, xs = rng.normal(0, 2, n_c), rng.normal(0, 2, n_s)  # a query's difficulty, same law in both arms
    yc = xc + 0.3 + rng.normal(0, 0.3, n_c)
    ys = xs + rng.normal(0, 0.3, n_s)
    plain = on_policy_gain(yc, ys, 0.02)
    adjusted = on_policy_gain(yc, ys, 0.02, canary_x=xc, serving_x=xs)
    assert plain is not None and adjusted is not None
    assert adjusted.high - adjusted.low < 0.25 * (plain.high - plain.low)
    assert adjusted.low < 0.3 < adjusted.high
    assert adjusted.low > 0.0 > plain.low  # decides what the plain difference cannot


def test_neighbour_covariate_averages_the_nearest_earlier_queries() -> None:
    before = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]], np.float32)
    u = np.array([2.0, 4.0, 10.0])
    assert neighbour_covariate(before, u, np.array([[1.0, 0.0]]), k=2).tolist() == [3.0]
    assert neighbour_covariate(before, u, np.array([[0.0, 1.0]]), k=1).tolist() == [10.0]
    assert neighbour_covariate(before[:0], u[:0], np.array([[0.0, 1.0]])).tolist() == [0.0]


def test_looking_after_every_batch_keeps_the_error_rate() -> None:
    """Equal arms, looked at every 20 canary decisions up to 600: the sequence excludes
    the true difference (0) in at most ~α of the runs; a fixed 95% interval, looked at as
    often, does so far more often."""
    rng = np.random.default_rng(0)
    runs, seq_errors, fixed_errors = 200, 0, 0
    for _ in range(runs):
        c, s = rng.normal(0, 1, 600), rng.normal(0, 1, 5400)
        seq = fixed = False
        for n in range(20, 601, 20):
            g = on_policy_gain(c[:n], s[: 9 * n], epsilon=0.02)
            assert g is not None
            seq |= g.low > 0 or g.high < 0
            se = math.sqrt(c[:n].var(ddof=1) / n + s[: 9 * n].var(ddof=1) / (9 * n))
            fixed |= abs(g.value) > 1.96 * se
        seq_errors += seq
        fixed_errors += fixed
    assert seq_errors / runs <= 0.06
    assert fixed_errors / runs > 0.15


def test_the_rule_refuses_promotes_and_retires() -> None:
    rng = np.random.default_rng(2)

    def arms(effect: float, n: int) -> CanaryArms:
        a = CanaryArms(rng.normal(size=(40, 3)), rng.normal(size=40))
        for i in range(n):
            on = i % 10 == 0
            a.add(on, float(rng.normal(effect if on else 0.0, 1.0)), rng.normal(size=3))
        return a

    assert arms(-1.0, 2000).verdict(0.02, max_decisions=1000) == "refused"
    assert arms(+1.0, 2000).verdict(0.02, max_decisions=1000) == "promoted"
    assert arms(0.0, 150).verdict(0.02, max_decisions=1000) is None  # undecided: keep serving it
    assert arms(0.0, 150).verdict(0.02, max_decisions=10) == "retired"
    assert arms(0.0, 100).verdict(0.02, max_decisions=1000) is None  # 10 canary decisions: no interval yet
