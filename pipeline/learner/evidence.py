"""The promotion rule's evidence: what each decision says about each version.

For every logged decision the rule (:mod:`pipeline.learner.promotion`) needs the
probability, under each version it tests *as clients serve it* (the manifest's serving
parameters: the mixture of the serving and exploration temperatures, the hard drop), of the
set of memories the decision read, and the same under the policy that drew it. Sets, not
ordered slates: a prompt's utility does not depend on the order of its memories, and a set's
probability under Plackett–Luce is the sum over its k! orderings
(:func:`models.offpolicy.setlevel.set_probability`), far larger than any one ordering's.

The logging probability is that of the policy that drew the set (:func:`drawn_from`): the
mixture clients draw from (the manifest's temperatures; with contract 1.9, the serving policy
and the canary) where it is known exactly, else the draw's own (:func:`logging_probability`).

Similarity-only (:data:`pipeline.learner.promotion.SIMILARITY`) is plain top-k over the
logged candidates: what the client serves without the policy.

The terms are bounds (:meth:`pipeline.learner.promotion.Evidence.bounds`): every set a decision
could read is enumerated (:func:`every_set`), weights are clipped at :data:`CLIP`, and what a
version reads beyond the clip, or in sets no log shows, is valued at the utility's extremes. A
:class:`RewardTable`, the mean utility each query (by its embedding) was seen with after reading
each set, learnt from the decisions of earlier batches, never from the batch it predicts, is a
control variate: LM utilities are a function of the question and the set read, so where
questions recur it takes most of each utility's variance away, and whatever it predicts, the
bounds hold.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import TypeVar

import numpy as np

from models.offpolicy.logged import TOPK, LoggedDecisions, Served
from models.offpolicy.setlevel import set_probability, target_set_probability
from models.policy.baseline import MAX_QUERIES
from models.policy.baseline import query_key as baseline_query_key
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from pipeline.byid import keep_by_id
from pipeline.learner.promotion import SIMILARITY, Evidence
from topics.internal import Experience

T = TypeVar("T")
Version = tuple[PolicyNetwork, ServingParams]  # a version's network and how clients serve it


MAX_SETS = 32  # the sets the table holds per query (the most often read)
CLIP = 20.0  # importance weights are clipped here; the mass above goes to the bounds' extremes
PER_LOOK = 256  # decisions a look values at most: each costs milliseconds (every set is valued)
MAX_SETS_PER_DECISION = 2_048  # sets enumerated per decision (C choose k); beyond, no bound is made


def query_key(e: Experience) -> bytes:
    """A query's identity for the table (:func:`models.policy.baseline.query_key`, as the learner's baselines)."""
    return baseline_query_key(e.event.features.query_embedding)


class RewardTable:
    """A direct model of utility: by query, the mean utility of each set it was seen reading.

    Thread-safe: the learner adds on its event loop while a look reads in a worker thread.

    >>> t = RewardTable()
    >>> t.fold([(b"q", frozenset({1, 2}), 1.0), (b"q", frozenset({1, 2}), 3.0), (b"q", frozenset({3}), 0.0)])
    >>> t.sets(b"q")[frozenset({1, 2})], t.sets(b"other"), t.range(np.zeros(0))
    (2.0, {}, (0.0, 3.0))
    """

    def __init__(self, max_sets: int = MAX_SETS, max_queries: int = MAX_QUERIES) -> None:
        self.max_sets, self.max_queries = max_sets, max_queries
        self._sets: OrderedDict[bytes, dict[frozenset[int], list[float]]] = OrderedDict()
        self._range: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def add(self, experiences: Iterable[Experience]) -> None:
        """Take the utilities of joined feedback (fallback events read another retriever's sets)."""
        self.fold(
            (query_key(e), frozenset(int(s) for s in e.event.selected), float(e.utility))
            for e in experiences
            if e.kind == "feedback" and not e.event.fallback and e.event.selected
        )

    def fold(self, rows: Iterable[tuple[bytes, frozenset[int], float]]) -> None:
        with self._lock:
            for key, members, u in rows:
                sets = self._sets.pop(key, None) or {}
                self._sets[key] = sets  # the most recent last
                acc = sets.setdefault(members, [0.0, 0.0])
                acc[0] += u
                acc[1] += 1.0
                lo, hi = self._range or (u, u)
                self._range = (min(lo, u), max(hi, u))
                if len(sets) > 2 * self.max_sets:  # keep the most read
                    kept = sorted(sets.items(), key=lambda kv: -kv[1][1])[: self.max_sets]
                    self._sets[key] = dict(kept)
            while len(self._sets) > self.max_queries:
                self._sets.popitem(last=False)

    def range(self, fallback: np.ndarray) -> tuple[float, float]:
        """The lowest and highest utility seen (``fallback``'s before any): what a read the log
        cannot show may be worth."""
        with self._lock:
            if self._range is not None:
                return self._range
        return (float(np.min(fallback)), float(np.max(fallback))) if len(fallback) else (0.0, 0.0)

    def sets(self, key: bytes) -> dict[frozenset[int], float]:
        """The mean utility of each set ``key`` was seen reading (the most read :attr:`max_sets`)."""
        with self._lock:
            sets = self._sets.get(key) or {}
            top = sorted(sets.items(), key=lambda kv: -kv[1][1])[: self.max_sets]
            return {m: a[0] / a[1] for m, a in top}


def sample(items: list[T], at_most: int = PER_LOOK) -> list[T]:
    """At most ``at_most`` of ``items``, in their order: a uniform sample where there are more.
    Which are kept depends on their number alone, never on what they read or were worth, so the
    sample is evidence as the whole would be.

    >>> sample(list(range(5)), 10), len(sample(list(range(100)), 10))
    ([0, 1, 2, 3, 4], 10)
    """
    if len(items) <= at_most:
        return items
    keep = np.sort(np.random.default_rng(len(items)).choice(len(items), at_most, replace=False))
    return [items[i] for i in keep.tolist()]


def thin(experiences: Sequence[Experience], weights: Sequence[float] | np.ndarray) -> list[Experience]:
    """Each experience kept with probability its influence weight (contract 1.15's cap: 1 within
    ``influence_cap``, below 1 for a principal over it), decided by its id alone, so a replay
    keeps the same ones. The rule's evidence then holds no principal beyond the share the
    learner's updates give it: a principal flooding the traffic is thinned to its cap, in the
    gate's judgement as in training.

    >>> thin([], [])
    []
    """
    return [e for e, w in zip(experiences, weights, strict=True) if keep_by_id(e.id, float(w))]


def usable(experiences: Sequence[Experience], versions: Mapping[int, Version] | None = None) -> list[Experience]:
    """The experiences that can be evidence: joined feedback of a policy draw (not a fallback) whose
    first-draw probabilities are known, with a finite utility (the trainer skips the others too);
    and a client's own ranking served under an incumbent (contract 1.17) where its probability is
    the mixture of a version in ``versions`` (:func:`drawn_from`): no draw's own gives it."""
    drawn = [
        e
        for e in experiences
        if e.kind == "feedback"
        and math.isfinite(e.utility)
        and not e.event.fallback
        and e.event.canary_arm is None  # a coupled canary drew two slates: not one draw's probability
        and (e.event.candidate_probs is not None or e.event.incumbent)
        and e.event.selected
    ]
    mixed = drawn_from(drawn, versions or {})
    return [e for i, e in enumerate(drawn) if not e.event.incumbent or i in mixed]


def logging_probability(decisions: LoggedDecisions, rows: np.ndarray, members: np.ndarray) -> np.ndarray:
    """P(set ``members[j]`` | decision ``rows[j]``) under the draw that read decision ``rows[j]``'s
    set, from its logged first-draw probabilities (its ``candidate_probs``, or the learner's
    recomputation from the version that served it).

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.3, 0.2, 0.1]], [[1, 2]], [1.0], [-1.0], [0.0],
    ...                                first_probs=[[0.5, 0.3, 0.2]])
    >>> round(float(logging_probability(d, np.array([0]), d.selected)[0]), 6)  # 0.5·0.3/0.5 + 0.3·0.5/0.7
    0.514286
    """
    if decisions.first_probs is None:  # none drew: every one is valued as its incumbent's mixture
        return np.zeros(len(rows))
    first = np.where(decisions.valid, np.nan_to_num(decisions.first_probs), 0.0)
    return _set_probability(first[rows], members, decisions.n_selected[rows])


def _set_probability(first: np.ndarray, selected: np.ndarray, ks: np.ndarray) -> np.ndarray:
    out = np.zeros(len(ks))
    for k in np.unique(ks):
        rows = np.flatnonzero(ks == k)
        out[rows] = set_probability(first[rows], selected[rows, : int(k)])
    return out


def every_set(
    decisions: LoggedDecisions, limit: int = MAX_SETS_PER_DECISION
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows [P], members [P, K], enumerated [N]): every set of k of each decision's candidates
    (k its number of reads), for the decisions with at most ``limit`` such sets.

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.3, 0.2, 0.1]], [[1, 2]], [1.0], [-1.0], [0.0])
    >>> rows, members, done = every_set(d)
    >>> members.tolist(), done.tolist()
    ([[0, 1], [0, 2], [1, 2]], [True])
    """
    k_max = decisions.selected.shape[1]
    counts, ks = decisions.valid.sum(axis=1), decisions.n_selected
    enumerated = np.array([k > 0 and math.comb(int(c), int(k)) <= limit for c, k in zip(counts, ks, strict=True)], bool)
    rows, members = [np.zeros(0, np.int64)], [np.zeros((0, k_max), np.int64)]
    for i in np.flatnonzero(enumerated).tolist():
        c, k = int(counts[i]), int(ks[i])
        combos = np.flatnonzero(decisions.valid[i])[_combinations(c, k)]  # [C(c, k), k] positions
        padded = np.full((len(combos), k_max), -1, np.int64)
        padded[:, :k] = combos
        rows.append(np.full(len(combos), i, np.int64))
        members.append(padded)
    return np.concatenate(rows), np.concatenate(members), enumerated


@lru_cache(maxsize=64)
def _combinations(n: int, k: int) -> np.ndarray:
    return np.array(list(itertools.combinations(range(n), k)), np.int64).reshape(-1, k)


def build(
    experiences: Sequence[Experience],
    versions: Mapping[int, Version],
    params: ServingParams,
    table: RewardTable | None = None,
    clip: float = CLIP,
) -> Evidence:
    """The evidence of ``experiences`` (already :func:`usable`) for each of ``versions``.

    ``versions`` maps each version the rule tests to its network and serving parameters;
    :data:`SIMILARITY` needs none (``params`` gives its k and nothing else). With a ``table``
    (its predictions taken before the batch is added to it, which the caller does afterwards)
    the terms are bounds (:meth:`pipeline.learner.promotion.Evidence.bounds`): every set each
    decision could read is enumerated, weights are clipped at ``clip`` and what a version reads
    beyond that (sets the log shows too rarely, or never) is valued at the utility's extremes.
    """
    if not experiences:
        empty = np.zeros(0)
        return Evidence(empty, empty, np.zeros(0, np.int64), {v: empty for v in (*versions, SIMILARITY)})
    decisions = LoggedDecisions.from_experiences(list(experiences))
    n = len(decisions)
    targets: dict[int, Served] = {SIMILARITY: Served(TOPK, params)}
    for v, (net, served) in versions.items():
        if v == SIMILARITY:
            continue
        if served.base is None:
            targets[v] = Served(net, served)
        elif served.base in versions:  # a probe over a certified version (1.23), valued with that version's network
            targets[v] = Served(net, served, versions[served.base][0])
        # else a probe replaced since whose base is no longer held: the rule values it no more, and its
        # late decisions keep their own draw's probability (drawn_from)
    rows, members = np.arange(n), decisions.selected
    probs = {v: target_set_probability(decisions, t, rows, members) for v, t in targets.items()}
    logged_by = np.array([e.event.policy_version for e in experiences], np.int64)
    # A mixture is valued where both its versions are (a probe replaced since, whose base is no longer held, is not).
    mixtures = {i: m for i, m in drawn_from(experiences, versions).items() if m[0] in targets and m[1] in targets}
    logging = _mixed(logging_probability(decisions, rows, members), probs, mixtures)
    mixed_with, mix_share = _mix_arrays(logged_by, mixtures)
    if table is None:
        return Evidence(decisions.utility, logging, logged_by, probs, mixed_with=mixed_with, mix_share=mix_share)
    pair_rows, pair_members, enumerated = every_set(decisions)
    fitted, pair_values = _table_terms(experiences, decisions, table, pair_rows, pair_members)
    fitted = np.where(enumerated, fitted, np.nan)  # no correction where no bound is made
    pair_probs = {
        v: target_set_probability(decisions, t, pair_rows, pair_members) if len(pair_rows) else np.zeros(0)
        for v, t in targets.items()
    }
    pair_logging = _mixed(logging_probability(decisions, pair_rows, pair_members), pair_probs, mixtures, pair_rows)
    worst, best = table.range(decisions.utility)
    direct, low, high = {}, {}, {}
    for v in targets:
        p = pair_probs[v]
        excess = np.maximum(p - clip * pair_logging, 0.0)  # the mass clipped weights leave out
        missing = np.where(enumerated, np.clip(1.0 - np.bincount(pair_rows, weights=p, minlength=n), 0.0, 1.0), 1.0)
        direct[v] = np.bincount(pair_rows, weights=p * pair_values, minlength=n)
        low[v] = np.bincount(pair_rows, weights=excess * (worst - pair_values), minlength=n) + missing * worst
        high[v] = np.bincount(pair_rows, weights=excess * (best - pair_values), minlength=n) + missing * best
    return Evidence(
        decisions.utility, logging, logged_by, probs, fitted, direct, low, high, clip, mixed_with, mix_share
    )


def _mix_arrays(logged_by: np.ndarray, mixtures: Mapping[int, Mixture]) -> tuple[np.ndarray, np.ndarray]:
    """Per decision, the other version of the canary mix it was drawn from (-1: none) and the
    canary's share (:attr:`pipeline.learner.promotion.Evidence.mixed_with`, ``mix_share``)."""
    mixed_with = np.full(len(logged_by), -1, np.int64)
    share = np.zeros(len(logged_by))
    for i, (serving, canary, rate) in mixtures.items():
        if rate > 0.0 and serving != canary:
            mixed_with[i] = canary if logged_by[i] == serving else serving
            share[i] = rate
    return mixed_with, share


