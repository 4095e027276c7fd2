"""The serving rule's parts on the client (docs/contract.md §6), the bottom of the client's serving modules.

Written once here over :mod:`models.serving.rule`: which serving parameters are in force
(:func:`follow`: an explicit value wins, else the loaded checkpoint's manifest ``serving``
— what the learner was configured with and the promotion gate judged the policy under —
else :data:`UNSERVED`), the policy's mask over candidate slots (:func:`policy_masks`, or
:func:`policy_features` then :func:`masks_from_features`), the hard drop
(:func:`keep_flags`) and the Plackett–Luce draw with its true log-probability
(:func:`draw`). :mod:`pipeline.client.choice` makes one request's choice from them, and
:mod:`pipeline.client.serving_core` (which every client front serves through, and whose
docstring lists the modules) serves a request.

>>> import numpy as np
>>> keep_flags(np.array([1.0, 0.001, 0.5]), "dynamic").tolist()
[True, False, True]
>>> d = draw(np.array([0.9, 0.1]), np.zeros(2), alpha=0.5, temperature=1.0, k=2, rng=np.random.default_rng(0))
>>> sorted(d.positions), bool(d.logprob < 0), d.probs.round(3).tolist()
([0, 1], True, [0.69, 0.31])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from models.policy.rows import take_rows
from models.serving.params import ServingParams
from models.serving.rule import (
    DYNAMIC_DROP_RATIO,
    adjusted_logits,
    first_draw_probs,
    keep_dynamic,
    keep_fixed,
    plackett_luce_logprob,
    sample_plackett_luce,
)
from pipeline.client.subscriber import LoadedPolicy

FOLLOWED = ("temperature", "drop", "explore_rate", "explore_temperature")  # what an explicit value can fix
# Contract 1.4: a client's explicit value fixes the canary's share too (CausalRetriever's, AdapterConfig's).
CANARY_RATE = "canary_rate"
# Before a manifest says otherwise: what a manifest without ``serving`` means (docs/contract.md §7),
# the ServingParams defaults (T 0.05, 10% explored at T 0.25, dynamic drop) without a canary.
UNSERVED = ServingParams.from_wire(None)


@dataclass(frozen=True)
class ServingValues:
    """The serving parameters a client applies: ``drop`` as ``keep_flags`` takes it, and the dynamic drop's ratio."""

    temperature: float
    drop: str | float
    drop_ratio: float
    explore_rate: float
    explore_temperature: float
    canary_rate: float = 0.0  # contract 1.4: the share of requests that serve the canary
    canary_coupled: bool = False  # contract 1.5: those requests draw both slates (pipeline/client/choice.py)
    # Contract 1.17: the policy is not certified yet: serve the search's own first k but the explored share.
    incumbent: bool = False


def follow(params: ServingParams | None, explicit: Mapping[str, Any]) -> ServingValues:
    """The values in force: ``explicit`` ones (among :data:`FOLLOWED`) win, the rest come from ``params``
    (a manifest's ``serving``; None: :data:`UNSERVED`).

    >>> v = follow(ServingParams(temperature=0.2, explore_rate=0.1, drop="fixed", drop_ratio=0.3), {"temperature": 1.0})
    >>> v.temperature, v.drop, v.explore_rate
    (1.0, 0.3, 0.1)
    >>> p = ServingParams(drop_ratio=0.05)
    >>> follow(p, {}).drop_ratio, follow(p, {"drop": "dynamic"}).drop_ratio  # an explicit drop keeps its own ratio
    (0.05, 0.01)
    """
    p = params if params is not None else UNSERVED
    given = {k: v for k, v in explicit.items() if k in FOLLOWED and v is not None}
    return ServingValues(
        temperature=float(given.get("temperature", p.temperature)),
        drop=given.get("drop", p.drop_spec),
        drop_ratio=DYNAMIC_DROP_RATIO if "drop" in given else p.drop_ratio,
        explore_rate=float(given.get("explore_rate", p.explore_rate)),
        explore_temperature=float(given.get("explore_temperature", p.explore_temperature)),
        canary_rate=float(explicit[CANARY_RATE] if explicit.get(CANARY_RATE) is not None else p.canary_rate),
        canary_coupled=p.canary_coupled,
        incumbent=p.incumbent,
    )


def policy_masks(
    policy: LoadedPolicy | None, query_embedding: np.ndarray, loss: float, entropy: float, slots: np.ndarray
) -> np.ndarray:
    """m_i of each slot in ``slots`` (float64); zeros without a policy (similarity only).

    :func:`policy_features` (the query's part) then :func:`masks_from_features` (the
    candidates' part). The network's own operations (``PolicyNetwork.features`` then
    ``candidate_masks``), called directly: one query's masks are a dozen small operations, and
    the modules' calls, the einsum's parsing and the tensors built per call cost as much as
    the arithmetic. The values are the network's, bit for bit (tests/unit/models/serving/test_serving_masks.py).
    """
    if policy is None:
        return np.zeros(len(slots))
    return masks_from_features(policy, policy_features(policy, query_embedding, loss, entropy), slots)


def policy_features(policy: LoadedPolicy, query_embedding: np.ndarray, loss: float, entropy: float) -> torch.Tensor:
    """h [1, H] of one query: the part of the masks that does not depend on the candidates, so
    that it can be computed while the index is searched (``CausalRetriever``, large indices).
    An inference tensor: for serving only (no autograd, no in-place updates)."""
    net = policy.net
    norm, hidden = net.norm, net.hidden
    with torch.inference_mode():  # no autograd bookkeeping at all: the same values, fewer steps per op
        q = torch.from_numpy(np.ascontiguousarray(query_embedding, dtype=np.float32).reshape(1, -1))
        extra = torch.from_numpy(np.array([[loss, entropy]], np.float32))
        x = torch.cat([F.layer_norm(q, norm.normalized_shape, norm.weight, norm.bias, norm.eps), extra], dim=1)
        h: torch.Tensor = F.gelu(F.linear(x, hidden.weight, hidden.bias))
    return h


def masks_from_features(policy: LoadedPolicy, h: torch.Tensor, slots: np.ndarray) -> np.ndarray:
    """m_i (float64) of each slot in ``slots`` from the query's :func:`policy_features` ``h``."""
    if len(slots) == 0:
        return np.zeros(0)
    out = policy.net.out
    with torch.inference_mode():
        rows = torch.from_numpy(np.asarray(slots, dtype=np.int64).reshape(-1))
        w = take_rows(out.weight, rows)  # [C, H]
        z = torch.bmm(h.view(1, 1, -1), w.view(1, len(rows), -1).transpose(1, 2)).view(1, -1)
        m = F.softplus(z + take_rows(out.bias, rows).view(1, -1))
    masks: np.ndarray = m.numpy()[0].astype(np.float64)
    return masks


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
    """Positions drawn (in order) from the kept candidates, log π of that order, first-draw
    probabilities, and the logits z they were drawn from."""

    positions: list[int]
    logprob: float
    probs: np.ndarray
    z: np.ndarray


def draw(
    scores: np.ndarray,
    masks: np.ndarray,
    alpha: float,
    temperature: float,
    k: int,
    rng: np.random.Generator,
    gumbel: np.ndarray | None = None,
) -> Draw:
    """Plackett–Luce over ``z = score·(1+α·m)/T`` of the kept candidates (``gumbel``: the noise, if shared)."""
    z = adjusted_logits(scores, masks, alpha, temperature)
    pos = sample_plackett_luce(z, k, rng, gumbel)
    return Draw(positions=pos, logprob=plackett_luce_logprob(z, pos), probs=first_draw_probs(z), z=z)
