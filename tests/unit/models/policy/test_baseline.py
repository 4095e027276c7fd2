"""Baselines for A = u − b (docs/learning.md): moving average, none, restore from state."""

from __future__ import annotations

import numpy as np
import pytest

from models.policy.baseline import ClusterBaseline, MovingBaseline, NoBaseline, make_baseline


def test_moving_baseline_advantages_by_hand() -> None:
    f = 0.25
    b = MovingBaseline(fading_factor=f)
    us = [2.0, -1.0, 0.5, 3.0, 0.0]
    got = [b.advantage(u) for u in us]
    # by hand: b starts at 0 (nothing seen), the first update sets b = u, then b ← f·u + (1−f)·b;
    # each A uses b *before* its own utility enters it.
    expected, mean = [], None
    for u in us:
        expected.append(u - (mean if mean is not None else 0.0))
        mean = u if mean is None else f * u + (1 - f) * mean
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[0] == 2.0 and got[1] == -3.0
    assert b.get() == pytest.approx(mean, rel=1e-12)
    assert b.n == len(us)


def test_advantage_uses_baseline_before_update() -> None:
    b = MovingBaseline(fading_factor=0.5)
    b.update(1.0)
    assert b.get() == 1.0
    assert b.advantage(5.0) == 4.0  # not 5 − 3
    assert b.get() == 3.0


def test_get_before_any_update_is_zero() -> None:
    b = MovingBaseline()
    assert b.get() == 0.0 and b.n == 0
    assert b.state() == {"kind": "moving", "value": 0.0, "n": 0, "fading_factor": 0.01}


@pytest.mark.parametrize("history", [[0.3, -0.2, 1.7, 0.05], [0.0], [0.0, 0.0, 1.0], [-5.0, 2.0]])
def test_state_round_trip_reproduces_next_advantages_exactly(history: list[float]) -> None:
    a = MovingBaseline(fading_factor=0.1)
    for u in history:
        a.advantage(u)
    b = MovingBaseline.from_state(a.state())
    assert (b.get(), b.n, b.fading_factor) == (a.get(), a.n, a.fading_factor)
    future = [0.9, -0.4, 0.0, 2.5, 0.1]
    assert [b.advantage(u) for u in future] == [a.advantage(u) for u in future]  # bit-exact
    assert b.state() == a.state()


def test_from_empty_state() -> None:
    b = MovingBaseline.from_state(MovingBaseline(0.2).state())
    assert b.n == 0 and b.get() == 0.0 and b.fading_factor == 0.2
    assert b.advantage(1.5) == 1.5


def test_no_baseline() -> None:
    b = NoBaseline(0.5)
    assert [b.advantage(u) for u in (1.0, 3.0, -2.0)] == [1.0, 3.0, -2.0]
    assert b.get() == 0.0 and b.n == 3
    assert b.state() == {"kind": "none", "value": 0.0, "n": 3}


def test_make_baseline_kinds_and_restore() -> None:
    assert type(make_baseline("moving", 0.1)) is MovingBaseline
    assert type(make_baseline("none", 0.1)) is NoBaseline
    assert type(make_baseline("cluster", 0.1)) is ClusterBaseline
    src = MovingBaseline(0.3)
    for u in (1.0, 2.0, 4.0):
        src.advantage(u)
    restored = make_baseline("moving", 0.3, src.state())
    assert restored.get() == src.get() and restored.n == 3
    assert restored.advantage(1.0) == src.advantage(1.0)
    # the configured fading factor wins over the one in the state
    assert make_baseline("moving", 0.5, src.state()).fading_factor == 0.5
    c = make_baseline("cluster", 0.3, src.state())
    assert c.get() == src.get() and c.n == src.n


@pytest.mark.parametrize("kind", ["ema", "", "Moving", "value"])
def test_make_baseline_unknown_kind(kind: str) -> None:
    with pytest.raises(ValueError, match="unknown baseline"):
        make_baseline(kind, 0.1)


def test_cluster_baseline_falls_back_to_global_mean() -> None:
    c = ClusterBaseline(n_clusters=2, fading_factor=0.5, seed=0)
    emb = np.array([1.0, 0.0])
    assert c.advantage(2.0, emb) == 2.0
    assert c.get(emb) == 2.0  # a cluster seen < 5 times uses the global mean
    assert c.get() == 2.0
    assert c.state()["kind"] == "cluster" and c.state()["n"] == 1


@pytest.mark.parametrize("kind", ["moving", "cluster"])
def test_a_weighted_utility_moves_the_baseline_by_its_weight_and_one_of_weight_zero_not_at_all(kind: str) -> None:
    """A principal held to a share of the update is held to it in b too: a liar of weight 0 that
    reports −9 leaves b where the honest utilities put it."""
    emb = np.array([1.0, 0.0])
    b = make_baseline(kind, 0.5)
    b.advantage(2.0, emb)
    assert b.advantage(-9.0, emb, weight=0.0) == -11.0  # its advantage is still measured
    assert (b.get(), b.n) == (2.0, 1)
    b.advantage(4.0, emb, weight=0.5)
    assert b.get() == pytest.approx(2.0 + 0.5 * 0.5 * (4.0 - 2.0))
    full = make_baseline(kind, 0.5)
    full.advantage(2.0, emb)
    full.advantage(4.0, emb)
    assert full.get() == pytest.approx(3.0)  # weight 1: the unweighted step
    first = make_baseline(kind, 0.5)
    first.advantage(-1.0, emb, weight=0.25)
    assert first.get() == pytest.approx(-0.25)  # a first utility's step from 0, scaled: it does not set b
