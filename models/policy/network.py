"""The policy network of seed 000 §3.1 (docs/learning.md): features → non-negative mask over slots.

``m = softplus(out(gelu(hidden([LayerNorm(q); last_step_loss; last_step_entropy]))))``
with exact GELU and LayerNorm eps 1e-5. The tensor names are the checkpoint contract
(docs/contract.md §7), so any language can rebuild the mask from a checkpoint.

Only the candidate slots of a retrieval ever matter (the hard drop and the Plackett–Luce
rule look at candidates alone), so :meth:`PolicyNetwork.candidate_masks` computes the
output layer for those rows only: with S=1024 and ~20 candidates that is ~50× less work
than the full mask, with the same values. Its gradient on ``out`` is row-sparse (a
sparse COO tensor over the candidate rows), so training cost does not grow with S
(models/policy/row_adam.py). The network records which output rows were written
(:class:`RowTracker`), for delta checkpoints.

>>> import torch
>>> net = PolicyNetwork(embedding_dim=4, slots=6, hidden=8)
>>> m = net(torch.zeros(2, 4), torch.zeros(2), torch.zeros(2))
>>> tuple(m.shape), bool((m >= 0).all())
((2, 6), True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.policy.rows import HUGE_PAGE_MIN_BYTES, lazy_zeros, take_rows
from topics.fields import MAX_SLOTS

TENSOR_NAMES = ("norm.weight", "norm.bias", "hidden.weight", "hidden.bias", "out.weight", "out.bias", "alpha")
LAST_LAYER = ("out.weight", "out.bias")
INITIAL_ALPHA = 0.5
LAYER_NORM_EPS = 1e-5

SUPPRESSED_BIAS = -30.0  # a suppressed memory's output bias: its mask is softplus(-30) ≈ 1e-13


@dataclass(frozen=True)
class Arch:
    """The architecture a checkpoint's tensors must match (manifest ``arch``)."""

    embedding_dim: int
    slots: int
    hidden: int = 512

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"slots (S) must be in [1, {MAX_SLOTS:,}], got {self.slots:,}")
        if self.embedding_dim < 1 or self.hidden < 1:
            raise ValueError("embedding_dim and hidden must be at least 1")

    @property
    def input_dim(self) -> int:
        return self.embedding_dim + 2

    def to_dict(self) -> dict[str, int]:
        return {
            "input_dim": self.input_dim,
            "hidden": self.hidden,
            "slots": self.slots,
            "embedding_dim": self.embedding_dim,
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        d, h, s = self.embedding_dim, self.hidden, self.slots
        return {
            "norm.weight": (d,),
            "norm.bias": (d,),
            "hidden.weight": (h, d + 2),
            "hidden.bias": (h,),
            "out.weight": (s, h),
            "out.bias": (s,),
            "alpha": (1,),
        }


NEUTRAL_BIAS = math.log(math.e - 1.0)  # softplus(b) = 1: every memory starts with the same mask
NEUTRAL_WEIGHT_SCALE = 0.01  # the output rows start small: masks differ by ~1%, gradients still flow


def neutral_out(out: nn.Linear) -> None:
    """A fresh output layer that serves like similarity search: every mask ≈ 1.

    A randomly initialised layer gives each memory a random mask, and at the serving
    temperature (0.05) that reorders the candidates: before any learning, and for as long as
    the gate holds the first candidate back, clients would serve worse than similarity
    search. Small random rows keep the gradient's direction information.

    >>> layer = nn.Linear(8, 4)
    >>> neutral_out(layer)
    >>> m = torch.nn.functional.softplus(layer(torch.randn(3, 8)))
    >>> bool(((m - 1).abs() < 0.05).all())
    True
    """
    with torch.no_grad():
        out.weight.mul_(NEUTRAL_WEIGHT_SCALE)
        out.bias.fill_(NEUTRAL_BIAS)


def neutral_rows(n: int, hidden: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` fresh output rows as :func:`neutral_out` makes them: weight [n, H] (small,
    random) and bias [n] (mask 1).

    >>> w, b = neutral_rows(3, 4)
    >>> tuple(w.shape), bool((w.abs() <= NEUTRAL_WEIGHT_SCALE / 2).all()), round(float(b[0]), 4)
    ((3, 4), True, 0.5413)
    """
    bound = 1.0 / hidden**0.5
    w = torch.empty(n, hidden).uniform_(-bound, bound, generator=generator) * NEUTRAL_WEIGHT_SCALE
    return w, torch.full((n,), NEUTRAL_BIAS)


def output_layer(hidden: int, slots: int) -> nn.Linear:
    """``nn.Linear(hidden, slots)``, the same values; a large weight (≥ 64 MB) lives in memory
    advised for transparent huge pages (:func:`models.policy.rows.lazy_zeros`).

    Learning and serving read random rows of it (a memory's row whenever it is a candidate);
    with 4 KB pages each row read at S = 10^6 is also a TLB miss.

    >>> _ = torch.manual_seed(0); a = output_layer(4, 3)
    >>> _ = torch.manual_seed(0); torch.equal(a.weight, nn.Linear(4, 3).weight)
    True
    """
    if 4 * hidden * slots < HUGE_PAGE_MIN_BYTES:
        return nn.Linear(hidden, slots)
    layer = nn.Linear(hidden, slots, device="meta")
    layer.weight = nn.Parameter(lazy_zeros((slots, hidden), torch.device("cpu"), huge_pages=True))
    layer.bias = nn.Parameter(torch.empty(slots))
    layer.reset_parameters()  # what nn.Linear's constructor draws, in the same order
    return layer


class RowTracker:
    """The output rows written since the last :meth:`take` (all of them at first).

    >>> t = RowTracker(5)
    >>> t.take().tolist(), t.take().tolist()
    ([0, 1, 2, 3, 4], [])
    >>> t.mark([3, 1, 3]); t.take().tolist()
    [1, 3]
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.all = True
        self._mask = np.zeros(slots, bool)

    def mark(self, rows: Any) -> None:
        self._mask[np.asarray(rows, np.int64)] = True

    def mark_all(self) -> None:
        self.all = True

    def take(self) -> np.ndarray:
        """The changed rows (int64, sorted, unique); clears the record."""
        rows = np.arange(self.slots, dtype=np.int64) if self.all else np.flatnonzero(self._mask).astype(np.int64)
        self.all = False
        self._mask[rows] = False
        return rows


class _GatherRows(torch.autograd.Function):
    """``(weight[slots], bias[slots])`` with row-sparse gradients: the backward pass writes
    a sparse COO gradient over the gathered rows instead of a dense [S, H] one."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, bias: torch.Tensor, slots: torch.Tensor) -> Any:
        ctx.save_for_backward(slots)
        ctx.size = tuple(weight.shape)
        flat = slots.reshape(-1)
        w = take_rows(weight, flat).reshape(*slots.shape, weight.shape[1])
        return w, take_rows(bias, flat).reshape(slots.shape)

    @staticmethod
    def backward(ctx: Any, grad_w: torch.Tensor, grad_b: torch.Tensor) -> Any:
        (slots,) = ctx.saved_tensors
        s, h = ctx.size
        # Summed per distinct row here (one pass), so the optimizer gets a coalesced gradient.
        rows, inverse = torch.unique(slots.reshape(-1), return_inverse=True)
        gw_rows = grad_w.new_zeros(len(rows), h).index_add_(0, inverse, grad_w.reshape(-1, h))
        gb_rows = grad_b.new_zeros(len(rows)).index_add_(0, inverse, grad_b.reshape(-1))
        # Rows without gradient (the padding of a batch's candidate lists, masked out of the
        # loss) are left out: lazy Adam must neither step nor mark them. The bias gradient
        # says it: it is the sum of the row's logit gradients, of which the weight's are
        # multiples (h · ∂L/∂logit), so a row with a zero bias gradient has no signal but
        # for exact cancellations.
        keep = gb_rows != 0
        if not bool(keep.all()):
            rows, gw_rows, gb_rows = rows[keep], gw_rows[keep], gb_rows[keep]
        idx = rows.unsqueeze(0)
        gw = torch.sparse_coo_tensor(idx, gw_rows, (s, h), is_coalesced=True, check_invariants=False)
        gb = torch.sparse_coo_tensor(idx, gb_rows, (s,), is_coalesced=True, check_invariants=False)
        return gw, gb, None


class PolicyNetwork(nn.Module):
    """Linear(D+2, H) → GELU → Linear(H, S) → softplus, with LayerNorm on the embedding."""

    def __init__(self, embedding_dim: int, slots: int, hidden: int = 512, alpha: float = INITIAL_ALPHA) -> None:
        super().__init__()
        self.arch = Arch(embedding_dim, slots, hidden)
        self.norm = nn.LayerNorm(embedding_dim, eps=LAYER_NORM_EPS)
        self.hidden = nn.Linear(embedding_dim + 2, hidden)
        self.out = output_layer(hidden, slots)
        self.alpha = nn.Parameter(torch.tensor([float(alpha)]))
        neutral_out(self.out)
        self.changed = RowTracker(slots)  # output rows written since the last take()

    def features(self, embedding: torch.Tensor, loss: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """The hidden representation h = gelu(hidden(x)) of shape [B, H]."""
        x = torch.cat([self.norm(embedding), loss.unsqueeze(-1), entropy.unsqueeze(-1)], dim=-1)
        return F.gelu(self.hidden(x))  # exact (erf) GELU, as the contract says

    def forward(self, embedding: torch.Tensor, loss: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """The full mask m of shape [B, S]."""
        return F.softplus(self.out(self.features(embedding, loss, entropy)))

    def candidate_masks(self, h: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """m for the given slots only: ``h`` [B, H], ``slots`` [B, C] (long) → [B, C].

        The gradient on ``out.weight`` and ``out.bias`` is a sparse tensor over these rows.
        """
        if torch.is_grad_enabled() and self.out.weight.requires_grad:
            w, b = _GatherRows.apply(self.out.weight, self.out.bias, slots)  # type: ignore[no-untyped-call]
        else:  # serving: a plain gather, without the autograd Function's overhead
            flat = slots.reshape(-1)
            w = take_rows(self.out.weight, flat).reshape(*slots.shape, self.arch.hidden)
            b = take_rows(self.out.bias, flat).reshape(slots.shape)
        return F.softplus(torch.einsum("bh,bch->bc", h, w) + b)

    def set_rows(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
        """Write output rows (``rows`` [n] long, ``weight`` [n, H], ``bias`` [n]) and mark them changed."""
        with torch.no_grad():
            self.out.weight.index_copy_(0, rows, weight.to(self.out.weight))
            self.out.bias.index_copy_(0, rows, bias.to(self.out.bias))
        self.changed.mark(rows.cpu().numpy())

    def suppress(self, slots: list[int], bias: float = SUPPRESSED_BIAS) -> None:
        """Pin the masks of ``slots`` near 0 ("do not use"): a zero row and a very negative bias.

        ``softplus(−30) ≈ 1e−13``, below any dynamic drop threshold, and its gradient is as
        small, so later REINFORCE updates leave it there.

        >>> net = PolicyNetwork(embedding_dim=2, slots=3, hidden=4)
        >>> net.suppress([1])
        >>> m = net.candidate_masks(torch.ones(1, 4), torch.tensor([[0, 1, 2]]))
        >>> float(m[0, 1].detach()) < 1e-12
        True
        """
        idx = torch.tensor(sorted(set(slots)), dtype=torch.long)
        with torch.no_grad():
            self.out.weight[idx] = 0.0
            self.out.bias[idx] = bias
        self.changed.mark(idx.numpy())

    def reinitialise(self, seed: int) -> None:
        """Every parameter as :func:`init_policy` with ``seed`` makes them, in place.

        A drift reset at S = 10^6 would otherwise hold a second 2 GB network while the old
        one and its optimizer are still referenced.

        >>> net = init_policy(4, 6, 8, seed=1)
        >>> _ = net.changed.take()
        >>> net.reinitialise(seed=2)
        >>> fresh = init_policy(4, 6, 8, seed=2).tensors()
        >>> all(torch.equal(t, fresh[name]) for name, t in net.tensors().items())
        True
        >>> len(net.changed.take())
        6
        """
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            # the order in which the constructor draws: hidden, then out
            self.norm.reset_parameters()
            self.hidden.reset_parameters()
            self.out.reset_parameters()
            self.alpha.fill_(INITIAL_ALPHA)
            neutral_out(self.out)
        self.changed.mark_all()

    def reset_last_layer(self, generator: torch.Generator | None = None) -> None:
        """Re-initialise ``out`` (drift reset, seed 000 §4.3 level 3); keep everything else."""
        # In place, nn.Linear's own initialisation: a fresh layer at S = 10^6 would be 2 GB more.
        with torch.no_grad():
            bound = 1.0 / self.arch.hidden**0.5
            self.out.weight.uniform_(-bound, bound, generator=generator)
            self.out.bias.uniform_(-bound, bound, generator=generator)
        neutral_out(self.out)
        self.changed.mark_all()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The contract's named float32 tensors (detached, contiguous, on CPU)."""
        state = self.state_dict()
        return {name: state[name].detach().to("cpu", torch.float32).contiguous() for name in TENSOR_NAMES}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        expected = self.arch.shapes()
        for name in TENSOR_NAMES:
            if tuple(tensors[name].shape) != expected[name]:
                raise ValueError(f"{name}: shape {tuple(tensors[name].shape)} != {expected[name]}")
        self.load_state_dict({k: tensors[k] for k in TENSOR_NAMES}, strict=True)
        self.changed.mark_all()

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> PolicyNetwork:
        hidden, input_dim = tensors["hidden.weight"].shape
        slots = tensors["out.weight"].shape[0]
        net = cls(embedding_dim=input_dim - 2, slots=slots, hidden=hidden)
        net.load_tensors(tensors)
        return net


def init_policy(embedding_dim: int, slots: int, hidden: int = 512, seed: int = 0) -> PolicyNetwork:
    """A freshly initialised policy, deterministic for a seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PolicyNetwork(embedding_dim, slots, hidden)
