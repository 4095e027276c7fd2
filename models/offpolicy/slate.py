"""Slate off-policy estimators for additive rewards: pseudo-inverse (PI) and slate DR.

A step's reward is the mean over the k selected memories, r(S) = (1/k)·Σ_{m∈S} φ(x, m):
additive in the slot indicators 1_S. For such rewards V(π) = E_x[θ_π(x)ᵀφ(x)]/k with θ_π
the target's *marginal inclusion probabilities* (P(m ∈ S)) and, for a logging policy μ
with second-moment matrix Γ_μ = E_μ[1_S 1_Sᵀ], the pseudo-inverse estimator of
Swaminathan et al. (2017, "Off-policy evaluation for slate recommendation") is unbiased:

    V̂_PI = (1/n)·Σ_i w_i·u_i,    w_i = θ_π(x_i)ᵀ Γ_μ(x_i)^† 1_{S_i}.

(When μ draws slots independently this is Σ_{m∈S} θ_m/μ_m − k + 1, the form usually
quoted.) Plackett–Luce top-k draws without replacement are not independent, so Γ_μ is
computed in full: exactly, by enumerating the C!/(C−k)! ordered prefixes, when that is
small (k = 3 of 20 candidates: 6,840), else by a seeded Monte Carlo of Gumbel-top-k draws.

The logging μ of each event is known from its ``candidate_probs`` (first-draw
probabilities, which fix the Plackett–Luce law) and its T. A client explores a share of
requests at another temperature, so the behaviour policy is a mixture over the window's
logged temperatures; Γ_μ is that mixture (the balance heuristic of multiple importance
sampling), with each temperature's share as observed in the window.

:func:`slate_terms` gives per-decision terms for

* ``"pi"``: w_i·u_i;
* ``"dr"``: the slate doubly robust estimate r̂_π(x_i) + w_i·(u_i − r̂(S_i)) with the
  additive reward model (:class:`~models.offpolicy.reward_model.AdditiveRewardModel`, cross-fitted
  on two halves of the log; its direct term θ_πᵀφ̂/k is exact, no sampling). Where a decision carries per-memory credit
  (``effects``: e_m = nll_without_slot[m] − nll_with, so k·e_m estimates φ_m), its
  correction is per slot instead: (1/k)·Σ_{m∈S} (θ_m/μ_m)·(k·e_m − φ̂_m).

:mod:`models.offpolicy.served` applies them to served targets on one log. :func:`achievable_range`
bounds any policy's value on the log: the mean over decisions of
the worst and best top-k of the reward model's slot values among the logged candidates.

>>> p = np.array([[0.5, 0.3, 0.2]])
>>> q, g = inclusion(p, 2)
>>> q.round(4).tolist()  # P(a in top 2) = 0.5 + 0.3·0.5/0.7 + 0.2·0.5/0.8 …
[[0.8393, 0.675, 0.4857]]
>>> bool(np.allclose(np.diagonal(g, axis1=1, axis2=2), q)), round(float(q.sum()), 12)
(True, 2.0)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import lru_cache

import numpy as np

from models.offpolicy.logged import LoggedDecisions, Served, component_logits
from models.offpolicy.reward_model import SlotRewardModel

EXACT_LIMIT = 4_000_000  # exact enumeration when (ordered prefixes)·C² stays below this
MC_SAMPLES = 4000
PINV_RCOND = 1e-10
BLOCK = 1 << 22


@lru_cache(maxsize=16)
def _prefixes(c: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    perms = np.array(list(itertools.permutations(range(c), k)), np.int64).reshape(-1, k)
    inc = np.zeros((perms.shape[0], c))
    np.put_along_axis(inc, perms, 1.0, axis=1)
    return perms, inc


def softmax_rows(z: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``z`` over the ``kept`` entries (zeros elsewhere, and in rows with none)."""
    zz = np.where(kept, z, -np.inf)
    top = zz.max(axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(kept, np.exp(zz - top), 0.0)
    tot = e.sum(axis=1, keepdims=True)
    out: np.ndarray = np.divide(e, tot, out=np.zeros_like(e), where=tot > 0)
    return out


def _closed_form(p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """q and Γ of Plackett–Luce top-k for k ≤ 3 in O(C²) per row.

    With P2[a, b] = p_a·p_b/(1 − p_a) (a then b first) and S2 = P2 + P2ᵀ, k = 2 gives
    Γ_ab = S2_ab. For k = 3, {a, b} ⊂ S when they are the first two, or one of them and
    some c are, and the other is third: Γ_ab = S2_ab + X_ab + X_ba with
    X_ab = Σ_{c∉{a,b}} S2_ac·p_b/(1 − p_a − p_c). Then q_a = Σ_{b≠a} Γ_ab/(k − 1).
    """
    c = p.shape[1]
    if k == 1:
        return p.copy(), np.einsum("nc,cd->ncd", p, np.eye(c))
    off = ~np.eye(c, dtype=bool)[None]
    # 1 − p_a and 1 − p_a − p_c lose their digits when p_a ≈ 1 (near-greedy rows): for the
    # row's top slot t they are computed as sums of the small probabilities instead.
    top = p.argmax(axis=1)
    is_top = np.arange(c)[None, :] == top[:, None]
    others = np.where(is_top, 0.0, p).sum(axis=1, keepdims=True)  # 1 − p_t
    one_minus = np.where(is_top, others, 1.0 - p)
    p2 = np.where(off, p[:, :, None] * p[:, None, :] / np.maximum(one_minus, 1e-300)[:, :, None], 0.0)
    s2 = p2 + p2.transpose(0, 2, 1)
    if k == 2:
        g = s2
    else:
        rest = 1.0 - p[:, :, None] - p[:, None, :]
        rest = np.where(is_top[:, :, None], others[:, :, None] - p[:, None, :], rest)
        rest = np.where(is_top[:, None, :], others[:, :, None] - p[:, :, None], rest)
        # The top two together: others − p_second cancels when they hold nearly all the mass
        # (a target served at T = 0.001): sum the rest directly.
        second = np.argsort(-p, axis=1, kind="stable")[:, 1]
        is_second = np.arange(c)[None, :] == second[:, None]
        others2 = np.where(is_top | is_second, 0.0, p).sum(axis=1)
        pair = (is_top[:, :, None] & is_second[:, None, :]) | (is_second[:, :, None] & is_top[:, None, :])
        rest = np.where(pair, others2[:, None, None], rest)
        m = np.where(off, np.minimum(s2 / np.maximum(rest, 1e-300), 1e150), 0.0)  # [N, a, c]
        x = p[:, None, :] * (m.sum(axis=2, keepdims=True) - m)  # X_ab = p_b·(Σ_c M_ac − M_ab)
        x = np.where(off, np.minimum(x, 1.0), 0.0)
        g = s2 + x + x.transpose(0, 2, 1)
    g = np.clip(g, 0.0, 1.0)
    q = g.sum(axis=2) / (k - 1)
    g[:, np.arange(c), np.arange(c)] = q
    return q, g


def inclusion(
    p: np.ndarray, k: int, *, second: bool = True, seed: int = 0, samples: int = MC_SAMPLES, exact: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Marginal inclusion q [N, C] and co-inclusion Γ [N, C, C] of Plackett–Luce top-k draws.

    ``p`` holds each row's first-draw probabilities (0 for slots that cannot be drawn).
    Rows with at most k drawable slots include all of them. k ≤ 3 has a closed form;
    larger k enumerate the ordered prefixes when they are few enough (:data:`EXACT_LIMIT`;
    ``exact=True`` forces this for any k, as a check), else a Monte Carlo of ``samples``
    seeded Gumbel-top-k draws. ``second=False`` skips Γ (returned as zeros [N, 0, 0]).

    >>> q, g = inclusion(np.array([[0.5, 0.5, 0.0]]), 2)  # both drawable slots, always
    >>> q.tolist(), g[0].tolist()
    ([[1.0, 1.0, 0.0]], [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    """
    p = np.asarray(p, np.float64)
    n, c = p.shape
    q = np.zeros((n, c))
    g = np.zeros((n, c, c) if second else (n, 0, 0))
    if n == 0 or c == 0 or k <= 0:
        return q, g
    drawable = p > 0
    few = drawable.sum(axis=1) <= k
    q[few] = drawable[few]
    if second:
        g[few] = drawable[few][:, :, None] & drawable[few][:, None, :]
    rest = np.flatnonzero(~few)
    if rest.size == 0:
        return q, g
    if k <= 3 and not exact:
        q[rest], gg = _closed_form(p[rest], k)
        if second:
            g[rest] = gg
        # Products of probabilities below ~1e-154 underflow (logits hundreds of nats apart: a
        # target served at T = 0.001): such rows are enumerated instead, which stays exact.
        bad = rest[(np.abs(q[rest].sum(axis=1) - k) > 1e-6) | (q[rest].max(axis=1) > 1.0 + 1e-9)]
        if bad.size:
            q[bad], gb = inclusion(p[bad], k, second=second, seed=seed, samples=samples, exact=True)
            if second:
                g[bad] = gb
        return q, g
    m = 1
    for j in range(k):
        m *= c - j
    if m * c * (c if second else 1) <= EXACT_LIMIT:
        perms, inc = _prefixes(c, k)
        pair = (inc[:, :, None] * inc[:, None, :]).reshape(m, c * c) if second else None
        # The probability left before draw j, summed over the slots not yet drawn (not as
        # 1 − the drawn ones, which loses every digit on near-greedy rows).
        left = []
        for j in range(k):
            drawn = np.zeros((m, c))
            if j:
                np.put_along_axis(drawn, perms[:, :j], 1.0, axis=1)
            left.append(1.0 - drawn)
        rows = max(1, BLOCK // (m * max(k, c)))
        for lo in range(0, rest.size, rows):
            r = rest[lo : lo + rows]
            pp = p[r][:, perms]  # [B, M, k]
            denom = np.stack([p[r] @ lj.T for lj in left], axis=2)  # [B, M, k]
            ratio = np.clip(np.divide(pp, denom, out=np.zeros_like(pp), where=denom > 0), 0.0, 1.0)
            prob = ratio.prod(axis=2)
            q[r] = prob @ inc
            if pair is not None:
                g[r] = (prob @ pair).reshape(-1, c, c)
        return q, g
    rng = np.random.default_rng(seed)
    logp = np.log(np.where(drawable, p, 1.0))
    rows = max(1, BLOCK // (samples * c))
    for lo in range(0, rest.size, rows):
        r = rest[lo : lo + rows]
        keys = np.where(drawable[r], logp[r], -np.inf)[:, None, :] + rng.gumbel(size=(r.size, samples, c))
        top = np.argsort(-keys, axis=2, kind="stable")[:, :, :k]
        ind = np.zeros(keys.shape)
        np.put_along_axis(ind, top, 1.0, axis=2)
        q[r] = ind.mean(axis=1)
        if second:
            g[r] = np.einsum("bsc,bsd->bcd", ind, ind) / samples
    return q, g


def target_inclusion(decisions: LoggedDecisions, target: Served, seed: int = 0) -> np.ndarray:
    """θ_π [N, C]: the served target's marginal inclusion over each decision's logged candidates.

    A mixture's marginals are the mixture of its components' marginals; k is each event's.
    """
    theta = np.zeros(decisions.valid.shape)
    ks = decisions.n_selected
    for weight, p in target_components(decisions, target):
        for k in np.unique(ks):
            rows = ks == k
            q, _ = inclusion(p[rows], int(k), second=False, seed=seed)
            theta[rows] += weight * q
    return theta


def target_components(decisions: LoggedDecisions, target: Served) -> Iterator[tuple[float, np.ndarray]]:
    """``(weight, first-draw probabilities [N, C])`` of each component of the served target's mixture."""
    for weight, z, kept, uniform in component_logits(decisions, target):
        yield weight, softmax_rows(np.zeros_like(z) if uniform else z, kept)


def logging_components(decisions: LoggedDecisions) -> tuple[np.ndarray, list[tuple[float, float, np.ndarray]]]:
    """The steps whose logging policy can be rebuilt (they log ``candidate_probs``), and that
    policy as a mixture over the logged temperatures: ``(T, share of the usable steps,
    first-draw probabilities [N, C] at T)``, from each step's first-draw probabilities
    raised back to logits (log p · T_logged, up to a constant per step).
    """
    n = len(decisions)
    if decisions.first_probs is None or n == 0:
        return np.zeros(n, bool), []
    fp = decisions.first_probs
    usable = np.isfinite(fp).all(axis=1) & (fp.sum(axis=1) > 0)
    temps, counts = np.unique(np.round(decisions.temperature[usable], 9), return_counts=True)
    shares = counts / max(1, counts.sum())
    drawable = usable[:, None] & (np.nan_to_num(fp) > 0)
    with np.errstate(divide="ignore"):
        base = np.where(drawable, np.log(np.where(drawable, fp, 1.0)) * decisions.temperature[:, None], 0.0)
    parts = [(float(t), float(share), softmax_rows(base / t, drawable)) for t, share in zip(temps, shares, strict=True)]
    return usable, parts


class MomentCache:
    """Per logged step and temperature, the inclusion moments of the logging policy.

    The behaviour side of a step never changes; only the window's temperature shares do.
    The promotion gate keeps one across judgements, so that a sliding window computes the
    moments of its new steps only. Keyed by the step's first-draw probabilities, T and k;
    the oldest entries go first beyond ``size``.
    """

    def __init__(self, size: int = 20_000) -> None:
        self.size = size
        self.rows: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self.hits = 0

    def moments(self, p: np.ndarray, k: int, keys: list[bytes], seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(q, Γ) of Plackett–Luce top-k on rows ``p``, computed for the rows not cached."""
        missing = [i for i, key in enumerate(keys) if key not in self.rows]
        self.hits += len(keys) - len(missing)
        if missing:
            qq, gg = inclusion(p[missing], k, seed=seed)
            for j, i in enumerate(missing):
                self.rows[keys[i]] = (qq[j], gg[j])
        q = np.stack([self.rows[key][0] for key in keys])
        g = np.stack([self.rows[key][1] for key in keys])
        while len(self.rows) > self.size:  # oldest first (dicts keep insertion order)
            del self.rows[next(iter(self.rows))]
        return q, g


def behaviour_moments(
    decisions: LoggedDecisions, seed: int = 0, cache: MomentCache | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(usable [N], q_μ [N, C], Γ_μ [N, C, C]) of the logging mixture over the window's temperatures.

    Each event's first-draw probabilities give its logits up to a constant, times its T:
    log p·T = score·(1 + α·m) + const, so the same policy at another temperature T' is
    softmax(log p·T/T'). Events without ``candidate_probs`` are not usable. ``cache``
    keeps each step's moments for later calls (:class:`MomentCache`).
    """
    n, c = decisions.valid.shape
    usable = np.zeros(n, bool)
    q = np.zeros((n, c))
    g = np.zeros((n, c, c))
    if decisions.first_probs is None or n == 0:
        return usable, q, g
    fp = decisions.first_probs
    usable, parts = logging_components(decisions)
    ks = decisions.n_selected
    for t, share, p in parts:
        for k in np.unique(ks[usable]):
            rows = usable & (ks == k)
            if cache is None:
                qq, gg = inclusion(p[rows], int(k), seed=seed)
            else:
                tag = f"{t!r}/{int(k)}/{c}/".encode()
                keys = [tag + fp[i].tobytes() + decisions.temperature[i].tobytes() for i in np.flatnonzero(rows)]
                qq, gg = cache.moments(p[rows], int(k), keys, seed)
            q[rows] += share * qq
            g[rows] += share * gg
    return usable, q, g


def pi_weights(theta: np.ndarray, gamma: np.ndarray, selected_mask: np.ndarray) -> np.ndarray:
    """w_i = θ_iᵀ Γ_i^† 1_{S_i}, [N].

    >>> gam = np.array([[[0.5, 0.0], [0.0, 0.5]]])  # k = 1, μ uniform over two slots
    >>> pi_weights(np.array([[1.0, 0.0]]), gam, np.array([[True, False]])).tolist()  # 1 / 0.5
    [2.0]
    """
    if theta.shape[0] == 0:
        return np.zeros(0)
    w: np.ndarray = np.einsum("nc,nc->n", theta, pinv_selected(gamma, selected_mask))
    return w


def pinv_selected(gamma: np.ndarray, selected_mask: np.ndarray) -> np.ndarray:
    """Γ_i^† 1_{S_i}, [N, C]: the behaviour's half of the PI weights, the same for every target
    (computed once per log; the pseudo-inverse is most of a judgement's cost).

    >>> pinv_selected(np.array([[[0.5, 0.0], [0.0, 0.5]]]), np.array([[True, False]])).tolist()
    [[2.0, 0.0]]
    """
    if gamma.shape[0] == 0:
        return np.zeros(selected_mask.shape)
    pinv = np.linalg.pinv(gamma, rcond=PINV_RCOND, hermitian=True)
    out: np.ndarray = np.einsum("ncd,nd->nc", pinv, selected_mask.astype(np.float64))
    return out


def selected_mask(decisions: LoggedDecisions) -> np.ndarray:
    """1_S over each decision's candidate positions, [N, C] bool."""
    mask = np.zeros(decisions.valid.shape, bool)
    rows = np.nonzero(decisions.selected_valid)[0]
    mask[rows, decisions.selected[decisions.selected_valid]] = True
    return mask


def slot_spread(decisions: LoggedDecisions, model: SlotRewardModel, prior_weight: float = 5.0) -> np.ndarray:
    """Per candidate [N, C]: the spread of its slot's value, from the residuals k·(u − r̂(S)) of the
    decisions that read it (shrunk toward the global spread; the global one for unseen slots).

    A slot worth much in some contexts and nothing in others has a wide spread: what a
    per-slot value misses.
    """
    k = np.maximum(decisions.n_selected, 1)
    res2 = (k * (decisions.utility - model.predict(decisions))) ** 2
    mask = decisions.selected_valid
    slots = decisions.selected_slots()[mask]
    obs = np.broadcast_to(res2[:, None], mask.shape)[mask]
    glob = float(res2.mean()) if res2.size else 0.0
    ids, inv, counts = np.unique(slots, return_inverse=True, return_counts=True)
    var = (np.bincount(inv.reshape(-1), weights=obs, minlength=ids.size) + prior_weight * glob) / (
        counts + prior_weight
    )
    out = np.full(decisions.slots.shape, np.sqrt(glob))
    if ids.size:
        pos = np.clip(np.searchsorted(ids, decisions.slots), 0, ids.size - 1)
        out = np.where(ids[pos] == decisions.slots, np.sqrt(var[pos]), out)
    return out


def achievable_range(
    decisions: LoggedDecisions, model: SlotRewardModel, spread: np.ndarray | None = None
) -> tuple[float, float]:
    """(worst, best): the mean over decisions of the worst / best top-k of the slot values
    among the logged candidates, each value taken ``spread`` [N, C] lower / higher.

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.1, 0.2, 0.3]], [[1, 2]], [1.0], [-1.0], [0.0])
    >>> m = SlotRewardModel(slot_ids=np.array([1, 2, 3]), slot_values=np.array([0.0, 1.0, 3.0]))
    >>> achievable_range(d, m)  # worst pair (0 + 1)/2, best pair (1 + 3)/2
    (0.5, 2.0)
    """
    if len(decisions) == 0:
        return float("nan"), float("nan")
    vals = model.values(decisions.slots)
    extra = np.zeros(vals.shape) if spread is None else spread
    k = np.minimum(decisions.n_selected, decisions.n_candidates)
    hi = np.sort(np.where(decisions.valid, vals + extra, -np.inf), axis=1)[:, ::-1]
    lo = np.sort(np.where(decisions.valid, vals - extra, np.inf), axis=1)
    take = np.arange(vals.shape[1])[None, :] < k[:, None]
    kk = np.maximum(k, 1)
    best = np.where(take, hi, 0.0).sum(axis=1) / kk
    worst = np.where(take, lo, 0.0).sum(axis=1) / kk
    return float(worst.mean()), float(best.mean())


def slate_terms(
    decisions: LoggedDecisions,
    theta: np.ndarray,
    q_mu: np.ndarray,
    gamma: np.ndarray,
    method: str,
    phi: np.ndarray | None = None,
    pred: np.ndarray | None = None,
    pinv_s: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-decision terms of ``"pi"`` or ``"dr"`` (see the module docstring) and the PI weights.

    ``dr`` needs the reward model's slot values ``phi`` [N, C] over each decision's
    candidates and its prediction ``pred`` [N] of the logged selection (cross-fitted:
    from a model that did not see the decision, see :class:`SlateLog`). ``pinv_s``: a
    precomputed :func:`pinv_selected` of ``gamma``.
    """
    mask = selected_mask(decisions)
    if pinv_s is None:
        pinv_s = pinv_selected(gamma, mask)
    w = np.einsum("nc,nc->n", theta, pinv_s) if theta.shape[0] else np.zeros(0)
    u = decisions.utility
    if method == "pi":
        return w * u, w
    if method != "dr" or phi is None or pred is None:
        raise ValueError(f"unknown slate method {method!r} (or 'dr' without a reward model)")
    k = np.maximum(decisions.n_selected, 1).astype(np.float64)
    phi = np.where(decisions.valid, phi, 0.0)
    direct = (theta * phi).sum(axis=1) / k
    terms = direct + w * (u - pred)
    if decisions.effects is not None:
        eff = decisions.effects
        has = np.isfinite(np.where(decisions.selected_valid, eff, 0.0)).all(axis=1) & (
            np.isfinite(eff) & decisions.selected_valid
        ).any(axis=1)
        sel_theta = np.take_along_axis(theta, decisions.selected, axis=1)
        sel_q = np.take_along_axis(q_mu, decisions.selected, axis=1)
        sel_phi = np.take_along_axis(phi, decisions.selected, axis=1)
        ratio = np.divide(sel_theta, sel_q, out=np.zeros_like(sel_q), where=sel_q > 0)
        corr = np.where(decisions.selected_valid, ratio * (k[:, None] * np.nan_to_num(eff) - sel_phi), 0.0)
        terms = np.where(has, direct + corr.sum(axis=1) / k, terms)
    return terms, w
