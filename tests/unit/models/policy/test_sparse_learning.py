"""Row-sparse, lazy Adam on the output layer (models/policy/row_adam.py) and the row interfaces of
PolicyTrainer (init_rows, take_changed_rows): numerics against dense Adam, untouched rows,
optimizer state layouts. Small dims: D=8, hidden=16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.policy.network import NEUTRAL_BIAS, PolicyNetwork
from models.policy.trainer import PolicyTrainer, TrainerConfig
from topics.events import Features, RetrievalEvent
from topics.fields import MAX_SLOTS, Limits
from topics.internal import Experience

D, H = 8, 16
BASE_TS = 1_767_225_600.0


def trainer(slots: int, **kw: object) -> PolicyTrainer:
    args: dict[str, object] = dict(embedding_dim=D, slots=slots, hidden=H, lr=1e-2, seed=0)
    args.update(kw)
    return PolicyTrainer(TrainerConfig(**args))  # type: ignore[arg-type]


def fb(i: int, utility: float, candidates: list[int], kind: str = "feedback", **kw: object) -> Experience:
    rng = np.random.default_rng(i)
    ev = RetrievalEvent(
        event_id=f"e{i}",
        query_id=f"q{i}",
        step=0,
        ts=BASE_TS + i,
        features=Features(rng.normal(size=D).astype(np.float32), float(rng.uniform(0, 2)), float(rng.uniform(0, 2))),
        candidates=candidates,
        scores=np.linspace(0.9, 0.5, len(candidates)),
        selected=[candidates[i % len(candidates)], candidates[(i + 1) % len(candidates)]],
        temperature=0.5,
        logprob=-1.0,
        fallback=False,
    )
    return Experience(f"{kind}{i}", kind, ev, utility=utility, **kw)  # type: ignore[arg-type]


class DenseAdam:
    """The reference: torch's Adam (not fused) over every parameter with dense gradients,
    clipped by torch.nn.utils.clip_grad_norm_: what the trainer did before row-sparse Adam."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, slots: int) -> None:
        self.params, self.slots = params, slots
        self.opt = torch.optim.Adam(params, lr=lr)

    def prefetch(self, rows: torch.Tensor) -> None:
        pass  # dense: nothing to gather ahead

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def clip_grad_norm_(self, max_norm: float) -> float:
        for p in self.params:
            if p.grad is not None and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def step(self) -> np.ndarray:
        self.opt.step()
        return np.arange(self.slots, dtype=np.int64)


def _pair(slots: int) -> tuple[PolicyTrainer, PolicyTrainer]:
    sparse = trainer(slots)
    dense = trainer(slots)
    dense.optimizer = DenseAdam(list(dense.net.parameters()), dense.config.lr, slots)  # type: ignore[assignment]
    return sparse, dense


def test_rows_touched_every_step_match_dense_adam() -> None:
    slots = 6
    sparse, dense = _pair(slots)
    rng = np.random.default_rng(0)
    for step in range(25):
        batch = [fb(step * 4 + j, float(rng.normal()), list(rng.permutation(slots))) for j in range(4)]
        a, b = sparse.update(batch), dense.update(batch)
        assert a.applied == b.applied == 4
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for name, p in sparse.net.state_dict().items():
        q = dense.net.state_dict()[name]
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), (name, float((p - q).abs().max()))
    # and they did learn: the output layer moved from its initial values
    assert not torch.allclose(sparse.net.out.bias, torch.full((slots,), NEUTRAL_BIAS), atol=1e-3)


