"""Off-policy estimates of a policy's mean utility from logged retrievals (docs/learning.md).

Every retrieval event records the serving policy's kept candidates, their similarity
scores, the ordered ``selected`` slots, the temperature T and ``logprob`` = log π_serving
(selected | s) under the serving rule; the join adds the step's utility u. From such a log this
module estimates V(π) = E_s E_{a∼π(·|s)}[u] for another policy π:

* :func:`ips` — inverse propensity scoring, mean(w·u);
* :func:`snips` — self-normalised IPS, Σw·u / Σw (biased but consistent, lower variance);
* :func:`doubly_robust` — mean(r̂_π(s) + w·(u − r̂(logged selection))) with the
  :class:`~models.offpolicy.reward_model.AdditiveRewardModel` as the direct model by default;

where ``w = exp(log π(selected|s) − logprob)``, optionally clipped at ``clip`` (the share
of clipped weights is reported). Each :class:`Estimate` carries a seeded percentile
bootstrap interval (decisions resampled with replacement), the effective sample size
(Σw)²/Σw² and the number of decisions; :func:`empirical_bernstein_bound` gives a
finite-sample interval for clipped IPS instead. :func:`gain` estimates the *difference*
V(candidate) − V(baseline) with a paired bootstrap (the same resampled decisions for both
policies), which is what a promotion gate compares with −ε.

The log (:class:`~models.offpolicy.logged.LoggedDecisions`) and the evaluated policy's probability of
each logged selection (by the serving rule over the *logged* candidates; a
:class:`~models.offpolicy.logged.Tempered` policy fixes T) live in :mod:`models.offpolicy.logged`; the slot
reward model of DR in :mod:`models.offpolicy.reward_model`.

Limitations (known, by construction of the log):

* **Support deficiency.** Candidates the *serving* policy dropped are not in the event, so
  nothing is known about them: the estimates are of the target restricted to the logged
  candidate sets, not of the target as it would serve (it might have kept, and chosen,
  slots the serving policy dropped). For the same reason the target's drop threshold uses
  the maximum mask over the logged candidates only. The estimates are exact for targets
  whose kept set contains no slot outside the logged one (e.g. ``"similarity"``/
  ``"uniform"`` when the serving policy dropped nothing, or a network close to the serving
  one); the further apart they are, the more this matters.
* The number of selections k is taken from each event (it is configuration, not policy).
* Fallback events (the hard drop left nothing, a different retriever served) and label
  experiences are left out by :meth:`~models.offpolicy.logged.LoggedDecisions.from_experiences`.
* Clipping trades bias for variance; the percentile bootstrap is approximate (it can
  under-cover with very heavy-tailed weights: watch ``ess``); the DR reward model is fit
  on the same log and kept fixed across bootstrap resamples; its direct term is a
  seeded Monte Carlo average (exact for k = 1 and when the target draws all its kept
  candidates).

>>> d = LoggedDecisions.from_lists(
...     candidates=[[1, 2], [1, 3]], scores=[[0.9, 0.1], [0.5, 0.5]], selected=[[1], [3]],
...     temperature=[1.0, 1.0], logprob=[np.log(0.5), np.log(0.5)], utility=[1.0, 0.0])
>>> est = evaluate(d, {"uniform": "uniform"}, method="ips", n_boot=50)["uniform"]
>>> est.value, est.n, est.ess  # uniform gives each selection 1/2: every weight is 1
(0.5, 2, 2.0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from models.offpolicy.logged import (
    BLOCK_ELEMENTS,
    LoggedDecisions,
    TargetPolicy,
    logprob_from_logits,
    resolve_target,
    target_logits,
)
from models.offpolicy.reward_model import DEFAULT_SAMPLES, AdditiveRewardModel, SlotRewardModel

DEFAULT_CLIP = 50.0
DEFAULT_LEVEL = 0.95
DEFAULT_BOOT = 500

Method = Literal["ips", "snips", "dr"]


# --------------------------------------------------------------------------- weights and intervals


@dataclass(frozen=True)
class Estimate:
    """A policy value (or gain) estimate with its interval, ESS and the share of clipped weights."""

    value: float
    low: float
    high: float
    ess: float
    n: int
    method: str
    clipped_share: float


def clipped_weights(logw: np.ndarray, clip: float | None = DEFAULT_CLIP) -> tuple[np.ndarray, float]:
    """w = min(clip, exp(log w)) and the share of decisions whose weight was clipped.

    >>> w, share = clipped_weights(np.log([100.0, 1.0, 0.5]), clip=50.0)
    >>> w.tolist(), round(share, 4)
    ([50.0, 1.0, 0.5], 0.3333)
    """
    logw = np.asarray(logw, np.float64)
    if np.isnan(logw).any():
        raise ValueError("log-weights contain NaN")
    w = np.exp(np.minimum(logw, 700.0))
    if clip is None or w.size == 0:
        return w, 0.0
    over = w > clip
    return np.minimum(w, clip), float(over.mean())


def effective_sample_size(w: np.ndarray) -> float:
    """Kish's effective sample size (Σw)²/Σw² (0 when every weight is 0).

    >>> round(effective_sample_size(np.array([2.0, 0.5, 1.0])), 6)  # 3.5² / 5.25
    2.333333
    """
    w = np.asarray(w, np.float64)
    s2 = float((w * w).sum())
    return float(w.sum() ** 2 / s2) if s2 > 0 else 0.0


@dataclass(frozen=True)
class Parts:
    """statistic = Σ num / Σ den over a set of decisions (den = 1 for IPS and DR); ``w`` gives the ESS."""

    num: np.ndarray
    den: np.ndarray
    w: np.ndarray
    clipped_share: float


def _ratio(num_sum: np.ndarray, den_sum: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den_sum != 0, num_sum / np.where(den_sum != 0, den_sum, 1.0), np.nan)


def paired_bootstrap(
    parts: Sequence[tuple[np.ndarray, np.ndarray, float]],
    n_boot: int = DEFAULT_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of Σ_j sign_j·(Σ num_j / Σ den_j), decisions resampled jointly.

    ``parts`` holds (num, den, sign) per policy; every policy sees the same resampled
    decisions (a paired bootstrap). Resamples whose denominator is 0 are ignored.

    >>> u = np.arange(10.0)
    >>> lo, hi = paired_bootstrap([(u, np.ones(10), 1.0)], n_boot=200, seed=1)
    >>> bool(lo < 4.5 < hi)
    True
    """
    n = parts[0][0].shape[0]
    if n == 0 or n_boot <= 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    stats = np.empty(n_boot, np.float64)
    rows = max(1, BLOCK_ELEMENTS // n)
    for lo in range(0, n_boot, rows):
        hi = min(n_boot, lo + rows)
        idx = rng.integers(0, n, size=(hi - lo, n))
        total = np.zeros(hi - lo)
        for num, den, sign in parts:
            total = total + sign * _ratio(num[idx].sum(axis=1), den[idx].sum(axis=1))
        stats[lo:hi] = total
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return float("nan"), float("nan")
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(stats, [tail, 100.0 - tail])
    return float(low), float(high)


def estimate_from_parts(
    parts: Sequence[Parts], signs: Sequence[float], method: str, n_boot: int, level: float, seed: int
) -> Estimate:
    """Σ_j sign_j·(Σ num_j / Σ den_j) with its paired bootstrap interval; ESS: the smallest of the parts'."""
    n = int(parts[0].num.shape[0])
    ess = min(effective_sample_size(p.w) for p in parts)
    share = max(p.clipped_share for p in parts)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0.0, 0, method, 0.0)
    value = float(
        sum(s * _ratio(np.array(p.num.sum()), np.array(p.den.sum())) for p, s in zip(parts, signs, strict=True))
    )
    low, high = paired_bootstrap(
        [(p.num, p.den, s) for p, s in zip(parts, signs, strict=True)], n_boot=n_boot, level=level, seed=seed
    )
    return Estimate(value, low, high, ess, n, method, share)


