"""One request's choice of memories under one policy: the hard drop, exploration, the draw.

The serving core (:class:`~pipeline.client.serving_core.ServingCore`, which every client
front serves through) makes it once per request, or twice
with the same random draws (:class:`Noise` with ``shared``) when a coupled canary
(contract 1.5) compares the canary's slate with the serving policy's on the same request:
where the two policies agree, the shared draws give both the same slate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.serving.rule import plackett_luce_logprob, revive_dropped
from pipeline.client.serving import ServingValues, draw, keep_flags
from pipeline.client.subscriber import LoadedPolicy

CANARY_SHARE = 0.5  # q: the share of differing requests that the canary's slate serves (contract 1.5)


def event_labels(known: list[int | None]) -> list[int]:
    """Distinct slot numbers for an event's memories: the known slot, else the smallest unused number.

    >>> event_labels([7, None, 0, None])
    [7, 1, 0, 2]
    """
    used = {s for s in known if s is not None}
    out, nxt = [], 0
    for s in known:
        if s is None:
            while nxt in used:
                nxt += 1
            s = nxt
            used.add(s)
        out.append(s)
    return out


@dataclass
class Noise:
    """A request's random draws, made on first use.

    Unshared (one policy), each comes from ``rng`` where the serving rule asks for it, in
    the order it always has. Shared (a coupled canary), the exploration coin, one revival
    uniform per candidate and one Gumbel per candidate (by position in the search's
    result) are drawn once and used by both policies.

    >>> n = Noise(np.random.default_rng(0), shared=True)
    >>> n.explore() == n.explore(), n.gumbel(np.array([2, 0]), 3).tolist() == n.gumbel(np.array([2, 0]), 3).tolist()
    (True, True)
    >>> Noise(np.random.default_rng(0)).gumbel(np.array([0]), 3) is None
    True
    """

    rng: np.random.Generator
    shared: bool = False
    _explore: float | None = field(default=None, repr=False)
    _revive: np.ndarray | None = field(default=None, repr=False)
    _gumbel: np.ndarray | None = field(default=None, repr=False)

    def explore(self) -> float:
        if self._explore is None or not self.shared:
            self._explore = float(self.rng.random())
        return self._explore

    def revive(self, n: int) -> np.ndarray | None:
        """One uniform per candidate, shared; None: ``revive_dropped`` draws its own."""
        if not self.shared:
            return None
        if self._revive is None:
            self._revive = self.rng.random(n)
        return self._revive

    def gumbel(self, positions: np.ndarray, n: int) -> np.ndarray | None:
        """The Gumbel noise of the candidates at ``positions``, shared; None: the draw makes its own."""
        if not self.shared:
            return None
        if self._gumbel is None:
            self._gumbel = self.rng.gumbel(size=n)
        out: np.ndarray = self._gumbel[positions]
        return out


@dataclass
class Choice:
    """What one policy serves a request, and what its event logs."""

    policy: LoadedPolicy | None
    labels: np.ndarray  # the event's slot numbers of the searched candidates
    masks: np.ndarray
    keep: np.ndarray
    temperature: float
    selected: list[int]
    logprob: float
    probs: np.ndarray | None
    candidates: list[int]
    cand_scores: np.ndarray
    cand_masks: np.ndarray | None
    fallback: bool
    id_of: dict[int, str]  # event label -> memory id (memories by id)
    z: np.ndarray | None = None  # the draw's logits over ``candidates``
    # Cold start (contract 1.10): no policy yet, so the search's own ranking served, logged as a
    # fallback step; ``selected`` are the first k of the candidates found, in the search's order.
    # Contract 1.17: the same under a policy whose manifest says ``incumbent`` (not yet
    # certified), logged with every candidate found and ``incumbent: true``.
    wrapped: bool = False

    @property
    def incumbent(self) -> bool:
        """The search's own first k served under a policy not yet certified (contract 1.17)."""
        return self.wrapped and not self.fallback

    def logprob_of(self, read: tuple[int | str, ...]) -> float:
        """log-probability that this policy's draw serves ``read`` (:meth:`read`'s form); −inf if it cannot."""
        if self.fallback or self.z is None:
            return 0.0 if read == self.read() else -math.inf
        position = {(self.id_of[c] if self.id_of else c): i for i, c in enumerate(self.candidates)}
        if any(m not in position for m in read):
            return -math.inf
        return plackett_luce_logprob(self.z, [position[m] for m in read])

    @property
    def version(self) -> int:
        return self.policy.version if self.policy is not None else 0

    def read(self) -> tuple[int | str, ...]:
        """The memories served, in order, by id where they have one (two policies label them apart)."""
        if self.id_of:
            return tuple(self.id_of[s] for s in self.selected)
        return tuple(self.selected)


