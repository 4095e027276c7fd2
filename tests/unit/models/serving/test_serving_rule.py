"""The serving rule and the policy network against the contract vectors (docs/contract.md §6)."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.policy.network import NEUTRAL_BIAS, TENSOR_NAMES, Arch, PolicyNetwork, init_policy
from models.serving.rule import (
    adjusted_logits,
    adjusted_logits_torch,
    first_draw_probs,
    keep_dynamic,
    keep_fixed,
    plackett_luce_logprob,
    plackett_luce_logprob_torch,
    revive_dropped,
    sample_plackett_luce,
)
from tests.paths import SHARED_CONTRACT, TEST_DATA

REL = 1e-5


@pytest.fixture(scope="module")
def vectors(request: pytest.FixtureRequest) -> dict[str, Any]:
    base = SHARED_CONTRACT if (SHARED_CONTRACT / "vectors.json").exists() else TEST_DATA / "contract"
    return json.loads((base / "vectors.json").read_text())


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    base = SHARED_CONTRACT if (SHARED_CONTRACT / "vectors.safetensors").exists() else TEST_DATA / "contract"
    return load_file(str(base / "vectors.safetensors"))


@pytest.fixture(scope="module")
def net(tensors: dict[str, torch.Tensor]) -> PolicyNetwork:
    n = PolicyNetwork.from_tensors(tensors)
    n.eval()
    return n


def _mask(net: PolicyNetwork, case: dict[str, Any]) -> np.ndarray:
    with torch.no_grad():
        m = net(
            torch.tensor([case["query_embedding"]], dtype=torch.float32),
            torch.tensor([case["last_step_loss"]], dtype=torch.float32),
            torch.tensor([case["last_step_entropy"]], dtype=torch.float32),
        )
    return m[0].double().numpy()


def _kept(net: PolicyNetwork, case: dict[str, Any]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(kept slots, their scores, their masks) after the dynamic hard drop."""
    mask = _mask(net, case)
    cand = case["index_candidates"]
    keep = keep_dynamic(mask[cand])
    slots = [s for s, k in zip(cand, keep, strict=True) if k]
    scores = np.array([sc for sc, k in zip(case["index_scores"], keep, strict=True) if k])
    return slots, scores, mask[slots]