def test_untouched_rows_do_not_move_lazy_semantics() -> None:
    slots = 50
    sparse, dense = _pair(slots)
    first, second = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]
    sparse.update([fb(0, 1.0, first), fb(1, -0.5, first)])
    dense.update([fb(0, 1.0, first), fb(1, -0.5, first)])
    rows_s = sparse.net.out.weight.detach().clone()
    rows_d = dense.net.out.weight.detach().clone()
    sparse.update([fb(2, 0.7, second), fb(3, -0.2, second)])
    dense.update([fb(2, 0.7, second), fb(3, -0.2, second)])
    w_s, w_d = sparse.net.out.weight.detach(), dense.net.out.weight.detach()
    # lazy: rows 0-4 (no gradient in the second step) and 10-49 (never touched) keep their values
    assert torch.equal(w_s[first], rows_s[first])
    assert torch.equal(w_s[10:], rows_s[10:])
    assert not torch.equal(w_s[second], rows_s[second])
    # dense Adam keeps moving rows 0-4 along their momentum: the difference documented in docs/learning.md
    assert not torch.equal(w_d[first], rows_d[first])


def test_a_rows_first_update_is_adams_first_step() -> None:
    """Per-row bias correction: a row touched first at a late step moves by ~lr, as in a fresh Adam."""
    t = trainer(40, lr=1e-3)
    for i in range(20):
        t.update([fb(i, float(np.sin(i)), [0, 1, 2, 3])])
    before = t.net.out.bias.detach().clone()
    t.update([fb(100, 1.0, [30, 31, 32, 33])])
    moved = (t.net.out.bias.detach() - before)[30:34].abs()
    assert torch.allclose(moved, torch.full((4,), 1e-3), rtol=1e-2)


def test_take_changed_rows_reports_what_was_written() -> None:
    t = trainer(40)
    first = t.take_changed_rows()
    assert first.dtype == np.int64 and first.tolist() == list(range(40))  # a new trainer: every row
    assert t.take_changed_rows().tolist() == []
    t.update([fb(0, 1.0, [9, 3, 17]), fb(1, -1.0, [3, 25])])
    assert t.take_changed_rows().tolist() == [3, 9, 17, 25]
    t.fine_tune([fb(2, 0.0, [11, 12, 13], kind="label", correct_memories=[12])])
    assert t.take_changed_rows().tolist() == [11, 12, 13]
    t.net.suppress([30, 5])
    t.init_rows([38])
    assert t.take_changed_rows().tolist() == [5, 30, 38]
    t.reset_last_layer([], epochs=0)
    assert t.take_changed_rows().tolist() == list(range(40))
    t.load(t.tensors())
    assert len(t.take_changed_rows()) == 40
    # a skipped (non-finite) batch writes nothing
    assert t.update([fb(3, float("nan"), [1, 2])]).skipped_non_finite == 1
    assert t.take_changed_rows().tolist() == []


def test_init_rows_sets_rows_and_forgets_their_moments() -> None:
    t = trainer(20)
    t.update([fb(i, 1.0 if i % 2 else -1.0, [2, 4, 6, 8]) for i in range(6)])
    t.fine_tune([fb(9, 0.0, [2, 4], kind="label", correct_memories=[4])])
    other = t.net.out.weight.detach()[6].clone()
    t.init_rows([4])  # neutral
    m = t.net.candidate_masks(torch.randn(3, H), torch.tensor([[4]] * 3)).detach()
    assert torch.allclose(m, torch.ones_like(m), atol=0.05)
    assert float(t.net.out.bias.detach()[4]) == pytest.approx(NEUTRAL_BIAS)
    for opt in (t.optimizer.rows, t.label_optimizer.rows):
        assert int(opt.step_count[4]) == 0 and float(opt.exp_avg[4].abs().sum()) == 0.0
        assert float(opt.bias_avg_sq[4]) == 0.0
        assert int(opt.step_count[2]) > 0  # other rows keep theirs
    assert torch.equal(t.net.out.weight.detach()[6], other)
    w, b = torch.full((2, H), 0.25), torch.tensor([0.5, -1.0])
    t.init_rows([7, 1], w, b)
    assert torch.equal(t.net.out.weight.detach()[[7, 1]], w) and torch.equal(t.net.out.bias.detach()[[7, 1]], b)
    for bad in ([3, 3], [20], [-1]):
        with pytest.raises(ValueError):
            t.init_rows(bad)
    with pytest.raises(ValueError):
        t.init_rows([1, 2], torch.zeros(1, H), torch.zeros(1))


