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
# The queries a learner keeps something of its own for (their means for per-memory credit here, the
# promotion rule's reward table): the least recently seen go first.
MAX_QUERIES = 50_000
# The slots a query keeps its own mean effect of (the least recently credited go first): a query's
# candidates, bounded whatever the index's churn (at both bounds ~165 MB, measured).
MAX_SLOTS_PER_QUERY = 16


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
        # mean: what a query without a mean of its own (QueryMeans) is imputed with.
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


class QueryMeans:
    """What a learner knows of each query by :func:`query_key` (docs/learning.md, "Per-memory
    credit"): its own moving mean of imputed credit's residual ``u − Σ b̂``, and its own mean
    effect of each slot it was credited with. Both follow a slot mean's running-then-fading rule,
    whose first value is the first observation's (a query's first residual, or a slot's first
    effect for it, taken at a weight below 1 moves part of the way from ``start``, the mean over
    all queries). At most ``max_queries`` queries, the least recently seen go first (0: none,
    every query gets the means over all, as with ``--baseline none``), and
    :data:`MAX_SLOTS_PER_QUERY` slots each, the least recently credited go first. Not saved: a
    restarted learner relearns them. Real LM utilities differ most by question (an easy one
    scores high whatever it reads), and a memory's effect does too (a fact helps its own question
    and misleads its look-alikes): taken over all queries, a question's level would be shared out
    as the memories' doing, and a look-alike's read credited with its fact's help elsewhere.

    >>> q = QueryMeans(fading_factor=0.01)
    >>> q.residuals([b"easy"], fallback=1.0).tolist()  # never seen: the mean over all queries
    [1.0]
    >>> q.update(b"easy", 2.0, start=1.0); q.update(b"easy", 4.0, start=1.0)
    >>> q.residuals([b"easy", b"new"], fallback=1.0).tolist()  # 2, then the running mean of 2 and 4
    [3.0, 1.0]
    >>> q.update(b"half", 3.0, weight=0.5, start=1.0); q.residuals([b"half"], 0.0).tolist()  # half way from 1
    [2.0]

    A slot's effect for a query, where it was credited for that query; the mean over all elsewhere
    (a query credited but without a residual yet has no residual mean of its own either):

    >>> q.update_effect(b"easy", slot=7, effect=0.5, start=0.1)
    >>> q.update_effect(b"lone", slot=7, effect=1.0, weight=0.5, start=0.2)  # half way from 0.2
    >>> q.effects([b"easy", b"lone", b"new"], np.full((3, 1), 7), np.full((3, 1), 0.1)).round(6).tolist()
    [[0.5], [0.6], [0.1]]
    >>> q.residuals([b"lone"], fallback=-1.0).tolist()
    [-1.0]

    A slot given to a new memory is forgotten by every query (at once, whatever their number), and
    its next effect starts from ``start`` again:

    >>> q.forget([7]); q.effects([b"easy"], np.array([[7]]), np.zeros((1, 1))).tolist()
    [[0.0]]
    >>> q.update_effect(b"easy", slot=7, effect=1.0, weight=0.5, start=0.0)
    >>> q.effects([b"easy"], np.array([[7]]), np.zeros((1, 1))).tolist()
    [[0.5]]
    """

    def __init__(self, fading_factor: float = 0.01, max_queries: int = MAX_QUERIES) -> None:
        self.fading_factor, self.max_queries = fading_factor, max_queries
        # per query: [residual mean, its count, {slot: (effect mean, count, generation)}], the most recent last
        self._of: OrderedDict[bytes, list[Any]] = OrderedDict()
        # How often each slot credited so far was given to a new memory: an effect of an older
        # generation is of the memory before (forgetting is one increment, not a pass over every
        # query). One entry per slot ever credited, never more than the index's slots.
        self._generation: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._of)

    def residuals(self, queries: Sequence[bytes], fallback: float) -> np.ndarray:
        """Each query's residual mean, ``fallback`` for a query without one."""
        out = np.full(len(queries), fallback, np.float64)
        for i, q in enumerate(queries):
            held = self._of.get(q)
            if held is not None and held[1]:
                out[i] = held[0]
        return out

    def effects(self, queries: Sequence[bytes], slots: np.ndarray, fallback: np.ndarray) -> np.ndarray:
        """``fallback`` [B, C] with each query's own effect mean where it has one for the slot."""
        out = np.array(fallback, np.float64, copy=True)
        generation = self._generation.get
        for i, q in enumerate(queries):
            held = self._of.get(q)
            if held is None or not held[2]:
                continue
            own = held[2]
            for j, s in enumerate(slots[i].tolist()):
                m = own.get(s)
                if m is not None and m[2] == generation(s, 0):
                    out[i, j] = m[0]
        return out

    def _held(self, query: bytes) -> list[Any]:
        held = self._of.pop(query, None)
        if held is None:
            held = [0.0, 0, {}]
        self._of[query] = held
        if len(self._of) > self.max_queries:
            self._of.popitem(last=False)
        return held

    def update(self, query: bytes, r: float, weight: float = 1.0, start: float = 0.0) -> None:
        """One residual of ``query``."""
        if weight <= 0.0 or self.max_queries <= 0:
            return
        held = self._held(query)
        mean = held[0] if held[1] else start
        held[0], held[1] = _running_then_fading(mean, held[1], r, weight, self.fading_factor)

    def update_effect(self, query: bytes, slot: int, effect: float, weight: float = 1.0, start: float = 0.0) -> None:
        """One measured effect of ``slot`` for ``query``."""
        if weight <= 0.0 or self.max_queries <= 0:
            return
        own, slot = self._held(query)[2], int(slot)
        generation = self._generation.setdefault(slot, 0)
        mean, n, of = own.pop(slot, (start, 0, generation))
        if of != generation:
            mean, n = start, 0
        own[slot] = (*_running_then_fading(mean, n, effect, weight, self.fading_factor), generation)
        if len(own) > MAX_SLOTS_PER_QUERY:
            del own[next(iter(own))]

    def forget(self, slots: Iterable[int]) -> None:
        """Drop every query's effect of ``slots`` (a slot given to a new memory)."""
        for s in slots:
            if int(s) in self._generation:  # a slot never credited has nothing to forget
                self._generation[int(s)] += 1


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
