"""REINFORCE loss pieces (docs/learning.md): importance weights, the policy-gradient loss, the label loss."""

from __future__ import annotations

import math

import pytest
import torch

from models.policy.reinforce import grad_norm, importance_weights, label_loss, reinforce_loss


def test_importance_weights_ratio_and_clip() -> None:
    cur = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    logged = torch.tensor([-1.0, -1.0, -3.0, -2.5], dtype=torch.float64)
    w = importance_weights(cur, logged, clip=5.0)
    expected = [1.0, math.exp(-1.0), 5.0, math.exp(-0.5)]  # exp(2.5) ≈ 12.2 clipped to 5
    assert w.tolist() == pytest.approx(expected, rel=1e-12)
    assert importance_weights(cur, logged, clip=0.5).tolist() == pytest.approx([0.5, math.exp(-1.0), 0.5, 0.5])


def test_importance_weights_carry_no_gradient() -> None:
    cur = torch.tensor([-1.0, -2.0], requires_grad=True)
    w = importance_weights(cur, torch.tensor([-1.5, -1.0]), clip=5.0)
    assert not w.requires_grad and w.grad_fn is None
    # the loss' gradient is w·A/B only: if w carried one, the gradient would pick up w·A·logp too
    loss = reinforce_loss(cur, torch.tensor([1.0, 1.0]), w)
    loss.backward()
    assert cur.grad is not None
    assert cur.grad.tolist() == pytest.approx((-w / 2).tolist())


def test_reinforce_loss_gradient_by_hand() -> None:
    logp = torch.tensor([-0.7, -1.9, -0.2], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([2.0, -0.5, 0.0], dtype=torch.float64)
    w = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    loss = reinforce_loss(logp, adv, w)
    b = 3
    assert float(loss.detach()) == pytest.approx(-(0.5 * 2.0 * -0.7 + 1.0 * -0.5 * -1.9 + 0.0) / b, rel=1e-12)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-(0.5 * 2.0) / b, -(1.0 * -0.5) / b, 0.0], rel=1e-12)


def test_positive_advantage_descends_toward_higher_logp() -> None:
    logp = torch.tensor([-1.0], requires_grad=True)
    reinforce_loss(logp, torch.tensor([1.0]), torch.tensor([1.0])).backward()
    assert logp.grad is not None and float(logp.grad[0]) < 0  # gradient descent raises log π


def _hand_label_loss(z: list[float], good: list[int]) -> float:
    return math.log(sum(math.exp(v) for v in z)) - math.log(sum(math.exp(z[i]) for i in good))


def test_label_loss_value_and_gradient_three_candidates() -> None:
    zv = [0.5, -1.0, 2.0]
    z = torch.tensor([zv], dtype=torch.float64, requires_grad=True)
    valid = torch.ones(1, 3, dtype=torch.bool)
    target = torch.tensor([[True, False, False]])
    loss = label_loss(z, valid, target)
    assert float(loss.detach()) == pytest.approx(_hand_label_loss(zv, [0]), rel=1e-12)
    loss.backward()
    assert z.grad is not None
    e = [math.exp(v) for v in zv]
    p = [x / sum(e) for x in e]
    # d/dz_i [lse(all) − lse(good)] = p_i − [i ∈ good]·softmax_good(i)
    assert z.grad[0].tolist() == pytest.approx([p[0] - 1.0, p[1], p[2]], rel=1e-12)


def test_label_loss_two_targets_padding_and_batch_mean() -> None:
    z = torch.tensor([[0.5, -1.0, 2.0, 9.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    target = torch.tensor([[True, False, True, True], [False, True, False, False]])  # padding target ignored
    loss = label_loss(z, valid, target)
    row0 = _hand_label_loss([0.5, -1.0, 2.0], [0, 2])
    row1 = _hand_label_loss([1.0, 1.0], [1])  # = log 2
    assert row1 == pytest.approx(math.log(2))
    assert float(loss.detach()) == pytest.approx((row0 + row1) / 2, rel=1e-12)
    loss.backward()
    assert z.grad is not None
    e = [math.exp(v) for v in (0.5, -1.0, 2.0)]
    p = [x / sum(e) for x in e]
    q0, q2 = e[0] / (e[0] + e[2]), e[2] / (e[0] + e[2])
    expected0 = [(p[0] - q0) / 2, p[1] / 2, (p[2] - q2) / 2, 0.0]
    expected1 = [0.5 / 2, (0.5 - 1.0) / 2, 0.0, 0.0]
    assert z.grad[0].tolist() == pytest.approx(expected0, rel=1e-12, abs=1e-15)
    assert z.grad[1].tolist() == pytest.approx(expected1, rel=1e-12, abs=1e-15)


def test_label_loss_zero_when_all_candidates_labelled() -> None:
    z = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    ones = torch.ones(1, 2, dtype=torch.bool)
    assert float(label_loss(z, ones, ones)) == pytest.approx(0.0, abs=1e-15)


def test_grad_norm() -> None:
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    c = torch.nn.Parameter(torch.zeros(1))  # no gradient: ignored
    assert grad_norm([a, b, c]) == 0.0
    a.grad = torch.tensor([3.0, 0.0])
    b.grad = torch.tensor([4.0])
    assert grad_norm([a, b, c]) == pytest.approx(5.0)
    b.grad = torch.tensor([float("nan")])
    assert math.isnan(grad_norm([a, b]))
