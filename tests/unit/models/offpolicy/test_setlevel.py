"""Set-level estimators (models/offpolicy/setlevel.py): rewards that depend on the set read, not additive.

Small cases computed by hand, exact expectations over every possible log, and the inclusion
probabilities of a target served at T = 0.001 (models/offpolicy/slate.py), which the gate's serving
policy is when it is the fresh first policy.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from models.offpolicy.logged import TOPK, LoggedDecisions, Served
from models.offpolicy.setlevel import (
    MAX_SET_K,
    SetTable,
    logging_set_probability,
    set_probability,
    set_terms,
)
from models.offpolicy.slate import behaviour_moments, inclusion, slate_terms, target_inclusion
from models.serving.params import ServingParams


def test_set_probability_by_hand() -> None:
    p = np.array([[0.5, 0.3, 0.2]] * 3)
    got = set_probability(p, np.array([[0, 1], [0, 2], [2, 1]]))
    # {a, b}: a then b, b then a; {a, c}: 0.5·0.2/0.5 + 0.2·0.5/0.8; {b, c}: 0.3·0.2/0.7 + 0.2·0.3/0.8
    assert got.tolist() == pytest.approx([0.3 + 0.15 / 0.7, 0.2 + 0.1 / 0.8, 0.06 / 0.7 + 0.06 / 0.8])
    assert got.sum() == pytest.approx(1.0)
    # A slot that is not a candidate (−1) or cannot be drawn (p = 0): probability 0.
    assert set_probability(np.array([[0.5, 0.5, 0.0]] * 2), np.array([[0, -1], [0, 2]])).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_set_probabilities_sum_to_one_and_match_inclusion(k: int) -> None:
    rng = np.random.default_rng(k)
    p = rng.dirichlet(np.full(7, 0.5), size=5)
    p[0] = [1 - 6e-18] + [1e-18] * 6  # near-greedy: 1 − p_top must not be computed as such
    sets = list(itertools.combinations(range(7), k))
    probs = np.stack([set_probability(p, np.array([s] * 5)) for s in sets], axis=1)  # [5, sets]
    assert probs.sum(axis=1) == pytest.approx(np.ones(5), abs=1e-12)
    member = np.array([[i in s for i in range(7)] for s in sets], float)  # [sets, 7]
    q, _ = inclusion(p, k, exact=True)
    assert probs @ member == pytest.approx(q, abs=1e-12)  # P(m ∈ S) = Σ_{S ∋ m} P(S)


def test_larger_k_than_supported_is_refused() -> None:
    with pytest.raises(ValueError, match="k ≤"):
        set_probability(np.ones((1, 9)) / 9, np.arange(MAX_SET_K + 1)[None])


def test_inclusion_of_a_target_served_at_t_0_001_is_exact() -> None:
    # Such rows made the closed form's inclusion probabilities reach 2 (the gate's serving
    # policy, the fresh first policy served at T = 0.001, was valued far too high).
    p = np.array(
        [
            [9.99999290e-001, 7.09791592e-007, 3.25081648e-028, 3.71572099e-150, 1.10795054e-150, 4.45930879e-156],
            [0.0, 2.699e-255, 2.367e-203, 1.0, 0.0, 3.599e-114],  # products underflow
        ]
    )
    q, g = inclusion(p, 3)
    qe, ge = inclusion(p, 3, exact=True)
    assert np.allclose(q, qe, atol=1e-12) and np.allclose(g, ge, atol=1e-12)
    assert q.max() <= 1.0 and q[0, :3].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert q[1].tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])


def _world(n_queries: int = 3, c: int = 5, k: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate scores, the logging first-draw probabilities and a non-additive set reward."""
    rng = np.random.default_rng(seed)
    scores = rng.uniform(0.2, 0.9, size=(n_queries, c))
    logp = rng.dirichlet(np.ones(c), size=n_queries)
    sets = list(itertools.combinations(range(c), k))
    # "Holds the gold fact" is worth 1 whatever else is read; otherwise small additive values.
    gold = rng.integers(0, c, size=n_queries)
    small = rng.uniform(0.0, 0.2, size=(n_queries, c))
    reward = np.array([[1.0 if g in s else small[q, list(s)].mean() for s in sets] for q, g in enumerate(gold)])
    return scores, logp, reward


