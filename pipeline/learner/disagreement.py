"""Whether a principal's utilities disagree with everyone else's (docs/learning.md, "Influence per principal").

Per *slate* (the set of memories a step read) the learner keeps each principal's mean reported
utility. When principal ``p`` reports utility ``u`` for a step that read the slate ``S``, its
*residual* is ``u`` minus the **median of the other principals' means** for ``S`` (each of them
with at least ``min_per_key`` reports; no residual when none has): the median, so that with
three or more other principals one liar among them does not shift the reference an honest
principal is compared with. The step is then added to ``p``'s own mean for ``S``. The slate,
not each memory: a step's utility is the whole slate's, so a per-memory mean would mix in the
memories read beside it, which differ between principals whose users ask different things
(an honest principal would then disagree by the mix alone). The same slate is served to the
same kind of query whoever asks, so the comparison is like with like.

Per principal the residuals' mean gets a normal interval, ``mean ± z·sd/√n`` with ``z = 3``
(two-sided ≈ 99.7 %; the interval is looked at after every micro-batch, for every principal,
so it is wider than a one-off 95 %). A principal is **flagged** when it has at least ``min_n``
residuals and the interval lies entirely beyond ``±tolerance``: its utilities are
systematically higher or lower than the others' for the same memories, by more than the
tolerance allows for differences in slates and queries. Residuals are not independent (the
references move as reports arrive), so the interval is a guard, not a test with an exact error
rate. The learner holds a flagged principal at weight 0 while it is flagged
(:meth:`pipeline.learner.principals.PrincipalBook.held`); quarantine stays the operator's decision.

>>> d = Disagreement(tolerance=0.1, min_n=20, min_per_key=3)
>>> for i in range(40):
...     for honest in ("a", "b", "c"):
...         d.observe(honest, [i % 4, 9], 0.5 + 0.01 * (i % 3))
...     d.observe("liar", [9, i % 4], -0.5)
>>> d.verdict("liar").flagged, d.verdict("a").flagged
(True, False)
>>> round(d.verdict("liar").mean, 2)
-1.01
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Z = 3.0
# Bounds on what is kept; past them the least recently reported slate or principal makes room,
# so a principal or a slate that appears late is compared like the first ones.
MAX_PRINCIPALS = 1024
MAX_KEYS = 200_000


@dataclass(frozen=True)
class Verdict:
    """One principal's residuals: how many, their mean and its interval, and whether that flags it."""

    n: int
    mean: float
    low: float
    high: float
    flagged: bool


class _Running:
    """Welford's running mean and variance."""

    __slots__ = ("m2", "mean", "n")

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)


class Disagreement:
    """The running comparison of each principal's utilities with the others' (module docstring)."""

    def __init__(
        self,
        tolerance: float,
        min_n: int,
        *,
        min_per_key: int = 3,
        z: float = Z,
        max_keys: int = MAX_KEYS,
        max_principals: int = MAX_PRINCIPALS,
    ) -> None:
        if tolerance < 0 or min_n < 2 or min_per_key < 1 or max_keys < 1 or max_principals < 1:
            raise ValueError("disagreement: tolerance >= 0, min_n >= 2, min_per_key >= 1 and positive bounds")
        self.tolerance = tolerance
        self.min_n = min_n
        self.min_per_key = min_per_key
        self.z = z
        self.max_keys = max_keys
        self.max_principals = max_principals
        # slate → principal → [count, sum], least recently reported first
        self.per_key: OrderedDict[frozenset[int], dict[str, list[float]]] = OrderedDict()
        self.residuals: OrderedDict[str, _Running] = OrderedDict()  # least recently reported first
        self.flagged: set[str] = set()  # kept as residuals arrive: a verdict changes only then
        self.forgotten = 0  # slates and principals dropped to make room

    def observe(self, principal: str, selected: Sequence[int], utility: float) -> None:
        """One step's report: its residual against the others' (when they reported on its slate), then its own."""
        if not math.isfinite(utility) or not selected:
            return
        if principal in self.residuals:
            self.residuals.move_to_end(principal)
        else:
            if len(self.residuals) >= self.max_principals:
                self.flagged.discard(self.residuals.popitem(last=False)[0])
                self.forgotten += 1
            self.residuals[principal] = _Running()
        key = frozenset(selected)
        means = self.per_key.get(key)
        if means is not None:
            self.per_key.move_to_end(key)
        else:
            if len(self.per_key) >= self.max_keys:
                self.per_key.popitem(last=False)
                self.forgotten += 1
            means = self.per_key[key] = {}
        others = [
            total / count for who, (count, total) in means.items() if who != principal and count >= self.min_per_key
        ]
        if others:
            self.residuals[principal].add(utility - float(np.median(others)))
            if self.verdict(principal).flagged:
                self.flagged.add(principal)
            else:
                self.flagged.discard(principal)
        own = means.setdefault(principal, [0.0, 0.0])
        own[0] += 1
        own[1] += utility

    def verdict(self, principal: str) -> Verdict:
        """``principal``'s residuals so far (n = 0: none yet)."""
        r = self.residuals.get(principal)
        if r is None or r.n == 0:
            return Verdict(0, 0.0, -math.inf, math.inf, False)
        if r.n < 2:
            return Verdict(r.n, r.mean, -math.inf, math.inf, False)
        half = self.z * math.sqrt(r.m2 / (r.n - 1) / r.n)
        low, high = r.mean - half, r.mean + half
        flagged = r.n >= self.min_n and (low > self.tolerance or high < -self.tolerance)
        return Verdict(r.n, r.mean, low, high, flagged)

    def principals(self) -> list[str]:
        return list(self.residuals)
