"""models/policy/row_adam.py's step (torch's fused Adam kernel on rows grouped by step count) against
dense fused Adam, its unfused fallback, the exact sqrt floor, the numpy row gather/scatter
and huge-page memory; models/policy/network.py's output layer in that memory."""

from __future__ import annotations

import math
import mmap
from typing import Any

import pytest
import torch
from torch import nn

import models.policy.network as policy_mod
import models.policy.rows as rows_mod
from models.policy.row_adam import LazyRowAdam, fused_kernel, sqrt_floor
from models.policy.rows import lazy_zeros, put_rows, take_rows

S, H = 12, 5


def sparse(rows: list[int], values: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, size, is_coalesced=True, check_invariants=True)


def layer(seed: int = 0) -> tuple[nn.Parameter, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(S, H, generator=g)), nn.Parameter(torch.randn(S, generator=g))


def grads(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, H, generator=g), torch.randn(n, generator=g)


def test_rows_touched_every_step_equal_dense_fused_adam_bit_for_bit() -> None:
    w, b = layer()
    ref_w, ref_b = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
    opt = LazyRowAdam(w, b, lr=0.01)
    dense = torch.optim.Adam([ref_w, ref_b], lr=0.01, fused=True)
    assert opt.fused
    for step in range(30):
        gw, gb = grads(step, S)
        w.grad, b.grad = sparse(list(range(S)), gw, (S, H)), sparse(list(range(S)), gb, (S,))
        ref_w.grad, ref_b.grad = gw.clone(), gb.clone()
        assert opt.step().tolist() == list(range(S))
        dense.step()
    assert torch.equal(w, ref_w) and torch.equal(b, ref_b)
    assert torch.equal(opt.exp_avg_sq, dense.state[ref_w]["exp_avg_sq"])


def test_each_row_takes_adams_step_for_its_own_count() -> None:
    """Rows with different step counts in one step (different groups in the kernel): each row
    moves as a one-row fused Adam fed that row's gradients alone."""
    w, b = layer(1)
    opt = LazyRowAdam(w, b, lr=0.05)
    touched = {0: [0, 1, 2, 3, 4], 1: [3, 4], 2: [0, 3, 9], 3: [0, 1, 3, 4, 9, 11], 4: [11]}
    refs = {
        r: (nn.Parameter(w.detach()[r : r + 1].clone()), nn.Parameter(b.detach()[r : r + 1].clone())) for r in range(S)
    }
    adams = {r: torch.optim.Adam(list(p), lr=0.05, fused=True) for r, p in refs.items()}
    for step, rows in touched.items():
        gw, gb = grads(step, len(rows))
        w.grad, b.grad = sparse(rows, gw, (S, H)), sparse(rows, gb, (S,))
        assert opt.step().tolist() == rows
        for i, r in enumerate(rows):
            refs[r][0].grad, refs[r][1].grad = gw[i : i + 1].clone(), gb[i : i + 1].clone()
            adams[r].step()
    for r in range(S):
        assert torch.equal(w.detach()[r], refs[r][0].detach()[0]), r
        assert torch.equal(b.detach()[r], refs[r][1].detach()[0]), r
    assert opt.step_count.tolist() == [3, 2, 1, 4, 3, 0, 0, 0, 0, 2, 0, 2]
    never = [5, 6, 7, 8, 10]
    assert torch.equal(w.detach()[never], layer(1)[0].detach()[never])  # lazy: untouched rows stay


def test_the_unfused_fallback_gives_the_same_update() -> None:
    results = []
    for fused in (True, False):
        w, b = layer(2)
        opt = LazyRowAdam(w, b, lr=0.02)
        opt.fused = fused
        for step, rows in enumerate(([1, 2, 3], [2, 3, 7], [3, 7, 8, 10], [1, 10])):
            gw, gb = grads(step, len(rows))
            w.grad, b.grad = sparse(rows, gw * 1e-20 if step == 1 else gw, (S, H)), sparse(rows, gb, (S,))
            opt.step()
        results.append((w.detach().clone(), b.detach().clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone()))
    for a, c in zip(*results, strict=True):
        assert torch.allclose(a, c, rtol=1e-6, atol=1e-12)


