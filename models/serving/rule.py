"""The serving rule (docs/contract.md §6, docs/learning.md), shared by the serving side and the learner.

Candidates C come from a similarity index with base scores. The *hard drop* removes slot
i when ``m_i < ratio · max_{j∈C} m_j`` (dynamic threshold, ratio 0.01). Over the kept
candidates ``z_i = score_i · (1 + α·m_i) / T`` and ``selected`` is drawn in order without
replacement from softmax(z) (Plackett–Luce)::

    log π(selected|s) = Σ_j [ z_{σ_j} − logsumexp_{i ∈ C \\ {σ_1..σ_{j−1}}} z_i ]

NumPy versions serve one query at a time (float64); the torch version is batched and
differentiable, for the learner. Both are pinned by ``contract/vectors.json``.

>>> import numpy as np
>>> z = adjusted_logits(np.array([1.0, 0.0]), np.array([0.0, 0.0]), alpha=0.5, temperature=1.0)
>>> round(plackett_luce_logprob(z, [0]), 6)  # log(e / (e + 1))
-0.313262
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from models.serving.params import DYNAMIC_DROP_RATIO as DYNAMIC_DROP_RATIO  # declared once, without torch


def keep_dynamic(masks: np.ndarray, ratio: float = DYNAMIC_DROP_RATIO) -> np.ndarray:
    """Boolean keep-flags: m_i ≥ ratio · max m over the candidates (all dropped if non-finite)."""
    masks = np.asarray(masks, dtype=np.float64)
    if masks.size == 0 or not np.isfinite(masks).all():
        return np.zeros(masks.shape, dtype=bool)
    keep: np.ndarray = masks >= ratio * masks.max()
    return keep


def keep_fixed(masks: np.ndarray, threshold: float) -> np.ndarray:
    """Boolean keep-flags for a fixed threshold m_i ≥ τ (the seed's first, worse design)."""
    masks = np.asarray(masks, dtype=np.float64)
    keep: np.ndarray = np.isfinite(masks) & (masks >= threshold)
    return keep


def revive_dropped(
    keep: np.ndarray, rate: float, rng: np.random.Generator, draws: np.ndarray | None = None
) -> np.ndarray:
    """Keep-flags after giving each dropped candidate an independent ``rate`` chance back.

    Only exploratory requests call it (docs/contract.md §6, step 3b): without it a memory
    the hard drop removes is never read again, so it can never be relearnt. The draw is
    made before, and independently of, the Plackett–Luce draw, so ``log π`` over the
    candidates as served (revived ones included) stays the exact probability of the order
    given those candidates. Candidates with a non-finite mask are never revived.

    >>> keep = np.array([True, False, False])
    >>> revive_dropped(keep, 0.0, np.random.default_rng(0)).tolist()
    [True, False, False]
    >>> revive_dropped(keep, 1.0, np.random.default_rng(0)).tolist()
    [True, True, True]
    """
    keep = np.asarray(keep, dtype=bool)
    if rate <= 0 or keep.all():
        return keep
    # ``draws``: the caller's uniforms, one per candidate (shared by a coupled canary's two draws).
    u = rng.random(keep.shape[0]) if draws is None else np.asarray(draws)
    out: np.ndarray = keep | (u < rate)
    return out


def adjusted_logits(scores: np.ndarray, masks: np.ndarray, alpha: float, temperature: float) -> np.ndarray:
    """z_i = score_i · (1 + α·m_i) / T."""
    scores = np.asarray(scores, dtype=np.float64)
    masks = np.asarray(masks, dtype=np.float64)
    return scores * (1.0 + alpha * masks) / temperature


def _logsumexp(x: np.ndarray) -> float:
    top = float(x.max())
    return top + float(np.log(np.exp(x - top).sum()))


def plackett_luce_logprob(z: np.ndarray, selected_positions: Sequence[int]) -> float:
    """log-probability of drawing ``selected_positions`` (indices into z) in that order."""
    z = np.asarray(z, dtype=np.float64)
    remaining = np.ones(z.shape[0], dtype=bool)
    total = 0.0
    for pos in selected_positions:
        total += float(z[pos]) - _logsumexp(z[remaining])
        remaining[pos] = False
    return total


def first_draw_probs(z: np.ndarray) -> np.ndarray:
    """softmax(z): the probability of each candidate being drawn first."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    probs: np.ndarray = e / e.sum()
    return probs


def sample_plackett_luce(
    z: np.ndarray, k: int, rng: np.random.Generator | None, gumbel: np.ndarray | None = None
) -> list[int]:
    """Draw k positions in order without replacement from softmax(z) (Gumbel-top-k).

    Adding independent Gumbel noise and sorting gives exactly the Plackett–Luce
    distribution over ordered prefixes. ``gumbel``: that noise, drawn by the caller (one
    standard Gumbel per position of ``z``), so that two policies' draws can share it (a
    coupled canary, :func:`pipeline.client.choice.coupled`); else drawn from ``rng``.

    >>> g = np.array([0.0, 2.0, 0.0])
    >>> sample_plackett_luce(np.array([1.0, 0.0, 0.5]), 2, None, gumbel=g)
    [1, 0]
    """
    z = np.asarray(z, dtype=np.float64)
    k = min(k, z.shape[0])
    if k <= 0:
        return []
    if gumbel is None:
        assert rng is not None, "sample_plackett_luce needs rng or gumbel"
        gumbel = np.asarray(rng.gumbel(size=z.shape[0]), dtype=np.float64)
    keys = z + gumbel
    return [int(i) for i in np.argsort(-keys, kind="stable")[:k]]


def plackett_luce_logprob_torch(
    z: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor, selected_valid: torch.Tensor
) -> torch.Tensor:
    """Batched, differentiable log π(selected|s).

    ``z`` [B, C] adjusted logits (padding anywhere), ``valid`` [B, C] marks real candidates,
    ``selected`` [B, K] positions into C (padding anywhere), ``selected_valid`` [B, K].
    Returns [B]; rows with no valid selection give 0.
    """
    terms, _ = plackett_luce_terms_torch(z, valid, selected, selected_valid)
    return terms.sum(dim=1)


def plackett_luce_terms_torch(
    z: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor, selected_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-position terms of the Plackett–Luce log-probability, and each draw's distribution.

    Term j is ``ℓ_j = z_{σ_j} − logsumexp_{i ∈ R_j} z_i`` with ``R_j`` the candidates still
    available at draw j; ``Σ_j ℓ_j = log π(selected|s)``. The second result, [B, K, C],
    is ``π_j(i) = softmax over R_j`` (0 outside ``R_j``): the distribution draw j was made
    from. Padded positions give ``ℓ_j = 0`` and an all-zero distribution.

    >>> z = torch.tensor([[1.0, 0.0, 0.0]])
    >>> terms, probs = plackett_luce_terms_torch(z, torch.ones(1, 3, dtype=torch.bool),
    ...                                          torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool))
    >>> [round(v, 4) for v in terms[0].tolist()]  # log(e/(e+2)), log(1/2)
    [-0.5514, -0.6931]
    >>> [round(v, 4) for v in probs[0, 1].tolist()]
    [0.0, 0.5, 0.5]
    """
    neg_inf = torch.finfo(z.dtype).min
    available = valid.clone()
    rows = torch.arange(z.shape[0], device=z.device)
    terms = []
    dists = []
    for j in range(selected.shape[1]):
        pos = selected[:, j]
        use = selected_valid[:, j]
        masked = z.masked_fill(~available, neg_inf)
        lse = torch.logsumexp(masked, dim=1)
        term = z[rows, pos] - lse
        terms.append(torch.where(use, term, torch.zeros_like(term)))
        p = torch.exp(masked - lse.unsqueeze(1)) * available
        dists.append(torch.where(use.unsqueeze(1), p, torch.zeros_like(p)))
        available = available.clone()
        available[rows[use], pos[use]] = False
    if not terms:
        return z.new_zeros((z.shape[0], 0)), z.new_zeros((z.shape[0], 0, z.shape[1]))
    return torch.stack(terms, dim=1), torch.stack(dists, dim=1)


def adjusted_logits_torch(
    scores: torch.Tensor, masks: torch.Tensor, alpha: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """Batched z = score · (1 + α·m) / T; ``temperature`` is [B]."""
    return scores * (1.0 + alpha * masks) / temperature.unsqueeze(-1)