def test_vectors_shape(vectors: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    assert (vectors["embedding_dim"], vectors["slots"], vectors["hidden"]) == (4, 6, 512)
    assert set(tensors) == set(TENSOR_NAMES)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    shapes = Arch(4, 6, 512).shapes()
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert len(vectors["cases"]) >= 3


def test_from_tensors_arch_and_roundtrip(net: PolicyNetwork, tensors: dict[str, torch.Tensor]) -> None:
    assert net.arch == Arch(embedding_dim=4, slots=6, hidden=512)
    assert net.arch.input_dim == 6
    for name, t in net.tensors().items():
        assert torch.equal(t, tensors[name]), name


def test_expected_masks(net: PolicyNetwork, vectors: dict[str, Any]) -> None:
    for case in vectors["cases"]:
        np.testing.assert_allclose(_mask(net, case), case["expected_mask"], rtol=REL, atol=0)


def test_expected_masks_batched(net: PolicyNetwork, vectors: dict[str, Any]) -> None:
    cases = vectors["cases"]
    with torch.no_grad():
        m = net(
            torch.tensor([c["query_embedding"] for c in cases]),
            torch.tensor([c["last_step_loss"] for c in cases]),
            torch.tensor([c["last_step_entropy"] for c in cases]),
        )
    np.testing.assert_allclose(m.double().numpy(), [c["expected_mask"] for c in cases], rtol=REL, atol=0)


def test_expected_kept(net: PolicyNetwork, vectors: dict[str, Any]) -> None:
    for case in vectors["cases"]:
        slots, _, _ = _kept(net, case)
        assert slots == case["expected_kept"]
        # the reference masks give the same answer
        ref = np.asarray(case["expected_mask"])[case["index_candidates"]]
        assert [s for s, k in zip(case["index_candidates"], keep_dynamic(ref), strict=True) if k] == case[
            "expected_kept"
        ]
    # the vectors exercise the drop: at least one candidate is removed somewhere
    assert any(len(c["expected_kept"]) < len(c["index_candidates"]) for c in vectors["cases"])


def test_expected_logprob_numpy(net: PolicyNetwork, vectors: dict[str, Any]) -> None:
    alpha = float(net.alpha.detach()[0])
    for case in vectors["cases"]:
        slots, scores, masks = _kept(net, case)
        z = adjusted_logits(scores, masks, alpha, case["temperature"])
        positions = [slots.index(s) for s in case["selected"]]
        assert plackett_luce_logprob(z, positions) == pytest.approx(case["expected_logprob"], rel=REL)


def test_revive_cases(net: PolicyNetwork, vectors: dict[str, Any]) -> None:
    """Contract 1.2, §6 step 3b: a revived candidate joins the event's candidates and the
    logprob is the Plackett–Luce one over them (a revived slot may be drawn)."""
    alpha = float(net.alpha.detach()[0])
    # The revive cases are this project's addition (1.2): always from its own copy of the
    # vectors, whose weights are the shared ones.
    own = json.loads((TEST_DATA / "contract" / "vectors.json").read_text())
    cases = own["revive_cases"]
    assert cases and any(set(c["revived"]) & set(c["selected"]) for c in cases)
    for case in cases:
        mask = _mask(net, case)
        cand = case["index_candidates"]
        keep = keep_dynamic(mask[cand])
        assert [s for s, k in zip(cand, keep, strict=True) if k] == case["expected_kept"]
        assert set(case["revived"]) <= {s for s, k in zip(cand, keep, strict=True) if not k}
        served = [s for s in cand if s in case["expected_kept"] or s in case["revived"]]
        assert served == case["expected_candidates"]
        score_of = dict(zip(cand, case["index_scores"], strict=True))
        z = adjusted_logits(np.array([score_of[s] for s in served]), mask[served], alpha, case["temperature"])
        positions = [served.index(s) for s in case["selected"]]
        assert plackett_luce_logprob(z, positions) == pytest.approx(case["expected_logprob"], rel=REL)


def test_revive_draw_is_independent_and_only_adds() -> None:
    keep = np.array([True, False, True, False, False])
    rng = np.random.default_rng(3)
    counts = np.zeros(5)
    for _ in range(4000):
        out = revive_dropped(keep, 0.25, rng)
        assert out[keep].all()  # nothing kept is ever removed
        counts += out
    assert counts[0] == counts[2] == 4000
    assert counts[[1, 3, 4]] / 4000 == pytest.approx([0.25] * 3, abs=0.03)
    assert revive_dropped(keep, 0.0, rng).tolist() == keep.tolist()


def test_expected_logprob_torch(net: PolicyNetwork, vectors: dict[str, Any]) -> None:
    """The learner's batched path: features → candidate_masks → z → PL, padded batch."""
    cases = vectors["cases"]
    kept = [_kept(net, c)[0] for c in cases]
    c_max = max(len(k) for k in kept)
    k_max = max(len(c["selected"]) for c in cases)
    b = len(cases)
    slots = torch.zeros(b, c_max, dtype=torch.long)
    valid = torch.zeros(b, c_max, dtype=torch.bool)
    scores = torch.zeros(b, c_max)
    selected = torch.zeros(b, k_max, dtype=torch.long)
    selected_valid = torch.zeros(b, k_max, dtype=torch.bool)
    for i, (case, ks) in enumerate(zip(cases, kept, strict=True)):
        n = len(ks)
        slots[i, :n] = torch.tensor(ks)
        valid[i, :n] = True
        by_slot = dict(zip(case["index_candidates"], case["index_scores"], strict=True))
        scores[i, :n] = torch.tensor([by_slot[s] for s in ks])
        pos = [ks.index(s) for s in case["selected"]]
        selected[i, : len(pos)] = torch.tensor(pos)
        selected_valid[i, : len(pos)] = True
    temperature = torch.tensor([c["temperature"] for c in cases])
    with torch.no_grad():
        h = net.features(
            torch.tensor([c["query_embedding"] for c in cases]),
            torch.tensor([c["last_step_loss"] for c in cases]),
            torch.tensor([c["last_step_entropy"] for c in cases]),
        )
        m = net.candidate_masks(h, slots)
        z = adjusted_logits_torch(scores, m, net.alpha, temperature)
        logp = plackett_luce_logprob_torch(z, valid, selected, selected_valid)
    np.testing.assert_allclose(logp.double().numpy(), [c["expected_logprob"] for c in cases], rtol=REL, atol=0)


def test_candidate_masks_equal_full_forward() -> None:
    net = init_policy(embedding_dim=8, slots=32, hidden=16, seed=3)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(5, 8, generator=g)
    loss, ent = torch.rand(5, generator=g), torch.rand(5, generator=g)
    slots = torch.randint(0, 32, (5, 7), generator=g)
    with torch.no_grad():
        full = net(emb, loss, ent)
        h = net.features(emb, loss, ent)
        part = net.candidate_masks(h, slots)
    expected = torch.gather(full, 1, slots)
    torch.testing.assert_close(part, expected, rtol=1e-6, atol=1e-7)
    assert bool((part >= 0).all())


def test_candidate_masks_on_contract_policy(net: PolicyNetwork, vectors: dict[str, Any]) -> None:
    case = vectors["cases"][1]
    slots = torch.tensor([case["index_candidates"]])
    with torch.no_grad():
        h = net.features(
            torch.tensor([case["query_embedding"]]),
            torch.tensor([case["last_step_loss"]]),
            torch.tensor([case["last_step_entropy"]]),
        )
        part = net.candidate_masks(h, slots)[0].double().numpy()
    np.testing.assert_allclose(part, np.asarray(case["expected_mask"])[case["index_candidates"]], rtol=REL)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_plackett_luce_sums_to_one(n: int) -> None:
    rng = np.random.default_rng(n)
    z = rng.normal(scale=2.0, size=n)
    for k in range(1, n + 1):
        total = sum(math.exp(plackett_luce_logprob(z, list(p))) for p in itertools.permutations(range(n), k))
        assert total == pytest.approx(1.0, abs=1e-12)


def test_plackett_luce_torch_sums_to_one() -> None:
    z = torch.tensor([[0.3, -1.2, 2.0, 0.5]], dtype=torch.float64)
    valid = torch.ones(1, 4, dtype=torch.bool)
    perms = list(itertools.permutations(range(4), 2))
    zz = z.expand(len(perms), 4)
    sel = torch.tensor(perms)
    logp = plackett_luce_logprob_torch(zz, valid.expand(len(perms), 4), sel, torch.ones_like(sel, dtype=torch.bool))
    assert float(logp.exp().sum()) == pytest.approx(1.0, abs=1e-12)


def test_plackett_luce_hand_values() -> None:
    z = np.array([1.0, 0.0, -1.0])
    e = np.exp(z)
    assert plackett_luce_logprob(z, [0]) == pytest.approx(math.log(e[0] / e.sum()))
    assert plackett_luce_logprob(z, [2, 0]) == pytest.approx(math.log(e[2] / e.sum()) + math.log(e[0] / (e[0] + e[1])))
    assert plackett_luce_logprob(z, []) == 0.0
    # order matters
    assert plackett_luce_logprob(z, [0, 1]) != pytest.approx(plackett_luce_logprob(z, [1, 0]))


def test_torch_matches_numpy_with_padding() -> None:
    rng = np.random.default_rng(7)
    z1, z2 = rng.normal(size=5), rng.normal(size=3)
    z = torch.zeros(2, 5, dtype=torch.float64)
    z[0] = torch.from_numpy(z1)
    z[1, :3] = torch.from_numpy(z2)
    z[1, 3:] = 100.0  # padding must not matter, however large
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    selected = torch.tensor([[4, 0, 2], [1, 0, 0]])
    selected_valid = torch.tensor([[True, True, True], [True, False, False]])
    out = plackett_luce_logprob_torch(z, valid, selected, selected_valid)
    assert float(out[0]) == pytest.approx(plackett_luce_logprob(z1, [4, 0, 2]), rel=1e-12)
    assert float(out[1]) == pytest.approx(plackett_luce_logprob(z2, [1]), rel=1e-12)
    # a row without any valid selection gives 0
    none = plackett_luce_logprob_torch(z, valid, selected, torch.zeros_like(selected_valid))
    assert none.tolist() == [0.0, 0.0]


def test_sampling_matches_first_draw_probs() -> None:
    z = np.array([1.2, 0.3, -0.5, 0.9, 0.0])
    p = first_draw_probs(z)
    assert p.sum() == pytest.approx(1.0)
    rng = np.random.default_rng(12345)
    draws = 20_000
    counts = np.zeros(len(z))
    pair_counts: dict[tuple[int, int], int] = {}
    for _ in range(draws):
        s = sample_plackett_luce(z, 2, rng)
        assert len(s) == 2 and s[0] != s[1]
        counts[s[0]] += 1
        pair_counts[tuple(s)] = pair_counts.get(tuple(s), 0) + 1
    freq = counts / draws
    # 5 standard errors at p≈0.35 and n=20k is ≈0.017
    np.testing.assert_allclose(freq, p, atol=0.017)
    # the ordered pair is Plackett–Luce distributed too
    for pair in [(0, 3), (3, 0), (1, 2)]:
        expected = math.exp(plackett_luce_logprob(z, list(pair)))
        assert pair_counts.get(pair, 0) / draws == pytest.approx(expected, abs=0.01)


def test_sample_plackett_luce_edges() -> None:
    rng = np.random.default_rng(0)
    z = np.array([0.0, 1.0, 2.0])
    assert sample_plackett_luce(z, 0, rng) == []
    assert sorted(sample_plackett_luce(z, 10, rng)) == [0, 1, 2]  # k clipped to the candidates
    # near-greedy at a very sharp distribution
    sharp = np.array([0.0, 50.0, 100.0])
    assert sample_plackett_luce(sharp, 3, rng) == [2, 1, 0]


def test_first_draw_probs_softmax_and_stable() -> None:
    z = np.array([1000.0, 999.0])
    p = first_draw_probs(z)
    assert np.isfinite(p).all()
    assert p[0] == pytest.approx(math.e / (math.e + 1))


def test_adjusted_logits_formula() -> None:
    z = adjusted_logits(np.array([0.5, -0.2]), np.array([2.0, 1.0]), alpha=0.5, temperature=0.25)
    np.testing.assert_allclose(z, [0.5 * 2.0 / 0.25, -0.2 * 1.5 / 0.25])
    zt = adjusted_logits_torch(
        torch.tensor([[0.5, -0.2]]), torch.tensor([[2.0, 1.0]]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    np.testing.assert_allclose(zt.numpy()[0], z, rtol=1e-6)


def test_keep_dynamic_threshold() -> None:
    m = np.array([1.0, 0.01, 0.0099999, 0.5, 0.0])
    assert keep_dynamic(m).tolist() == [True, True, False, True, False]
    assert keep_dynamic(m, ratio=0.6).tolist() == [True, False, False, False, False]
    assert keep_dynamic(np.array([])).tolist() == []
    # all-zero masks: 0 >= 0.01·0 keeps everything (nothing distinguishes them)
    assert keep_dynamic(np.zeros(3)).tolist() == [True, True, True]


def test_keep_fixed() -> None:
    m = np.array([0.2, 0.1, 0.05, np.nan, np.inf])
    # non-finite masks are never kept, whatever the threshold
    assert keep_fixed(m, 0.1).tolist() == [True, True, False, False, False]
    assert keep_fixed(m, 0.0).tolist() == [True, True, True, False, False]
    assert keep_fixed(m, 1.0).tolist() == [False] * 5


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_mask_drops_everything(bad: float) -> None:
    m = np.array([1.0, 0.5, bad, 0.2])
    assert keep_dynamic(m).tolist() == [False] * 4


def test_torch_gradient_single_draw_is_onehot_minus_softmax() -> None:
    z = torch.tensor([[0.4, -0.3, 1.1]], dtype=torch.float64, requires_grad=True)
    valid = torch.ones(1, 3, dtype=torch.bool)
    logp = plackett_luce_logprob_torch(z, valid, torch.tensor([[0]]), torch.tensor([[True]]))
    logp.sum().backward()
    p = torch.softmax(z.detach(), dim=1)[0]
    expected = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64) - p
    torch.testing.assert_close(z.grad[0], expected, rtol=1e-12, atol=1e-12)


def test_torch_gradient_two_draws_hand_and_finite_difference() -> None:
    z0 = torch.tensor([[0.4, -0.3, 1.1]], dtype=torch.float64)
    valid = torch.ones(1, 3, dtype=torch.bool)
    sel = torch.tensor([[2, 0]])
    sel_valid = torch.tensor([[True, True]])
    z = z0.clone().requires_grad_(True)
    plackett_luce_logprob_torch(z, valid, sel, sel_valid).sum().backward()
    assert z.grad is not None
    # by hand: d/dz [z2 − lse(z0,z1,z2)] + d/dz [z0 − lse(z0,z1)]
    p_all = torch.softmax(z0[0], 0)
    p_rest = torch.softmax(z0[0, :2], 0)
    hand = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64) - p_all
    hand[0] += 1.0 - p_rest[0]
    hand[1] += -p_rest[1]
    torch.testing.assert_close(z.grad[0], hand, rtol=1e-12, atol=1e-12)
    # central finite differences on the numpy reference
    eps = 1e-6
    fd = np.zeros(3)
    for i in range(3):
        up, down = z0[0].numpy().copy(), z0[0].numpy().copy()
        up[i] += eps
        down[i] -= eps
        fd[i] = (plackett_luce_logprob(up, [2, 0]) - plackett_luce_logprob(down, [2, 0])) / (2 * eps)
    np.testing.assert_allclose(z.grad[0].numpy(), fd, atol=1e-8)
    assert z.grad[0].sum().item() == pytest.approx(0.0, abs=1e-12)  # shift invariance


def test_torch_gradient_ignores_invalid_candidates() -> None:
    z = torch.tensor([[0.4, -0.3, 1.1, 5.0]], dtype=torch.float64, requires_grad=True)
    valid = torch.tensor([[True, True, True, False]])
    plackett_luce_logprob_torch(z, valid, torch.tensor([[1]]), torch.tensor([[True]])).sum().backward()
    assert z.grad is not None
    assert z.grad[0, 3].item() == 0.0


def test_policy_mask_non_negative_and_reset_last_layer() -> None:
    net = init_policy(4, 6, hidden=8, seed=1)
    before = {k: v.clone() for k, v in net.tensors().items()}
    net.reset_last_layer(torch.Generator().manual_seed(5))
    after = net.tensors()
    for name in TENSOR_NAMES:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name == "out.weight"), name
    # A fresh output layer is neutral (serves like similarity search): every bias at softplus⁻¹(1).
    assert torch.allclose(after["out.bias"], torch.full((6,), NEUTRAL_BIAS))
    # same generator seed → same fresh layer
    other = init_policy(4, 6, hidden=8, seed=1)
    other.reset_last_layer(torch.Generator().manual_seed(5))
    assert torch.equal(other.out.weight, net.out.weight)
    with torch.no_grad():
        m = net(torch.randn(3, 4) * 10, torch.randn(3), torch.randn(3))
    assert bool((m >= 0).all())


def test_init_policy_deterministic_and_load_tensors_checks_shapes() -> None:
    a, b = init_policy(4, 6, hidden=8, seed=9), init_policy(4, 6, hidden=8, seed=9)
    for name in TENSOR_NAMES:
        assert torch.equal(a.tensors()[name], b.tensors()[name])
    assert float(a.alpha.detach()[0]) == 0.5
    bad = a.tensors()
    bad["out.bias"] = torch.zeros(7)
    with pytest.raises(ValueError):
        b.load_tensors(bad)
