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
from scipy.special import erf

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
# the contract's: T 0.05, 10% explored at T 0.25, dynamic drop, no canary (the ServingParams defaults
# but the *_ABSENT ones: the learner's own drop and exploration temperature differ).
UNSERVED = ServingParams.from_wire(None)
_SQRT_HALF = np.float32(0.5**0.5)


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
    candidates' part): the network's operations (``PolicyNetwork.features`` then
    ``candidate_masks``, docs/contract.md §7) in NumPy over the checkpoint's tensors, in float32
    as the network computes them. One query's masks are a dozen small operations: through torch
    each pays its dispatch, and on a request path whose search has just run through megabytes
    (a Python vector store) that dispatch runs with cold caches, ~0.5 ms against ~0.15 ms here.
    The values are the network's within float32 rounding (tests/unit/models/serving/test_serving_masks.py).
    """
    if policy is None:
        return np.zeros(len(slots))
    return masks_from_features(policy, policy_features(policy, query_embedding, loss, entropy), slots)


def _array(t: torch.Tensor) -> np.ndarray:
    """A float32 tensor of the network as a NumPy view (no copy: deltas written in place show)."""
    out: np.ndarray = t.detach().numpy()
    return out


def policy_features(policy: LoadedPolicy, query_embedding: np.ndarray, loss: float, entropy: float) -> np.ndarray:
    """h [H] (float32) of one query: the part of the masks that does not depend on the candidates,
    so that it can be computed while the index is searched (``CausalRetriever``, large indices)."""
    net = policy.net
    norm, hidden = net.norm, net.hidden
    q = np.asarray(query_embedding, dtype=np.float32).reshape(-1)
    centred = q - q.mean(dtype=np.float32)
    var = (centred * centred).mean(dtype=np.float32)
    x = np.empty(len(q) + 2, np.float32)
    x[: len(q)] = centred / np.sqrt(var + np.float32(norm.eps)) * _array(norm.weight) + _array(norm.bias)
    x[len(q) :] = (loss, entropy)
    a = _array(hidden.weight) @ x + _array(hidden.bias)
    h: np.ndarray = np.float32(0.5) * a * (np.float32(1.0) + erf(a * _SQRT_HALF))  # exact (erf) GELU
    return h


def masks_from_features(policy: LoadedPolicy, h: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """m_i (float64) of each slot in ``slots`` from the query's :func:`policy_features` ``h``.

    Raises ``IndexError`` for a slot outside the network (negative ones too, as torch would).
    """
    rows = np.asarray(slots, dtype=np.int64).reshape(-1)
    if len(rows) == 0:
        return np.zeros(0)
    if rows.min() < 0:
        raise IndexError(f"row index {int(rows.min())} is negative")
    out = policy.net.out
    # einsum, not BLAS: a slot's mask must not depend on which other candidates share the request
    z = np.einsum("ch,h->c", np.take(_array(out.weight), rows, axis=0), h) + np.take(_array(out.bias), rows)
    # torch's softplus: x itself above 20, where log1p(exp(x)) equals it in float32
    m = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, np.float32(20.0)))))
    masks: np.ndarray = m.astype(np.float64)
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
