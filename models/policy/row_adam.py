"""Row-sparse, lazy Adam for the policy's output layer (docs/learning.md, "Sparse learning").

A step of REINFORCE or of a label fine-tune only reads the output rows of its candidate
slots (:meth:`models.policy.network.PolicyNetwork.candidate_masks`), so its gradient on
``out.weight`` [S, H] and ``out.bias`` [S] is row-sparse. :class:`LazyRowAdam` applies
Adam to those rows alone: a step costs O(rows touched · H), whatever S is. The rest of
the network (the backbone) keeps the fused dense Adam; :class:`models.policy.sparse_adam.RowSparseAdam`
joins the two.

Lazy semantics: a row that has no gradient in a step does not move and its moments do not
decay (dense Adam would keep moving it along its momentum). Each row counts its own steps
for the bias correction, so a row touched for the first time takes exactly Adam's first
step. The update itself is Adam's, bit for bit: the touched rows are gathered, grouped by
step count and passed to torch's fused Adam kernel (the one ``torch.optim.Adam(fused=True)``
runs), so a row touched in every step moves exactly as under dense fused Adam.

>>> import torch
>>> w = torch.nn.Parameter(torch.zeros(5, 2)); b = torch.nn.Parameter(torch.zeros(5))
>>> opt = LazyRowAdam(w, b, lr=0.1)
>>> w.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 2), (5, 2), check_invariants=True)
>>> b.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2), (5,), check_invariants=True)
>>> opt.step().tolist(), [round(float(x), 4) for x in w.detach()[:, 0]]
([1, 3], [0.0, -0.1, 0.0, -0.1, 0.0])
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from models.policy.rows import HUGE_PAGE_MIN_BYTES, RowMover, available_cpus, lazy_zeros, put_rows, take_rows

__all__ = ["MOVE_ROWS_MIN_BYTES", "LazyRowAdam", "coalesced", "fused_kernel", "sqrt_floor"]

# Below this a moment's rows stay in the CPU's caches and a handoff to the mover would cost
# more than it hides (S = 1,024, H = 512: 2 MB).
MOVE_ROWS_MIN_BYTES = HUGE_PAGE_MIN_BYTES


def fused_kernel(device: torch.device) -> bool:
    """Whether torch's fused Adam kernel runs on ``device``; where not, LazyRowAdam steps unfused."""
    if not hasattr(torch, "_fused_adam_"):
        return False
    p, step = torch.zeros(1, device=device), torch.ones((), device=device)
    g, m, v = p.clone(), p.clone(), p.clone()  # gradient, exp_avg, exp_avg_sq
    hyper: dict[str, Any] = {"lr": 0.0, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8}
    try:
        torch._fused_adam_([p], [g], [m], [v], [], [step], amsgrad=False, maximize=False, **hyper)
    except RuntimeError:  # torch's "no kernel for this device" (NotImplementedError is a RuntimeError)
        return False
    return True


def coalesced(grad: torch.Tensor) -> torch.Tensor:
    """A sparse row gradient, coalesced; one whose rows are already strictly increasing is
    only marked so (O(rows) on the indices, no sort, no copy of the values).

    Autograd drops the flag: it stores a sparse gradient as a new tensor over the same
    indices and values, so each ``coalesce()`` of it sorted and summed again — four times a
    step (clip, scale, step), ~0.8 ms at S = 10^6.

    >>> g = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.ones(2, 3), (6, 3), check_invariants=True)
    >>> g.is_coalesced(), coalesced(g).is_coalesced(), coalesced(g).values().data_ptr() == g._values().data_ptr()
    (False, True, True)
    >>> dup = torch.sparse_coo_tensor(torch.tensor([[4, 1, 4]]), torch.ones(3, 1), (6, 1), check_invariants=True)
    >>> coalesced(dup).to_dense().flatten().tolist()
    [0.0, 1.0, 0.0, 0.0, 2.0, 0.0]
    """
    if grad.is_coalesced():
        return grad
    idx = grad._indices()
    if idx.shape[0] == 1 and (idx.shape[1] < 2 or bool((idx[0, 1:] > idx[0, :-1]).all())):
        return grad._coalesced_(True)
    return grad.coalesce()


