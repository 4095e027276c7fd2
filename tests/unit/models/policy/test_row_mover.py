"""The row mover (models/policy/rows.py) and LazyRowAdam's moved rows (models/policy/row_adam.py): the
moments' rows gathered ahead by :meth:`prefetch` and written back on the mover's thread give
the same updates, bit for bit, as gathering and writing them in the step; a stale prefetch
is not used; readers of the moments see every pending write; errors on the thread surface."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import models.policy.row_adam as row_adam
from models.policy.row_adam import LazyRowAdam
from models.policy.rows import RowMover, put_rows, take_rows
from models.policy.trainer import PolicyTrainer, TrainerConfig
from tests.unit.models.policy.test_sparse_learning import D, fb

S, H = 40, 6


def layer(seed: int = 0) -> tuple[nn.Parameter, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(S, H, generator=g)), nn.Parameter(torch.randn(S, generator=g))


def set_grads(w: nn.Parameter, b: nn.Parameter, rows: list[int], step: int) -> None:
    g = torch.Generator().manual_seed(500 + step)
    idx = torch.tensor([sorted(rows)])
    w.grad = torch.sparse_coo_tensor(idx, torch.randn(len(rows), H, generator=g), (S, H), check_invariants=True)
    b.grad = torch.sparse_coo_tensor(idx, torch.randn(len(rows), generator=g), (S,), check_invariants=True)


def pair() -> tuple[tuple[nn.Parameter, nn.Parameter, LazyRowAdam], tuple[nn.Parameter, nn.Parameter, LazyRowAdam]]:
    w1, b1 = layer()
    w2, b2 = nn.Parameter(w1.detach().clone()), nn.Parameter(b1.detach().clone())
    moved = LazyRowAdam(w1, b1, lr=0.05, move_rows=True)
    plain = LazyRowAdam(w2, b2, lr=0.05, move_rows=False)
    assert moved.mover is not None and plain.mover is None
    return (w1, b1, moved), (w2, b2, plain)


def same(a: LazyRowAdam, b: LazyRowAdam) -> bool:
    return (
        torch.equal(a.weight, b.weight)
        and torch.equal(a.bias, b.bias)
        and torch.equal(a.exp_avg, b.exp_avg)
        and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
        and torch.equal(a.step_count, b.step_count)
    )


def test_moved_rows_give_the_steps_of_rows_gathered_in_place_bit_for_bit() -> None:
    (w1, b1, moved), (w2, b2, plain) = pair()
    gen = torch.Generator().manual_seed(3)
    for step in range(60):
        cands = torch.randint(0, S, (5, 4), generator=gen)  # repeats, as a batch's candidates
        rows = sorted(set(cands.flatten().tolist()))
        if step % 7 == 3:  # a padding row: prefetched, but without gradient (dropped)
            rows = rows[1:]
        if step % 11 != 5:  # and now and then a step without a prefetch
            moved.prefetch(cands)
        set_grads(w1, b1, rows, step)
        set_grads(w2, b2, rows, step)
        assert moved.step().tolist() == plain.step().tolist() == rows
    assert same(moved, plain)
    moved.close()


def test_a_prefetch_made_stale_by_a_write_is_not_used() -> None:
    (w1, b1, moved), (w2, b2, plain) = pair()
    for opt, (w, b) in ((moved, (w1, b1)), (plain, (w2, b2))):
        set_grads(w, b, [1, 2, 3], 0)
        opt.step()
    # prefetch, then the weight (a lifecycle's new row), the moments (a reset row) change
    moved.prefetch(torch.tensor([1, 2, 3]))
    with torch.no_grad():
        w1[2] = 7.0
        w2[2] = 7.0
    moved.reset_rows(torch.tensor([3]))
    plain.reset_rows(torch.tensor([3]))
    set_grads(w1, b1, [1, 2, 3], 1)
    set_grads(w2, b2, [1, 2, 3], 1)
    moved.step()
    plain.step()
    assert same(moved, plain)
    # a numpy write to the weight (another optimizer's step) makes it stale too
    moved.prefetch(torch.tensor([1, 2]))
    put_rows(w1, torch.tensor([1]), torch.full((1, H), 3.0))
    put_rows(w2, torch.tensor([1]), torch.full((1, H), 3.0))
    set_grads(w1, b1, [1, 2], 2)
    set_grads(w2, b2, [1, 2], 2)
    moved.step()
    plain.step()
    assert same(moved, plain)
    moved.close()


def test_readers_of_the_moments_see_the_pending_writes() -> None:
    (w1, b1, moved), (w2, b2, plain) = pair()
    release = threading.Event()
    assert moved.mover is not None
    moved.prefetch(torch.tensor([4, 9]))
    moved.mover.sync()  # the prefetch is done; then the mover is held:
    moved.mover.submit(lambda: release.wait(30))  # the step's write-back waits behind this
    set_grads(w1, b1, [4, 9], 0)
    set_grads(w2, b2, [4, 9], 0)
    moved.step()
    plain.step()
    assert float(moved._m[4].abs().sum()) == 0.0  # not written yet
    threading.Timer(0.05, release.set).start()
    assert torch.equal(moved.exp_avg, plain.exp_avg)  # waits for it
    state = moved.state_tensors("x")
    assert torch.equal(state["x.weight.exp_avg_sq"], plain.state_tensors("x")["x.weight.exp_avg_sq"])
    moved.close()


def test_an_error_on_the_movers_thread_is_raised_by_the_next_sync() -> None:
    mover = RowMover()
    mover.scatter([torch.zeros(3, 2)], torch.tensor([5]), [torch.ones(1, 2)])  # row 5 of 3
    mover.gather([torch.zeros(3, 2)], torch.tensor([0])).result()  # later jobs still run
    with pytest.raises(RuntimeError, match="row copy"):
        mover.sync()
    with pytest.raises(RuntimeError):
        mover.sync()  # and stays raised: the arrays may be half written
    mover.close()
    mover.close()


def test_jobs_run_in_the_order_asked() -> None:
    mover = RowMover()
    a = torch.zeros(6, 3)
    for i in range(20):
        mover.scatter([a], torch.tensor([i % 6]), [torch.full((1, 3), float(i))])
    got = mover.gather([a], torch.arange(6)).result()[0][:, 0].tolist()
    assert got == [18.0, 19.0, 14.0, 15.0, 16.0, 17.0]
    mover.close()


def test_put_rows_counts_as_an_in_place_write() -> None:
    t = torch.zeros(4, 2)
    before = t._version
    put_rows(t, torch.tensor([1]), torch.ones(1, 2))
    assert t._version > before and take_rows(t, torch.tensor([1])).tolist() == [[1.0, 1.0]]
    with torch.inference_mode():
        inf = torch.zeros(4, 2)
    put_rows(inf, torch.tensor([0]), torch.ones(1, 2))  # no version counter: written all the same
    assert inf[0].tolist() == [1.0, 1.0]


def test_a_trainer_learns_the_same_with_its_rows_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's main optimizer moves rows from MOVE_ROWS_MIN_BYTES up (S ≥ 32,768 at
    H = 512): forced on at a small S, its updates are those of the same trainer without."""
    monkeypatch.setattr(row_adam, "available_cpus", lambda: 2)
    runs = []
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(row_adam, "MOVE_ROWS_MIN_BYTES", threshold)
        t = PolicyTrainer(TrainerConfig(embedding_dim=D, slots=30, hidden=16, lr=1e-2, seed=4))
        assert (t.optimizer.rows.mover is not None) == (threshold == 0)
        gen = torch.Generator().manual_seed(9)
        for i in range(25):
            batch = []
            for j in range(4):  # 3 to 6 candidates: the shorter lists are padded
                cands = torch.randperm(30, generator=gen)[: 3 + (i + j) % 4].tolist()
                batch.append(fb(i * 4 + j, float(torch.rand(1, generator=gen)), cands))
            assert t.update(batch).applied == 4
        runs.append(t)
    moved, plain = runs
    for (name, p), (_, q) in zip(moved.net.named_parameters(), plain.net.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(moved.optimizer.rows.exp_avg_sq, plain.optimizer.rows.exp_avg_sq)
    moved.optimizer.close()


def test_rows_are_moved_only_for_large_moments_and_with_a_second_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b = layer()
    monkeypatch.setattr(row_adam, "MOVE_ROWS_MIN_BYTES", 0)
    monkeypatch.setattr(row_adam, "available_cpus", lambda: 2)
    assert LazyRowAdam(w, b, lr=0.1, huge_pages=True).mover is not None
    assert LazyRowAdam(w, b, lr=0.1).mover is None  # the label optimizer's (no huge pages)
    monkeypatch.setattr(row_adam, "available_cpus", lambda: 1)  # one CPU: handoffs, no overlap
    assert LazyRowAdam(w, b, lr=0.1, huge_pages=True).mover is None
    monkeypatch.setattr(row_adam, "MOVE_ROWS_MIN_BYTES", 1 << 62)
    monkeypatch.setattr(row_adam, "available_cpus", lambda: 8)
    assert LazyRowAdam(w, b, lr=0.1, huge_pages=True).mover is None  # small moments stay in the caches
