"""Off-policy estimators (models/offpolicy/estimators.py): hand-computed cases and coverage on a synthetic log."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.offpolicy.estimators import (
    Estimate,
    clipped_weights,
    doubly_robust,
    effective_sample_size,
    empirical_bernstein_bound,
    evaluate,
    gain,
    ips,
    snips,
)
from models.offpolicy.logged import (
    LoggedDecisions,
    Tempered,
    from_experiences,
    log_weights,
    target_logprobs,
    uniform_logprob,
)
from models.offpolicy.reward_model import SlotRewardModel
from models.policy.network import PolicyNetwork
from models.serving.rule import adjusted_logits, keep_dynamic, plackett_luce_logprob, sample_plackett_luce
from topics.events import Features, RetrievalEvent
from topics.internal import Experience

# ---------------------------------------------------------------- hand-computed cases

U = np.array([1.0, 2.0, 3.0])
LOGW = np.log([2.0, 0.5, 1.0])


def test_ips_snips_hand_values() -> None:
    e = ips(U, LOGW, n_boot=50)
    assert isinstance(e, Estimate)
    assert e.value == pytest.approx((2 * 1 + 0.5 * 2 + 1 * 3) / 3)
    assert e.n == 3 and e.method == "ips" and e.clipped_share == 0.0
    assert e.ess == pytest.approx(3.5**2 / (4 + 0.25 + 1))
    s = snips(U, LOGW, n_boot=50)
    assert s.value == pytest.approx(6.0 / 3.5)
    assert s.low <= s.high


def test_ess_and_clipping() -> None:
    assert effective_sample_size(np.ones(7)) == pytest.approx(7.0)
    assert effective_sample_size(np.array([1.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert effective_sample_size(np.zeros(3)) == 0.0
    w, share = clipped_weights(np.log([100.0, 1.0]), clip=50.0)
    assert w.tolist() == pytest.approx([50.0, 1.0]) and share == 0.5
    w, share = clipped_weights(np.log([100.0, 1.0]), clip=None)
    assert w.tolist() == pytest.approx([100.0, 1.0]) and share == 0.0
    e = ips(np.array([1.0, 1.0]), np.log([100.0, 1.0]), clip=50.0, n_boot=20)
    assert e.value == pytest.approx(25.5) and e.clipped_share == 0.5
    assert e.ess == pytest.approx(51.0**2 / (2500 + 1))
    # -inf log-weight (target probability 0) gives weight 0; NaN is rejected.
    w, _ = clipped_weights(np.array([-np.inf, 0.0]))
    assert w.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError):
        clipped_weights(np.array([np.nan]))


def test_snips_all_zero_weights_is_nan() -> None:
    e = snips(np.array([1.0, 2.0]), np.array([-np.inf, -np.inf]), n_boot=20)
    assert math.isnan(e.value) and e.ess == 0.0


def _hand_dr_log() -> LoggedDecisions:
    # k = n everywhere: every target's direct term is the mean value over all candidates, exactly.
    return LoggedDecisions.from_lists(
        candidates=[[1, 2], [1, 3], [2, 3]],
        scores=[[0.5, 0.4], [0.3, 0.2], [0.9, 0.1]],
        selected=[[1, 2], [3, 1], [3, 2]],
        temperature=[1.0, 1.0, 1.0],
        logprob=[-0.5, -0.6, -0.7],
        utility=[1.0, 2.0, 4.0],
    )


def test_slot_reward_model_hand_values() -> None:
    d = _hand_dr_log()
    m = SlotRewardModel(shrinkage=0.0).fit(d)
    # slot 1: decisions 1, 2 -> 1.5; slot 2: decisions 1, 3 -> 2.5; slot 3: decisions 2, 3 -> 3.0
    assert m.values(np.array([1, 2, 3])).tolist() == pytest.approx([1.5, 2.5, 3.0])
    assert m.predict(d).tolist() == pytest.approx([2.0, 2.25, 2.75])
    shrunk = SlotRewardModel(shrinkage=1.0).fit(d)
    gm = 7.0 / 3.0
    assert shrunk.global_mean == pytest.approx(gm)
    assert shrunk.values(np.array([1, 42])).tolist() == pytest.approx([(3.0 + gm) / 3.0, gm])


def test_doubly_robust_hand_value() -> None:
    d = _hand_dr_log()
    m = SlotRewardModel(shrinkage=0.0).fit(d)
    logw = np.log([2.0, 0.5, 1.0])
    # terms: 2 + 2(1 − 2) = 0; 2.25 + 0.5(2 − 2.25) = 2.125; 2.75 + (4 − 2.75) = 4
    for policy in ("uniform", "similarity", Tempered("similarity", 0.1)):
        e = doubly_robust(d, logw, m, policy, n_boot=50)
        assert e.value == pytest.approx((0.0 + 2.125 + 4.0) / 3.0)
        assert e.method == "dr" and e.ess == pytest.approx(3.5**2 / 5.25)


def test_dr_direct_term_k1_is_exact_softmax() -> None:
    d = LoggedDecisions.from_lists([[1, 2]], [[1.0, 0.0]], [[1]], [1.0], [-0.3], [0.0])
    m = SlotRewardModel(global_mean=0.0, slot_ids=np.array([1, 2]), slot_values=np.array([1.0, 0.0]))
    p1 = math.e / (math.e + 1.0)
    assert m.expected_under(d, "similarity")[0] == pytest.approx(p1)
    assert m.expected_under(d, "uniform")[0] == pytest.approx(0.5)


def test_dr_equals_direct_method_when_weights_zero_and_ips_when_model_zero() -> None:
    d = _hand_dr_log()
    zero_model = SlotRewardModel(global_mean=0.0)
    logw = np.log([2.0, 0.5, 1.0])
    assert doubly_robust(d, logw, zero_model, "uniform", n_boot=10).value == pytest.approx(ips(d.utility, logw).value)
    m = SlotRewardModel(shrinkage=0.0).fit(d)
    dm = doubly_robust(d, np.full(3, -np.inf), m, "uniform", n_boot=10)
    assert dm.value == pytest.approx(np.mean([2.0, 2.25, 2.75]))


# ---------------------------------------------------------------- target log-probabilities


def test_uniform_and_similarity_logprob_hand_case() -> None:
    d = LoggedDecisions.from_lists(
        candidates=[[10, 11, 12], [5, 6, 7, 8]],
        scores=[[1.0, 0.0, 0.0], [0.2, 0.4, 0.6, 0.8]],
        selected=[[10, 11], [8]],
        temperature=[1.0, 0.5],
        logprob=[-1.0, -1.0],
        utility=[0.0, 0.0],
    )
    uni = target_logprobs(d, "uniform")
    assert uni.tolist() == pytest.approx([-math.log(6.0), -math.log(4.0)])
    sim = target_logprobs(d, "similarity")
    first = (1.0 - math.log(math.e + 2.0)) + (0.0 - math.log(2.0))
    z = np.array([0.4, 0.8, 1.2, 1.6])  # score / 0.5
    second = 1.6 - math.log(np.exp(z).sum())
    assert sim.tolist() == pytest.approx([first, second])
    tempered = target_logprobs(d, Tempered("similarity", 1.0))
    assert tempered[0] == pytest.approx(first)
    assert tempered[1] == pytest.approx(0.8 - math.log(np.exp(z / 2).sum()))
    assert log_weights(d, "uniform").tolist() == pytest.approx((uni + 1.0).tolist())
    assert uniform_logprob(np.array([5, 5, 1]), np.array([0, 2, 1])).tolist() == pytest.approx(
        [0.0, -math.log(20), 0.0]
    )


def _net(d: int = 4, s: int = 12, seed: int = 0) -> PolicyNetwork:
    torch.manual_seed(seed)
    net = PolicyNetwork(embedding_dim=d, slots=s, hidden=8, alpha=0.7)
    with torch.no_grad():
        net.out.weight.mul_(20.0)  # masks that differ clearly across slots and queries
    return net


def test_network_logprob_matches_numpy_serving_rule() -> None:
    net = _net()
    rng = np.random.default_rng(3)
    n = 40
    cands = [list(rng.choice(12, size=int(rng.integers(2, 7)), replace=False)) for _ in range(n)]
    sels = [list(rng.choice(c, size=min(2, len(c)), replace=False)) for c in cands]
    scores = [rng.uniform(0, 1, len(c)).tolist() for c in cands]
    temps = rng.uniform(0.2, 2.0, n)
    emb = rng.normal(size=(n, 4)).astype(np.float32)
    loss, ent = rng.uniform(0, 3, n), rng.uniform(0, 3, n)
    d = LoggedDecisions.from_lists(cands, scores, sels, temps, np.full(n, -1.0), np.zeros(n), emb, loss, ent)
    got = target_logprobs(d, net)
    with torch.no_grad():
        full = net(
            torch.from_numpy(emb), torch.tensor(loss, dtype=torch.float32), torch.tensor(ent, dtype=torch.float32)
        )
    alpha = float(net.alpha.detach())
    for i in range(n):
        m = full[i, cands[i]].double().numpy()
        keep = keep_dynamic(m)
        kept = [c for c, k in zip(cands[i], keep, strict=True) if k]
        if not set(sels[i]) <= set(kept):
            assert got[i] == -np.inf
            continue
        z = adjusted_logits(np.array(scores[i])[keep], m[keep], alpha, temps[i])
        want = plackett_luce_logprob(z, [kept.index(s) for s in sels[i]])
        assert got[i] == pytest.approx(want, abs=1e-5)


def _dropping_net() -> PolicyNetwork:
    net = PolicyNetwork(embedding_dim=3, slots=5, hidden=4)
    with torch.no_grad():
        net.out.weight.zero_()
        net.out.bias.copy_(torch.tensor([-10.0, 2.0, 2.0, 2.0, 2.0]))  # m_0 ≈ 4.5e-5 < 0.01·2.13
    return net


def test_target_hard_drop_of_a_selected_slot_gives_weight_zero() -> None:
    net = _dropping_net()
    d = LoggedDecisions.from_lists(
        candidates=[[0, 1, 2], [0, 1, 2]],
        scores=[[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]],
        selected=[[0, 1], [1, 2]],
        temperature=[1.0, 1.0],
        logprob=[math.log(1 / 6), math.log(1 / 6)],
        utility=[5.0, 1.0],
        embedding=np.zeros((2, 3)),
    )
    lp = target_logprobs(d, net)
    assert lp[0] == -np.inf
    # Slot 0 dropped by the target: decision 2 is drawn from {1, 2} with equal z: 1/2 · 1.
    assert lp[1] == pytest.approx(math.log(0.5))
    w, _ = clipped_weights(lp - d.logprob)
    assert w.tolist() == pytest.approx([0.0, 3.0])
    est = evaluate(d, {"net": net}, method="ips", n_boot=20)["net"]
    assert est.value == pytest.approx((0.0 * 5.0 + 3.0 * 1.0) / 2)
    # DR: the target's direct term never draws the dropped slot (it keeps {1, 2}, draws both).
    m = SlotRewardModel(global_mean=0.0, slot_ids=np.array([0, 1, 2]), slot_values=np.array([9.0, 1.0, 3.0]))
    assert m.expected_under(d, net).tolist() == pytest.approx([2.0, 2.0])


def test_network_with_wrong_embedding_dim_and_unknown_policy_raise() -> None:
    d = LoggedDecisions.from_lists([[0, 1]], [[0.5, 0.5]], [[0]], [1.0], [-0.7], [0.0], embedding=np.zeros((1, 2)))
    with pytest.raises(ValueError):
        target_logprobs(d, _dropping_net())
    with pytest.raises(ValueError):
        target_logprobs(d, "greedy")
    with pytest.raises(ValueError):
        LoggedDecisions.from_lists([[0, 1]], [[0.5, 0.5]], [[7]], [1.0], [-0.7], [0.0])


def test_from_experiences_builds_padded_arrays_and_skips_fallback_and_labels() -> None:
    def ev(eid: str, cands: list[int], sel: list[int], fallback: bool = False) -> RetrievalEvent:
        feats = Features(np.arange(3, dtype=np.float32), 0.25, 0.5)
        scores = np.linspace(0.9, 0.1, len(cands))
        return RetrievalEvent(eid, "q", 0, 1.0, feats, cands, scores, sel, 0.5, -1.5, fallback)

    exps = [
        Experience("a", "feedback", ev("a", [4, 5, 6], [6, 4]), 0.5),
        Experience("b", "feedback", ev("b", [7, 8], [8]), -0.25),
        Experience("c", "feedback", ev("c", [1, 2], [1], fallback=True), 9.0),
        Experience("d", "label", ev("d", [1, 2], [1]), 0.0, correct_memories=[2]),
    ]
    d = from_experiences(exps)
    assert len(d) == 2
    assert d.slots.tolist() == [[4, 5, 6], [7, 8, 0]]
    assert d.valid.tolist() == [[True, True, True], [True, True, False]]
    assert d.selected.tolist() == [[2, 0], [1, 0]]
    assert d.selected_valid.tolist() == [[True, True], [True, False]]
    assert d.selected_slots()[d.selected_valid].tolist() == [6, 4, 8]
    assert d.utility.tolist() == [0.5, -0.25] and d.temperature.tolist() == [0.5, 0.5]
    assert d.logprob.tolist() == [-1.5, -1.5] and d.embedding.shape == (2, 3)
    assert d.loss.tolist() == [0.25, 0.25] and d.entropy.tolist() == [0.5, 0.5]
    assert len(LoggedDecisions.from_experiences(exps, include_fallback=True)) == 3
    empty = from_experiences([])
    assert len(empty) == 0 and math.isnan(evaluate(empty, {"u": "uniform"})["u"].value)


def test_empirical_bernstein_bound() -> None:
    rng = np.random.default_rng(0)
    u = rng.uniform(0, 1, 2000)
    e = empirical_bernstein_bound(u, np.zeros(2000), clip=1.0, u_range=(0.0, 1.0), delta=0.05)
    assert e.method == "ips-bernstein" and e.low < 0.5 < e.high and e.value == pytest.approx(u.mean())
    assert e.high - e.low < 0.2
    boot = ips(u, np.zeros(2000), n_boot=200)
    assert e.high - e.low > boot.high - boot.low  # a finite-sample bound is wider than the bootstrap


# ---------------------------------------------------------------- coverage on a synthetic log

POOL, N_CAND, K = 30, 5, 2
EFFECTS = np.random.default_rng(2024).normal(0.0, 1.0, POOL)
NOISE = 0.5
TARGET_T = 0.3
RUNS, N_LOG, N_BOOT = 100, 400, 500


def _contexts(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    slots = np.argsort(rng.random((n, POOL)), axis=1)[:, :N_CAND]
    scores = np.clip(0.5 + 0.25 * EFFECTS[slots] + 0.2 * rng.normal(size=(n, N_CAND)), 0.0, 1.0)
    return slots, scores


def _inclusion(z: np.ndarray) -> np.ndarray:
    """P(candidate among the first 2 Plackett–Luce draws), exactly, row-wise."""
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    second = p * ((p / (1.0 - p)).sum(axis=1, keepdims=True) - p / (1.0 - p))
    return p + second


def _true_values() -> dict[str, float]:
    slots, scores = _contexts(np.random.default_rng(99), 400_000)
    eff = EFFECTS[slots]
    return {
        "logging": float(((_inclusion(scores) * eff).sum(axis=1) / K).mean()),
        "sharp": float(((_inclusion(scores / TARGET_T) * eff).sum(axis=1) / K).mean()),
        "uniform": float(eff.mean()),
    }


def _log_lists(n: int, seed: int) -> tuple[list, list, list, np.ndarray, list, np.ndarray]:
    """A log of the similarity policy at T = 1 choosing 2 of 5; utility = mean slot effect + noise."""
    rng = np.random.default_rng(seed)
    slots, scores = _contexts(rng, n)
    sel, logp = [], []
    for i in range(n):
        pos = sample_plackett_luce(scores[i], K, rng)  # logging policy: similarity, T = 1
        sel.append([int(slots[i, j]) for j in pos])
        logp.append(plackett_luce_logprob(scores[i], pos))
    util = np.array([EFFECTS[s].mean() for s in sel]) + NOISE * rng.normal(size=n)
    return slots.tolist(), scores.tolist(), sel, np.ones(n), logp, util


def _synthetic_log(seed: int) -> LoggedDecisions:
    return LoggedDecisions.from_lists(*_log_lists(N_LOG, seed))


@pytest.fixture(scope="module")
def coverage() -> dict[str, float]:
    truth = _true_values()
    assert truth["sharp"] > truth["logging"] + 0.1 > truth["uniform"] + 0.2  # the policies really differ
    policies = {"sharp": Tempered("similarity", TARGET_T), "uniform": "uniform"}
    hits: dict[str, int] = {}

    def hit(key: str, est: Estimate, true: float) -> None:
        hits[key] = hits.get(key, 0) + int(est.low <= true <= est.high)

    for run in range(RUNS):
        d = _synthetic_log(1000 + run)
        for method in ("ips", "snips", "dr"):
            out = evaluate(d, policies, method=method, n_boot=N_BOOT, seed=run)
            for name, est in out.items():
                hit(f"{method}/{name}", est, truth[name])
            g = gain(d, policies["sharp"], "similarity", method=method, n_boot=N_BOOT, seed=run)
            hit(f"{method}/gain", g, truth["sharp"] - truth["logging"])
    return {key: count / RUNS for key, count in hits.items()}


@pytest.mark.slow  # several seconds: make test runs it, make check does not
@pytest.mark.parametrize("method", ["snips", "dr", "ips"])
@pytest.mark.parametrize("target", ["sharp", "uniform", "gain"])
def test_true_value_inside_the_interval_in_90_percent_of_runs(coverage: dict[str, float], method: str, target: str):
    assert coverage[f"{method}/{target}"] >= 0.9, coverage


def test_logging_policy_evaluates_to_weight_one() -> None:
    d = _synthetic_log(7)
    lw = log_weights(d, "similarity")
    assert np.allclose(lw, 0.0, atol=1e-9)
    e = evaluate(d, {"serving": "similarity"}, method="snips", n_boot=50)["serving"]
    assert e.value == pytest.approx(d.utility.mean()) and e.ess == pytest.approx(len(d))
    g = gain(d, "similarity", "similarity", method="dr", n_boot=50)
    assert g.value == pytest.approx(0.0, abs=1e-12) and g.low == pytest.approx(0.0, abs=1e-12)


def test_bootstrap_is_seeded() -> None:
    d = _synthetic_log(8)
    a = evaluate(d, {"u": "uniform"}, method="dr", n_boot=100, seed=5)["u"]
    b = evaluate(d, {"u": "uniform"}, method="dr", n_boot=100, seed=5)["u"]
    assert a == b


def test_gain_sign_is_resolved_on_a_larger_log() -> None:
    d = LoggedDecisions.from_lists(*_log_lists(2000, seed=11))
    better = gain(d, Tempered("similarity", TARGET_T), "similarity", method="dr", n_boot=300)
    worse = gain(d, "uniform", "similarity", method="snips", n_boot=300)
    assert better.low > 0.0 and better.method == "dr-gain"
    assert worse.high < 0.0 and worse.method == "snips-gain"
