"""Per-memory statistics from per-memory credit: reads, mean effect and its 95% interval.

Fed by the learner from every joined experience: each selected slot counts a *read*; each
measured effect (``Experience.slot_effects``, contract 1.1: ``nll_without_slot[s] −
nll_with``, > 0 when the memory helped) updates the slot's running mean and variance
(Welford's algorithm, one pass, numerically stable). River style: ``update`` then
``get``. Memory is bounded: three arrays of size S (the policy's slots).

The 95% interval is the normal one, ``mean ± 1.96·sd/√n``; it is reported from two
effects on. Operators see the most harmful and the most helpful memories (``top``).

>>> st = MemoryStats(slots=8)
>>> st.update([3, 5], {3: 0.5, 5: -1.0})
>>> st.update([3], {3: 1.5})
>>> st.update([3, 5])            # a read without per-memory credit
>>> s = st.get(3)
>>> s.reads, s.effects, s.mean
(3, 2, 1.0)
>>> round(s.low, 3), round(s.high, 3)  # sd = 0.7071, 1.96·0.7071/√2 = 0.98
(0.02, 1.98)
>>> [(x.slot, x.mean) for x in st.top(2, harmful=True, min_effects=1)]
[(5, -1.0), (3, 1.0)]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054


@dataclass(frozen=True)
class SlotStats:
    """One memory's figures: reads (all experiences), effects measured, mean and 95% interval."""

    slot: int
    reads: int
    effects: int
    mean: float
    low: float  # nan with fewer than two effects
    high: float


class MemoryStats:
    """Reads and Welford mean/variance of the measured effect, per slot (arrays of size ``slots``)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.reads = np.zeros(slots, np.int64)
        self.n = np.zeros(slots, np.int64)
        self.mean = np.zeros(slots, np.float64)
        self._m2 = np.zeros(slots, np.float64)

    def forget(self, slots: Iterable[int]) -> None:
        """Zero the statistics of ``slots``: a slot reused by a new memory starts unread."""
        idx = np.array([int(s) for s in slots if 0 <= int(s) < self.slots], np.int64)
        for arr in (self.reads, self.n, self.mean, self._m2):
            arr[idx] = 0

    def update(self, selected: Iterable[int], slot_effects: Mapping[int, float] | None = None) -> None:
        """Count a read of each selected slot; fold each finite measured effect in."""
        sel = [int(s) for s in selected if 0 <= int(s) < self.slots]
        self.reads[sel] += 1
        for s, e in (slot_effects or {}).items():
            s, e = int(s), float(e)
            if not (0 <= s < self.slots and math.isfinite(e)):
                continue
            self.n[s] += 1
            delta = e - self.mean[s]
            self.mean[s] += delta / self.n[s]
            self._m2[s] += delta * (e - self.mean[s])

    def get(self, slot: int) -> SlotStats:
        n = int(self.n[slot])
        mean = float(self.mean[slot]) if n else float("nan")
        half = Z95 * math.sqrt(self._m2[slot] / (n - 1) / n) if n >= 2 else float("nan")
        return SlotStats(int(slot), int(self.reads[slot]), n, mean, mean - half, mean + half)

    def top(self, n: int, harmful: bool, min_effects: int = 2) -> list[SlotStats]:
        """The ``n`` slots with the lowest (``harmful``) or highest mean effect among those
        with at least ``min_effects`` measured effects."""
        seen = np.nonzero(self.n >= min_effects)[0]
        if seen.size == 0:
            return []
        order = np.argsort(self.mean[seen] if harmful else -self.mean[seen], kind="stable")[:n]
        return [self.get(int(s)) for s in seen[order]]

    @property
    def measured(self) -> int:
        """How many slots have at least one measured effect."""
        return int((self.n > 0).sum())
