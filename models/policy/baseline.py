"""Baselines b for the advantage A = u − b (docs/learning.md; seed 000 §5.1, seed 004 §4.2).

``MovingBaseline`` is the seed's moving average (an exponentially weighted mean from
river); ``ClusterBaseline`` keeps one such mean per query-intent cluster (seed 004 §4.2:
"use the topic cluster's mean reward as the expectation"), the clusters found online by
river's k-means over the query embeddings. Both follow river's style: ``get`` before
``update``, so the advantage of an experience never includes its own utility.

Each step baseline carries a :class:`SlotBaseline` (``.slots``): one moving mean of the
per-memory effect per slot, for per-memory credit. Its state travels inside the step
baseline's ``state()``, so it is checkpointed and restored with it.

>>> b = MovingBaseline(fading_factor=0.5)
>>> [b.advantage(u) for u in (1.0, 3.0, 5.0)]
[1.0, 2.0, 3.0]
>>> b.get()
3.5
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from river import cluster, stats

# At most this many slots are kept in a saved state (the most read ones): the state rides
# in the checkpoint manifest's metrics.
MAX_SAVED_SLOTS = 2048
# The queries a learner keeps something of its own for (a residual mean here, the promotion rule's
# reward table): the least recently seen go first.
MAX_QUERIES = 50_000


def query_key(embedding: np.ndarray) -> bytes:
    """A query's identity: a hash of its embedding (the same question, the same key).

    >>> query_key(np.ones(4)) == query_key(np.ones(4, np.float32)), query_key(np.ones(4)) == query_key(np.zeros(4))
    (True, False)
    """
    emb = np.ascontiguousarray(np.asarray(embedding, np.float32))
    return hashlib.blake2b(emb.tobytes(), digest_size=8).digest()


def _running_then_fading(mean: float, n: int, x: float, weight: float, fading_factor: float) -> tuple[float, int]:
    """One step of a running-then-fading mean: ``b ← b + w·max(f, 1/n)·(x − b)`` (n counts this x)."""
    n += 1
    return mean + min(1.0, weight) * max(fading_factor, 1.0 / n) * (float(x) - mean), n


class SlotBaseline:
    """One moving mean of the per-memory effect per slot (docs/learning.md, per-memory credit).

    A slot's mean is a plain running mean for its first ``1/f`` effects, then an
    exponentially weighted one (``b ← b + max(f, 1/n)·(e − b)``): a memory read rarely
    gets a usable estimate quickly, a memory read often follows change. Only touched slots
    are stored. ``get`` before ``update``, as for the step baselines.

    >>> b = SlotBaseline(fading_factor=0.5)
    >>> b.get(7), b.n(7)
    (0.0, 0)
    >>> for e in (1.0, 3.0, 5.0):
    ...     b.update(7, e)
    >>> b.get(7), b.n(7)  # 1 → (1+3)/2 = 2 → 2 + 0.5·(5 − 2)
    (3.5, 3)
    >>> SlotBaseline.from_state(b.state()).get(7)
    3.5

    An effect with ``weight`` w (a principal's influence weight, pipeline/learner/influence.py)
    moves a mean by w times the usual step; with weight 0 it is not counted at all:

    >>> b.update(7, 100.0, weight=0.0); b.get(7), b.n(7)
    (3.5, 3)
    >>> b.update(7, 5.5, weight=0.5); b.get(7)  # 3.5 + 0.5·0.5·(5.5 − 3.5)
    4.0
    """

    def __init__(self, fading_factor: float = 0.01) -> None:
        self.fading_factor = fading_factor
        self._mean: dict[int, float] = {}
        self._n: dict[int, int] = {}
        # The moving mean of the residual u − Σ b̂(σ_j) of imputed credit (models/policy/reinforce.py
        # impute_effects) over all steps, with the same running-then-fading rule as a slot's
        # mean: what a query without a mean of its own (QueryResiduals) is imputed with.
        self.residual = 0.0
        self.residual_n = 0

    def get(self, slot: int) -> float:
        return self._mean.get(slot, 0.0)

    def n(self, slot: int) -> int:
        return self._n.get(slot, 0)

    def update(self, slot: int, effect: float, weight: float = 1.0) -> None:
        if weight <= 0.0:
            return
        self._mean[slot], self._n[slot] = _running_then_fading(
            self._mean.get(slot, 0.0), self._n.get(slot, 0), effect, weight, self.fading_factor
        )

    def forget(self, slots: Iterable[int]) -> None:
        """Drop what was learnt about ``slots`` (a slot given to a new memory starts at b = 0)."""
        for s in slots:
            self._mean.pop(int(s), None)
            self._n.pop(int(s), None)

    def update_residual(self, r: float, weight: float = 1.0) -> None:
        if weight <= 0.0:
            return
        self.residual, self.residual_n = _running_then_fading(
            self.residual, self.residual_n, r, weight, self.fading_factor
        )

    def means(self, slots: np.ndarray) -> np.ndarray:
        """The current means of an array of slots (0 for slots never credited)."""
        get = self._mean.get
        return np.array([get(int(s), 0.0) for s in slots.ravel()], np.float32).reshape(slots.shape)

    def __len__(self) -> int:
        return len(self._n)

    def state(self) -> dict[str, list[float] | list[int]]:
        slots = sorted(self._n, key=lambda s: -self._n[s])[:MAX_SAVED_SLOTS]
        out: dict[str, list[float] | list[int]] = {
            "slot": slots,
            "mean": [round(self._mean[s], 6) for s in slots],
            "n": [self._n[s] for s in slots],
        }
        if self.residual_n:
            out["residual"] = [round(self.residual, 6), float(self.residual_n)]
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None, fading_factor: float = 0.01) -> SlotBaseline:
        b = cls(fading_factor)
        if state:
            for s, m, n in zip(state.get("slot", []), state.get("mean", []), state.get("n", []), strict=False):
                b._mean[int(s)] = float(m)
                b._n[int(s)] = int(n)
            if state.get("residual"):
                b.residual, b.residual_n = float(state["residual"][0]), int(state["residual"][1])
        return b


class NoSlotBaseline(SlotBaseline):
    """Per-slot b = 0 (with ``--baseline none``)."""

    def get(self, slot: int) -> float:
        return 0.0

    def means(self, slots: np.ndarray) -> np.ndarray:
        return np.zeros(slots.shape, np.float32)

    def update_residual(self, r: float, weight: float = 1.0) -> None:
        self.residual_n += weight > 0.0  # b = 0 here: the residual's baseline stays 0 too


class QueryResiduals:
    """Each query's own moving mean of imputed credit's residual ``u − Σ b̂`` (docs/learning.md,
    "Steps without measured effects"), by :func:`query_key`, with a slot mean's
    running-then-fading rule; a query's first residual moves it from ``start`` (the mean over
    all queries). At most ``max_queries``, the least recently seen go first (0: none, every
    query gets the mean over all, as with ``--baseline none``, whose residual is 0). Not saved: a
    restarted learner relearns them. Real LM utilities differ most by question (an easy one
    scores high whatever it reads): shared out as imputed credit, a question's own level would
    be taken for the memories' doing.

    >>> q = QueryResiduals(fading_factor=0.01)
    >>> q.of([b"easy"], fallback=1.0).tolist()  # never seen: the mean over all queries
    [1.0]
    >>> q.update(b"easy", 2.0, start=1.0); q.update(b"easy", 4.0, start=1.0)
    >>> q.of([b"easy", b"new"], fallback=1.0).tolist()  # 2, then the running mean of 2 and 4
    [3.0, 1.0]
    >>> q.update(b"half", 3.0, weight=0.5, start=1.0); q.of([b"half"], 0.0).tolist()  # half way from 1
    [2.0]
    """

    def __init__(self, fading_factor: float = 0.01, max_queries: int = MAX_QUERIES) -> None:
        self.fading_factor, self.max_queries = fading_factor, max_queries
        self._mean: OrderedDict[bytes, tuple[float, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._mean)

    def of(self, queries: Sequence[bytes], fallback: float) -> np.ndarray:
        """Each query's mean, ``fallback`` for a query without one."""
        get = self._mean.get
        return np.array([get(q, (fallback, 0))[0] for q in queries], np.float64)

    def update(self, query: bytes, r: float, weight: float = 1.0, start: float = 0.0) -> None:
        if weight <= 0.0 or self.max_queries <= 0:
            return
        mean, n = self._mean.pop(query, (start, 0))
        self._mean[query] = _running_then_fading(mean, n, r, weight, self.fading_factor)  # the most recent last
        if len(self._mean) > self.max_queries:
            self._mean.popitem(last=False)