# --------------------------------------------------------------------------- estimators


def _ips_parts(u: np.ndarray, logw: np.ndarray, clip: float | None) -> Parts:
    w, share = clipped_weights(logw, clip)
    u = np.asarray(u, np.float64)
    return Parts(w * u, np.ones_like(w), w, share)


def _snips_parts(u: np.ndarray, logw: np.ndarray, clip: float | None) -> Parts:
    w, share = clipped_weights(logw, clip)
    u = np.asarray(u, np.float64)
    return Parts(w * u, w, w, share)


def ips(
    u: np.ndarray,
    logw: np.ndarray,
    *,
    clip: float | None = DEFAULT_CLIP,
    level: float = DEFAULT_LEVEL,
    n_boot: int = DEFAULT_BOOT,
    seed: int = 0,
) -> Estimate:
    """Inverse propensity scoring: mean(w·u).

    >>> e = ips(np.array([1.0, 2.0, 3.0]), np.log([2.0, 0.5, 1.0]), n_boot=100)
    >>> round(e.value, 6), round(e.ess, 6)  # (2 + 1 + 3) / 3
    (2.0, 2.333333)
    """
    return estimate_from_parts([_ips_parts(u, logw, clip)], [1.0], "ips", n_boot, level, seed)


def snips(
    u: np.ndarray,
    logw: np.ndarray,
    *,
    clip: float | None = DEFAULT_CLIP,
    level: float = DEFAULT_LEVEL,
    n_boot: int = DEFAULT_BOOT,
    seed: int = 0,
) -> Estimate:
    """Self-normalised IPS: Σw·u / Σw (NaN when every weight is 0).

    >>> e = snips(np.array([1.0, 2.0, 3.0]), np.log([2.0, 0.5, 1.0]), n_boot=100)
    >>> round(e.value, 6)  # 6 / 3.5
    1.714286
    """
    return estimate_from_parts([_snips_parts(u, logw, clip)], [1.0], "snips", n_boot, level, seed)


