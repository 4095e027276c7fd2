"""D-MEM-style re-ranking (seed 004 §3.4), the benchmark's reward-prediction-error baseline.

Each memory carries δ, an exponential average of the reward-prediction errors
``u − ū`` of the steps that read it (ū: the running mean utility). Retrieval takes the
top candidates by similarity and re-ranks them by ``similarity + β·δ``: memories that
surprised positively before come first. No policy network, no intervention: a memory is
never dropped, only moved.

>>> d = DMem(beta=1.0, fading=0.5)
>>> d.update([3], 1.0); d.update([4], -1.0)
>>> [round(float(x), 3) for x in d.rerank([0.5, 0.5], [3, 4])]
[1.0, -0.5]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from river import stats


class DMem:
    """Per-memory δ (reward-prediction error) and the re-ranking score."""

    def __init__(self, beta: float = 0.5, fading: float = 0.1) -> None:
        self.beta = beta
        self.fading = fading
        self.expected = stats.Mean()  # ū: what a step usually earns
        self.delta: dict[int, float] = {}

    def update(self, selected: Sequence[int], utility: float) -> None:
        rpe = float(utility) - self.expected.get()
        self.expected.update(float(utility))
        for slot in selected:
            old = self.delta.get(int(slot), 0.0)
            self.delta[int(slot)] = old + self.fading * (rpe - old)

    def rerank(self, similarity: Sequence[float], slots: Sequence[int]) -> np.ndarray:
        deltas = np.array([self.delta.get(int(s), 0.0) for s in slots])
        return np.asarray(similarity, dtype=np.float64) + self.beta * deltas