class MovingBaseline:
    """Exponentially weighted mean of past utilities; b ← f·u + (1−f)·b."""

    def __init__(self, fading_factor: float = 0.01) -> None:
        self.fading_factor = fading_factor
        self._mean = stats.EWMean(fading_factor=fading_factor)
        self.n = 0
        self.slots = SlotBaseline(fading_factor)

    def get(self, embedding: np.ndarray | None = None) -> float:
        return float(self._mean.get()) if self.n else 0.0

    def update(self, utility: float, embedding: np.ndarray | None = None, weight: float = 1.0) -> None:
        """b ← b + w·f·(u − b): a utility of weight ``w`` (a principal's influence weight) moves b by
        w times the usual step; of weight 0, not at all. The first utility's step is from 0 to u
        (b = w·u): one of weight 1 sets b."""
        if weight <= 0.0:
            return
        u = float(utility)
        if weight < 1.0:
            b = self._mean.get() if self.n else 0.0
            u = b + weight * (u - b)  # EWMean's own step, scaled by w (its first sets the mean)
        self._mean.update(u)
        self.n += 1

    def advantage(self, utility: float, embedding: np.ndarray | None = None, weight: float = 1.0) -> float:
        """A = u − b, then update b (docs/learning.md: update b after computing A).

        >>> b = MovingBaseline(fading_factor=0.5)
        >>> [b.advantage(u, weight=w) for u, w in ((1.0, 1.0), (9.0, 0.0), (3.0, 0.5))]
        [1.0, 8.0, 2.0]
        >>> b.get()  # 1 + 0.5·0.5·(3 − 1); the utility of weight 0 left no trace
        1.5
        """
        a = float(utility) - self.get(embedding)
        self.update(utility, embedding, weight)
        return a

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "moving", "value": self.get(), "n": self.n, "fading_factor": self.fading_factor}
        if len(self.slots):  # absent until per-memory credit arrives: states stay as they were
            out["slots"] = self.slots.state()
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MovingBaseline:
        b = cls(fading_factor=float(state.get("fading_factor", 0.01)))
        if int(state.get("n", 0)) > 0:
            # The first update of a fresh EWMean sets its mean exactly to the value.
            b._mean.update(float(state["value"]))
            b.n = int(state["n"])
        b.slots = SlotBaseline.from_state(state.get("slots"), b.fading_factor)
        return b