def _dr_parts(
    decisions: LoggedDecisions,
    logw: np.ndarray,
    reward_model: SlotRewardModel,
    target_reward: np.ndarray,
    clip: float | None,
) -> Parts:
    w, share = clipped_weights(logw, clip)
    terms = target_reward + w * (decisions.utility - reward_model.predict(decisions))
    return Parts(terms, np.ones_like(terms), w, share)


def doubly_robust(
    decisions: LoggedDecisions,
    logw: np.ndarray,
    reward_model: SlotRewardModel | None,
    policy: TargetPolicy,
    *,
    clip: float | None = DEFAULT_CLIP,
    level: float = DEFAULT_LEVEL,
    n_boot: int = DEFAULT_BOOT,
    seed: int = 0,
    samples: int = DEFAULT_SAMPLES,
) -> Estimate:
    """Doubly robust: mean(r̂_π(s) + w·(u − r̂(logged selection))).

    ``reward_model`` defaults to an :class:`AdditiveRewardModel` fit on ``decisions``; r̂_π comes
    from :meth:`SlotRewardModel.expected_under` for ``policy`` (the policy ``logw`` is for).

    >>> d = LoggedDecisions.from_lists([[1, 2]], [[0.5, 0.5]], [[1, 2]], [1.0], [np.log(0.5)], [1.0])
    >>> m = SlotRewardModel(global_mean=0.0, slot_ids=np.array([1, 2]), slot_values=np.array([0.0, 1.0]))
    >>> round(doubly_robust(d, np.zeros(1), m, "uniform", n_boot=10).value, 6)  # 0.5 + 1·(1 − 0.5)
    1.0
    """
    model = reward_model if reward_model is not None else AdditiveRewardModel().fit(decisions)
    target_reward = model.expected_under(decisions, policy, samples=samples, seed=seed)
    parts = _dr_parts(decisions, logw, model, target_reward, clip)
    return estimate_from_parts([parts], [1.0], "dr", n_boot, level, seed)


def empirical_bernstein_bound(
    u: np.ndarray,
    logw: np.ndarray,
    *,
    clip: float = DEFAULT_CLIP,
    u_range: tuple[float, float] | None = None,
    delta: float = 1.0 - DEFAULT_LEVEL,
) -> Estimate:
    """Clipped IPS with a two-sided empirical-Bernstein interval (Maurer & Pontil 2009, Thm 4).

    For i.i.d. X_i = min(w_i, clip)·u_i in [a, b], with probability ≥ 1 − δ,
    |E X − mean X| ≤ (b − a)·(√(2·V·ln(4/δ)/n) + 7·ln(4/δ)/(3(n − 1))) with V the sample
    variance of (X − a)/(b − a). The interval holds for the *clipped* estimand E[min(w, c)·u]
    (equal to V(π) when no weight on the target's support exceeds ``clip``). ``u_range``
    bounds the utility; by default the observed range (then the bound is not rigorous).

    >>> e = empirical_bernstein_bound(np.full(1000, 0.5), np.zeros(1000), clip=2.0, u_range=(0.0, 1.0))
    >>> e.value, bool(e.low < 0.5 < e.high)
    (0.5, True)
    """
    w, share = clipped_weights(logw, clip)
    u = np.asarray(u, np.float64)
    n = int(u.size)
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0.0, 0, "ips-bernstein", 0.0)
    u_lo, u_hi = u_range if u_range is not None else (float(u.min()), float(u.max()))
    a, b = clip * min(u_lo, 0.0), clip * max(u_hi, 0.0)
    x = w * u
    value = float(x.mean())
    span = b - a
    if n < 2 or span <= 0:
        half = 0.0 if span <= 0 else float("inf")
    else:
        v = float(np.var((x - a) / span, ddof=1))
        log_term = np.log(4.0 / delta)
        half = span * (np.sqrt(2.0 * v * log_term / n) + 7.0 * log_term / (3.0 * (n - 1)))
    low, high = max(a, value - half), min(b, value + half)
    return Estimate(value, float(low), float(high), effective_sample_size(w), n, "ips-bernstein", share)


