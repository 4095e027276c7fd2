"""The client's masks (pipeline/client/serving.py ``policy_masks``, NumPy over the checkpoint's
tensors) are the network's within float32 rounding: what ``PolicyNetwork.features`` then
``candidate_masks`` give, on both branches of softplus and for suppressed memories."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.policy.network import init_policy
from pipeline.client.serving import policy_masks
from pipeline.client.subscriber import LoadedPolicy
from topics.manifest import Manifest


def loaded(dim: int, slots: int, hidden: int, seed: int) -> LoadedPolicy:
    net = init_policy(dim, slots, hidden, seed=seed).eval()
    with torch.no_grad():  # learnt-looking rows: masks far from the neutral 1
        net.out.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
        net.out.bias.uniform_(-4.0, 4.0, generator=torch.Generator().manual_seed(seed + 1))
    return LoadedPolicy(manifest=Manifest("p", 1, 0.0, "init", {}, 0.5, 0.0, "0" * 64, 1, 1), net=net)


def network_masks(policy: LoadedPolicy, q: np.ndarray, loss: float, entropy: float, slots: np.ndarray) -> np.ndarray:
    net = policy.net
    with torch.no_grad():
        h = net.features(torch.from_numpy(q[None]), torch.tensor([loss]), torch.tensor([entropy]))
        m = net.candidate_masks(h, torch.from_numpy(slots[None].astype(np.int64)))
    return m[0].double().numpy()


@pytest.mark.parametrize(("dim", "slots", "hidden"), [(8, 30, 16), (384, 2000, 512)])
def test_policy_masks_equal_the_networks(dim: int, slots: int, hidden: int) -> None:
    rng = np.random.default_rng(0)
    for seed in range(3):
        policy = loaded(dim, slots, hidden, seed)
        for _ in range(20):
            q = rng.normal(size=dim).astype(np.float32)
            cand = rng.choice(slots, size=int(rng.integers(1, 21)), replace=False)
            loss, entropy = float(rng.uniform(0, 3)), float(rng.uniform(0, 3))
            got = policy_masks(policy, q, loss, entropy, cand)
            assert got.dtype == np.float64 and got.shape == (len(cand),)
            np.testing.assert_allclose(got, network_masks(policy, q, loss, entropy, cand), rtol=2e-6, atol=1e-7)
    assert policy_masks(None, q, 0.0, 0.0, cand).tolist() == [0.0] * len(cand)


def test_policy_masks_on_both_branches_of_softplus() -> None:
    """Above 20 softplus is its input (torch's threshold); a suppressed row (bias -30) is ~1e-13, not 0."""
    policy = loaded(8, 30, 16, seed=5)
    with torch.no_grad():
        policy.net.out.bias[1] = 40.0
        policy.net.out.bias[2] = -30.0
    q, cand = np.ones(8, np.float32), np.array([0, 1, 2])
    got = policy_masks(policy, q, 0.0, 0.0, cand)
    np.testing.assert_allclose(got, network_masks(policy, q, 0.0, 0.0, cand), rtol=2e-6, atol=1e-15)
    assert got[1] > 20.0 and 0.0 < got[2] < 1e-12


def test_policy_masks_refuse_a_slot_outside_the_network() -> None:
    policy = loaded(8, 30, 16, seed=6)
    for bad in ([-1], [30]):
        with pytest.raises(IndexError):
            policy_masks(policy, np.ones(8, np.float32), 0.0, 0.0, np.array(bad))


def test_policy_masks_follow_rows_written_in_place() -> None:
    """A delta applied in place (the subscriber's path) is served at once: nothing is cached."""
    policy = loaded(8, 30, 16, seed=4)
    q, cand = np.ones(8, np.float32), np.array([3, 7])
    before = policy_masks(policy, q, 0.0, 0.0, cand)
    with torch.no_grad():
        policy.net.out.bias[7] = -30.0
    after = policy_masks(policy, q, 0.0, 0.0, cand)
    assert after[0] == before[0] and after[1] < 1e-12 < before[1]