def choose(
    policy: LoadedPolicy | None,
    v: ServingValues,
    labels: np.ndarray,
    masks: np.ndarray,
    scores: np.ndarray,
    k: int,
    noise: Noise,
    revive: float,
    fallback: Callable[[], list[Any]],
    ids: list[str] | None = None,
) -> Choice:
    """The serving rule (docs/contract.md §6) for one request under ``policy`` served as ``v``.

    ``labels``/``masks``/``scores``: the searched candidates'; ``ids``: their memory ids
    (memories by id); ``fallback()``: what to serve when the hard drop keeps nothing (the
    memory ids of a text search with ``ids``, else slots); ``revive``: the chance an
    exploratory request gives each dropped candidate back.
    """
    explore = v.explore_rate > 0 and noise.explore() < v.explore_rate
    temperature = v.explore_temperature if explore else v.temperature
    if (policy is None or v.incumbent) and not explore:
        return _wrapped(policy, labels, masks, scores, k, temperature, ids)
    keep = keep_flags(masks, v.drop, v.drop_ratio)
    if explore and revive > 0:
        keep = revive_dropped(keep, revive, noise.rng, noise.revive(len(keep))) & np.isfinite(masks)
    kept = np.flatnonzero(keep)
    empty = np.zeros(0)
    if len(kept) == 0 and ids is not None:
        fb_ids = fallback()
        # One labelling for the found (all dropped) and the fallback's memories.
        everyone = ids + [i for i in fb_ids if i not in set(ids)]
        found = event_labels([policy.slot_of(i) if policy is not None else None for i in everyone])
        id_of = dict(zip(found, everyone, strict=True))
        selected = [found[everyone.index(i)] for i in fb_ids]
        labels = np.array(found[: len(ids)], dtype=np.int64)
        return Choice(policy, labels, masks, keep, temperature, selected, 0.0, None, [], empty, None, True, id_of)
    if len(kept) == 0:
        selected = [int(s) for s in fallback()][:k]
        return Choice(policy, labels, masks, keep, temperature, selected, 0.0, None, [], empty, None, True, {})
    alpha = policy.alpha if policy is not None else 0.0
    d = draw(scores[kept], masks[kept], alpha, temperature, k, noise.rng, noise.gumbel(kept, len(masks)))
    kept_labels = labels[kept]
    id_of = dict(zip(labels.tolist(), ids, strict=True)) if ids is not None else {}
    return Choice(
        policy,
        labels,
        masks,
        keep,
        temperature,
        [int(kept_labels[p]) for p in d.positions],
        d.logprob,
        d.probs,
        [int(s) for s in kept_labels],
        scores[kept],
        masks[kept],
        False,
        id_of,
        d.z,
    )


def _wrapped(
    policy: LoadedPolicy | None,
    labels: np.ndarray,
    masks: np.ndarray,
    scores: np.ndarray,
    k: int,
    temperature: float,
    ids: list[str] | None,
) -> Choice:
    """The first k candidates as the search found them: the client's own ranking, item for item.

    Without a policy (cold start, docs/contract.md §6 step 2b, 1.10) it is logged as a fallback
    step: no draw chose it, it counts in the metrics, not in the gradient or the rule's
    evidence. Under a policy not yet certified (an incumbent, step 2c, 1.17) it is logged with
    every candidate, its score and mask, so that the learner trains on it and values it as
    drawn from the manifest's mixture of the client's own ranking and the explored share.

    >>> c = _wrapped(None, np.array([7, 3, 5]), np.zeros(3), np.array([0.5, 0.9, 0.7]), 2, 0.05, None)
    >>> c.selected, c.fallback, c.wrapped, c.candidates
    ([7, 3], True, True, [])
    >>> c = _wrapped(object(), np.array([7, 3, 5]), np.ones(3), np.array([0.5, 0.9, 0.7]), 2, 0.001, None)
    >>> c.selected, c.candidates, c.fallback, c.incumbent, c.logprob  # the search's order, not the scores'
    ([7, 3], [7, 3, 5], False, True, 0.0)
    """
    id_of = dict(zip(labels.tolist(), ids, strict=True)) if ids is not None else {}
    every = np.ones(len(labels), dtype=bool)
    selected = [int(s) for s in labels[:k]]
    if policy is None:
        empty = np.zeros(0)
        return Choice(
            None, labels, masks, every, temperature, selected, 0.0, None, [], empty, None, True, id_of, wrapped=True
        )
    logged_masks = masks if np.isfinite(masks).all() else None
    candidates, cand_scores = [int(s) for s in labels], np.asarray(scores, np.float64)
    return Choice(
        policy, labels, masks, every, temperature, selected, 0.0, None, candidates, cand_scores, logged_masks, False,
        id_of, wrapped=True,
    )  # fmt: skip


def coupled(serving: Choice, canary: Choice, rng: np.random.Generator) -> tuple[Choice, str, Choice | None]:
    """The served choice of a coupled request, its arm and the choice not served: ``"tie"``
    (none) when both read the same memories in the same order, else the canary's with
    probability q = ``CANARY_SHARE``.

    The served choice's ``logprob`` becomes the true probability of what was served: a
    coupled request serves slate s with probability (1 − q)·π_serving(s) + q·π_canary(s)
    (given the shared exploration coin), ties included, which is what the learner's
    importance weights divide by (docs/contract.md §3).
    """
    # The coin only where the slates differ (a tie draws nothing more).
    arm = "tie" if serving.read() == canary.read() else "canary" if rng.random() < CANARY_SHARE else "serving"
    served, unserved = (canary, serving) if arm == "canary" else (serving, canary)
    if not served.fallback:
        share = CANARY_SHARE if served is canary else 1.0 - CANARY_SHARE
        mixture = np.logaddexp(
            math.log(share) + served.logprob, math.log(1.0 - share) + unserved.logprob_of(served.read())
        )
        served = dataclasses.replace(served, logprob=float(mixture))
    return served, arm, None if arm == "tie" else unserved
