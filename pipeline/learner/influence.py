"""How much one principal may weigh in the learner's updates (docs/learning.md, "Influence per principal").

The rule, in one function (:func:`influence_weights`): over the learner's recent window of
experiences, no principal carries more than a share ``cap`` of the total weight. Principals
whose share of the window is within the bound keep weight 1; each one above it gets the same
weight ``w_p < 1`` on every one of its experiences, the smallest change that brings it to
exactly ``cap`` of the weighted total (water-filling: capping one principal shrinks the
total, so another may then need capping too). When the principals are too few for ``cap``
(``n`` principals with ``n · cap < 1``), the bound is ``1/n`` instead: with one principal,
or only anonymous traffic, every weight is 1 and the learner learns exactly as without it.

The same bound holds on each memory (:func:`per_memory_weights`): among the window's reads of
a memory, no principal carries more than ``cap`` of the weight, and an experience weighs the
least of its principal's weights over the memories it read (and the window's). A principal
sending a minority of the traffic, all of it about a few memories, is a majority on those
memories; bounded only over the whole window, it would steer what everyone is served there.

A quarantined principal's experiences weigh 0 (``causalmem quarantine``); they are not
counted in the window either, so quarantining one principal does not lower anyone else's
bound.

>>> w = influence_weights(["liar", "a"], {"liar": 50, "a": 10, "b": 10, "c": 10, "d": 10, "e": 10}, cap=0.2)
>>> [round(float(x), 3) for x in w]
[0.25, 1.0]
>>> influence_weights(["anonymous"] * 3, {"anonymous": 900}, cap=0.2).tolist()
[1.0, 1.0, 1.0]
>>> influence_weights(["a", "b"], {"a": 30, "b": 10}, cap=0.2).tolist()  # two principals: the bound is 1/2
[0.3333333333333333, 1.0]
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np


def capped_weights(counts: Mapping[str, int], cap: float) -> dict[str, float]:
    """Each principal's weight per experience, from its count of the window's experiences.

    The weighted share of principal ``p``, ``w_p c_p / Σ_q w_q c_q``, is then at most
    ``max(cap, 1/n)`` for the ``n`` principals with a positive count, and every principal
    within that bound keeps ``w_p = 1``.

    >>> capped_weights({"x": 80, "y": 10, "z": 10}, cap=0.5)
    {'x': 0.25, 'y': 1.0, 'z': 1.0}
    >>> capped_weights({"x": 5}, cap=0.2)
    {'x': 1.0}
    """
    if not 0.0 < cap <= 1.0:
        raise ValueError(f"influence cap {cap} must be in (0, 1]")
    live = {p: c for p, c in counts.items() if c > 0}
    total = sum(live.values())
    weights = dict.fromkeys(counts, 1.0)
    if len(live) <= 1:
        return weights
    bound = max(cap, 1.0 / len(live))
    shares = {p: c / total for p, c in live.items()}
    capped: set[str] = set()
    weighted_total = 1.0
    while True:
        free = sum(s for p, s in shares.items() if p not in capped)
        weighted_total = free / (1.0 - len(capped) * bound)
        over = {p for p, s in shares.items() if p not in capped and s > bound * weighted_total * (1 + 1e-12)}
        if not over:
            break
        capped |= over
    for p in capped:
        weights[p] = bound * weighted_total / shares[p]
    return weights


def influence_weights(
    principals: Sequence[str],
    window_counts: Mapping[str, int],
    cap: float,
    quarantined: Iterable[str] = (),
) -> np.ndarray:
    """The sample weight of each experience of a micro-batch, by its principal.

    Parameters
    ----------
    principals
        The principal of each experience of the micro-batch, in order.
    window_counts
        Each principal's experiences in the learner's recent window (the micro-batch's
        included): what its share is measured on.
    cap
        The most any one principal's share of the total weight may be (``influence_cap``);
        ``1/n`` instead when the window holds only ``n < 1/cap`` principals.
    quarantined
        Principals whose experiences weigh 0.

    >>> influence_weights(["q", "a"], {"q": 5, "a": 5}, 0.2, quarantined=["q"]).tolist()
    [0.0, 1.0]
    """
    blocked = set(quarantined)
    weights = capped_weights({p: c for p, c in window_counts.items() if p not in blocked}, cap)
    return np.array([0.0 if p in blocked else weights.get(p, 1.0) for p in principals], dtype=np.float64)


def per_memory_weights(
    weights: np.ndarray,
    principals: Sequence[str],
    reads: Sequence[Sequence[int]],
    memory_counts: Mapping[int, Mapping[str, int]],
    cap: float,
    quarantined: Iterable[str] = (),
) -> np.ndarray:
    """``weights`` lowered, experience by experience, to its principal's capped weight on each
    memory it read (:func:`capped_weights` over ``memory_counts[m]``, each principal's reads of
    memory ``m`` in the window, the ``quarantined`` principals' left out); a weight of 0 stays 0.

    >>> counts = {3: {"liar": 10, "a": 2, "b": 2, "c": 2, "d": 2, "e": 2}, 7: {"a": 5, "b": 5}}
    >>> w = per_memory_weights(np.ones(3), ["liar", "a", "a"], [[3], [3], [7]], counts, cap=0.2)
    >>> [round(float(x), 3) for x in w]  # the liar is half of memory 3's reads: held to a fifth
    [0.25, 1.0, 1.0]
    """
    out = np.array(weights, dtype=np.float64)
    blocked = set(quarantined)
    on: dict[int, dict[str, float] | None] = {}  # None: no principal over the bound on that memory
    for i, (p, read) in enumerate(zip(principals, reads, strict=True)):
        if out[i] == 0.0:
            continue
        for m in read:
            if m not in on:
                counts = memory_counts.get(m, {})
                if blocked:  # reads counted before their principal was quarantined or held
                    counts = {q: c for q, c in counts.items() if q not in blocked}
                total = sum(counts.values())
                # capped_weights changes nothing while every share is within the bound: most memories
                over = len(counts) > 1 and max(counts.values()) > max(cap, 1.0 / len(counts)) * total
                on[m] = capped_weights(dict(counts), cap) if over else None
            w = on[m]
            if w is not None:
                out[i] = min(out[i], w.get(p, 1.0))
    return out


class InfluenceWindow:
    """The learner's running count of each principal's recent experiences (the last ``size``),
    overall and per memory read.

    >>> win = InfluenceWindow(size=4, cap=0.5)
    >>> win.weights(["a", "a", "a"], reads=[[1], [1], [2]]).tolist()  # one principal: weight 1
    [1.0, 1.0, 1.0]
    >>> [round(float(x), 3) for x in win.weights(["b", "a"], reads=[[2], [1]])]  # a×3, b (a's oldest dropped)
    [1.0, 0.333]
    """

    def __init__(self, size: int, cap: float) -> None:
        if size < 1:
            raise ValueError(f"influence window {size} must be at least 1")
        capped_weights({}, cap)  # checks the cap
        self.size = size
        self.cap = cap
        self.recent: deque[tuple[str, tuple[int, ...]]] = deque()  # principal, memories read
        self.counts: Counter[str] = Counter()
        self.memory_counts: dict[int, Counter[str]] = {}

    def add(self, principals: Iterable[str], reads: Iterable[Sequence[int]]) -> None:
        memory_counts = self.memory_counts
        for p, read in zip(principals, reads, strict=True):
            memories = tuple(map(int, read))
            self.recent.append((p, memories))
            self.counts[p] += 1
            for m in memories:
                counts = memory_counts.get(m)
                if counts is None:
                    counts = memory_counts[m] = Counter()
                counts[p] += 1
            if len(self.recent) > self.size:
                self._forget(*self.recent.popleft())

    def _forget(self, p: str, memories: tuple[int, ...]) -> None:
        _drop_one(self.counts, p)
        for m in memories:
            _drop_one(self.memory_counts[m], p)
            if not self.memory_counts[m]:
                del self.memory_counts[m]

    def weights(
        self, principals: Sequence[str], quarantined: Iterable[str] = (), *, reads: Sequence[Sequence[int]]
    ) -> np.ndarray:
        """Count the micro-batch's experiences (a quarantined principal's are not), then weigh them:
        the bound over the window, then on each memory an experience read (``reads``)."""
        blocked = set(quarantined)
        kept = [i for i, p in enumerate(principals) if p not in blocked]
        self.add([principals[i] for i in kept], [reads[i] for i in kept])
        if sum(p not in blocked for p in self.counts) <= 1:
            # One principal counted (or only anonymous traffic): no share, overall or on a
            # memory, can exceed any bound. The learner's every micro-batch in most deployments.
            return np.array([0.0 if p in blocked else 1.0 for p in principals], dtype=np.float64)
        overall = influence_weights(principals, self.counts, self.cap, blocked)
        return per_memory_weights(overall, principals, reads, self.memory_counts, self.cap, blocked)

    def shares(self) -> dict[str, float]:
        """Each principal's share of the window's experiences."""
        total = sum(self.counts.values())
        return {p: c / total for p, c in self.counts.items()} if total else {}


def _drop_one(counts: Counter[str], key: str) -> None:
    """One fewer of ``key``, which leaves ``counts`` once none is left (in place: O(1))."""
    counts[key] -= 1
    if not counts[key]:
        del counts[key]
