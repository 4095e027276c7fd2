"""Writes gated by reward-prediction error (seed 004, D-MEM), and δ used for routing.

A proposed memory comes with the reward its step earned. The gate compares that reward
with what it expected and admits the memory only when the surprise is large::

    RPE = reward − expected_reward        admit when |RPE| > θ

A positive RPE (better than expected) is stored as a ``success``, a negative one as a
``pitfall``; either way the memory carries δ = RPE, its tag (docs/contract.md §9.2).

**The expected reward is the gate's own.** A producer may say what it expected (its
``expected_reward``, from a value network say), but a producer that chose the expectation
would choose the decision: any reward is a surprise against a far enough claim. So the
gate judges only against its own estimate (:meth:`WriteGate.judge` refuses an
expectation from anywhere else); the claim is carried on the decision as information
(``claimed_expected_reward``, and ``claim_disagrees`` when it is more than θ from the
gate's). The ``reward`` itself remains the producer's word: the gate cannot check it (see
docs/operations.md, "The write gate").

The gate's estimate follows the seed's "D-MEM Lite" (§3.2, §4.2): the running mean
reward of the proposal's *topic*. Topics are clusters of query embeddings found online
(leader clustering: a query joins the nearest cluster within cosine ``radius`` of its
centroid, else starts one, up to ``max_clusters``); each keeps an exponential moving mean
of the rewards seen in it (``fading``). A global mean covers proposals without an
embedding and clusters with fewer than ``min_count`` rewards; before any reward at all,
the gate expects ``prior``. Every proposal updates the estimate after it is judged
(admitted or not): the estimate is of the step's reward, not of the memories kept.

>>> est = RewardEstimator(prior=0.0, fading=0.5, min_count=1)
>>> gate = WriteGate(theta=0.3)
>>> d = gate.judge(1.0, est.expected(None))  # nothing seen yet: expect the prior, 0
>>> d.admitted, d.kind, d.rpe
(True, 'success', 1.0)
>>> est.update(None, 1.0); est.update(None, 0.0)
>>> est.expected(None)[0]  # 1.0, then halfway to 0.0
0.5
>>> gate.judge(0.6, est.expected(None)).admitted  # |0.6 − 0.5| ≤ 0.3
False
>>> d = gate.judge(0.6, est.expected(None), claimed_expected_reward=-4.0)  # a claim decides nothing
>>> d.admitted, d.expected_reward, d.claimed_expected_reward, d.claim_disagrees
(False, 0.5, -4.0, True)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

DEFAULT_THETA = 0.3  # in reward units; see docs/operations.md "The write gate" for choosing it
# The expected-reward estimate's defaults (RewardEstimator; the writes_* settings refer to them).
DEFAULT_PRIOR = 0.0  # expected reward before any reward was seen
DEFAULT_FADING = 0.05  # weight of a new reward in a running mean
DEFAULT_RADIUS = 0.5  # cosine similarity to a topic's centroid to join it
DEFAULT_MIN_COUNT = 5  # rewards a topic needs before its own mean is used
SUCCESS, PITFALL = "success", "pitfall"
# Where the expectation a gate judges by may come from: RewardEstimator.expected's answers.
# ("producer", a producer's own claim, was accepted before; it no longer decides.)
OWN_ESTIMATES = ("cluster", "global", "prior")


@dataclass(frozen=True)
class Decision:
    """What the gate decided about one proposal."""

    admitted: bool
    kind: str | None  # "success" or "pitfall" when admitted
    rpe: float  # reward − expected_reward
    expected_reward: float  # the gate's own expectation, the one judged by
    estimate: str  # where it came from: cluster | global | prior (OWN_ESTIMATES)
    # The producer's expected_reward, when it sent one: information, never the basis of the decision.
    claimed_expected_reward: float | None = None
    claim_disagrees: bool = False  # the claim is more than θ away from the gate's expectation


@dataclass(frozen=True)
class WriteGate:
    """``|RPE| > θ`` admits; the sign of RPE names the kind. The expectation is the gate's own.

    >>> d = WriteGate(0.5).judge(0.2, (1.0, "cluster"))
    >>> d.admitted, d.kind, d.rpe, d.expected_reward, d.estimate
    (True, 'pitfall', -0.8, 1.0, 'cluster')
    >>> WriteGate(0.5).judge(1.2, (1.0, "global"), claimed_expected_reward=0.0).admitted
    False
    >>> WriteGate(0.5).judge(1.2, (0.0, "producer"))
    Traceback (most recent call last):
    ...
    ValueError: the write gate judges by its own expectation (cluster, global or prior), not 'producer'
    """

    theta: float = DEFAULT_THETA

    def __post_init__(self) -> None:
        if not (self.theta >= 0.0 and math.isfinite(self.theta)):
            raise ValueError(f"write gate theta {self.theta}: expected a finite number >= 0")

    def judge(
        self, reward: float, expectation: tuple[float, str], claimed_expected_reward: float | None = None
    ) -> Decision:
        """Judge ``reward`` against the gate's own ``expectation`` (``RewardEstimator.expected``).

        ``claimed_expected_reward``, the producer's own prediction when it sent one, is only
        compared with the expectation and carried on the decision; it never changes it.
        """
        expected, source = expectation
        if source not in OWN_ESTIMATES:
            raise ValueError(f"the write gate judges by its own expectation (cluster, global or prior), not {source!r}")
        expected = float(expected)
        rpe = float(reward) - expected
        claimed = None if claimed_expected_reward is None else float(claimed_expected_reward)
        disagrees = claimed is not None and abs(claimed - expected) > self.theta
        if abs(rpe) > self.theta:
            return Decision(True, SUCCESS if rpe > 0 else PITFALL, rpe, expected, source, claimed, disagrees)
        return Decision(False, None, rpe, expected, source, claimed, disagrees)


class _Mean:
    """An exponential moving mean that starts as the plain mean of its first values."""

    __slots__ = ("count", "fading", "value")

    def __init__(self, fading: float) -> None:
        self.fading = fading
        self.count = 0
        self.value = 0.0

    def update(self, x: float) -> None:
        self.count += 1
        # 1/n until that falls below the fading rate: no bias toward the initial 0.
        self.value += max(self.fading, 1.0 / self.count) * (x - self.value)


class RewardEstimator:
    """The gate's own expected reward: a running mean per topic (query cluster), else global.

    >>> est = RewardEstimator(radius=0.8, min_count=2, fading=0.5)
    >>> a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    >>> for r in (1.0, 1.0):
    ...     est.update(a, r)
    >>> est.update(b, -1.0)
    >>> est.expected(a), est.expected(b)  # b's cluster has one reward: the global mean answers
    ((1.0, 'cluster'), (0.0, 'global'))
    >>> est.n_clusters
    2
    """

    def __init__(
        self,
        prior: float = DEFAULT_PRIOR,
        fading: float = DEFAULT_FADING,
        radius: float = DEFAULT_RADIUS,
        min_count: int = DEFAULT_MIN_COUNT,
        max_clusters: int = 256,
    ) -> None:
        if not 0.0 < fading <= 1.0:
            raise ValueError(f"fading {fading}: expected 0 < fading <= 1")
        if not -1.0 <= radius <= 1.0:
            raise ValueError(f"radius {radius}: a cosine similarity, -1..1")
        if min_count < 1 or max_clusters < 1:
            raise ValueError("min_count and max_clusters must be at least 1")
        self.prior = prior
        self.fading = fading
        self.radius = radius
        self.min_count = min_count
        self.max_clusters = max_clusters
        self.global_mean = _Mean(fading)
        self._centroids: list[np.ndarray] = []  # unit vectors
        self._sums: list[np.ndarray] = []  # sum of the unit members, for the centroid
        self._means: list[_Mean] = []

    @property
    def n_clusters(self) -> int:
        return len(self._centroids)

    def _nearest(self, context: np.ndarray) -> tuple[int, float]:
        if not self._centroids:
            return -1, -2.0
        sims = np.stack(self._centroids) @ context
        i = int(np.argmax(sims))
        return i, float(sims[i])

    @staticmethod
    def _unit(context: np.ndarray | None) -> np.ndarray | None:
        if context is None:
            return None
        v = np.asarray(context, dtype=np.float64).ravel()
        n = float(np.linalg.norm(v))
        return v / n if n > 0 and math.isfinite(n) else None

    def expected(self, context: np.ndarray | None) -> tuple[float, str]:
        """The expected reward for a step with this context embedding, and where it came from."""
        u = self._unit(context)
        if u is not None:
            i, sim = self._nearest(u)
            if i >= 0 and sim >= self.radius and self._means[i].count >= self.min_count:
                return self._means[i].value, "cluster"
        if self.global_mean.count:
            return self.global_mean.value, "global"
        return self.prior, "prior"

    def update(self, context: np.ndarray | None, reward: float) -> None:
        """Learn one observed reward (after the proposal was judged)."""
        self.global_mean.update(float(reward))
        u = self._unit(context)
        if u is None:
            return
        i, sim = self._nearest(u)
        if i < 0 or (sim < self.radius and self.n_clusters < self.max_clusters):
            self._centroids.append(u)
            self._sums.append(u.copy())
            self._means.append(_Mean(self.fading))
            i = self.n_clusters - 1
        else:
            self._sums[i] += u
            self._centroids[i] = self._sums[i] / max(float(np.linalg.norm(self._sums[i])), 1e-12)
        self._means[i].update(float(reward))


def memory_id_for(write_id: str) -> str:
    """The memory id an admitted proposal gets: a replay of the same write names the same memory.

    >>> memory_id_for("w1") == memory_id_for("w1"), memory_id_for("w1")[:3]
    (True, 'mw-')
    """
    return "mw-" + hashlib.sha256(write_id.encode("utf-8")).hexdigest()[:24]


# --------------------------------------------------------------------------- routing


def route(kind: str | None, delta: float | None, beta: float = 0.1) -> tuple[int, float]:
    """Where a retrieved memory goes in a prompt, by its lifecycle ``kind`` and δ tag.

    Returns ``(group, bonus)``: sort retrieved memories by ``group`` first (0: successes,
    1: plain memories, 2: pitfalls, to be shown as warnings), then by their score plus
    ``bonus`` = β·|δ| (the seed's ``similarity + λ·δ`` within a group: the more surprising
    a success or failure was, the more it matters). A memory without a kind is plain.

    >>> route("success", 0.8), route(None, None), route("pitfall", -1.0)
    ((0, 0.08000000000000002), (1, 0.0), (2, 0.1))
    >>> sorted(["p", "s", "m"], key=lambda m: route({"p": "pitfall", "s": "success"}.get(m), 0.5)[0])
    ['s', 'm', 'p']
    """
    group = {SUCCESS: 0, PITFALL: 2}.get(kind or "", 1)
    bonus = beta * abs(float(delta)) if delta is not None and math.isfinite(delta) else 0.0
    return group, bonus
