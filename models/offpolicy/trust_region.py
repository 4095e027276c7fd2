"""Conservative steps between two policies, and how far apart they serve.

Conservative policy improvement (Kakade & Langford 2002) and high-confidence policy
improvement (Thomas et al. 2015) move the deployed policy only part of the way toward a
new one, by a step that the logged data can certify. :func:`interpolate` builds the step
θ_α = θ_serve + α(θ_new − θ_serve) of two networks of one architecture;
:func:`served_tv` measures how far two served policies are on a log (the total variation of
their first draws over each decision's logged candidates), the trust-region distance: the
closer θ_α serves to the serving policy, the closer to 1 its importance weights relative to
the serving policy's, and the tighter the gain's interval. :func:`largest_step` picks the
largest step of a grid within a given distance, from the logged contexts alone.

>>> import torch
>>> a, b = PolicyNetwork(4, 3, 2), PolicyNetwork(4, 3, 2)
>>> with torch.no_grad():
...     _ = b.alpha.fill_(2.0)
>>> half = interpolate(a, b, 0.5)
>>> round(float(half.alpha.detach()), 6) == round((float(a.alpha.detach()) + 2.0) / 2, 6)
True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from models.offpolicy.logged import LoggedDecisions, Served, component_logits
from models.policy.network import SUPPRESSED_BIAS, PolicyNetwork
from models.serving.params import ServingParams


def interpolate(
    serving: PolicyNetwork, candidate: PolicyNetwork, alpha: float, fresh: Sequence[int] = ()
) -> PolicyNetwork:
    """θ_serve + α(θ_new − θ_serve), tensor by tensor, as a new network in eval mode.

    A memory suppressed in either network (output bias at or below the suppressed bias)
    stays suppressed: a step must never half-restore what an operator said not to use.
    ``fresh``: output slots given to another memory between the two versions; their rows are
    the candidate's (the new owner's), never a blend with the earlier owner's row.

    Raises ``ValueError`` when the architectures differ or α is outside [0, 1].

    >>> a = PolicyNetwork(4, 3, 2)
    >>> b = PolicyNetwork(4, 3, 2)
    >>> b.suppress([1])
    >>> float(interpolate(a, b, 0.25).out.bias.detach()[1])
    -30.0
    >>> bool(torch.equal(interpolate(a, b, 0.25, fresh=[2]).out.weight[2], b.out.weight[2]))
    True
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha {alpha} outside [0, 1]")
    if serving.arch != candidate.arch:
        raise ValueError(f"architectures differ: {serving.arch} vs {candidate.arch}")
    old, new = serving.tensors(), candidate.tensors()
    mixed = {name: torch.lerp(old[name], new[name], alpha) for name in old}
    if len(fresh):
        rows = torch.as_tensor(list(fresh), dtype=torch.long)
        mixed["out.weight"][rows] = new["out.weight"][rows]
        mixed["out.bias"][rows] = new["out.bias"][rows]
    suppressed = (old["out.bias"] <= SUPPRESSED_BIAS) | (new["out.bias"] <= SUPPRESSED_BIAS)
    if bool(suppressed.any()):
        mixed["out.bias"][suppressed] = SUPPRESSED_BIAS
        mixed["out.weight"][suppressed] = 0.0
    return PolicyNetwork.from_tensors(mixed).eval()


def first_draw_probs(decisions: LoggedDecisions, target: Served) -> np.ndarray:
    """The served mixture's first-draw probabilities over each decision's logged candidates, [N, C].

    >>> from models.serving.params import ServingParams
    >>> d = LoggedDecisions.from_lists([[1, 2]], [[0.5, 0.5]], [[1]], [1.0], [-0.7], [0.0])
    >>> first_draw_probs(d, Served("uniform", ServingParams())).round(6).tolist()
    [[0.5, 0.5]]
    """
    out = np.zeros(decisions.valid.shape, np.float64)
    for weight, z, kept, uniform in component_logits(decisions, target):
        logits = np.where(kept, 0.0 if uniform else z, -np.inf)
        top = logits.max(axis=1, initial=-np.inf)
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.where(kept, np.exp(logits - np.where(np.isfinite(top), top, 0.0)[:, None]), 0.0)
        total = p.sum(axis=1, keepdims=True)
        out += weight * np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    return out


def served_tv(decisions: LoggedDecisions, a: Served, b: Served) -> np.ndarray:
    """Per decision, the total variation ½Σ|p_a − p_b| between two served policies' first draws, [N].

    >>> from models.serving.params import ServingParams
    >>> d = LoggedDecisions.from_lists([[1, 2]], [[1.0, 0.0]], [[1]], [1.0], [-0.3], [0.0])
    >>> p = ServingParams(temperature=1.0, explore_rate=0.0)
    >>> float(served_tv(d, Served("uniform", p), Served("uniform", p))[0])
    0.0
    """
    tv: np.ndarray = 0.5 * np.abs(first_draw_probs(decisions, a) - first_draw_probs(decisions, b)).sum(axis=1)
    return tv


STEP_GRID = (0.5, 0.25, 0.125, 0.0625, 0.03125)  # α = 1 is the candidate itself, judged whole before


def largest_step(
    decisions: LoggedDecisions,
    serving: PolicyNetwork,
    candidate: PolicyNetwork,
    *,
    params: ServingParams,
    radius: float,
    serving_params: ServingParams | None = None,
    grid: Sequence[float] = STEP_GRID,
    fresh: Sequence[int] = (),
) -> tuple[float, PolicyNetwork, float] | None:
    """The largest step toward ``candidate`` that serves within ``radius`` of ``serving``.

    Returns ``(α, θ_α, mean TV)`` for the largest α of ``grid`` whose first draw, served by
    ``params``, is on average over the logged decisions within total variation ``radius`` of
    the serving policy's served by ``serving_params`` (default ``params``; :func:`served_tv`),
    or None when even the smallest step is outside. The choice reads the logged contexts and
    candidates only, never a utility, so that a judgement of θ_α on the same decisions is not
    biased by it. ``fresh``: as :func:`interpolate`.

    >>> from models.serving.params import ServingParams
    >>> a, b = PolicyNetwork(4, 3, 2), PolicyNetwork(4, 3, 2)
    >>> d = LoggedDecisions.from_lists([[0, 1, 2]], [[0.5, 0.2, 0.1]], [[0]], [1.0], [-1.0], [0.0],
    ...                                embedding=np.zeros((1, 4)))
    >>> p = ServingParams(temperature=1.0, explore_rate=0.0)
    >>> largest_step(d, a, b, params=p, radius=1.0)[0]  # anything is within TV 1
    0.5
    >>> largest_step(d, a, b, params=p, radius=0.0) is None  # they differ: no step is within 0
    True
    """
    base = Served(serving, serving_params or params)
    for alpha in sorted(grid, reverse=True):
        net = interpolate(serving, candidate, alpha, fresh)
        tv = float(served_tv(decisions, Served(net, params), base).mean()) if len(decisions) else 0.0
        if tv <= radius:
            return alpha, net, tv
    return None
