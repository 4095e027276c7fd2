"""Off-policy estimates of a policy's mean utility from logged retrievals (docs/learning.md).

Every retrieval event records the serving policy's kept candidates, their similarity
scores, the ordered ``selected`` slots, the temperature T and ``logprob`` = log π_serving
(selected | s) under the serving rule; the join adds the step's utility u. From such a log this
module estimates V(π) = E_s E_{a∼π(·|s)}[u] for another policy π:

* :func:`ips` — inverse propensity scoring, mean(w·u);
* :func:`snips` — self-normalised IPS, Σw·u / Σw (biased but consistent, lower variance);
* :func:`doubly_robust` — mean(r̂_π(s) + w·(u − r̂(logged selection))) with the
  :class:`SlotRewardModel` as the direct model;

where ``w = exp(log π(selected|s) − logprob)``, optionally clipped at ``clip`` (the share
of clipped weights is reported). Each :class:`Estimate` carries a seeded percentile
bootstrap interval (decisions resampled with replacement), the effective sample size
(Σw)²/Σw² and the number of decisions; :func:`empirical_bernstein_bound` gives a
finite-sample interval for clipped IPS instead. :func:`gain` estimates the *difference*
V(candidate) − V(baseline) with a paired bootstrap (the same resampled decisions for both
policies), which is what a promotion gate compares with −ε.

The evaluated policy's probability of the logged selection is computed by the serving rule over
the *logged* candidates: z_i = score_i·(1 + α·m_i)/T with the logged T (or the T of a
:class:`Tempered` policy), then Plackett–Luce. A :class:`~models.policy.PolicyNetwork`
target also applies its own hard drop (m_i < 0.01·max m over the logged candidates):
when it drops a slot the log selected, its probability of that selection is 0 (log −inf,
weight 0). ``"similarity"`` is the rule with m = 0 (z = score/T) and ``"uniform"`` draws
k of the n candidates uniformly in order, π = (n−k)!/n!.

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
  experiences are left out by :meth:`LoggedDecisions.from_experiences`.
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
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from models.policy import PolicyNetwork
from models.serving_rule import DYNAMIC_DROP_RATIO, plackett_luce_logprob_torch
from topics.internal import Experience

DEFAULT_CLIP = 50.0
DEFAULT_LEVEL = 0.95
DEFAULT_BOOT = 500
DEFAULT_SAMPLES = 32
DEFAULT_SHRINKAGE = 5.0
_CHUNK = 1 << 22  # elements per bootstrap / sampling block (bounds memory)

Method = Literal["ips", "snips", "dr"]


# --------------------------------------------------------------------------- the log


@dataclass(frozen=True)
class LoggedDecisions:
    """N logged decisions as padded arrays (C = most candidates, K = most selections).

    ``selected`` holds *positions* into each candidate row, in selection order.

    >>> d = LoggedDecisions.from_lists([[7, 8, 9]], [[0.3, 0.2, 0.1]], [[9, 7]], [0.5], [-2.0], [1.0])
    >>> d.slots.tolist(), d.selected.tolist(), len(d)
    ([[7, 8, 9]], [[2, 0]], 1)
    """

    slots: np.ndarray  # [N, C] int64 candidate slots (padding 0)
    valid: np.ndarray  # [N, C] bool: real candidates
    scores: np.ndarray  # [N, C] float64 similarity scores (padding 0)
    selected: np.ndarray  # [N, K] int64 positions into the candidate row (padding 0)
    selected_valid: np.ndarray  # [N, K] bool
    temperature: np.ndarray  # [N] float64, the logged T
    logprob: np.ndarray  # [N] float64, log π_serving(selected | s)
    utility: np.ndarray  # [N] float64
    embedding: np.ndarray  # [N, D] float32 query embeddings
    loss: np.ndarray  # [N] float32 last_step_loss
    entropy: np.ndarray  # [N] float32 last_step_entropy

    def __len__(self) -> int:
        return int(self.utility.shape[0])

    @property
    def n_candidates(self) -> np.ndarray:
        """Number of logged candidates per decision."""
        counts: np.ndarray = self.valid.sum(axis=1)
        return counts

    @property
    def n_selected(self) -> np.ndarray:
        """Number of selected slots k per decision."""
        counts: np.ndarray = self.selected_valid.sum(axis=1)
        return counts

    def selected_slots(self) -> np.ndarray:
        """Selected slot ids [N, K] (padding where ``selected_valid`` is False)."""
        return np.take_along_axis(self.slots, self.selected, axis=1)

    @classmethod
    def from_lists(
        cls,
        candidates: Sequence[Sequence[int]],
        scores: Sequence[Sequence[float] | np.ndarray],
        selected: Sequence[Sequence[int]],
        temperature: Sequence[float],
        logprob: Sequence[float],
        utility: Sequence[float],
        embedding: np.ndarray | Sequence[Sequence[float]] | None = None,
        loss: Sequence[float] | None = None,
        entropy: Sequence[float] | None = None,
    ) -> LoggedDecisions:
        """Build from ragged per-decision lists; ``selected`` are slot ids, as in the events.

        Raises ``ValueError`` on inconsistent input (a selected slot that is not a candidate,
        repeated slots, T ≤ 0, non-finite logprob or utility).
        """
        n = len(candidates)
        if not all(len(x) == n for x in (scores, selected, temperature, logprob, utility)):
            raise ValueError("all per-decision inputs must have the same length")
        c = max((len(x) for x in candidates), default=0)
        k = max((len(x) for x in selected), default=0)
        slots = np.zeros((n, c), np.int64)
        valid = np.zeros((n, c), bool)
        score_arr = np.zeros((n, c), np.float64)
        sel = np.zeros((n, k), np.int64)
        sel_valid = np.zeros((n, k), bool)
        for i, (cand, sc, chosen) in enumerate(zip(candidates, scores, selected, strict=True)):
            if len(sc) != len(cand):
                raise ValueError(f"decision {i}: {len(sc)} scores for {len(cand)} candidates")
            pos = {int(s): j for j, s in enumerate(cand)}
            if len(pos) != len(cand) or len(set(chosen)) != len(chosen):
                raise ValueError(f"decision {i}: repeated slots")
            try:
                positions = [pos[int(s)] for s in chosen]
            except KeyError as exc:
                raise ValueError(f"decision {i}: selected slot {exc.args[0]} is not a candidate") from None
            slots[i, : len(cand)] = cand
            valid[i, : len(cand)] = True
            score_arr[i, : len(cand)] = sc
            sel[i, : len(positions)] = positions
            sel_valid[i, : len(positions)] = True
        temp = np.asarray(temperature, np.float64).reshape(n)
        lp = np.asarray(logprob, np.float64).reshape(n)
        u = np.asarray(utility, np.float64).reshape(n)
        if not (np.isfinite(temp).all() and (temp > 0).all()):
            raise ValueError("temperatures must be finite and > 0")
        if not (np.isfinite(lp).all() and np.isfinite(u).all() and np.isfinite(score_arr).all()):
            raise ValueError("logprob, utility and scores must be finite")
        emb = np.zeros((n, 0), np.float32) if embedding is None else np.asarray(embedding, np.float32).reshape(n, -1)
        return cls(
            slots=slots,
            valid=valid,
            scores=score_arr,
            selected=sel,
            selected_valid=sel_valid,
            temperature=temp,
            logprob=lp,
            utility=u,
            embedding=emb,
            loss=np.zeros(n, np.float32) if loss is None else np.asarray(loss, np.float32).reshape(n),
            entropy=np.zeros(n, np.float32) if entropy is None else np.asarray(entropy, np.float32).reshape(n),
        )

    @classmethod
    def from_experiences(cls, experiences: Sequence[Experience], include_fallback: bool = False) -> LoggedDecisions:
        """The ``feedback`` experiences of a joined log (fallback events left out by default)."""
        kept = [e for e in experiences if e.kind == "feedback" and (include_fallback or not e.event.fallback)]
        evs = [e.event for e in kept]
        emb = np.stack([ev.features.query_embedding for ev in evs]) if evs else None
        return cls.from_lists(
            candidates=[ev.candidates for ev in evs],
            scores=[np.asarray(ev.scores, np.float64) for ev in evs],
            selected=[ev.selected for ev in evs],
            temperature=[ev.temperature for ev in evs],
            logprob=[ev.logprob for ev in evs],
            utility=[e.utility for e in kept],
            embedding=emb,
            loss=[ev.features.last_step_loss for ev in evs],
            entropy=[ev.features.last_step_entropy for ev in evs],
        )


def from_experiences(experiences: Sequence[Experience], include_fallback: bool = False) -> LoggedDecisions:
    """Shorthand for :meth:`LoggedDecisions.from_experiences`."""
    return LoggedDecisions.from_experiences(experiences, include_fallback=include_fallback)


# --------------------------------------------------------------------------- target policies


@dataclass(frozen=True)
class Tempered:
    """A target policy served at a fixed temperature instead of each event's logged T.

    >>> Tempered("similarity", 0.3).temperature
    0.3
    """

    policy: PolicyNetwork | str
    temperature: float


TargetPolicy = PolicyNetwork | str | Tempered


def _resolve(policy: TargetPolicy, decisions: LoggedDecisions) -> tuple[PolicyNetwork | str, np.ndarray]:
    if isinstance(policy, Tempered):
        if isinstance(policy.policy, Tempered) or not (policy.temperature > 0 and np.isfinite(policy.temperature)):
            raise ValueError("Tempered needs a base policy and a finite temperature > 0")
        return policy.policy, np.full(len(decisions), float(policy.temperature))
    return policy, decisions.temperature


def candidate_masks(net: PolicyNetwork, decisions: LoggedDecisions, batch_size: int = 1024) -> np.ndarray:
    """The network's mask m over each decision's logged candidates, [N, C] float64 (no grad)."""
    n, c = decisions.slots.shape
    if decisions.embedding.shape[1] != net.arch.embedding_dim:
        raise ValueError(f"embedding dim {decisions.embedding.shape[1]} != network's {net.arch.embedding_dim}")
    out = np.zeros((n, c), np.float64)
    if n == 0 or c == 0:
        return out
    param = next(net.parameters())
    with torch.no_grad():
        for lo in range(0, n, batch_size):
            hi = min(n, lo + batch_size)

            def t(x: np.ndarray, dtype: torch.dtype = param.dtype) -> torch.Tensor:
                return torch.as_tensor(np.ascontiguousarray(x), dtype=dtype, device=param.device)

            h = net.features(t(decisions.embedding[lo:hi]), t(decisions.loss[lo:hi]), t(decisions.entropy[lo:hi]))
            m = net.candidate_masks(h, t(decisions.slots[lo:hi], torch.long))
            out[lo:hi] = m.to("cpu", torch.float64).numpy()
    return out


def keep_dynamic_rows(masks: np.ndarray, valid: np.ndarray, ratio: float = DYNAMIC_DROP_RATIO) -> np.ndarray:
    """Row-wise serving-rule hard drop over the valid candidates: keep m_i ≥ ratio·max m (none if non-finite).

    >>> keep_dynamic_rows(np.array([[1.0, 0.001, 0.5]]), np.array([[True, True, True]])).tolist()
    [[True, False, True]]
    """
    with np.errstate(invalid="ignore"):
        finite = np.where(valid, np.isfinite(masks), True).all(axis=1)
        top = np.where(valid, masks, -np.inf).max(axis=1, initial=-np.inf)
        keep: np.ndarray = valid & np.asarray(finite)[:, None] & (masks >= ratio * top[:, None])
        return keep


def target_logits(
    decisions: LoggedDecisions, policy: TargetPolicy, batch_size: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """The target's adjusted logits z [N, C] and its kept candidates [N, C] over the logged ones.

    >>> d = LoggedDecisions.from_lists([[1, 2]], [[0.6, 0.2]], [[1]], [0.5], [-0.5], [0.0])
    >>> z, kept = target_logits(d, "similarity")
    >>> z.round(6).tolist(), kept.tolist()
    ([[1.2, 0.4]], [[True, True]])
    """
    base, temp = _resolve(policy, decisions)
    if isinstance(base, PolicyNetwork):
        masks = candidate_masks(base, decisions, batch_size)
        kept = keep_dynamic_rows(masks, decisions.valid)
        alpha = float(base.alpha.detach().reshape(-1)[0])
        with np.errstate(invalid="ignore", over="ignore"):
            z = decisions.scores * (1.0 + alpha * masks) / temp[:, None]
        return np.where(kept, z, 0.0), kept
    if base == "similarity":
        return np.where(decisions.valid, decisions.scores / temp[:, None], 0.0), decisions.valid.copy()
    if base == "uniform":
        return np.zeros(decisions.valid.shape, np.float64), decisions.valid.copy()
    raise ValueError(f"unknown policy {base!r}: expected a PolicyNetwork, 'similarity' or 'uniform'")


def uniform_logprob(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """log of (n−k)!/n!: an ordered draw of k out of n, uniformly without replacement.

    >>> round(float(np.exp(uniform_logprob(np.array([3]), np.array([2]))[0])), 12)  # 1/(3·2)
    0.166666666667
    """
    n = np.asarray(n, np.int64)
    k = np.asarray(k, np.int64)
    j = np.arange(int(k.max(initial=0)))
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(j[None, :] < k[:, None], np.log(np.maximum(n[:, None] - j[None, :], 0)), 0.0)
    logprob: np.ndarray = -terms.sum(axis=1)
    return logprob


def _logprob_from_logits(
    decisions: LoggedDecisions, z: np.ndarray, kept: np.ndarray, uniform: bool, chunk: int = 8192
) -> np.ndarray:
    n = len(decisions)
    if uniform:
        out = uniform_logprob(kept.sum(axis=1), decisions.n_selected)
    else:
        out = np.zeros(n, np.float64)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            out[lo:hi] = plackett_luce_logprob_torch(
                torch.from_numpy(np.ascontiguousarray(z[lo:hi])),
                torch.from_numpy(np.ascontiguousarray(kept[lo:hi])),
                torch.from_numpy(np.ascontiguousarray(decisions.selected[lo:hi])),
                torch.from_numpy(np.ascontiguousarray(decisions.selected_valid[lo:hi])),
            ).numpy()
    sel_kept = np.take_along_axis(kept, decisions.selected, axis=1)
    dropped = (decisions.selected_valid & ~sel_kept).any(axis=1)
    out[dropped | ~np.isfinite(out)] = -np.inf
    return out


def target_logprobs(decisions: LoggedDecisions, policy: TargetPolicy, batch_size: int = 1024) -> np.ndarray:
    """log π_target(logged selection | s) by the serving rule over the logged candidates, [N].

    −inf where the target's own hard drop removes a selected slot (probability 0).

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[1.0, 0.0, 0.0]], [[1, 2]], [1.0], [-1.0], [0.0])
    >>> lp = target_logprobs(d, "similarity")  # (1 − log(e + 2)) + (0 − log 2)
    >>> bool(np.isclose(lp[0], 1 - np.log(np.e + 2) - np.log(2)))
    True
    >>> bool(np.isclose(target_logprobs(d, "uniform")[0], -np.log(6)))
    True
    """
    base, _ = _resolve(policy, decisions)
    z, kept = target_logits(decisions, policy, batch_size)
    return _logprob_from_logits(decisions, z, kept, uniform=isinstance(base, str) and base == "uniform")


def log_weights(decisions: LoggedDecisions, policy: TargetPolicy, batch_size: int = 1024) -> np.ndarray:
    """log w = log π_target(selected|s) − logged logprob, [N]."""
    log_w: np.ndarray = target_logprobs(decisions, policy, batch_size) - decisions.logprob
    return log_w


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
class _Parts:
    """statistic = Σ num / Σ den over a set of decisions (den = 1 for IPS and DR)."""

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
    rows = max(1, _CHUNK // n)
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


def _estimate(
    parts: Sequence[_Parts], signs: Sequence[float], method: str, n_boot: int, level: float, seed: int
) -> Estimate:
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


def _ips_parts(u: np.ndarray, logw: np.ndarray, clip: float | None) -> _Parts:
    w, share = clipped_weights(logw, clip)
    u = np.asarray(u, np.float64)
    return _Parts(w * u, np.ones_like(w), w, share)


def _snips_parts(u: np.ndarray, logw: np.ndarray, clip: float | None) -> _Parts:
    w, share = clipped_weights(logw, clip)
    u = np.asarray(u, np.float64)
    return _Parts(w * u, w, w, share)


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
    return _estimate([_ips_parts(u, logw, clip)], [1.0], "ips", n_boot, level, seed)


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
    return _estimate([_snips_parts(u, logw, clip)], [1.0], "snips", n_boot, level, seed)


@dataclass
class SlotRewardModel:
    """Direct reward model for DR: a shrunk mean utility per slot.

    Every (decision, selected slot) pair is one observation of the decision's utility (the
    utility is attributed equally to the selected slots). A slot's value is its mean
    utility shrunk toward a prior p with weight n_s/(n_s + λ), v_s = (Σ u + λ·p)/(n_s + λ);
    unseen slots get p. The prior is the global mean ū, or — ``prior_quantile`` set — a low
    quantile of the logged utilities (pessimism about what the log has not shown). A selection's predicted utility is
    the *mean* of its slots' values (ū for an empty selection).

    >>> d = LoggedDecisions.from_lists([[1, 2], [1, 3]], [[0.5, 0.5]] * 2, [[1], [3]], [1.0] * 2, [-0.7] * 2,
    ...                                [1.0, 3.0])
    >>> m = SlotRewardModel(shrinkage=2.0).fit(d)
    >>> m.global_mean, m.values(np.array([1, 3, 99])).tolist()  # (1 + 2·2)/3, (3 + 2·2)/3, ū
    (2.0, [1.6666666666666667, 2.3333333333333335, 2.0])
    """

    shrinkage: float = DEFAULT_SHRINKAGE
    prior_quantile: float | None = None  # None: shrink toward ū; else toward that quantile of u
    global_mean: float = 0.0
    prior: float = 0.0
    slot_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    slot_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))

    def fit(self, decisions: LoggedDecisions) -> SlotRewardModel:
        u = decisions.utility
        self.global_mean = float(u.mean()) if u.size else 0.0
        # A pessimistic prior (a low quantile) makes slots the log has rarely or never shown
        # look bad rather than average: what a safety gate should assume about them.
        q = self.prior_quantile
        self.prior = float(np.quantile(u, q)) if q is not None and u.size else self.global_mean
        mask = decisions.selected_valid
        slots = decisions.selected_slots()[mask]
        obs = np.broadcast_to(u[:, None], mask.shape)[mask]
        ids, inverse, counts = np.unique(slots, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse.reshape(-1), weights=obs, minlength=ids.size)
        self.slot_ids = ids.astype(np.int64)
        self.slot_values = (sums + self.shrinkage * self.prior) / (counts + self.shrinkage)
        return self

    def values(self, slots: np.ndarray) -> np.ndarray:
        """v_s for an array of slot ids (ū for slots never selected in the fit)."""
        slots = np.asarray(slots, np.int64)
        if self.slot_ids.size == 0:
            return np.full(slots.shape, self.prior)
        pos = np.clip(np.searchsorted(self.slot_ids, slots), 0, self.slot_ids.size - 1)
        return np.where(self.slot_ids[pos] == slots, self.slot_values[pos], self.prior)

    def predict(self, decisions: LoggedDecisions) -> np.ndarray:
        """r̂(logged selection): mean slot value over each decision's selected slots, [N]."""
        return self._mean_over(self.values(decisions.selected_slots()), decisions.selected_valid)

    def _mean_over(self, vals: np.ndarray, mask: np.ndarray) -> np.ndarray:
        k = mask.sum(axis=1)
        total = np.where(mask, vals, 0.0).sum(axis=1)
        return np.where(k > 0, total / np.maximum(k, 1), self.global_mean)

    def expected_under(
        self, decisions: LoggedDecisions, policy: TargetPolicy, samples: int = DEFAULT_SAMPLES, seed: int = 0
    ) -> np.ndarray:
        """r̂_π(s): E over π's Plackett–Luce draws of the mean slot value of its first k picks, [N]."""
        z, kept = target_logits(decisions, policy)
        return self.expected_from_logits(decisions, z, kept, samples=samples, seed=seed)

    def expected_from_logits(
        self, decisions: LoggedDecisions, z: np.ndarray, kept: np.ndarray, samples: int = DEFAULT_SAMPLES, seed: int = 0
    ) -> np.ndarray:
        """As :meth:`expected_under` for given logits z and kept candidates.

        k_i = min(logged k, kept candidates). Exact when k_i = 1 (softmax expectation) or
        when the target draws all its kept candidates; otherwise the average over
        ``samples`` seeded Gumbel-top-k draws (unbiased). ū when the target keeps nothing.

        >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.5, 0.5, 0.5]], [[1, 2]], [1.0], [-1.8], [1.0])
        >>> m = SlotRewardModel(slot_ids=np.array([1, 2, 3]), slot_values=np.array([0.0, 1.0, 2.0]))
        >>> r = m.expected_from_logits(d, np.zeros((1, 3)), np.ones((1, 3), bool), samples=4000, seed=0)
        >>> bool(abs(r[0] - 1.0) < 0.05)  # uniform over pairs: mean value 1
        True
        """
        n, c = kept.shape
        vals = self.values(decisions.slots)
        n_kept = kept.sum(axis=1)
        k = np.minimum(decisions.n_selected, n_kept)
        out = np.full(n, self.global_mean, np.float64)
        neg = np.where(kept, z, -np.inf)
        # k = 1: the softmax expectation.
        one = k == 1
        if one.any():
            zz = neg[one]
            p = np.exp(zz - zz.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[one] = (p * np.where(kept[one], vals[one], 0.0)).sum(axis=1)
        # Every kept candidate drawn: order does not matter.
        full = (k > 1) & (k == n_kept)
        out[full] = self._mean_over(vals[full], kept[full])
        rest = np.flatnonzero((k > 1) & (k < n_kept))
        if rest.size:
            rng = np.random.default_rng(seed)
            kmax = int(k[rest].max())
            rows = max(1, _CHUNK // max(1, samples * c))
            for lo in range(0, rest.size, rows):
                r = rest[lo : lo + rows]
                keys = neg[r][:, None, :] + rng.gumbel(size=(r.size, samples, c))
                top = np.argsort(-keys, axis=2, kind="stable")[:, :, :kmax]  # [R, S, kmax]
                picked = np.take_along_axis(np.broadcast_to(vals[r][:, None, :], keys.shape), top, axis=2)
                use = np.arange(kmax)[None, None, :] < k[r][:, None, None]
                out[r] = (np.where(use, picked, 0.0).sum(axis=2) / k[r][:, None]).mean(axis=1)
        return out


def _dr_parts(
    decisions: LoggedDecisions,
    logw: np.ndarray,
    reward_model: SlotRewardModel,
    target_reward: np.ndarray,
    clip: float | None,
) -> _Parts:
    w, share = clipped_weights(logw, clip)
    terms = target_reward + w * (decisions.utility - reward_model.predict(decisions))
    return _Parts(terms, np.ones_like(terms), w, share)


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

    ``reward_model`` defaults to a :class:`SlotRewardModel` fit on ``decisions``; r̂_π comes
    from :meth:`SlotRewardModel.expected_under` for ``policy`` (the policy ``logw`` is for).

    >>> d = LoggedDecisions.from_lists([[1, 2]], [[0.5, 0.5]], [[1, 2]], [1.0], [np.log(0.5)], [1.0])
    >>> m = SlotRewardModel(global_mean=0.0, slot_ids=np.array([1, 2]), slot_values=np.array([0.0, 1.0]))
    >>> round(doubly_robust(d, np.zeros(1), m, "uniform", n_boot=10).value, 6)  # 0.5 + 1·(1 − 0.5)
    1.0
    """
    model = reward_model if reward_model is not None else SlotRewardModel().fit(decisions)
    target_reward = model.expected_under(decisions, policy, samples=samples, seed=seed)
    parts = _dr_parts(decisions, logw, model, target_reward, clip)
    return _estimate([parts], [1.0], "dr", n_boot, level, seed)


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
) -> _Parts:
    base, _ = _resolve(policy, decisions)
    z, kept = target_logits(decisions, policy)
    logw = _logprob_from_logits(decisions, z, kept, uniform=isinstance(base, str) and base == "uniform")
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

    For ``method="dr"`` one reward model (default: a :class:`SlotRewardModel` fit on the log)
    serves every policy.

    >>> d = LoggedDecisions.from_lists([[1, 2]] * 2, [[0.9, 0.1]] * 2, [[1], [2]], [1.0] * 2,
    ...                                 [np.log(0.5)] * 2, [1.0, 0.0])
    >>> out = evaluate(d, {"u": "uniform", "s": Tempered("similarity", 0.01)}, n_boot=20)
    >>> round(out["u"].value, 6), round(out["s"].value, 6)
    (0.5, 1.0)
    """
    if method == "dr" and reward_model is None:
        reward_model = SlotRewardModel().fit(decisions)
    return {
        name: _estimate(
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

    >>> d = LoggedDecisions.from_lists([[1, 2]] * 2, [[0.9, 0.1]] * 2, [[1], [2]], [1.0] * 2,
    ...                                 [np.log(0.5)] * 2, [1.0, 0.0])
    >>> round(gain(d, Tempered("similarity", 0.01), "uniform", n_boot=20).value, 6)
    0.5
    """
    if method == "dr" and reward_model is None:
        reward_model = SlotRewardModel().fit(decisions)
    parts = [
        _policy_parts(decisions, policy, method, clip, reward_model, samples, seed) for policy in (candidate, baseline)
    ]
    return _estimate(parts, [1.0, -1.0], f"{method}-gain", n_boot, level, seed)
