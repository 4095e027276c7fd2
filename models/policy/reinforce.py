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

With per-memory credit (:func:`credit_loss`) each draw j of the Plackett–Luce order gets
its own advantage ``A_j = e(σ_j) − b̂(σ_j)`` against the slot's moving mean effect b̂,
plus the analytic term ``Σ_{i∈R_j} π_j(i)·b̂_i`` that keeps the estimate unbiased
(docs/learning.md, "Per-memory credit"). On steps without measured effects,
:func:`impute_effects` fills each read memory's effect from its per-slot mean plus an
equal share of the step's unexplained residual (a doubly robust credit).
"""

from __future__ import annotations

import numpy as np
import torch


def importance_weights(logp_current: torch.Tensor, logp_logged: torch.Tensor, clip: float) -> torch.Tensor:
    """w = min(c, exp(log π_θ − logprob)), detached."""
    with torch.no_grad():
        return torch.clamp(torch.exp(logp_current.detach() - logp_logged), max=clip)


def reinforce_loss(logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over the micro-batch of −w·A·log π."""
    return -(weights * advantages * logp).mean()


def credit_loss(
    terms: torch.Tensor,
    dists: torch.Tensor,
    selected: torch.Tensor,
    step_advantages: torch.Tensor,
    effects: torch.Tensor,
    has_effect: torch.Tensor,
    slot_baselines: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Mean over the micro-batch of −w · Σ_j [A_j·ℓ_j + 1{e_j}·Σ_i π_j(i)·b̂_i].

    ``terms`` [B, K] the Plackett–Luce terms ℓ_j and ``dists`` [B, K, C] the distributions
    π_j of each draw (:func:`models.serving.rule.plackett_luce_terms_torch`), ``selected``
    [B, K] the drawn positions into C;
    ``step_advantages`` [B] the step's u − b; ``effects`` [B, K] each selected memory's
    measured effect where ``has_effect`` [B, K]; ``slot_baselines`` [B, C] the mean
    effect b̂ of every candidate (the row's query's own where the trainer has one). A
    position with an effect gets ``A_j = e_j − b̂(σ_j)`` and the analytic term; one without
    uses the step's advantage.
    A row without any effect is exactly :func:`reinforce_loss`'s ``−w·A·log π``.

    Hand-computed (one row, two candidates, one draw, b̂ = [0.5, −0.5]): z = [0, 0] gives
    π = [½, ½] and ℓ = log ½; drawing slot 0 with effect 1.5 gives A = 1.5 − 0.5 = 1 and the
    analytic term ½·0.5 − ½·0.5 = 0. d/dz_0 = A·(1 − ½) + b̂_0·π_0(1 − π_0) − b̂_1·π_0π_1
    = 0.5 + 0.125 + 0.125 = 0.75, so the loss's gradient is −0.75 (and +0.75 for z_1).

    >>> z = torch.zeros(1, 2, requires_grad=True)
    >>> from models.serving.rule import plackett_luce_terms_torch
    >>> terms, dists = plackett_luce_terms_torch(z, torch.ones(1, 2, dtype=torch.bool),
    ...                                          torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool))
    >>> loss = credit_loss(terms, dists, torch.tensor([[0]]), torch.tensor([9.0]), torch.tensor([[1.5]]),
    ...                    torch.tensor([[True]]), torch.tensor([[0.5, -0.5]]), torch.ones(1))
    >>> loss.backward(); [round(g, 4) for g in z.grad[0].tolist()]
    [-0.75, 0.75]
    """
    rows = torch.arange(terms.shape[0], device=terms.device).unsqueeze(1)
    chosen = slot_baselines[rows, selected]
    adv = torch.where(has_effect, effects - chosen, step_advantages.unsqueeze(1).expand_as(effects))
    analytic = (dists * slot_baselines.unsqueeze(1)).sum(dim=2) * has_effect
    surrogate = (adv.detach() * terms + analytic).sum(dim=1)
    return -(weights * surrogate).mean()


def impute_effects(
    utility: np.ndarray,
    chosen_means: np.ndarray,
    selected_valid: np.ndarray,
    residual_baseline: float | np.ndarray,
) -> np.ndarray:
    """Imputed per-memory effects for steps without measured ones (docs/learning.md).

    ``ê_j = b̂(σ_j) + (u − c − Σ_j' b̂(σ_j')) / K``: each read memory gets its own mean
    effect so far (the direct model) plus an equal share of what the model does not
    explain, ``K`` the row's number of read memories and ``c`` the residual's moving mean,
    one for all rows or one per row (the query's own: ``models.policy.baseline.QueryMeans``).
    In :func:`credit_loss` the advantage becomes ``ê_j − b̂(σ_j) = r / K`` and the analytic
    term ``Σ_i π_j(i)·b̂_i`` carries what is known about every candidate, on every step.
    With every b̂ = 0 it is the step reward, shared out: ``(u − c) / K``.

    ``utility`` [B], ``chosen_means`` [B, K] b̂ of each read memory, ``selected_valid``
    [B, K]; returns [B, K] (0 at padding).

    Hand-computed: u = 1, c = 0.2, two memories read with b̂ = 0.5 and −0.1: r = 1 − 0.2 −
    0.4 = 0.4, a share of 0.2 each.

    >>> e = impute_effects(np.array([1.0]), np.array([[0.5, -0.1, 9.0]]), np.array([[True, True, False]]), 0.2)
    >>> e.round(6).tolist()
    [[0.7, 0.1, 0.0]]
    """
    b = np.where(selected_valid, chosen_means, 0.0)
    k = np.maximum(selected_valid.sum(axis=1), 1)
    share = (utility - residual_baseline - b.sum(axis=1)) / k
    return np.where(selected_valid, b + share[:, None], 0.0)


def label_loss(
    z: torch.Tensor, valid: torch.Tensor, target: torch.Tensor, harmful: torch.Tensor | None = None
) -> torch.Tensor:
    """Fine-tune toward labelled slots and away from slots marked harmful.

    Per row: ``−log Σ_{i∈labelled} softmax(z)_i`` when the row has labelled candidates, plus
    ``−log(1 − Σ_{i∈harmful} softmax(z)_i)`` when it has harmful ones; the mean over rows.
    ``z`` [B, C] adjusted logits, ``valid`` [B, C] real candidates, ``target`` and ``harmful``
    [B, C] (every row must have at least one of the two, and a non-harmful candidate).

    >>> z = torch.tensor([[0.0, 0.0]]); v = torch.tensor([[True, True]])
    >>> round(float(label_loss(z, v, torch.tensor([[True, False]]))), 4)  # −log ½
    0.6931
    >>> round(float(label_loss(z, v, torch.tensor([[False, False]]), torch.tensor([[False, True]]))), 4)
    0.6931
    """
    neg_inf = torch.finfo(z.dtype).min
    log_all = torch.logsumexp(z.masked_fill(~valid, neg_inf), dim=1)
    has_good = (valid & target).any(dim=1)
    log_good = torch.logsumexp(z.masked_fill(~(valid & target), neg_inf), dim=1)
    loss = torch.where(has_good, log_all - log_good, torch.zeros_like(log_all))
    if harmful is not None:
        bad = valid & harmful
        has_bad = bad.any(dim=1)
        log_rest = torch.logsumexp(z.masked_fill(~valid | bad, neg_inf), dim=1)
        loss = loss + torch.where(has_bad, log_all - log_rest, torch.zeros_like(log_all))
    return loss.mean()


def grad_norm(parameters: list[torch.nn.Parameter]) -> float:
    """Global L2 norm of the gradients (inf/nan propagate, so callers can skip)."""
    grads = [p.grad.detach().flatten() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.cat(grads)))