def _rows_and_values(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, summed gradient rows) of a sparse or dense row gradient."""
    if grad.is_sparse:
        g = coalesced(grad)
        return g.indices()[0], g.values()
    # A dense gradient (a full forward with gradients): every row is touched.
    return torch.arange(grad.shape[0], device=grad.device), grad


class LazyRowAdam:
    """Lazy Adam over the rows of an output layer: ``weight`` [S, H] and ``bias`` [S].

    Both gradients must touch the same rows (they come from one gather). Per-row state:
    ``exp_avg``/``exp_avg_sq`` of the weight [S, H] and of the bias [S], and ``step`` [S]
    (int64), allocated lazily (:func:`lazy_zeros`; the weight's moments in huge pages with
    ``huge_pages``). ``fused`` says whether steps run torch's fused kernel (else
    :meth:`_step_unfused`, the same update to float precision).

    ``move_rows`` (default: with ``huge_pages``, where each of the weight's moments takes
    at least :data:`MOVE_ROWS_MIN_BYTES` and the process may use two CPUs or more; on CPU
    with the fused kernel only): the
    weight moments' rows are gathered and scattered on a :class:`~models.policy.rows.RowMover`
    thread — gathered from :meth:`prefetch`, which the trainer calls with a batch's
    candidate rows before its forward pass, and written back after :meth:`step` returns.
    The values are the same; ``exp_avg``/``exp_avg_sq`` wait for the pending writes.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        huge_pages: bool = False,
        move_rows: bool | None = None,
    ) -> None:
        self.weight, self.bias = weight, bias
        self.fused = fused_kernel(weight.device)
        # torch.optim's shape, so that code setting param_groups[0]["lr"] works the same
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "betas": betas, "eps": eps}]
        s, h = weight.shape
        dev = weight.device
        self._m = lazy_zeros((s, h), dev, huge_pages)
        self._v = lazy_zeros((s, h), dev, huge_pages)
        self.bias_avg = lazy_zeros((s,), dev)
        self.bias_avg_sq = lazy_zeros((s,), dev)
        self.step_count = torch.zeros(s, dtype=torch.int64, device=dev)  # 8 MB at 10^6: written at once
        if move_rows is None:
            # On one CPU the thread only adds handoffs: measured 27% slower steps at S = 10^6.
            move_rows = huge_pages and 4 * s * h >= MOVE_ROWS_MIN_BYTES and available_cpus() >= 2
        self.mover = RowMover() if move_rows and dev.type == "cpu" and self.fused else None
        self._writes = 0  # moment writes by this optimizer: a prefetch from before one is stale
        self._prefetched: tuple[tuple[int, int], Future[tuple[torch.Tensor, list[torch.Tensor]]]] | None = None

    @property
    def slots(self) -> int:
        return int(self.weight.shape[0])

    @property
    def exp_avg(self) -> torch.Tensor:
        """The weight's first moment [S, H] (after any pending row writes)."""
        self.sync()
        return self._m

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        """The weight's second moment [S, H] (after any pending row writes)."""
        self.sync()
        return self._v

    def sync(self) -> None:
        """Wait for the row mover's pending writes (if any); raise an error it met."""
        if self.mover is not None:
            self.mover.sync()

    def close(self) -> None:
        """Finish pending writes and end the row mover's thread (idempotent)."""
        if self.mover is not None:
            self.mover.close()

    def prefetch(self, rows: torch.Tensor) -> None:
        """Start gathering the weight and moment rows of ``rows`` (the next step's candidate
        slots, any shape, repeats allowed) on the row mover, in the order :meth:`step` uses
        them; the weight first, which warms it for the forward pass. A no-op without a mover.

        Used by the next :meth:`step` if nothing wrote the weight or the moments in between
        (the weight's version counter and this optimizer's own count of writes say so).
        """
        self._prefetched = None
        if self.mover is None or rows.numel() == 0:
            return
        rows = torch.unique(rows.reshape(-1)).to(self.step_count.device, torch.int64)  # sorted, as a step's rows
        key = (self._writes, self.weight._version)
        self._prefetched = (key, self.mover.submit(lambda: self._gather_in_step_order(rows)))

    def _gather_in_step_order(self, rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(rows in :meth:`_step_fused`'s order, [weight, m, v] rows): on the mover's thread."""
        order = torch.argsort(take_rows(self.step_count, rows), stable=True)
        rows = rows.index_select(0, order)
        return rows, [take_rows(t, rows) for t in (self.weight, self._m, self._v)]

    def _await_prefetch(self) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The pending prefetch's result if still current; waited for before a step writes
        anything (the mover may still be reading)."""
        pre, self._prefetched = self._prefetched, None
        if pre is None:
            return None
        key, future = pre
        result = future.result()
        return result if key == (self._writes, self.weight._version) else None

    def _weight_rows(
        self, rows: torch.Tensor, pre: tuple[torch.Tensor, list[torch.Tensor]] | None
    ) -> list[torch.Tensor]:
        """[weight, m, v] of ``rows`` (in this order): from the prefetch where it covers them."""
        if pre is not None:
            fetched, got = pre
            if torch.equal(fetched, rows):
                return got
            keep = torch.isin(fetched, rows)  # rows without gradient (padding) were dropped
            if torch.equal(fetched[keep], rows):
                return [t[keep] for t in got]
        self.sync()
        return [take_rows(t, rows) for t in (self.weight, self._m, self._v)]

    def _grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        gw, gb = self.weight.grad, self.bias.grad
        if gw is None or gb is None:
            return None
        rows, vw = _rows_and_values(gw)
        rows_b, vb = _rows_and_values(gb)
        if not torch.equal(rows, rows_b):
            raise ValueError("out.weight and out.bias gradients touch different rows")
        return rows, vw, vb

    def grad_sq_norm(self) -> float:
        """The squared norm of this layer's gradient (duplicates summed, as dense would)."""
        g = self._grads()
        if g is None:
            return 0.0
        _, vw, vb = g
        return float(torch.linalg.vector_norm(vw)) ** 2 + float(torch.linalg.vector_norm(vb)) ** 2

    def scale_grad_(self, factor: float) -> None:
        for p in (self.weight, self.bias):
            if p.grad is not None:
                if p.grad.is_sparse:
                    p.grad = coalesced(p.grad)
                    p.grad._values().mul_(factor)
                else:
                    p.grad.mul_(factor)

    def zero_grad(self) -> None:
        self.weight.grad = None
        self.bias.grad = None

    @torch.no_grad()
    def step(self) -> np.ndarray:
        """Apply Adam to the rows in the current gradients; return them (int64, sorted)."""
        g = self._grads()
        if g is None:
            return np.zeros(0, np.int64)
        rows, gw, gb = g
        pre = self._await_prefetch()
        if len(rows) == 0:
            return np.zeros(0, np.int64)
        step = take_rows(self.step_count, rows).add_(1)
        put_rows(self.step_count, rows, step)
        if self.fused:
            self._step_fused(rows, gw, gb, step, pre)
        else:
            self._step_unfused(rows, gw, gb, step)
        self._writes += 1
        return rows.cpu().numpy().astype(np.int64, copy=False)

    def _hyper(self) -> tuple[float, float, float, float]:
        group = self.param_groups[0]
        b1, b2 = group["betas"]
        return float(group["lr"]), float(b1), float(b2), float(group["eps"])

    def _step_fused(
        self,
        rows: torch.Tensor,
        gw: torch.Tensor,
        gb: torch.Tensor,
        step: torch.Tensor,
        pre: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> None:
        """torch's fused Adam kernel (one pass over each row's weight, gradient and moments)
        on the gathered rows, grouped by their step count: each group is one tensor to the
        kernel, which takes one count per tensor. The update is dense fused Adam's, bit for
        bit, with each row's own count."""
        lr, b1, b2, eps = self._hyper()
        order = torch.argsort(step, stable=True)
        counts, sizes = torch.unique_consecutive(step.index_select(0, order), return_counts=True)
        rows = rows.index_select(0, order)
        split = sizes.tolist()
        # [param, m, v] rows of the weight and of the bias, in step-count order
        weight_rows = self._weight_rows(rows, pre)
        bias_rows = [take_rows(t, rows) for t in (self.bias, self.bias_avg, self.bias_avg_sq)]
        groups: list[list[torch.Tensor]] = [[], [], [], []]
        for parts, grad in ((weight_rows, gw), (bias_rows, gb)):
            for i, t in enumerate((parts[0], grad.index_select(0, order), parts[1], parts[2])):
                groups[i].extend(torch.split(t, split))
        steps = list(counts.to(torch.float32).unbind()) * 2
        params, grads, avgs, avg_sqs = groups
        empty: list[torch.Tensor] = []
        torch._fused_adam_(
            params, grads, avgs, avg_sqs, empty, steps,
            lr=lr, beta1=b1, beta2=b2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        put_rows(self.weight, rows, weight_rows[0])  # read by the next forward: written now
        for t, part in zip((self.bias, self.bias_avg, self.bias_avg_sq), bias_rows, strict=True):
            put_rows(t, rows, part)
        if self.mover is not None:  # read by the next step only, after its prefetch: in the background
            self.mover.scatter((self._m, self._v), rows, weight_rows[1:])
        else:
            put_rows(self._m, rows, weight_rows[1])
            put_rows(self._v, rows, weight_rows[2])

    def _step_unfused(self, rows: torch.Tensor, gw: torch.Tensor, gb: torch.Tensor, step: torch.Tensor) -> None:
        """The same update with plain tensor operations (a device without the fused kernel)."""
        lr, b1, b2, eps = self._hyper()
        stepd = step.double()
        bc1 = 1.0 - torch.pow(b1, stepd)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(b2, stepd))
        # lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps) = (lr·sqrt(bc2)/bc1) · m / (sqrt(v) + eps·sqrt(bc2)):
        # one pass fewer over the gathered rows
        step_size = (lr * bc2_sqrt / bc1).to(gw.dtype).unsqueeze(1)  # [U, 1]
        row_eps = (eps * bc2_sqrt).to(gw.dtype).unsqueeze(1)
        v_floor = sqrt_floor(eps, b2)
        self.sync()
        for p, m_all, v_all, grad in (
            (self.weight, self._m, self._v, gw),
            (self.bias, self.bias_avg.unsqueeze(1), self.bias_avg_sq.unsqueeze(1), gb.unsqueeze(1)),
        ):
            m = m_all.index_select(0, rows).lerp_(grad, 1 - b1)
            v = v_all.index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
            m_all.index_copy_(0, rows, m)
            v_all.index_copy_(0, rows, v)
            # p -= step_size · m / (sqrt(v) + row_eps), in place on the gathered copies, then
            # added to the rows in one pass
            update = m.mul_(step_size).div_(v.clamp_min_(v_floor).sqrt_().add_(row_eps))
            p.detach().view(len(p), -1).index_add_(0, rows, update, alpha=-1.0)

    def touched(self) -> bool:
        """Whether any row has state (O(S): for diagnostics, not the training path)."""
        return bool((self.step_count > 0).any())

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Forget these rows' moments and step counts (a re-initialised row starts afresh)."""
        self.sync()
        self._writes += 1
        for t in (self._m, self._v, self.bias_avg, self.bias_avg_sq, self.step_count):
            t.index_fill_(0, rows, 0)

    # ------------------------------------------------------------------ state
    def state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The touched rows' state: ``{prefix}.rows`` and ``.step`` [n], moments [n, H] / [n].

        When every row has been touched the full tensors are returned as they are (no
        ``.rows``): a copy of 4 GB of moments at S = 10^6 would double the learner's memory.
        """
        touched = torch.nonzero(self.step_count > 0).flatten()
        if len(touched) == 0:
            return {}
        names = ("weight.exp_avg", "weight.exp_avg_sq", "bias.exp_avg", "bias.exp_avg_sq")
        self.sync()
        full = (self._m, self._v, self.bias_avg, self.bias_avg_sq)
        if len(touched) == self.slots:
            out = {f"{prefix}.{n}": t.detach().cpu() for n, t in zip(names, full, strict=True)}
            out[f"{prefix}.step"] = self.step_count.to(torch.float32).cpu()
            return out
        out = {f"{prefix}.{n}": t.index_select(0, touched).cpu() for n, t in zip(names, full, strict=True)}
        out[f"{prefix}.rows"] = touched.cpu()
        out[f"{prefix}.step"] = self.step_count.index_select(0, touched).to(torch.float32).cpu()
        return out

    def load_state_tensors(self, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of :meth:`state_tensors`; also reads the dense per-parameter layout of
        earlier versions (``{prefix}.weight.exp_avg`` [S, H] with one ``{prefix}.weight.step``)."""
        if f"{prefix}.weight.exp_avg" not in tensors:
            return
        dev = self.weight.device
        rows_t = tensors.get(f"{prefix}.rows")
        rows = rows_t.to(dev, torch.int64) if rows_t is not None else torch.arange(self.slots, device=dev)
        step = tensors.get(f"{prefix}.step", tensors.get(f"{prefix}.weight.step"))
        if step is None:
            raise ValueError(f"{prefix}: optimizer state without a step count")
        steps = step.to(dev, torch.int64).flatten()
        if len(steps) == 1:  # the earlier dense layout: one count for the whole tensor
            steps = steps.expand(len(rows))
        names = ("weight.exp_avg", "weight.exp_avg_sq", "bias.exp_avg", "bias.exp_avg_sq")
        self.sync()
        self._writes += 1
        full = (self._m, self._v, self.bias_avg, self.bias_avg_sq)
        for n, t in zip(names, full, strict=True):
            t.index_copy_(0, rows, tensors[f"{prefix}.{n}"].to(dev, torch.float32))
        self.step_count.index_copy_(0, rows, steps.contiguous())


def sqrt_floor(eps: float, beta2: float) -> float:
    """The largest second moment whose square root cannot change ``sqrt(v) + eps·sqrt(bc2)``.

    Rows that are rarely candidates at large S get tiny gradients, and their ``exp_avg_sq``
    holds zeros and subnormal floats (below 1.2e-38); torch's ``sqrt`` is 10–35× slower on
    those. Every row's ``eps·sqrt(bc2)`` is at least ``eps·sqrt(1 − β2)``; a square root
    below 2^-26 of that is less than half a float32 ulp of it and rounds away, so clamping
    ``v`` at this floor before the root changes no update, bit for bit. 0 when the floor
    would itself be subnormal (a tiny ``eps``): no clamp.

    >>> f = sqrt_floor(1e-8, 0.999)
    >>> 1e-35 < f < 1e-34
    True
    >>> row_eps = torch.tensor(1e-8 * math.sqrt(1 - 0.999))
    >>> v = torch.tensor([0.0, 1e-40, f, 1e-20])
    >>> torch.equal(v.clamp_min(f).sqrt() + row_eps, v.sqrt() + row_eps)
    True
    """
    floor = (eps * math.sqrt(1.0 - beta2) * 2.0**-26) ** 2
    return floor if floor >= float(torch.finfo(torch.float32).tiny) else 0.0
