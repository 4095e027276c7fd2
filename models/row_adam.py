"""Row-sparse, lazy Adam for the policy's output layer (docs/learning.md, "Sparse learning").

A step of REINFORCE or of a label fine-tune only reads the output rows of its candidate
slots (:meth:`models.policy.PolicyNetwork.candidate_masks`), so its gradient on
``out.weight`` [S, H] and ``out.bias`` [S] is row-sparse. :class:`LazyRowAdam` applies
Adam to those rows alone: a step costs O(rows touched · H), whatever S is. The rest of
the network (the backbone) keeps the fused dense Adam; :class:`RowSparseAdam` joins the two.

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
import mmap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

HUGE_PAGE_MIN_BYTES = 64 << 20  # below this the TLB covers an array well enough


def adam(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Adam:
    """Adam with the fused kernel (CPU and CUDA): ~10× faster steps for this network."""
    plist = list(params)
    try:
        return torch.optim.Adam(plist, lr=lr, fused=True)
    except (RuntimeError, TypeError):  # a device without the fused kernel
        return torch.optim.Adam(plist, lr=lr)


def lazy_zeros(shape: tuple[int, ...], device: torch.device, huge_pages: bool = False) -> torch.Tensor:
    """float32 zeros whose memory is only committed where written (CPU: calloc via numpy).

    ``torch.zeros`` writes every byte, so 10^6 rows of moments would be resident from the
    start; calloc'ed pages cost nothing until a row is first updated.

    ``huge_pages`` (CPU, Linux, arrays of at least :data:`HUGE_PAGE_MIN_BYTES`): an anonymous
    mapping advised for transparent huge pages, still zero and committed where written, but
    in 2 MB pieces. A step at S = 10^6 reads and writes ~1,300 random rows of each moment;
    with 4 KB pages each of those is also a TLB miss whose page-table entry is itself a
    cache miss (a 2 GB array has 4 MB of them). Where the kernel gives no huge pages
    (``/sys/kernel/mm/transparent_hugepage/enabled`` = never) this is plain zeroed memory.

    >>> t = lazy_zeros((3, 2), torch.device("cpu"), huge_pages=True)
    >>> t.shape, float(t.abs().sum())
    (torch.Size([3, 2]), 0.0)
    """
    nbytes = 4 * math.prod(shape)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if huge_pages and nbytes >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        return torch.from_numpy(np.frombuffer(buf, np.float32).reshape(shape))
    return torch.from_numpy(np.zeros(shape, np.float32))


def _numpy_rows(rows: torch.Tensor) -> np.ndarray:
    """``rows`` as numpy indices; negative ones are refused as torch refuses them (numpy
    would count them from the end)."""
    idx: np.ndarray = rows.numpy()
    if len(idx) and idx.min() < 0:
        raise IndexError(f"row index {int(idx.min())} is negative")
    return idx


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, rows)``; on CPU through numpy, whose row gather is ~25% faster
    on rows spread over a large array (the same values: a copy).

    >>> take_rows(torch.arange(6.0).reshape(3, 2), torch.tensor([2, 0])).tolist()
    [[4.0, 5.0], [0.0, 1.0]]
    """
    if t.device.type == "cpu" and t.is_contiguous() and rows.device.type == "cpu":
        return torch.from_numpy(np.take(t.detach().numpy(), _numpy_rows(rows), axis=0))
    return t.detach().index_select(0, rows)


