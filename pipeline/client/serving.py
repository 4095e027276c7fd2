"""The serving rule applied to candidates that are already found (docs/contract.md §6).

:class:`~pipeline.client.retriever.CausalRetriever` finds candidates in its own faiss
index; the adapters for LangChain and LlamaIndex get them from the user's retriever. Both
then do the same three things, written once here over :mod:`models.serving_rule`: the
policy's mask over the candidate slots (:func:`policy_masks`), the hard drop
(:func:`keep_flags`) and the Plackett–Luce draw with its true log-probability
(:func:`draw`).

>>> import numpy as np
>>> keep_flags(np.array([1.0, 0.001, 0.5]), "dynamic").tolist()
[True, False, True]
>>> d = draw(np.array([0.9, 0.1]), np.zeros(2), alpha=0.5, temperature=1.0, k=2, rng=np.random.default_rng(0))
>>> sorted(d.positions), bool(d.logprob < 0), d.probs.round(3).tolist()
([0, 1], True, [0.69, 0.31])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.serving_rule import (
    DYNAMIC_DROP_RATIO,
    adjusted_logits,
    first_draw_probs,
    keep_dynamic,
    keep_fixed,
    plackett_luce_logprob,
    sample_plackett_luce,
)
from pipeline.client.subscriber import LoadedPolicy


def policy_masks(
    policy: LoadedPolicy | None, query_embedding: np.ndarray, loss: float, entropy: float, slots: np.ndarray
) -> np.ndarray:
    """m_i of each slot in ``slots`` (float64); zeros without a policy (similarity only)."""
    if policy is None:
        return np.zeros(len(slots))
    net = policy.net
    with torch.no_grad():
        h = net.features(torch.from_numpy(query_embedding[None]), torch.tensor([loss]), torch.tensor([entropy]))
        m = net.candidate_masks(h, torch.from_numpy(np.asarray(slots)[None].astype(np.int64)))
    return m[0].double().numpy()


def keep_flags(masks: np.ndarray, drop: str | float, ratio: float = DYNAMIC_DROP_RATIO) -> np.ndarray:
    """The hard drop: ``"dynamic"`` (m_i ≥ ratio·max m), ``"none"`` (keep every finite m) or a fixed τ."""
    if drop == "dynamic":
        return keep_dynamic(masks, ratio)
    if drop == "none":
        finite: np.ndarray = np.isfinite(masks)
        return finite
    return keep_fixed(masks, float(drop))


@dataclass(frozen=True)
class Draw:
    """Positions drawn (in order) from the kept candidates, log π of that order, first-draw probabilities."""

    positions: list[int]
    logprob: float
    probs: np.ndarray


def draw(
    scores: np.ndarray, masks: np.ndarray, alpha: float, temperature: float, k: int, rng: np.random.Generator
) -> Draw:
    """Plackett–Luce over ``z = score·(1+α·m)/T`` of the kept candidates."""
    z = adjusted_logits(scores, masks, alpha, temperature)
    pos = sample_plackett_luce(z, k, rng)
    return Draw(positions=pos, logprob=plackett_luce_logprob(z, pos), probs=first_draw_probs(z))
