"""Served policies evaluated on one log: :class:`SlateLog`, :func:`evaluate_served`.

The promotion gate and ``causalmem evaluate`` judge policies *as clients serve them*
(:class:`~models.offpolicy.logged.Served`: the serving parameters' mixture of temperatures and hard
drop). A :class:`SlateLog` prepares a log once — the logging mixture's inclusion moments,
the cross-fitted additive reward model, the achievable range — for any number of targets;
the estimators are those of :mod:`models.offpolicy.slate` (``pi``, ``dr``), the set-level ones of
:mod:`models.offpolicy.setlevel` (``set-ips``, ``set-snips``, ``set-dr``: for rewards that depend on
the set read, not additive) and OBP's standard slate IPS (``ips``, ``snips``) with the
served mixture's probability of the logged selection.
Every value is clipped to the achievable range and every gain to ± its width.

>>> d = LoggedDecisions.from_lists([[1, 2, 3]] * 2, [[0.3, 0.2, 0.1]] * 2, [[1, 2], [2, 3]], [1.0] * 2,
...                                [np.log(1 / 3)] * 2, [1.0, 0.0], first_probs=[[1 / 3] * 3] * 2)
>>> from models.serving.params import ServingParams
>>> log = SlateLog.prepare(d)
>>> est = evaluate_served(log, {"u": Served("uniform", ServingParams())}, "pi", n_boot=20)["u"]
>>> round(est.value, 6)  # uniform target = uniform logging: every PI weight is 1
0.5
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from models.offpolicy.estimators import (
    DEFAULT_BOOT,
    DEFAULT_CLIP,
    DEFAULT_LEVEL,
    Estimate,
    Parts,
    clipped_weights,
    estimate_from_parts,
)
from models.offpolicy.logged import LoggedDecisions, Served, component_logits, logprob_from_logits
from models.offpolicy.reward_model import AdditiveRewardModel, SlotRewardModel
from models.offpolicy.setlevel import SET_METHODS, SetTable, logging_set_probability, set_terms
from models.offpolicy.slate import (
    MomentCache,
    achievable_range,
    behaviour_moments,
    pinv_selected,
    selected_mask,
    slate_terms,
    slot_spread,
    target_inclusion,
)

RANGE_SHRINKAGE = 0.5  # the achievable range's reward model: nearly the least-squares fit

SLATE_METHODS = ("ips", "snips", "pi", "dr", *SET_METHODS)


@dataclass
class SlateLog:
    """A log prepared once for several served targets: the logging mixture's moments, the
    additive reward model and the achievable range. Decisions without ``candidate_probs``
    are left out (``left_out`` counts them)."""

    decisions: LoggedDecisions
    q_mu: np.ndarray
    gamma: np.ndarray
    model: SlotRewardModel
    phi: np.ndarray  # [N, C] cross-fitted slot values of each decision's candidates
    pred: np.ndarray  # [N] cross-fitted r̂ of each logged selection
    value_range: tuple[float, float]
    left_out: int
    seed: int = 0
    cache: dict[tuple[Served, str], Parts] = field(default_factory=dict)  # served_parts, per target and method
    theta: dict[Served, np.ndarray] = field(default_factory=dict)  # target_inclusion, per target
    pinv_s: np.ndarray | None = None  # Γ^†1_S of the logging moments, computed on first use
    sets: SetTable | None = None  # the set-level estimators' logged sets, built on first use

    @classmethod
    def prepare(
        cls,
        decisions: LoggedDecisions,
        prior_quantile: float | None = None,
        seed: int = 0,
        moments: bool = True,
        cache: MomentCache | None = None,
    ) -> SlateLog:
        """``moments=False``: every decision kept, without the logging moments (for ``ips``/``snips`` only);
        ``cache`` keeps each step's logging moments across logs (:class:`~models.offpolicy.slate.MomentCache`)."""
        if moments:
            usable, q, g = behaviour_moments(decisions, seed=seed, cache=cache)
        else:
            n, c = decisions.valid.shape
            usable, q, g = np.ones(n, bool), np.zeros((n, c)), np.zeros((n, 0, 0))
        kept = decisions.subset(usable)
        model = AdditiveRewardModel(prior_quantile=prior_quantile).fit(kept)
        # Cross-fitting: each half's DR terms use the model fit on the other half, so that
        # the residuals u − r̂(S) are not shrunk by the fit having seen them.
        fold = np.random.default_rng(seed).random(len(kept)) < 0.5
        phi, pred = np.zeros(kept.valid.shape), np.zeros(len(kept))
        for part in (fold, ~fold):
            if part.any() and (~part).any():
                other = AdditiveRewardModel(prior_quantile=prior_quantile).fit(kept.subset(~part))
            else:
                other = model
            phi[part] = other.values(kept.slots[part])
            pred[part] = other.predict(kept.subset(part))
        # The range from a barely shrunk fit, each value widened by its spread: a bound must
        # err wide rather than cut off a true value (per-slot values are an approximation).
        loose = AdditiveRewardModel(shrinkage=RANGE_SHRINKAGE).fit(kept)
        bounds = achievable_range(kept, loose, slot_spread(kept, loose)) if len(kept) else (np.nan, np.nan)
        return cls(kept, q[usable], g[usable], model, phi, pred, bounds, int((~usable).sum()), seed)

    def __len__(self) -> int:
        return len(self.decisions)