def _every_set(scores: np.ndarray, logp: np.ndarray, k: int) -> tuple[LoggedDecisions, list[tuple[int, ...]]]:
    """One decision per (query, set): the log's support, to take exact expectations over."""
    n, c = scores.shape
    sets = list(itertools.combinations(range(c), k))
    cands, sc, sel, fp, emb = [], [], [], [], []
    for q in range(n):
        for s in sets:
            cands.append(list(range(10 * q, 10 * q + c)))
            sc.append(scores[q])
            sel.append([10 * q + i for i in s])
            fp.append(logp[q])
            emb.append(np.eye(n)[q])
    d = LoggedDecisions.from_lists(
        cands, sc, sel, [1.0] * len(sel), [0.0] * len(sel), [0.0] * len(sel), embedding=np.array(emb), first_probs=fp
    )
    return d, sets


def test_set_ips_is_unbiased_for_a_non_additive_reward_where_pseudo_inverse_is_not() -> None:
    # Either of two gold facts answers the question: u(S) = 1 when S holds slot 0 or 1, else 0.
    # Logged uniformly; the target, plain top-2, reads {0, 1}: worth 1, not 2 × a fact's worth.
    scores, logp = np.array([[0.9, 0.8, 0.3, 0.2]]), np.full((1, 4), 0.25)
    k = 2
    d, sets = _every_set(scores, logp, k)
    reward = np.array([1.0 if set(s) & {0, 1} else 0.0 for s in sets])
    d = LoggedDecisions(**{**d.__dict__, "utility": reward})
    target = Served(TOPK, ServingParams())
    _, mu = logging_set_probability(d)
    assert mu == pytest.approx(np.full(6, 1 / 6))
    table = SetTable.build(d, np.zeros(d.valid.shape), mu)
    terms, w = set_terms(d, table, target, "set-ips")
    # E_μ[w·u] = Σ_S μ(S)·w(S)·u(S) over every set the log can hold: exactly the truth, 1.
    assert float(mu @ terms) == pytest.approx(1.0, abs=1e-9)
    assert w.tolist() == pytest.approx([6.0, 0, 0, 0, 0, 0], abs=1e-9)
    # The pseudo-inverse estimator's expectation is the additive fit's value of {0, 1}: least
    # squares of u(S) ≈ β_a + β_b on the six sets gives β_0 = β_1 = 2/3, β_2 = β_3 = 1/6, so 4/3.
    _, q_mu, gamma = behaviour_moments(d)
    pi, _ = slate_terms(d, target_inclusion(d, target), q_mu, gamma, "pi")
    assert float(mu @ pi) == pytest.approx(4 / 3, abs=1e-6)


def test_set_dr_by_hand_uses_the_other_steps_of_the_same_query_and_set() -> None:
    # One query, candidates 1, 2, 3 (k = 2), logged uniformly; sets {1,2} twice (u = 1, 3) and {2,3}
    # once (u = 5). The additive model is zero, the prior weight 0.5.
    d = LoggedDecisions.from_lists(
        [[1, 2, 3]] * 3,
        [[0.3, 0.2, 0.1]] * 3,
        [[1, 2], [2, 1], [3, 2]],
        [1.0] * 3,
        [np.log(1 / 6)] * 3,
        [1.0, 3.0, 5.0],
        embedding=[[1.0, 0.0]] * 3,
        first_probs=[[1 / 3] * 3] * 3,
    )
    _, mu = logging_set_probability(d)
    assert mu.tolist() == pytest.approx([1 / 3] * 3)
    table = SetTable.build(d, np.zeros((3, 3)), mu)
    target = Served("uniform", ServingParams())  # each set 1/3: every weight is 1
    theta = target_inclusion(d, target)
    terms, w = set_terms(d, table, target, "set-dr", theta=theta, phi=np.zeros((3, 3)))
    assert w.tolist() == pytest.approx([1.0, 1.0, 1.0])
    # Step 0: r̂({1,2}) from step 1 alone = 3/1.5 = 2, r̂({2,3}) = 5/1.5; direct = (2 + 10/3)/3,
    # residual 1 − 2. Step 2: r̂({1,2}) = 4/2.5, r̂({2,3}) = 0 (no other step): residual 5 − 0.
    d0 = (2.0 + 5 / 1.5) / 3 + (1.0 - 2.0)
    d1 = (1 / 1.5 + 5 / 1.5) / 3 + (3.0 - 1 / 1.5)
    d2 = (4 / 2.5 + 0.0) / 3 + 5.0
    assert terms.tolist() == pytest.approx([d0, d1, d2])
