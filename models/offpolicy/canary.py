"""On-policy comparison of a canary with the serving policy: a time-uniform interval.

A *canary* is a candidate that clients serve, as it will be served, on a random share of
their requests while the serving policy serves the rest. The mean utility of each arm is
then an unbiased estimate of that policy's value as served — no importance weights, no
reward model, no assumption that utilities add up over the memories read — and their
difference is the candidate's gain.

The learner looks at the accumulating arms after every checkpoint and stops as soon as
they decide, so a fixed 95% interval looked at again and again would promote a candidate
no better than serving far more often than 5% of the time. The interval here is a
*confidence sequence*: the normal-mixture boundary of Robbins (1970) and Howard et al.
(2021), which holds at every look at once with probability 1 − α. For an estimate with
standard error ``se`` (information I = 1/se²) and a mixture of prior information I₀,

    |θ̂ − θ| ≤ √( 2·(I + I₀)/I² · log(√((I + I₀)/I₀) / α) ).

It is tightest around I ≈ I₀; :func:`on_policy_gain` sets I₀ from the decision's scale,
the tolerance ε (tightest where se ≈ 4ε). The arms' variances are estimated (Welch), so
the guarantee is asymptotic, as for the time-uniform CLT of Waudby-Smith et al. (2021).

>>> r = confidence_radius(0.1, prior_se=0.1, alpha=0.05)
>>> round(r, 3)  # about twice the fixed 95% interval's 1.96·se
0.366
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from models.offpolicy.estimators import Estimate

ALPHA = 0.05
PRIOR_SCALE = 4.0  # the boundary is tightest where se ≈ PRIOR_SCALE·ε
MIN_ARM = 20  # decisions per arm before an interval is reported
NEIGHBOURS = 10
TIE = 1e-5  # similarities this close to the k-th count as tied with it


def confidence_radius(se: float, prior_se: float, alpha: float = ALPHA) -> float:
    """Half-width of the normal-mixture confidence sequence for an estimate with standard
    error ``se``, the mixture's prior information being 1/``prior_se``².

    >>> confidence_radius(0.05, 0.1) < confidence_radius(0.1, 0.1)
    True
    >>> math.isinf(confidence_radius(0.0, 0.1))
    False
    """
    if se <= 0.0:
        return 0.0
    info, info0 = 1.0 / se**2, 1.0 / prior_se**2
    return math.sqrt(2.0 * (info + info0) / info**2 * math.log(math.sqrt((info + info0) / info0) / alpha))


def neighbour_covariate(
    before: np.ndarray, before_u: np.ndarray, queries: np.ndarray, k: int = NEIGHBOURS
) -> np.ndarray:
    """Each query's predicted utility: the mean utility of its ``k`` most similar queries
    (inner product), and of any tied with the k-th, among those logged *before* the
    canary started.

    A function of the query alone, fixed before either arm served it, so adjusting both
    arms by it (CUPED) removes the part of each utility that the query explains — on the
    real-LM world most of it: which question, how easy — without biasing the difference.

    >>> before = np.eye(3, dtype=np.float32)
    >>> neighbour_covariate(before, np.array([1.0, 2.0, 3.0]), np.eye(3)[[2, 0]], k=1).tolist()
    [3.0, 1.0]
    >>> neighbour_covariate(before[[0, 0, 1]], np.array([1.0, 2.0, 9.0]), np.eye(3)[[0]], k=1).tolist()
    [1.5]
    """
    if len(before) == 0:
        return np.zeros(len(queries))
    k = min(k, len(before))
    sims = np.asarray(queries, np.float32) @ np.asarray(before, np.float32).T
    # Every query as similar as the k-th (a query asked again ties with all its repeats):
    # which of tied neighbours count must not be left to the sort.
    kth = -np.partition(-sims, k - 1, axis=1)[:, k - 1 : k]
    near = sims >= kth - TIE
    out: np.ndarray = (near @ np.asarray(before_u, float)) / near.sum(axis=1)
    return out


def on_policy_gain(
    canary: np.ndarray | list[float],
    serving: np.ndarray | list[float],
    epsilon: float,
    alpha: float = ALPHA,
    canary_x: np.ndarray | None = None,
    serving_x: np.ndarray | None = None,
) -> Estimate | None:
    """The canary's gain over serving, mean(canary) − mean(serving), with its
    time-uniform interval; None while either arm has fewer than ``MIN_ARM`` decisions.

    ``canary_x`` / ``serving_x``: a covariate of each decision fixed before the arms were
    drawn (:func:`neighbour_covariate`); both arms' utilities are then adjusted by
    β·(x − mean x), β the pooled regression slope (CUPED, Deng et al. 2013), which
    narrows the interval by √(1 − ρ²) and leaves the difference unbiased.
    ``ess`` and ``n`` are the canary arm's size (the smaller arm in practice).

    >>> rng = np.random.default_rng(0)
    >>> g = on_policy_gain(rng.normal(1.0, 1.0, 400), rng.normal(0.5, 1.0, 4000), epsilon=0.02)
    >>> g.low > 0.2 and g.high < 0.8, g.method
    (True, 'canary')
    >>> on_policy_gain([1.0] * 5, [0.0] * 100, epsilon=0.02) is None
    True
    """
    c, s = np.asarray(canary, float), np.asarray(serving, float)
    if len(c) < MIN_ARM or len(s) < MIN_ARM:
        return None
    if canary_x is not None and serving_x is not None:
        x = np.concatenate([canary_x, serving_x]).astype(float)
        y = np.concatenate([c, s])
        var = float(x.var())
        beta = float(((x - x.mean()) * (y - y.mean())).mean() / var) if var > 0 else 0.0
        c = c - beta * (np.asarray(canary_x, float) - x.mean())
        s = s - beta * (np.asarray(serving_x, float) - x.mean())
    diff = float(c.mean() - s.mean())
    se = math.sqrt(float(c.var(ddof=1)) / len(c) + float(s.var(ddof=1)) / len(s))
    r = confidence_radius(se, PRIOR_SCALE * max(epsilon, 1e-9), alpha)
    return Estimate(diff, diff - r, diff + r, float(len(c)), len(c), "canary", 0.0)


@dataclass
class CanaryArms:
    """A running canary's decisions, arm by arm, with each one's covariate.

    ``before`` / ``before_u``: query embeddings and utilities logged before the canary
    started (the covariate's reference, :func:`neighbour_covariate`). :meth:`verdict` is
    the gate's rule on the on-policy gain: promoted when its lower bound is above −ε,
    refused when its upper bound is below −ε, retired (undecided, give way to a newer
    candidate) after ``max_decisions`` canary decisions, else None: keep serving it.

    >>> rng = np.random.default_rng(1)
    >>> arms = CanaryArms(rng.normal(size=(50, 4)), rng.normal(size=50))
    >>> for i in range(600):
    ...     q = rng.normal(size=4)
    ...     arms.add(i % 5 == 0, float(rng.normal(0.5 if i % 5 == 0 else 0.0)), q)
    >>> arms.verdict(0.02, max_decisions=1000), len(arms.canary)
    ('promoted', 120)
    """

    before: np.ndarray
    before_u: np.ndarray
    canary: list[float] = field(default_factory=list)
    serving: list[float] = field(default_factory=list)
    canary_x: list[float] = field(default_factory=list)
    serving_x: list[float] = field(default_factory=list)

    def add(self, on_canary: bool, utility: float, query: np.ndarray) -> None:
        self.extend([on_canary], [utility], np.asarray(query)[None])

    def extend(self, on_canary: Sequence[bool], utilities: Sequence[float], queries: np.ndarray) -> None:
        """Several decisions at once (``queries`` [n, D]): one covariate computation for all."""
        xs = neighbour_covariate(self.before, self.before_u, queries)
        for arm, u, x in zip(on_canary, utilities, xs.tolist(), strict=True):
            (self.canary if arm else self.serving).append(u)
            (self.canary_x if arm else self.serving_x).append(x)

    def gain(self, epsilon: float) -> Estimate | None:
        return on_policy_gain(
            self.canary, self.serving, epsilon, canary_x=np.array(self.canary_x), serving_x=np.array(self.serving_x)
        )

    def verdict(self, epsilon: float, max_decisions: int, gain: Estimate | None = None) -> str | None:
        """:func:`canary_verdict` on ``gain`` (computed here if not given: :meth:`gain`) and the canary arm."""
        g = gain if gain is not None else self.gain(epsilon)
        return canary_verdict(g, epsilon, len(self.canary), max_decisions)


def canary_verdict(gain: Estimate | None, epsilon: float, decisions: int, max_decisions: int) -> str | None:
    """The gate's rule on a canary's ``gain``: promoted when its lower bound is above −ε,
    refused when its upper bound is below −ε, else retired after ``max_decisions`` canary
    decisions (None: keep serving it).

    >>> canary_verdict(Estimate(0.0, -0.01, 0.01, 1.0, 1, "x", 0.0), 0.02, 5, 100)
    'promoted'
    >>> canary_verdict(None, 0.02, 100, 100)
    'retired'
    """
    if gain is not None and gain.low > -epsilon:
        return "promoted"
    if gain is not None and gain.high < -epsilon:
        return "refused"
    return "retired" if decisions >= max_decisions else None