def _continue(t: PolicyTrainer) -> dict[str, torch.Tensor]:
    t.update([fb(50 + i, float(np.cos(i)), [1, 2, 3, 30, 31]) for i in range(3)])
    t.fine_tune([fb(60, 0.0, [2, 3, 31], kind="label", correct_memories=[31])])
    t.update([fb(70, 0.4, [0, 1, 2, 3])])
    return {k: v.detach().clone() for k, v in t.net.state_dict().items()}


def test_optimizer_state_keeps_touched_rows_only_and_round_trips() -> None:
    a = trainer(1000)
    a.update([fb(i, float(np.sin(i)), [1, 2, 3, 4, 5]) for i in range(4)])
    a.fine_tune([fb(10, 0.0, [2, 3], kind="label", correct_memories=[3])])
    saved = a.optimizer_tensors()
    assert saved["main.out.rows"].tolist() == [1, 2, 3, 4, 5]
    assert tuple(saved["main.out.weight.exp_avg"].shape) == (5, H)
    assert tuple(saved["main.out.bias.exp_avg_sq"].shape) == (5,)
    assert saved["label.out.rows"].tolist() == [2, 3]
    assert "main.hidden.weight.exp_avg" in saved  # the backbone keeps its per-parameter layout
    b = trainer(1000, seed=7)
    b.load(a.tensors(), a.baseline.state())
    b.load_optimizer_tensors(saved)
    pa, pb = _continue(a), _continue(b)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_dense_and_earlier_optimizer_layouts_load() -> None:
    slots = 6
    a = trainer(slots)
    a.update([fb(i, float(np.sin(i)), list(range(slots))) for i in range(3)])
    saved = a.optimizer_tensors()
    assert "main.out.rows" not in saved  # every row touched: stored whole, no copy
    assert tuple(saved["main.out.weight.exp_avg"].shape) == (slots, H)
    # the layout of earlier versions: per parameter, one step count
    earlier = {k: v for k, v in saved.items() if not k.startswith("main.out.step")}
    earlier["main.out.weight.step"] = saved["main.out.step"][:1].clone()
    earlier["main.out.bias.step"] = saved["main.out.step"][:1].clone()
    loaded = []
    for layout in (saved, earlier):  # (loaded before ``a`` goes on: the saved tensors share its memory)
        b = trainer(slots, seed=3)
        b.load(a.tensors(), a.baseline.state())
        b.load_optimizer_tensors(layout)
        loaded.append(b)
    pa = _continue_small(a)
    for b in loaded:
        pb = _continue_small(b)
        for k in pa:
            assert torch.equal(pa[k], pb[k]), k


def _continue_small(t: PolicyTrainer) -> dict[str, torch.Tensor]:
    t.update([fb(80 + i, float(np.cos(i)), [0, 2, 4, 5]) for i in range(2)])
    return {k: v.detach().clone() for k, v in t.net.state_dict().items()}


def test_out_gradient_is_row_sparse() -> None:
    net = PolicyNetwork(embedding_dim=D, slots=10_000, hidden=H)
    h = net.features(torch.randn(2, D), torch.zeros(2), torch.zeros(2))
    net.candidate_masks(h, torch.tensor([[5, 9], [9, 70]])).sum().backward()
    g = net.out.weight.grad
    assert g is not None and g.is_sparse
    assert g.coalesce().indices()[0].tolist() == [5, 9, 70]


def test_slots_bounds() -> None:
    with pytest.raises(ValueError):
        Limits(slots=0)
    with pytest.raises(ValueError):
        TrainerConfig(embedding_dim=D, slots=MAX_SLOTS + 1, hidden=H) and PolicyNetwork(D, MAX_SLOTS + 1, H)
    assert PolicyNetwork(D, 1, H).arch.slots == 1