class NoBaseline(MovingBaseline):
    """b = 0 (plain REINFORCE): the benchmark's "without the baseline" row."""

    def __init__(self, fading_factor: float = 0.01) -> None:
        super().__init__(fading_factor)
        self.slots = NoSlotBaseline(fading_factor)

    def get(self, embedding: np.ndarray | None = None) -> float:
        return 0.0

    def state(self) -> dict[str, Any]:
        return {"kind": "none", "value": 0.0, "n": self.n}


class ClusterBaseline:
    """One moving mean per intent cluster of the query embedding (seed 004 §4.2)."""

    def __init__(self, n_clusters: int = 8, fading_factor: float = 0.01, seed: int = 0) -> None:
        self.n_clusters = n_clusters
        self.fading_factor = fading_factor
        self._kmeans: Any = cluster.KMeans(n_clusters=n_clusters, halflife=0.5, sigma=1.0, seed=seed)
        self._means: dict[int, MovingBaseline] = {}
        self._global = MovingBaseline(fading_factor)
        self.n = 0
        self.slots = SlotBaseline(fading_factor)

    def _cluster(self, embedding: np.ndarray) -> int:
        x = {i: float(v) for i, v in enumerate(embedding)}
        return int(self._kmeans.predict_one(x))

    def get(self, embedding: np.ndarray | None = None) -> float:
        if embedding is None:
            return self._global.get()
        mean = self._means.get(self._cluster(embedding))
        # A cluster seen too few times falls back to the global mean.
        return mean.get() if mean is not None and mean.n >= 5 else self._global.get()

    def update(self, utility: float, embedding: np.ndarray | None = None, weight: float = 1.0) -> None:
        if weight <= 0.0:
            return
        self._global.update(utility, weight=weight)
        self.n += 1
        if embedding is None:
            return
        x = {i: float(v) for i, v in enumerate(embedding)}
        self._kmeans.learn_one(x)
        c = int(self._kmeans.predict_one(x))
        self._means.setdefault(c, MovingBaseline(self.fading_factor)).update(utility, weight=weight)

    def advantage(self, utility: float, embedding: np.ndarray | None = None, weight: float = 1.0) -> float:
        a = float(utility) - self.get(embedding)
        self.update(utility, embedding, weight)
        return a

    def state(self) -> dict[str, Any]:
        # Cluster centres are not part of the checkpoint; after a restore the per-cluster
        # means are relearnt while the global mean carries on.
        out: dict[str, Any] = {
            "kind": "cluster",
            "value": self._global.get(),
            "n": self.n,
            "fading_factor": self.fading_factor,
        }
        if len(self.slots):
            out["slots"] = self.slots.state()
        return out


def make_baseline(kind: str, fading_factor: float, state: dict[str, Any] | None = None) -> Any:
    """Baseline by name (``moving``, ``cluster`` or ``none``), restored from ``state`` if given."""
    if kind == "none":
        return NoBaseline(fading_factor)
    if kind == "cluster":
        b = ClusterBaseline(fading_factor=fading_factor)
        if state and int(state.get("n", 0)) > 0:
            b._global = MovingBaseline.from_state({**state, "fading_factor": fading_factor})
            b.n = b._global.n
        if state:
            b.slots = SlotBaseline.from_state(state.get("slots"), fading_factor)
        return b
    if kind != "moving":
        raise ValueError(f"unknown baseline {kind!r} (moving, cluster, none)")
    if state:
        return MovingBaseline.from_state({**state, "fading_factor": fading_factor})
    return MovingBaseline(fading_factor)
