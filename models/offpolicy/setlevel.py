"""Set-level off-policy estimators: the reward depends on the *set* of memories read.

The slate estimators of :mod:`models.offpolicy.slate` are unbiased when a step's utility is additive
over the memories it read. Utilities measured by an LM are not: a prompt that holds the
gold fact is worth about the same whatever else it holds (docs/learning.md, "The
promotion gate"). What they do satisfy is that the order of a selection does not matter
(a set has one prompt and one utility), so the importance weight of a step can be the
ratio of the *set's* probabilities:

    w_i = P_π(S_i | x_i) / P_μ(S_i | x_i),

unbiased for any reward that is a function of (x, S). Under Plackett–Luce top-k drawn
without replacement, the probability of a set is the sum over its k! orderings of the
ordered probabilities — exact and cheap for the k of a retriever (k = 3: 6 orderings):

    P(S) = Σ_{o ∈ perm(S)} Π_j p_{o_j} / (R + Σ_{l ≥ j} p_{o_l}),

with p the first-draw probabilities and R the mass of the candidates outside S (summed
directly, not as 1 − Σ_S p, which loses every digit on near-greedy rows). The logging
policy μ is, as in :func:`models.offpolicy.slate.behaviour_moments`, the mixture of the window's
logged temperatures over each event's ``candidate_probs``; the target π is the served
mixture of :class:`~models.offpolicy.logged.Served`.

Estimators (per-decision terms, :func:`set_terms`):

* ``"set-ips"``: w_i·u_i; ``"set-snips"``: the same, self-normalised (Σ w·u / Σ w);
* ``"set-dr"``: r̂_π(x_i) + w_i·(u_i − r̂(x_i, S_i)), with the direct model r̂(x, S) the mean
  reward of the *other* logged steps of the same query (same query embedding and step
  features) that read the same set, shrunk toward the additive model's prediction
  φ̂(S)/k with weight :data:`PRIOR_WEIGHT`, and the additive prediction for sets never
  logged with that query. Since r̂ is the additive model plus a correction on the few
  logged sets, its value under π is exact without enumerating every set:

      r̂_π(x) = θ_π(x)ᵀφ̂(x)/k + Σ_{S logged with x} P_π(S | x)·(r̂(x, S) − φ̂(S)/k).

  Each step's own reward is left out of its direct model (leave-one-out), so that its
  residual is not shrunk by a model that saw it.

>>> p = np.array([[0.5, 0.3, 0.2]])
>>> round(float(set_probability(p, np.array([[0, 1]]))[0]), 6)  # 0.5·0.3/0.5 + 0.3·0.5/0.7
0.514286
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from models.offpolicy.logged import LoggedDecisions, Served
from models.offpolicy.slate import logging_components, target_components

MAX_SET_K = 6  # k! orderings per set: 720 at k = 6; larger k are not supported (ValueError)
PRIOR_WEIGHT = 0.5  # pseudo-count of the additive prediction in a logged set's mean reward
MAX_SETS_PER_QUERY = 64  # the direct model's logged sets per query (most frequent first)
SET_METHODS = ("set-ips", "set-snips", "set-dr")


@lru_cache(maxsize=8)
def _orderings(k: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(k))), np.int64).reshape(-1, k)


def set_probability(p: np.ndarray, members: np.ndarray) -> np.ndarray:
    """P(the top-k draw is the set ``members``) under Plackett–Luce without replacement, [N].

    Parameters
    ----------
    p
        First-draw probabilities [N, C] (0 for candidates that cannot be drawn).
    members
        The set's positions into each row [N, k]; a row holding −1 (a slot that is not
        among the row's candidates) has probability 0.

    Raises ``ValueError`` when k exceeds :data:`MAX_SET_K`.

    >>> p = np.array([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    >>> pr = set_probability(p, np.array([[0, 1], [1, 2]]))
    >>> [round(float(x), 6) for x in pr]  # {a, b}: 0.5·0.3/0.5 + 0.3·0.5/0.7; {b, c}: 0.3·0.2/0.7 + 0.2·0.3/0.8
    [0.514286, 0.160714]
    >>> set_probability(np.array([[0.999999, 1e-6, 0.0]]), np.array([[0, 1]])).round(12).tolist()
    [1.0]
    """
    p = np.asarray(p, np.float64)
    members = np.asarray(members, np.int64)
    n, k = members.shape
    if k > MAX_SET_K:
        raise ValueError(f"set-level estimators support k ≤ {MAX_SET_K}, not {k}")
    if n == 0:
        return np.zeros(0)
    present = members >= 0
    pos = np.where(present, members, 0)
    ps = np.where(present, np.take_along_axis(p, pos, axis=1), 0.0)  # [N, k]
    inside = np.zeros(p.shape, bool)
    np.put_along_axis(inside, pos, present, axis=1)
    outside = np.where(inside, 0.0, p).sum(axis=1)  # R, summed from the small terms
    cols = [np.ascontiguousarray(ps[:, j]) for j in range(k)]
    total = np.zeros(n)
    for order in _orderings(k).tolist():
        # The draw in this order: Π_j p_{o_j} / (R + Σ_{l ≥ j} p_{o_l}), the tails summed from
        # the last (the smallest terms first, as near-greedy draws need).
        tail, product = outside.copy(), np.ones(n)
        for j in reversed(order):
            tail += cols[j]
            product *= np.clip(np.divide(cols[j], tail, out=np.zeros(n), where=tail > 0), 0.0, 1.0)
        total += product
    out: np.ndarray = np.where(present.all(axis=1), np.minimum(total, 1.0), 0.0)
    return out


def target_set_probability(
    decisions: LoggedDecisions, target: Served, rows: np.ndarray, members: np.ndarray
) -> np.ndarray:
    """P_π(set | decision) of a served target for (decision ``rows[j]``, set ``members[j]``) pairs.

    The target is restricted to each decision's logged candidates, as every estimator here
    (docs/learning.md); its mixture components are summed with their weights. ``members``
    [P, K] holds positions, of which the first k (the decision's number of selections) count.

    >>> from models.serving.params import ServingParams
    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.3, 0.2, 0.1]], [[1, 2]], [1.0], [-1.0], [0.0])
    >>> pr = target_set_probability(d, Served("uniform", ServingParams()), np.array([0]), np.array([[0, 2]]))
    >>> round(float(pr[0]), 6)  # one of the three sets of two
    0.333333
    """
    out = np.zeros(len(rows))
    if len(rows) == 0:
        return out
    ks = decisions.n_selected[rows]
    for weight, p in target_components(decisions, target):
        for k in np.unique(ks):
            sel = np.flatnonzero(ks == k)
            out[sel] += weight * set_probability(p[rows[sel]], members[sel, : int(k)])
    return out


def logging_set_probability(decisions: LoggedDecisions) -> tuple[np.ndarray, np.ndarray]:
    """(usable [N], P_μ(S_i) [N]): each logged set's probability under the logging mixture.

    As :func:`models.offpolicy.slate.behaviour_moments`: each event's ``candidate_probs`` at its T
    give its logits up to a constant; the behaviour policy is the mixture over the window's
    logged temperatures with their observed shares. Events without ``candidate_probs``
    are not usable.

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.3, 0.2, 0.1]], [[1, 2]], [1.0], [-1.0], [0.0],
    ...                                first_probs=[[0.5, 0.3, 0.2]])
    >>> usable, pm = logging_set_probability(d)
    >>> usable.tolist(), round(float(pm[0]), 6)
    ([True], 0.514286)
    """
    usable, parts = logging_components(decisions)
    prob = np.zeros(len(decisions))
    ks = decisions.n_selected
    for _, share, p in parts:
        for k in np.unique(ks[usable]):
            rows = np.flatnonzero(usable & (ks == k))
            prob[rows] += share * set_probability(p[rows], decisions.selected[rows, : int(k)])
    return usable, prob


@dataclass(frozen=True)
class SetTable:
    """The direct model's logged sets: per decision, the sets logged with the same query.

    ``pair_row`` / ``pair_members`` list (decision, set) pairs: each decision with every
    distinct set logged with its query (at most :data:`MAX_SETS_PER_QUERY`), as positions
    into the decision's candidates (−1 where a slot is not among them). ``pair_sum`` and
    ``pair_count`` are that set's reward sum and count *without the decision itself*;
    ``own`` indexes, per decision, its own set's pair. ``mu`` is P_μ(S_i).
    """

    pair_row: np.ndarray  # [P] int64
    pair_members: np.ndarray  # [P, k] int64 positions (−1: not a candidate of that row)
    pair_sum: np.ndarray  # [P] leave-one-out reward sums
    pair_count: np.ndarray  # [P] leave-one-out counts
    pair_additive: np.ndarray  # [P] φ̂(S)/k on that row's candidates
    own: np.ndarray  # [N] index of each decision's own pair
    mu: np.ndarray  # [N] P_μ(S_i)

    @classmethod
    def build(cls, decisions: LoggedDecisions, phi: np.ndarray, mu: np.ndarray) -> SetTable:
        """From usable decisions (all with ``candidate_probs``), the cross-fitted additive slot
        values ``phi`` [N, C] and the logging set probabilities ``mu`` [N]."""
        n = len(decisions)
        ks = decisions.n_selected
        if n and int(ks.max()) > MAX_SET_K:
            raise ValueError(f"set-level estimators support k ≤ {MAX_SET_K}, not {int(ks.max())}")
        pad = np.iinfo(np.int64).max  # sorts last: a set's real slots come first
        sets = np.sort(np.where(decisions.selected_valid, decisions.selected_slots(), pad), axis=1)
        # A query: its embedding and step features. Without embeddings every decision is its own.
        if decisions.embedding.shape[1]:
            feats = np.concatenate(
                [decisions.embedding, decisions.loss[:, None], decisions.entropy[:, None]], axis=1
            ).astype(np.float32)
            _, query = np.unique(feats, axis=0, return_inverse=True)
            query = query.reshape(-1)
        else:
            query = np.arange(n)
        groups: dict[tuple[int, bytes], int] = {}
        gid = np.zeros(n, np.int64)
        for i in range(n):
            gid[i] = groups.setdefault((int(query[i]), sets[i].tobytes()), len(groups))
        g_sum = np.bincount(gid, weights=decisions.utility, minlength=len(groups))
        g_count = np.bincount(gid, minlength=len(groups)).astype(np.float64)
        g_query = np.zeros(len(groups), np.int64)
        g_query[gid] = query
        g_first = np.full(len(groups), -1, np.int64)
        g_first[gid[::-1]] = np.arange(n)[::-1]  # a decision that logged the set (its slots)
        per_query: dict[int, list[int]] = {}
        for g in np.argsort(-g_count, kind="stable"):
            lst = per_query.setdefault(int(g_query[g]), [])
            if len(lst) < MAX_SETS_PER_QUERY:
                lst.append(int(g))
        rows_l, groups_l = [], []
        for i in range(n):
            gs = per_query[int(query[i])]
            if int(gid[i]) not in gs:
                gs = [*gs, int(gid[i])]
            rows_l.extend([i] * len(gs))
            groups_l.extend(gs)
        pair_row = np.asarray(rows_l, np.int64)
        pair_group = np.asarray(groups_l, np.int64)
        set_slots = sets[g_first[pair_group]]  # [P, K] sorted slot ids, padding last
        row_slots = np.where(decisions.valid, decisions.slots, -1)[pair_row]  # [P, C]
        match = (set_slots[:, :, None] == row_slots[:, None, :]) & (set_slots[:, :, None] != pad)
        members = np.where(match.any(axis=2), match.argmax(axis=2), -1)
        # Only sets of the row's own size k are comparable (columns past k are padding).
        same_k = (set_slots != pad).sum(axis=1) == ks[pair_row]
        members = np.where(same_k[:, None], members, -1)
        own_pair = pair_group == gid[pair_row]
        pair_sum = g_sum[pair_group] - np.where(own_pair, decisions.utility[pair_row], 0.0)
        pair_count = g_count[pair_group] - own_pair
        kk = np.maximum(ks[pair_row], 1)
        vals = np.take_along_axis(phi[pair_row], np.maximum(members, 0), axis=1)
        first_k = np.arange(members.shape[1])[None, :] < ks[pair_row][:, None]
        pair_additive = np.where((members >= 0) & first_k, vals, 0.0).sum(axis=1) / kk
        own = np.zeros(n, np.int64)
        own[pair_row[own_pair]] = np.flatnonzero(own_pair)
        return cls(pair_row, members, pair_sum, pair_count, pair_additive, own, mu)

    def direct(self) -> np.ndarray:
        """r̂(x, S) per pair: the leave-one-out mean reward, shrunk toward φ̂(S)/k."""
        out: np.ndarray = (self.pair_sum + PRIOR_WEIGHT * self.pair_additive) / (self.pair_count + PRIOR_WEIGHT)
        return out


def set_terms(
    decisions: LoggedDecisions,
    table: SetTable,
    target: Served,
    method: str,
    theta: np.ndarray | None = None,
    phi: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-decision terms of ``set-ips``, ``set-snips`` (numerators) or ``set-dr``, and the weights.

    ``set-dr`` needs the target's inclusion probabilities ``theta`` [N, C]
    (:func:`models.offpolicy.slate.target_inclusion`) and the additive slot values ``phi`` [N, C]
    the table was built with.

    >>> from models.serving.params import ServingParams
    >>> d = LoggedDecisions.from_lists([[1, 2]] * 2, [[0.2, 0.1]] * 2, [[1], [2]], [1.0] * 2, [np.log(0.5)] * 2,
    ...                                [1.0, 3.0], first_probs=[[0.5, 0.5]] * 2)
    >>> usable, mu = logging_set_probability(d)
    >>> t = SetTable.build(d, np.zeros((2, 2)), mu)
    >>> terms, w = set_terms(d, t, Served("uniform", ServingParams()), "set-ips")
    >>> terms.tolist(), w.tolist()  # uniform target = uniform logging
    ([1.0, 3.0], [1.0, 1.0])
    """
    own_members = table.pair_members[table.own]
    rows = np.arange(len(decisions))
    p_target = target_set_probability(decisions, target, rows, own_members)
    w = np.divide(p_target, table.mu, out=np.zeros_like(p_target), where=table.mu > 0)
    u = decisions.utility
    if method in ("set-ips", "set-snips"):
        return w * u, w
    if method != "set-dr" or theta is None or phi is None:
        raise ValueError(f"unknown set-level method {method!r} (or 'set-dr' without theta and phi)")
    k = np.maximum(decisions.n_selected, 1).astype(np.float64)
    additive = (theta * np.where(decisions.valid, phi, 0.0)).sum(axis=1) / k
    r_hat = table.direct()
    p_pairs = target_set_probability(decisions, target, table.pair_row, table.pair_members)
    corr = np.bincount(table.pair_row, weights=p_pairs * (r_hat - table.pair_additive), minlength=len(decisions))
    terms = additive + corr + w * (u - r_hat[table.own])
    return terms, w
