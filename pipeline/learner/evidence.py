"""The promotion rule's evidence: what each held-out decision says about each version.

For every held-out logged decision the rule (:mod:`pipeline.learner.promotion`) needs the
probability, under each version it tests *as clients serve it* (the manifest's serving
parameters: the mixture of the serving and exploration temperatures, the hard drop), of the
set of memories the decision read, and the same under the policy that drew it. Sets, not
ordered slates: a prompt's utility does not depend on the order of its memories, and a set's
probability under Plackett–Luce is the sum over its k! orderings
(:func:`models.offpolicy.setlevel.set_probability`), far larger than any one ordering's.

The logging probability is the one of the draw that happened: each event's first-draw
probabilities (its ``candidate_probs``, or the learner's recomputation from the version that
served it, :class:`pipeline.learner.logging_policy.LoggingPolicies`) at the temperature it
logged. That the request explored or not is a coin the client tossed before the draw and the
logged temperature reveals, so the draw's own probability is the exact propensity given it.

Similarity-only (:data:`pipeline.learner.promotion.SIMILARITY`) is plain top-k over the
logged candidates: what the client serves without the policy.

The gain terms are doubly robust (:meth:`pipeline.learner.promotion.Evidence.gains`), with a
:class:`RewardTable` as the direct model: the mean utility each query (by its embedding) was
seen with after reading each set, learnt from the decisions the learner trains on and from
held-out decisions of earlier batches, never from the batch it predicts. LM utilities are a
function of the question and the set read, so on traffic where questions recur the table
predicts most of each utility, and the importance-weighted residual that remains is small;
where nothing is known of a query, the table predicts the mean utility, and the terms are the
plain importance-weighted differences.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from models.offpolicy.logged import TOPK, LoggedDecisions, Served, component_logits
from models.offpolicy.setlevel import set_probability, target_set_probability
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from pipeline.learner.promotion import SIMILARITY, Evidence
from topics.internal import Experience

Version = tuple[PolicyNetwork, ServingParams]  # a version's network and how clients serve it


MAX_SETS = 32  # the sets the table holds per query (the most often read)
MAX_QUERIES = 50_000  # the queries it holds (the least recently seen go)


def query_key(e: Experience) -> bytes:
    """A query's identity for the table: a hash of its embedding (the same question, the same key)."""
    emb = np.ascontiguousarray(np.asarray(e.event.features.query_embedding, np.float32))
    return hashlib.blake2b(emb.tobytes(), digest_size=8).digest()


class RewardTable:
    """A direct model of utility: by query, the mean utility of each set it was seen reading.

    Thread-safe: the learner adds on its event loop while a look reads in a worker thread.

    >>> t = RewardTable()
    >>> t.fold([(b"q", frozenset({1, 2}), 1.0), (b"q", frozenset({1, 2}), 3.0), (b"q", frozenset({3}), 0.0)])
    >>> t.query_mean(b"q"), t.sets(b"q")[frozenset({1, 2})], t.query_mean(b"other")
    (1.3333333333333333, 2.0, 1.3333333333333333)
    """

    def __init__(self, max_sets: int = MAX_SETS, max_queries: int = MAX_QUERIES) -> None:
        self.max_sets, self.max_queries = max_sets, max_queries
        self._sets: OrderedDict[bytes, dict[frozenset[int], list[float]]] = OrderedDict()
        self._total = [0.0, 0.0]
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
                self._total[0] += u
                self._total[1] += 1.0
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

    def query_mean(self, key: bytes) -> float:
        """The mean utility of ``key``'s reads (every query's before it was seen; 0 before any)."""
        with self._lock:
            sets = self._sets.get(key)
            acc = [sum(a[0] for a in sets.values()), sum(a[1] for a in sets.values())] if sets else self._total
            return acc[0] / acc[1] if acc[1] else 0.0

    def sets(self, key: bytes) -> dict[frozenset[int], float]:
        """The mean utility of each set ``key`` was seen reading (the most read :attr:`max_sets`)."""
        with self._lock:
            sets = self._sets.get(key) or {}
            top = sorted(sets.items(), key=lambda kv: -kv[1][1])[: self.max_sets]
            return {m: a[0] / a[1] for m, a in top}


def usable(experiences: Sequence[Experience]) -> list[Experience]:
    """The experiences that can be evidence: joined feedback of a policy draw (not a fallback) whose
    first-draw probabilities are known."""
    return [
        e
        for e in experiences
        if e.kind == "feedback"
        and not e.event.fallback
        and e.event.canary_arm is None  # a coupled canary drew two slates: not one draw's probability
        and e.event.candidate_probs is not None
        and e.event.selected
    ]