def put_rows(t: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``t.index_copy_(0, rows, values)`` for distinct ``rows``; on CPU through numpy (as
    :func:`take_rows`).

    >>> t = torch.zeros(3, 2); put_rows(t, torch.tensor([2, 0]), torch.ones(2, 2)); t.tolist()
    [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    """
    if t.device.type == "cpu" and t.is_contiguous() and rows.device.type == "cpu" and values.device.type == "cpu":
        t.detach().numpy()[_numpy_rows(rows)] = values.detach().numpy()
    else:
        t.detach().index_copy_(0, rows, values)


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


def _rows_and_values(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, summed gradient rows) of a sparse or dense row gradient."""
    if grad.is_sparse:
        g = grad.coalesce()
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
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        huge_pages: bool = False,
    ) -> None:
        self.weight, self.bias = weight, bias
        self.fused = fused_kernel(weight.device)
        # torch.optim's shape, so that code setting param_groups[0]["lr"] works the same
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "betas": betas, "eps": eps}]
        s, h = weight.shape
        dev = weight.device
        self.exp_avg = lazy_zeros((s, h), dev, huge_pages)
        self.exp_avg_sq = lazy_zeros((s, h), dev, huge_pages)
        self.bias_avg = lazy_zeros((s,), dev)
        self.bias_avg_sq = lazy_zeros((s,), dev)
        self.step_count = torch.zeros(s, dtype=torch.int64, device=dev)  # 8 MB at 10^6: written at once

    @property
    def slots(self) -> int:
        return int(self.weight.shape[0])

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
                    p.grad = p.grad.coalesce()
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
        if len(rows) == 0:
            return np.zeros(0, np.int64)
        step = take_rows(self.step_count, rows).add_(1)
        put_rows(self.step_count, rows, step)
        if self.fused:
            self._step_fused(rows, gw, gb, step)
        else:
            self._step_unfused(rows, gw, gb, step)
        return rows.cpu().numpy().astype(np.int64, copy=False)

    def _hyper(self) -> tuple[float, float, float, float]:
        group = self.param_groups[0]
        b1, b2 = group["betas"]
        return float(group["lr"]), float(b1), float(b2), float(group["eps"])

    def _step_fused(self, rows: torch.Tensor, gw: torch.Tensor, gb: torch.Tensor, step: torch.Tensor) -> None:
        """torch's fused Adam kernel (one pass over each row's weight, gradient and moments)
        on the gathered rows, grouped by their step count: each group is one tensor to the
        kernel, which takes one count per tensor. The update is dense fused Adam's, bit for
        bit, with each row's own count."""
        lr, b1, b2, eps = self._hyper()
        order = torch.argsort(step, stable=True)
        counts, sizes = torch.unique_consecutive(step.index_select(0, order), return_counts=True)
        rows = rows.index_select(0, order)
        split = sizes.tolist()
        groups: list[list[torch.Tensor]] = [[], [], [], []]
        gathered = []
        for full, grad in (
            ((self.weight, self.exp_avg, self.exp_avg_sq), gw),
            ((self.bias, self.bias_avg, self.bias_avg_sq), gb),
        ):
            parts = [take_rows(t, rows) for t in full]
            gathered.append((full, parts))
            for i, t in enumerate((parts[0], grad.index_select(0, order), parts[1], parts[2])):
                groups[i].extend(torch.split(t, split))
        steps = list(counts.to(torch.float32).unbind()) * 2
        params, grads, avgs, avg_sqs = groups
        empty: list[torch.Tensor] = []
        torch._fused_adam_(
            params, grads, avgs, avg_sqs, empty, steps,
            lr=lr, beta1=b1, beta2=b2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        for full, parts in gathered:
            for t, part in zip(full, parts, strict=True):
                put_rows(t, rows, part)

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
        for p, m_all, v_all, grad in (
            (self.weight, self.exp_avg, self.exp_avg_sq, gw),
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
        for t in (self.exp_avg, self.exp_avg_sq, self.bias_avg, self.bias_avg_sq, self.step_count):
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
        full = (self.exp_avg, self.exp_avg_sq, self.bias_avg, self.bias_avg_sq)
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
        full = (self.exp_avg, self.exp_avg_sq, self.bias_avg, self.bias_avg_sq)
        for n, t in zip(names, full, strict=True):
            t.index_copy_(0, rows, tensors[f"{prefix}.{n}"].to(dev, torch.float32))
        self.step_count.index_copy_(0, rows, steps.contiguous())


class RowSparseAdam:
    """Dense fused Adam for ``dense`` parameters plus :class:`LazyRowAdam` for the output layer.

    ``dense`` may be empty (the label fine-tune trains the output layer alone).
    """

    def __init__(
        self,
        dense: Sequence[torch.Tensor],
        weight: torch.Tensor,
        bias: torch.Tensor,
        lr: float,
        huge_pages: bool = False,
    ) -> None:
        self.dense_params = list(dense)
        self.dense = adam(dense, lr) if dense else None
        self.rows = LazyRowAdam(weight, bias, lr, huge_pages=huge_pages)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The dense part's group (if any), then the rows' group: ``lr`` may be changed."""
        return (self.dense.param_groups if self.dense is not None else []) + self.rows.param_groups

    @property
    def state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Per parameter, as ``torch.optim`` has it: the output layer's entries appear once a
        row has state (a snapshot, for inspection)."""
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = dict(self.dense.state) if self.dense is not None else {}
        r = self.rows
        if r.touched():
            out[r.weight] = {"step": r.step_count, "exp_avg": r.exp_avg, "exp_avg_sq": r.exp_avg_sq}
            out[r.bias] = {"step": r.step_count, "exp_avg": r.bias_avg, "exp_avg_sq": r.bias_avg_sq}
        return out

    def zero_grad(self) -> None:
        for p in self.dense_params:
            p.grad = None
        self.rows.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_`` over all parameters, sparse rows included."""
        sq = self.rows.grad_sq_norm()
        for p in self.dense_params:
            if p.grad is not None:
                sq += float(torch.linalg.vector_norm(p.grad.detach())) ** 2
        total = math.sqrt(sq)
        if not math.isfinite(total):
            return total
        coef = min(max_norm / (total + 1e-6), 1.0)
        if coef < 1.0:
            for p in self.dense_params:
                if p.grad is not None:
                    p.grad.mul_(coef)
            self.rows.scale_grad_(coef)
        return total

    def step(self) -> np.ndarray:
        """One Adam step; the output rows it wrote (int64, sorted)."""
        if self.dense is not None:
            self.dense.step()
        return self.rows.step()

    def state_tensors(self, prefix: str, names: Mapping[torch.Tensor, str]) -> dict[str, torch.Tensor]:
        """``{prefix}.{param name}.exp_avg|exp_avg_sq|step`` for the dense part (the layout
        of earlier versions), ``{prefix}.out.*`` for the rows (:meth:`LazyRowAdam.state_tensors`)."""
        out: dict[str, torch.Tensor] = {}
        if self.dense is not None:
            for p in self.dense_params:
                st = self.dense.state.get(p)
                if not st:
                    continue
                key = f"{prefix}.{names[p]}"
                out[f"{key}.exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
                out[f"{key}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
                out[f"{key}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).cpu()
        out.update(self.rows.state_tensors(f"{prefix}.out"))
        return out

    def load_state_tensors(
        self, prefix: str, names: Mapping[torch.Tensor, str], tensors: dict[str, torch.Tensor]
    ) -> None:
        if self.dense is not None:
            for p in self.dense_params:
                key = f"{prefix}.{names[p]}"
                if f"{key}.exp_avg" not in tensors:
                    continue
                dev = p.device
                step = torch.tensor(float(tensors[f"{key}.step"][0]), dtype=torch.float32, device=dev)
                self.dense.state[p] = {
                    "step": step,
                    "exp_avg": tensors[f"{key}.exp_avg"].to(dev).clone(),
                    "exp_avg_sq": tensors[f"{key}.exp_avg_sq"].to(dev).clone(),
                }
        self.rows.load_state_tensors(f"{prefix}.out", tensors)


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