def of_look(
    gathered: list[Experience],
    versions: Mapping[int, Version],
    params: ServingParams,
    table: RewardTable,
    complete: Callable[[list[Experience]], list[Experience]],
) -> Evidence:
    """One look's evidence, as the learner's gate and the lab's loop take it: a :func:`sample` of
    what was gathered since the last look, its logging probabilities completed (``complete``:
    :meth:`pipeline.learner.logging_policy.LoggingPolicies.complete`), the :func:`usable` ones
    :func:`build`-t on the table's predictions, and only then added to the table."""
    decisions = usable(complete(sample(gathered)), versions)
    ev = build(decisions, versions, params, table)
    table.add(decisions)  # after its own predictions: later looks may learn from them
    return ev


Mixture = tuple[int, int, float]  # (the serving version, the canary's, the canary's share)


def drawn_from(experiences: Sequence[Experience], versions: Mapping[int, Version]) -> dict[int, Mixture]:
    """The decisions whose draw is known as a mixture the rule can value exactly: drawn by a
    version the learner holds, as its manifest says to serve it (the draw at one of its
    temperatures) and dropping nothing (so every request, explored or not, drew from the same
    candidates); with contract 1.9's ``canary_rate`` and ``alternative_version``, from the
    client's mix of that version and the other, if held and dropping nothing too.

    There the logging probability of a set is the mixture's: each temperature's share times the
    set's probability at it, and ``(1 − ρ)·P_serving + ρ·P_canary`` over a canary's mix. The
    client tossed those coins before the draw, so the draw's own probability is a valid
    propensity too; but near-greedy draws make it vanish for every set but the greedy one, and
    the weights of the rare explored reads of those sets explode. The mixture's is the same
    propensity without the coins, under which the serving policy's reads and the canary's are
    both in the log (weights at most 1/(1 − ρ) and 1/ρ). Elsewhere (a client serving its own
    way, a drop that a client's own revival of dropped candidates may have undone), the draw's own.

    Under an incumbent (contract 1.17) the share not explored is the client's own ranking: its
    requests say so (``incumbent``), and only they and the explored draws are of that mixture.
    A client before 1.17 drew near-greedily instead, and keeps its draw's own probability.
    """
    out: dict[int, Mixture] = {}
    for i, e in enumerate(experiences):
        drew, rate, other = e.event.policy_version, e.event.canary_rate, e.event.alternative_version
        if drew not in versions or versions[drew][1].drop != "none":
            continue
        params, temperature = versions[drew][1], e.event.temperature
        if e.event.incumbent and not params.incumbent:
            continue
        explored = (
            np.isclose(params.explore_temperature, temperature, rtol=1e-6)
            and params.explore_rate > 0
            and not e.event.base
        )
        if params.incumbent and not (e.event.incumbent or explored):
            continue
        # Contract 1.23: under a probe over a certified version the share not explored is that
        # version's draw, and says so (``base``); the rule values it only where it holds that version.
        if bool(e.event.base) != (params.base is not None and not explored) or (
            params.base is not None and params.base not in versions
        ):
            continue
        if not e.event.incumbent and not any(np.isclose(t, temperature, rtol=1e-6) for _, t in params.components()):
            continue
        if rate is None or other is None:
            out[i] = (drew, drew, 0.0)
        elif other in versions and versions[other][1].drop == "none":
            out[i] = (other, drew, rate) if e.event.canary else (drew, other, rate)
    return out


