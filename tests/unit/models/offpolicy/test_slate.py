"""Slate estimators for additive rewards (models/offpolicy/slate.py): small cases computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from models.offpolicy.logged import LoggedDecisions, Served
from models.offpolicy.reward_model import AdditiveRewardModel, SlotRewardModel
from models.offpolicy.served import SlateLog, evaluate_served
from models.offpolicy.slate import (
    MomentCache,
    achievable_range,
    behaviour_moments,
    inclusion,
    pi_weights,
    pinv_selected,
    selected_mask,
    slate_terms,
    target_inclusion,
)
from models.serving.params import ServingParams


def test_plackett_luce_inclusion_by_hand() -> None:
    q, g = inclusion(np.array([[0.5, 0.3, 0.2]]), 2)
    # P(a ∈ top 2) = p_a + Σ_{b≠a} p_b·p_a/(1 − p_b)
    assert q[0].tolist() == pytest.approx([0.5 + 0.3 * 0.5 / 0.7 + 0.2 * 0.5 / 0.8, 0.675, 0.2 + 0.2 + 0.3 * 0.2 / 0.7])
    # Γ_01 = P(a then b) + P(b then a) = 0.5·0.3/0.5 + 0.3·0.5/0.7
    assert g[0, 0, 1] == pytest.approx(0.3 + 0.15 / 0.7) and g[0, 1, 0] == g[0, 0, 1]
    assert np.diagonal(g[0]).tolist() == pytest.approx(q[0].tolist())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_closed_form_matches_enumeration_and_near_greedy_rows_stay_finite(k: int) -> None:
    rng = np.random.default_rng(k)
    p = rng.dirichlet(np.full(7, 0.4), size=6)
    p[0] = [1 - 6e-18] + [1e-18] * 6  # a near-greedy row: 1 − p_top underflows naively
    p[1, -2:] = 0.0  # slots that cannot be drawn
    p[1] /= p[1].sum()
    q, g = inclusion(p, k)
    qe, ge = inclusion(p, k, exact=True)
    assert np.isfinite(g).all() and np.allclose(q, qe, atol=1e-12) and np.allclose(g, ge, atol=1e-12)
    assert np.allclose(q.sum(axis=1), k)
    assert q[0, 0] == pytest.approx(1.0) and (q[1, -2:] == 0).all()


def test_monte_carlo_inclusion_is_seeded_and_close(monkeypatch: pytest.MonkeyPatch) -> None:
    import models.offpolicy.slate as slate

    p = np.random.default_rng(0).dirichlet(np.ones(6), size=2)
    monkeypatch.setattr(slate, "EXACT_LIMIT", 0)
    q1, g1 = inclusion(p, 4, samples=20000, seed=3)
    q2, _ = inclusion(p, 4, samples=20000, seed=3)
    qe, ge = inclusion(p, 4, exact=True)
    assert (q1 == q2).all() and np.abs(q1 - qe).max() < 0.02 and np.abs(g1 - ge).max() < 0.02


def test_pseudo_inverse_weights_by_hand() -> None:
    # k = 1 is IPS: θ_a/μ_a.
    assert pi_weights(np.array([[0.8, 0.2]]), np.array([[[0.5, 0.0], [0.0, 0.5]]]), np.array([[True, False]]))[
        0
    ] == pytest.approx(1.6)
    # 2 of 3, μ uniform over the 3 pairs: Γ = (I + J)/3, Γ⁻¹ = 3I − (3/4)J.
    gamma = np.array([[[2, 1, 1], [1, 2, 1], [1, 1, 2]]]) / 3.0
    pair = {(0, 1): [True, True, False], (0, 2): [True, False, True], (1, 2): [False, True, True]}
    # A target that always reads {0, 1}: θ = (1, 1, 0); PI gives the set's IPS weight 1/(1/3) or 0.
    w = {s: pi_weights(np.array([[1.0, 1.0, 0.0]]), gamma, np.array([m]))[0] for s, m in pair.items()}
    assert w == pytest.approx({(0, 1): 3.0, (0, 2): 0.0, (1, 2): 0.0})
    # Always 0, then 1 or 2: θ = (1, ½, ½): Γ⁻¹1_{01} = (1.5, 1.5, −1.5) → w = 1.5 + .75 − .75.
    theta = np.array([[1.0, 0.5, 0.5]])
    w = {s: pi_weights(theta, gamma, np.array([m]))[0] for s, m in pair.items()}
    assert w == pytest.approx({(0, 1): 1.5, (0, 2): 1.5, (1, 2): 0.0})
    # Unbiased for any additive reward: E_μ[w·r] = θᵀφ/k.
    phi = np.array([0.7, -1.3, 2.0])
    expected = sum(w[s] * phi[list(s)].mean() for s in pair) / 3
    assert expected == pytest.approx(float(theta[0] @ phi) / 2)


def _log(selected, utility, probs, effects=None, temperature=1.0) -> LoggedDecisions:
    n = len(selected)
    return LoggedDecisions.from_lists(
        [[1, 2, 3]] * n,
        [[0.3, 0.2, 0.1]] * n,
        selected,
        [temperature] * n,
        [np.log(1 / 3)] * n,
        utility,
        first_probs=[probs] * n,
        effects=effects,
    )


def test_dr_terms_and_per_slot_correction_by_hand() -> None:
    # μ: uniform pairs of 3 (first-draw probabilities 1/3 each); q_μ = 2/3 for every slot.
    d = _log([[1, 2], [2, 3]], [1.0, 0.0], [1 / 3] * 3, effects=[None, {2: -0.5, 3: 0.25}])
    log = SlateLog.prepare(d)
    assert np.allclose(log.q_mu, 2 / 3) and np.allclose(log.gamma[0], (np.eye(3) + 1) / 3)
    theta = np.array([[1.0, 1.0, 0.0]] * 2)  # the target always reads {1, 2}
    phi = np.array([[0.4, 0.2, 0.0]] * 2)
    pred = np.array([0.3, 0.1])
    terms, w = slate_terms(log.decisions, theta, log.q_mu, log.gamma, "dr", phi, pred)
    assert w.tolist() == pytest.approx([3.0, 0.0])
    direct = (0.4 + 0.2) / 2
    # row 0: direct + w·(u − r̂) = 0.3 + 3·(1 − 0.3)
    assert terms[0] == pytest.approx(direct + 3.0 * 0.7)
    # row 1 has per-memory credit: (1/k)·Σ_{m∈S} θ_m/q_m·(k·e_m − φ_m) over S = {2, 3}
    per_slot = (1.0 / (2 / 3) * (2 * -0.5 - 0.2) + 0.0) / 2
    assert terms[1] == pytest.approx(direct + per_slot)
    assert slate_terms(log.decisions, theta, log.q_mu, log.gamma, "pi")[0].tolist() == pytest.approx([3.0, 0.0])


def test_additive_model_does_not_leak_credit_to_co_selected_slots() -> None:
    # φ1 = 2, φ2 = φ3 = 0: slot 2 is read next to the good slot 1 and must not inherit its reward.
    d = _log([[1, 2], [1, 3], [2, 3]], [1.0, 1.0, 0.0], [1 / 3] * 3)
    leaky = SlotRewardModel(shrinkage=0.0).fit(d).values(np.array([1, 2, 3]))
    fixed = AdditiveRewardModel(shrinkage=0.0).fit(d).values(np.array([1, 2, 3]))
    assert leaky.tolist() == pytest.approx([1.0, 0.5, 0.5])
    assert fixed.tolist() == pytest.approx([2.0, 0.0, 0.0], abs=1e-6)
    # per-memory credit e = φ/k alone identifies the values too
    d2 = _log([[1, 2]], [1.0], [1 / 3] * 3, effects=[{1: 1.0, 2: 0.0}])
    assert AdditiveRewardModel(shrinkage=0.0).fit(d2).values(np.array([1, 2])).tolist() == pytest.approx(
        [2.0, 0.0], abs=1e-6
    )


def test_estimates_are_clipped_to_the_achievable_range() -> None:
    d = _log([[1, 2], [2, 3], [1, 3]] * 5, [1.0, 0.0, 0.5] * 5, [0.8, 0.1, 0.1])
    lo, hi = achievable_range(d, AdditiveRewardModel(shrinkage=0.0).fit(d))
    assert (lo, hi) == pytest.approx((0.0, 1.0), abs=1e-6)  # φ = (1, 1, 0): pairs reach 0.5 … 1
    log = SlateLog.prepare(d)
    assert log.value_range[0] <= lo and log.value_range[1] >= hi  # widened by each slot's spread, never narrower
    log.value_range = (lo, hi)
    # weights far from 1 (μ favours slot 1; the target never reads it) push PI beyond the range
    est = evaluate_served(log, {"t": Served("uniform", ServingParams())}, "pi", n_boot=50)["t"]
    assert lo <= est.low <= est.value <= est.high <= hi


def test_served_mixture_inclusion_is_the_mixture_of_its_temperatures() -> None:
    d = _log([[1, 2]], [1.0], [1 / 3] * 3)
    params = ServingParams(temperature=0.05, explore_rate=0.25, explore_temperature=1.0)
    theta = target_inclusion(d, Served("similarity", params))
    cold = target_inclusion(d, Served("similarity", ServingParams(0.05, 0.0, 1.0)))
    warm = target_inclusion(d, Served("similarity", ServingParams(1.0, 0.0, 1.0)))
    assert np.allclose(theta, 0.75 * cold + 0.25 * warm)
    assert selected_mask(d).tolist() == [[True, True, False]]


def test_moment_cache_gives_the_same_moments_and_computes_only_new_steps() -> None:
    rng = np.random.default_rng(5)
    n = 40
    probs = [rng.dirichlet(np.ones(5)) for _ in range(n)]
    temps = [0.05 if i % 10 else 0.25 for i in range(n)]
    d = LoggedDecisions.from_lists(
        [[1, 2, 3, 4, 5]] * n,
        [[0.5, 0.4, 0.3, 0.2, 0.1]] * n,
        [[1, 2]] * n,
        temps,
        [-1.0] * n,
        [0.0] * n,
        first_probs=probs,
    )
    cache = MomentCache()
    plain = behaviour_moments(d)
    first = behaviour_moments(d.subset(np.arange(30)), cache=cache)
    assert cache.hits == 0 and all(np.allclose(a, b[:30]) for a, b in zip(first, plain, strict=True))
    later = behaviour_moments(d, cache=cache)  # a window that slid on by 10 steps
    assert cache.hits == 2 * 30  # each old step, at each of the window's two temperatures
    assert all(np.allclose(a, b) for a, b in zip(later, plain, strict=True))


def test_pi_weights_from_the_cached_pseudo_inverse_are_the_same() -> None:
    d = _log([[1, 2], [2, 3], [1, 3]], [1.0, 0.0, 0.5], [0.5, 0.3, 0.2])
    log = SlateLog.prepare(d)
    theta = np.array([[0.9, 0.6, 0.5]] * 3)
    mask = selected_mask(log.decisions)
    direct = pi_weights(theta, log.gamma, mask)
    cached = slate_terms(log.decisions, theta, log.q_mu, log.gamma, "pi", pinv_s=pinv_selected(log.gamma, mask))[1]
    assert cached.tolist() == pytest.approx(direct.tolist())
