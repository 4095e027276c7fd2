"""Dense fused Adam for the backbone joined with :class:`models.policy.row_adam.LazyRowAdam` for the
output layer: the trainer's optimizer (docs/learning.md, "Sparse learning").

>>> import torch
>>> from torch import nn
>>> lin, out = nn.Linear(2, 3), nn.Linear(3, 4)
>>> opt = RowSparseAdam(list(lin.parameters()), out.weight, out.bias, lr=0.1)
>>> len(opt.param_groups), opt.step().tolist()  # no gradients yet: no rows written
(2, [])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from models.policy.row_adam import LazyRowAdam


def adam(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Adam:
    """Adam with the fused kernel (CPU and CUDA): ~10× faster steps for this network."""
    plist = list(params)
    try:
        return torch.optim.Adam(plist, lr=lr, fused=True)
    except (RuntimeError, TypeError):  # a device without the fused kernel
        return torch.optim.Adam(plist, lr=lr)


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

    def prefetch(self, rows: torch.Tensor) -> None:
        """See :meth:`LazyRowAdam.prefetch`."""
        self.rows.prefetch(rows)

    def close(self) -> None:
        self.rows.close()

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
