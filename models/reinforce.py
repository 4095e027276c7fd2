"""REINFORCE with a moving baseline and clipped importance weights (docs/learning.md).

For a joined experience with utility u and baseline b the advantage is ``A = u − b``. The
loss is ``−w · A · log π_θ(selected|s)`` with ``log π_θ`` recomputed under the current
parameters and ``w = min(c, exp(log π_θ − logprob))``: the serving policy that logged the
selection may be an older version (Chen et al. 2019, top-K off-policy correction). The
weight is a constant in the gradient (no gradient flows through it).

>>> import torch
>>> logp = torch.tensor([-1.0, -2.0], requires_grad=True)
>>> w = importance_weights(logp, torch.tensor([-1.0, -2.0]), clip=5.0)
>>> w.tolist()
[1.0, 1.0]
>>> loss = reinforce_loss(logp, torch.tensor([1.0, -1.0]), w)
>>> loss.backward(); logp.grad.tolist()  # d/dlogp of -(w·A·logp).mean()
[-0.5, 0.5]
"""

from __future__ import annotations

import torch


def importance_weights(logp_current: torch.Tensor, logp_logged: torch.Tensor, clip: float) -> torch.Tensor:
    """w = min(c, exp(log π_θ − logprob)), detached."""
    with torch.no_grad():
        return torch.clamp(torch.exp(logp_current.detach() - logp_logged), max=clip)


def reinforce_loss(logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over the micro-batch of −w·A·log π."""
    return -(weights * advantages * logp).mean()


def label_loss(z: torch.Tensor, valid: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fine-tune toward labelled slots: −log Σ_{i∈labelled} softmax(z)_i over the candidates.

    ``z`` [B, C] adjusted logits, ``valid`` [B, C] real candidates, ``target`` [B, C] the
    labelled ones (rows without any labelled candidate must be filtered out beforehand).
    """
    neg_inf = torch.finfo(z.dtype).min
    log_all = torch.logsumexp(z.masked_fill(~valid, neg_inf), dim=1)
    log_good = torch.logsumexp(z.masked_fill(~(valid & target), neg_inf), dim=1)
    return (log_all - log_good).mean()


def grad_norm(parameters: list[torch.nn.Parameter]) -> float:
    """Global L2 norm of the gradients (inf/nan propagate, so callers can skip)."""
    grads = [p.grad.detach().flatten() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.cat(grads)))
