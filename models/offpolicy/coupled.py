"""A coupled canary: the canary's gain measured only where its slate differs from serving's.

On a request drawn into a coupled canary (contract 1.5), the client draws the canary's
slate and the serving policy's with the *same* random numbers — the exploration coin, the
revival of dropped candidates, the Gumbel noise of the Plackett–Luce draw — so that the two
slates are the same wherever the two policies nearly agree. Such a request (a *tie*)
serves that slate; one where they differ serves the canary's slate with probability
q = ``CANARY_SHARE`` and the serving policy's otherwise, and logs the other slate. With u
the utility that followed and q̂_C, q̂_S predictions of the two slates' utilities made
without this request's coin (a reward model fit before the canary started, or one
baseline b for both),

    D = 0 (tie)
    D = q̂_C − q̂_S + (u − q̂_C)/q          (the canary's slate served)
    D = q̂_C − q̂_S − (u − q̂_S)/(1 − q)    (the serving policy's served)

has expectation exactly the canary's gain V(canary) − V(serving) on these requests: a tie
reads the same memories under either policy, so it adds nothing to the difference, and on
the others each slate is served with a known probability (doubly robust with known
propensities: the predictions cancel in expectation, whatever their error). Its variance
is about P(differ) times the spread of the per-request differences plus the prediction's
residuals scaled by 1/q + 1/(1 − q): the fewer requests the canary changes, and the
better the reward model, the fewer decisions the gain needs (docs/learning.md, "The canary").

The interval is :mod:`models.offpolicy.canary`'s confidence sequence, on a deliberately cautious
variance: E[D²] (not centred) as P̃(differ)·M̃, with P̃ = (n_differ + 1)/(n + 2) and M̃
the differing requests' mean D² shrunk toward a prior from the utilities logged before
the canary (``PRIOR_DECISIONS`` pseudo-decisions), so that a run of ties reads as a small
share of differing requests, never as no variance at all.

>>> arms = CoupledArms(prior_d2=1.0)
>>> arms.extend(["tie"] * 300, [0.5] * 300, np.zeros(300))
>>> g = arms.gain(0.02)
>>> g.value, round(g.low, 4) > -0.02, arms.differing
(0.0, True, 0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from models.offpolicy.canary import MIN_ARM, PRIOR_SCALE, confidence_radius
from models.offpolicy.estimators import Estimate

CANARY_SHARE = 0.5  # q: the share of differing requests that the canary's slate serves (contract 1.5)
PRIOR_DECISIONS = 10.0  # pseudo-decisions of the prior second moment of D on a differing request


def coupled_term(arm: str, utility: float, served: float, other: float, q: float = CANARY_SHARE) -> float:
    """One request's D; ``served``/``other``: the predicted utilities of the slate served and
    of the other one (the same baseline for both without a reward model).

    >>> [coupled_term(arm, 3.0, 1.0, 1.0) for arm in ("tie", "canary", "serving")]
    [0.0, 4.0, -4.0]
    >>> coupled_term("canary", 3.0, 3.0, 1.0)  # predicted exactly: the predictions' difference
    2.0
    """
    if arm == "tie":
        return 0.0
    if arm == "canary":
        return served - other + (utility - served) / q
    return other - served - (utility - served) / (1.0 - q)


def prior_second_moment(utilities: np.ndarray, q: float = CANARY_SHARE) -> float:
    """E[D² | differing] if each arm's u − b were as spread as the utilities logged before.

    >>> prior_second_moment(np.array([0.0, 2.0]))  # variance 1, times 1/q + 1/(1 − q)
    4.0
    """
    u = np.asarray(utilities, float)
    var = float(u.var()) if len(u) > 1 else 1.0
    # Half the differing requests serve each arm: E[D²] = q·E[(u−b)²]/q² + (1−q)·E[(u−b)²]/(1−q)².
    return var * (1.0 / q + 1.0 / (1.0 - q))


@dataclass
class CoupledArms:
    """A running coupled canary's decisions: each request's D (:func:`coupled_term`).

    ``prior_d2``: :func:`prior_second_moment` of the utilities logged before the canary.
    ``differing``: the requests whose two slates differed.
    """

    prior_d2: float
    terms: list[float] = field(default_factory=list)
    differing: int = 0

    def __len__(self) -> int:
        return len(self.terms)

    def extend(
        self, arms: Sequence[str], utilities: Sequence[float], served: np.ndarray, other: np.ndarray | None = None
    ) -> None:
        """Requests' arms, utilities and predictions (:func:`coupled_term`; ``other`` defaults to ``served``)."""
        served = np.asarray(served, float)
        other = served if other is None else np.asarray(other, float)
        for arm, u, s, o in zip(arms, utilities, served.tolist(), other.tolist(), strict=True):
            self.terms.append(coupled_term(arm, u, s, o))
            self.differing += arm != "tie"

    def gain(self, epsilon: float, alpha: float = 0.05) -> Estimate | None:
        """The canary's gain over serving, mean D, with its time-uniform interval; None under
        ``MIN_ARM`` requests. ``ess`` and ``n``: the requests drawn in."""
        n = len(self.terms)
        if n < MIN_ARM:
            return None
        d = np.asarray(self.terms, float)
        value = float(d.mean())
        share = (self.differing + 1.0) / (n + 2.0)
        m2 = (float((d * d).sum()) + PRIOR_DECISIONS * self.prior_d2) / (self.differing + PRIOR_DECISIONS)
        se = math.sqrt(share * m2 / n)
        r = confidence_radius(se, PRIOR_SCALE * max(epsilon, 1e-9), alpha)
        return Estimate(value, value - r, value + r, float(n), n, "coupled", 0.0)