def _mixed(
    own: np.ndarray,
    probs: Mapping[int, np.ndarray],
    mixtures: Mapping[int, Mixture],
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """``own`` with the entries of the decisions drawn from a mixture replaced by its probability
    (``probs[v]``: each version's, per entry; ``rows``: each entry's decision, else entry = decision)."""
    if not mixtures:
        return own
    of = np.arange(len(own)) if rows is None else rows
    kinds = sorted(set(mixtures.values()))
    code = np.full(max(len(own), int(of.max(initial=-1)) + 1, max(mixtures) + 1), -1, np.int64)
    for i, m in mixtures.items():
        code[i] = kinds.index(m)
    entry_code = code[of]
    out = own.copy()
    for c, (serving, canary, rate) in enumerate(kinds):
        entries = np.flatnonzero(entry_code == c)
        out[entries] = (1.0 - rate) * probs[serving][entries] + rate * probs[canary][entries]
    return out


def _table_terms(
    experiences: Sequence[Experience],
    decisions: LoggedDecisions,
    table: RewardTable,
    pair_rows: np.ndarray,
    pair_members: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The table's utility for the set each decision read, and for each (decision, set) pair: the
    mean its query was seen with after reading that set, else the mean of the query's sets of
    that size seen, else 0 (a control variate only: any value keeps the bounds valid)."""
    fitted = np.zeros(len(decisions))
    values = np.zeros(len(pair_rows))
    starts = np.searchsorted(pair_rows, np.arange(len(decisions) + 1))
    for i, e in enumerate(experiences):
        k = int(decisions.n_selected[i])
        known = {m: v for m, v in table.sets(query_key(e)).items() if len(m) == k}
        if not known:
            continue  # a query never seen: 0 everywhere
        baseline = float(np.mean(list(known.values())))
        fitted[i] = known.get(frozenset(int(s) for s in e.event.selected), baseline)
        lo, hi = int(starts[i]), int(starts[i + 1])
        if hi == lo:
            continue
        values[lo:hi] = baseline
        # The pairs of decision i are every_set's combinations of its valid positions, in
        # lexicographic order: a known set's pair is found by its rank, not by a search.
        positions = np.flatnonzero(decisions.valid[i]).tolist()
        index = {int(e.event.candidates[p]): j for j, p in enumerate(positions)}
        for members, v in known.items():
            idx = sorted(index[m] for m in members if m in index)
            if len(idx) == k:
                values[lo + combination_rank(idx, len(positions))] = v
    return fitted, values


def combination_rank(idx: Sequence[int], n: int) -> int:
    """The rank of the sorted combination ``idx`` of ``range(n)`` among
    ``itertools.combinations(range(n), len(idx))`` (lexicographic order).

    >>> combos = list(itertools.combinations(range(5), 3))
    >>> all(combination_rank(c, 5) == r for r, c in enumerate(combos))
    True
    """
    k, rank, prev = len(idx), 0, -1
    for j, a in enumerate(idx):
        for x in range(prev + 1, a):
            rank += math.comb(n - 1 - x, k - 1 - j)
        prev = a
    return rank