# --------------------------------------------------------------------------- policies and gains


def _policy_parts(
    decisions: LoggedDecisions,
    policy: TargetPolicy,
    method: Method,
    clip: float | None,
    reward_model: SlotRewardModel | None,
    samples: int,
    seed: int,
) -> Parts:
    base, _ = resolve_target(policy, decisions)
    z, kept = target_logits(decisions, policy)
    logw = logprob_from_logits(decisions, z, kept, uniform=isinstance(base, str) and base == "uniform")
    logw = logw - decisions.logprob
    if method == "ips":
        return _ips_parts(decisions.utility, logw, clip)
    if method == "snips":
        return _snips_parts(decisions.utility, logw, clip)
    if method == "dr":
        assert reward_model is not None
        target_reward = reward_model.expected_from_logits(decisions, z, kept, samples=samples, seed=seed)
        return _dr_parts(decisions, logw, reward_model, target_reward, clip)
    raise ValueError(f"unknown method {method!r}: expected 'ips', 'snips' or 'dr'")


def evaluate(
    decisions: LoggedDecisions,
    policies: Mapping[str, TargetPolicy],
    method: Method = "snips",
    *,
    clip: float | None = DEFAULT_CLIP,
    level: float = DEFAULT_LEVEL,
    n_boot: int = DEFAULT_BOOT,
    seed: int = 0,
    reward_model: SlotRewardModel | None = None,
    samples: int = DEFAULT_SAMPLES,
) -> dict[str, Estimate]:
    """Estimate the mean utility of each named policy from the same log.

    For ``method="dr"`` one reward model (default: an :class:`AdditiveRewardModel` fit on the log)
    serves every policy.

    >>> from models.offpolicy.logged import Tempered
    >>> d = LoggedDecisions.from_lists([[1, 2]] * 2, [[0.9, 0.1]] * 2, [[1], [2]], [1.0] * 2,
    ...                                 [np.log(0.5)] * 2, [1.0, 0.0])
    >>> out = evaluate(d, {"u": "uniform", "s": Tempered("similarity", 0.01)}, n_boot=20)
    >>> round(out["u"].value, 6), round(out["s"].value, 6)
    (0.5, 1.0)
    """
    if method == "dr" and reward_model is None:
        reward_model = AdditiveRewardModel().fit(decisions)
    return {
        name: estimate_from_parts(
            [_policy_parts(decisions, policy, method, clip, reward_model, samples, seed)],
            [1.0],
            method,
            n_boot,
            level,
            seed,
        )
        for name, policy in policies.items()
    }


def gain(
    decisions: LoggedDecisions,
    candidate: TargetPolicy,
    baseline: TargetPolicy,
    method: Method = "snips",
    *,
    clip: float | None = DEFAULT_CLIP,
    level: float = DEFAULT_LEVEL,
    n_boot: int = DEFAULT_BOOT,
    seed: int = 0,
    reward_model: SlotRewardModel | None = None,
    samples: int = DEFAULT_SAMPLES,
) -> Estimate:
    """V(candidate) − V(baseline) with a paired bootstrap interval (same resamples for both).

    A promotion gate accepts the candidate when ``low > −ε``. ``ess`` is the smaller of the
    two policies' effective sample sizes and ``clipped_share`` the larger clipped share.

    >>> from models.offpolicy.logged import Tempered
    >>> d = LoggedDecisions.from_lists([[1, 2]] * 2, [[0.9, 0.1]] * 2, [[1], [2]], [1.0] * 2,
    ...                                 [np.log(0.5)] * 2, [1.0, 0.0])
    >>> round(gain(d, Tempered("similarity", 0.01), "uniform", n_boot=20).value, 6)
    0.5
    """
    if method == "dr" and reward_model is None:
        reward_model = AdditiveRewardModel().fit(decisions)
    parts = [
        _policy_parts(decisions, policy, method, clip, reward_model, samples, seed) for policy in (candidate, baseline)
    ]
    return estimate_from_parts(parts, [1.0, -1.0], f"{method}-gain", n_boot, level, seed)