def served_parts(log: SlateLog, target: Served, method: str, clip: float | None = DEFAULT_CLIP) -> Parts:
    """Per-decision terms of a served target by ``method`` (``ips``: OBP's standard slate IPS
    with the mixture's probability of the logged ordered selection over the event's logged
    propensity, weights clipped at ``clip``; ``snips`` its self-normalised form; ``pi`` and
    ``dr``: see :func:`slate_terms`; ``set-ips``, ``set-snips``, ``set-dr``: see
    :func:`models.offpolicy.setlevel.set_terms`)."""
    key = (target, method)
    if key not in log.cache:
        log.cache[key] = _served_parts(log, target, method, clip)
    return log.cache[key]


def _served_parts(log: SlateLog, target: Served, method: str, clip: float | None) -> Parts:
    d = log.decisions
    if method in ("ips", "snips"):
        comps = component_logits(d, target)
        lps = [np.log(w) + logprob_from_logits(d, z, kept, uniform) for w, z, kept, uniform in comps]
        with np.errstate(divide="ignore", invalid="ignore"):
            logw = np.logaddexp.reduce(np.stack(lps), axis=0) - d.logprob
        w, share = clipped_weights(logw, clip)
        return Parts(w * d.utility, w if method == "snips" else np.ones_like(w), w, share)
    if method in SET_METHODS:
        if log.sets is None:
            _, mu = logging_set_probability(d)
            log.sets = SetTable.build(d, log.phi, mu)
        theta = None
        if method == "set-dr":
            if target not in log.theta:
                log.theta[target] = target_inclusion(d, target, seed=log.seed)
            theta = log.theta[target]
        terms, w = set_terms(d, log.sets, target, method, theta=theta, phi=log.phi)
        return Parts(terms, w if method == "set-snips" else np.ones_like(terms), np.abs(w), 0.0)
    if target not in log.theta:
        log.theta[target] = target_inclusion(d, target, seed=log.seed)
    theta = log.theta[target]
    if log.pinv_s is None:
        log.pinv_s = pinv_selected(log.gamma, selected_mask(d))
    terms, w = slate_terms(d, theta, log.q_mu, log.gamma, method, log.phi, log.pred, pinv_s=log.pinv_s)
    return Parts(terms, np.ones_like(terms), np.abs(w), 0.0)


def _clip(e: Estimate, lo: float, hi: float) -> Estimate:
    def c(x: float) -> float:
        return float(min(max(x, lo), hi)) if np.isfinite(x) else x

    return replace(e, value=c(e.value), low=c(e.low), high=c(e.high))


def evaluate_served(
    log: SlateLog,
    policies: Mapping[str, Served],
    method: str = "dr",
    *,
    n_boot: int = DEFAULT_BOOT,
    level: float = DEFAULT_LEVEL,
    seed: int = 0,
) -> dict[str, Estimate]:
    """Each served policy's value with its interval, clipped to the log's achievable range."""
    lo, hi = log.value_range
    out = {}
    for name, target in policies.items():
        est = estimate_from_parts([served_parts(log, target, method)], [1.0], method, n_boot, level, seed)
        out[name] = _clip(est, lo, hi) if len(log) else est
    return out