def logging_probability(decisions: LoggedDecisions) -> np.ndarray:
    """P(S_i | x_i) of each logged set under the draw that read it, from its first-draw probabilities.

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.3, 0.2, 0.1]], [[1, 2]], [1.0], [-1.0], [0.0],
    ...                                first_probs=[[0.5, 0.3, 0.2]])
    >>> round(float(logging_probability(d)[0]), 6)  # 0.5·0.3/0.5 + 0.3·0.5/0.7
    0.514286
    """
    assert decisions.first_probs is not None
    out = np.zeros(len(decisions))
    ks = decisions.n_selected
    for k in np.unique(ks):
        rows = np.flatnonzero(ks == k)
        out[rows] = set_probability(np.nan_to_num(decisions.first_probs[rows]), decisions.selected[rows, : int(k)])
    return out


def build(
    experiences: Sequence[Experience],
    versions: Mapping[int, Version],
    params: ServingParams,
    table: RewardTable | None = None,
) -> Evidence:
    """The evidence of ``experiences`` (already :func:`usable`) for each of ``versions``.

    ``versions`` maps each version the rule tests to its network and serving parameters;
    :data:`SIMILARITY` needs none (``params`` gives its k and nothing else). With a ``table``
    the gain terms are doubly robust (its predictions are taken before the batch is added to it,
    which the caller does afterwards).
    """
    if not experiences:
        empty = np.zeros(0)
        return Evidence(empty, empty, np.zeros(0, np.int64), {v: empty for v in (*versions, SIMILARITY)})
    decisions = LoggedDecisions.from_experiences(list(experiences))
    n = len(decisions)
    targets: dict[int, Served] = {SIMILARITY: Served(TOPK, params)}
    targets.update({v: Served(net, p) for v, (net, p) in versions.items() if v != SIMILARITY})
    rows, members = np.arange(n), decisions.selected
    probs = {v: target_set_probability(decisions, t, rows, members) for v, t in targets.items()}
    logged_by = np.array([e.event.policy_version for e in experiences], np.int64)
    logging = logging_probability(decisions)
    if table is None:
        return Evidence(decisions.utility, logging, logged_by, probs)
    fitted, means, pair_rows, pair_members, pair_values = _table_terms(experiences, decisions, table)
    direct, unsupported = {}, {}
    for v, t in targets.items():
        p = target_set_probability(decisions, t, pair_rows, pair_members) if len(pair_rows) else np.zeros(0)
        direct[v] = means + np.bincount(pair_rows, weights=p * pair_values, minlength=n)
        unsupported[v] = reads_fewer(decisions, t)
    worst, best = table.range(decisions.utility)
    return Evidence(decisions.utility, logging, logged_by, probs, fitted, direct, unsupported, worst, best)


def reads_fewer(decisions: LoggedDecisions, target: Served) -> np.ndarray:
    """Where the target's hard drop keeps fewer of the logged candidates than the decision read:
    it would read a smaller set, which the log never shows (so its value there is unknown)."""
    _, _, kept, _ = component_logits(decisions, target)[0]
    out: np.ndarray = kept.sum(axis=1) < decisions.n_selected
    return out


def _table_terms(
    experiences: Sequence[Experience], decisions: LoggedDecisions, table: RewardTable
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per decision, the table's prediction for the set it read and its query's mean; and the
    (decision, set) pairs of the sets its query was seen reading (of its size k), with the table's
    value minus the query's mean (what a version's reads of other sets are valued at)."""
    fitted = np.zeros(len(decisions))
    means = np.zeros(len(decisions))
    pair_rows: list[int] = []
    pair_members: list[list[int]] = []
    pair_values: list[float] = []
    k_max = decisions.selected.shape[1]
    for i, e in enumerate(experiences):
        key = query_key(e)
        mean = means[i] = table.query_mean(key)
        k = int(decisions.n_selected[i])
        known = {m: v for m, v in table.sets(key).items() if len(m) == k}
        fitted[i] = known.get(frozenset(int(s) for s in e.event.selected), mean)
        pos = {int(s): j for j, s in enumerate(e.event.candidates)}
        for m, v in known.items():
            pair_rows.append(i)
            pair_members.append([pos.get(s, -1) for s in sorted(m)] + [-1] * (k_max - k))
            pair_values.append(v - mean)
    shape = (len(pair_rows), k_max)
    return (
        fitted,
        means,
        np.asarray(pair_rows, np.int64),
        np.asarray(pair_members, np.int64).reshape(shape),
        np.asarray(pair_values, np.float64),
    )
