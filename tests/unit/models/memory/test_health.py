"""Memory health score (seed 000 §6.1): the formula and its bands."""

from __future__ import annotations

import pytest

from models.memory.health import band, health_score

BASE = dict(correlation=0.8, pairs=100, min_pairs=50, nonnegative_share=1.0, intervention_rate=0.2, fallback_rate=0.0)


def score(**changes: float) -> tuple[float, str]:
    return health_score(**{**BASE, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (100.0, "efficient"),
        (90.0, "efficient"),
        (89.99, "healthy"),
        (70.0, "healthy"),
        (69.99, "warning"),
        (50.0, "warning"),
        (49.99, "critical"),
        (0.0, "critical"),
    ],
)
def test_band_boundaries(value: float, expected: str) -> None:
    assert band(value) == expected


def test_perfect_score() -> None:
    assert score() == (100.0, "efficient")


def test_formula_weights() -> None:
    # s_c = 0.5/0.8, s_u = 0.6, s_i = 1 − (0.75−0.5)/0.5 = 0.5, s_f = 1 − 0.01/0.05 = 0.8
    s, _ = score(correlation=0.5, nonnegative_share=0.6, intervention_rate=0.75, fallback_rate=0.01)
    assert s == pytest.approx(round(100 * (0.35 * 0.625 + 0.35 * 0.6 + 0.15 * 0.5 + 0.15 * 0.8), 2))
    assert s == pytest.approx(62.375, abs=0.006)


def test_each_signal_clipped() -> None:
    assert score(correlation=1.5)[0] == 100.0  # ρ above 0.8 does not add
    assert score(correlation=-0.9)[0] == 65.0  # negative ρ counts as 0, not below
    assert score(nonnegative_share=1.7)[0] == 100.0
    assert score(nonnegative_share=-1.0)[0] == 65.0
    assert score(intervention_rate=0.5)[0] == 100.0
    assert score(intervention_rate=1.0)[0] == 85.0
    assert score(intervention_rate=2.0)[0] == 85.0
    assert score(fallback_rate=0.05)[0] == 85.0
    assert score(fallback_rate=0.9)[0] == 85.0


def test_too_few_pairs_uses_neutral_correlation() -> None:
    assert score(pairs=49, correlation=-1.0)[0] == pytest.approx(100 - 35 * 0.5)
    assert score(pairs=49, correlation=0.8) == score(pairs=49, correlation=-0.3)
    assert score(pairs=50, correlation=0.0)[0] == 65.0  # min_pairs reached: the real ρ counts


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # s_c=1, s_i=s_f=1: 65 + 35·s_u
        ({"nonnegative_share": 25 / 35}, (90.0, "efficient")),
        ({"nonnegative_share": 5 / 35}, (70.0, "healthy")),
        # s_c=0: 30 + 35·s_u
        ({"correlation": 0.0, "nonnegative_share": 20 / 35}, (50.0, "warning")),
        ({"correlation": 0.0, "nonnegative_share": 19.99 / 35}, (49.99, "critical")),
        ({"nonnegative_share": 24.99 / 35}, (89.99, "healthy")),
        ({"nonnegative_share": 4.99 / 35}, (69.99, "warning")),
        (
            {"correlation": 0.0, "nonnegative_share": 0.0, "intervention_rate": 1.0, "fallback_rate": 1.0},
            (0.0, "critical"),
        ),
    ],
)
def test_score_at_band_boundaries(changes: dict[str, float], expected: tuple[float, str]) -> None:
    s, b = score(**changes)
    assert (s, b) == expected