def test_the_sqrt_floor_changes_no_denominator() -> None:
    """sqrt(max(v, floor)) + eps·sqrt(bc2) == sqrt(v) + eps·sqrt(bc2) for every v, zeros and
    subnormals included, at every step's bias correction."""
    eps, b2 = 1e-8, 0.999
    floor = sqrt_floor(eps, b2)
    assert 0 < floor < 1e-34 and floor >= torch.finfo(torch.float32).tiny
    v = torch.cat([torch.zeros(1), torch.logspace(-45, -20, 4000), torch.tensor([floor, floor * 1.5])]).float()
    for step in (1, 2, 10, 1000, 10**6):
        row_eps = torch.tensor(eps * math.sqrt(1 - b2**step), dtype=torch.float32)
        assert torch.equal(v.clamp_min(floor).sqrt() + row_eps, v.sqrt() + row_eps), step
    assert sqrt_floor(1e-30, b2) == 0.0  # the floor would be subnormal: no clamp


def test_take_and_put_rows_are_index_select_and_index_copy() -> None:
    g = torch.Generator().manual_seed(3)
    for t in (torch.randn(50, 7, generator=g), torch.randn(50, generator=g), torch.arange(50, dtype=torch.int64)):
        rows = torch.tensor([49, 3, 17, 0])
        assert torch.equal(take_rows(t, rows), t.index_select(0, rows))
        a, c = t.clone(), t.clone()
        values = take_rows(t, torch.tensor([1, 2, 5, 6])) * 2
        put_rows(a, rows, values)
        c.index_copy_(0, rows, values)
        assert torch.equal(a, c)
    for bad in (torch.tensor([3, -1]), torch.tensor([50])):  # out of range, as index_select says
        with pytest.raises(IndexError):
            take_rows(t, bad)
        with pytest.raises(IndexError):
            put_rows(t, bad, torch.zeros(len(bad)))
    strided = torch.randn(6, 8, generator=g)[:, ::2]  # not contiguous: torch's own operations
    assert torch.equal(take_rows(strided, torch.tensor([4, 1])), strided[[4, 1]])


def test_huge_page_memory_is_zeroed_and_writable(monkeypatch: pytest.MonkeyPatch) -> None:
    maps: list[int] = []
    real = mmap.mmap

    def mapping(*args: Any, **kwargs: Any) -> Any:
        maps.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", mapping)
    assert float(lazy_zeros((1000, 64), torch.device("cpu"), huge_pages=True).sum()) == 0.0
    assert maps == []  # 256 KB: below HUGE_PAGE_MIN_BYTES, plain calloc'ed memory
    monkeypatch.setattr(rows_mod, "HUGE_PAGE_MIN_BYTES", 0)
    t = lazy_zeros((1000, 64), torch.device("cpu"), huge_pages=True)
    assert maps == [1000 * 64 * 4] and t.dtype == torch.float32 and float(t.abs().sum()) == 0.0
    t[7] = 3.0
    assert float(t.sum()) == 3.0 * 64


def test_a_large_output_layer_has_nn_linears_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_mod, "HUGE_PAGE_MIN_BYTES", 0)
    monkeypatch.setattr(rows_mod, "HUGE_PAGE_MIN_BYTES", 0)
    torch.manual_seed(5)
    ours = policy_mod.output_layer(16, 40)
    torch.manual_seed(5)
    ref = nn.Linear(16, 40)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    assert ours.weight.is_contiguous() and ours.weight.requires_grad


def test_the_fused_kernel_probe_says_no_where_torch_has_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert fused_kernel(cpu)  # torch 2.13 on CPU has it

    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError("Could not run 'aten::_fused_adam_' with arguments from the 'Meta' backend")

    monkeypatch.setattr(torch, "_fused_adam_", missing)
    assert not fused_kernel(cpu)
    monkeypatch.delattr(torch, "_fused_adam_")
    assert not fused_kernel(cpu)
