"""The client's one serving core: what ``CausalRetriever`` and the LangChain and LlamaIndex adapters share.

Every client front serves a request the same way (docs/contract.md §6, §7.2): the same
arm (the learner's canary on its share of requests, contract 1.4, or both policies drawn
together, 1.5), the same choice under that arm's policy (hard drop, exploration, revival
of dropped candidates on exploratory requests, Plackett–Luce draw, fallback), the same
random numbers in the same order, and the same RetrievalEvent. :class:`ServingCore` holds
a client's serving state (serving policy, canary, the serving values in force, the random
generator) and does all of it; a front only finds candidates and gives back what the
caller asked for.

The client's serving modules, from the bottom up (each imports only those above it):

* :mod:`pipeline.client.serving` — the serving rule's parts: the values in force (an
  explicit value, else the manifest's ``serving``), the policy's masks, the hard drop, the
  draw with its true log-probability;
* :mod:`pipeline.client.choice` — one request's choice under one policy, and the coupled
  pair of choices (contract 1.5);
* :mod:`pipeline.client.serving_core` (this module) — a client's serving state and one
  request served from the candidates a front found: arm, choice(s), canary fields, event;
* the fronts: :mod:`pipeline.client.retriever` (``CausalRetriever``, candidates from its own
  faiss index) and :mod:`pipeline.client.adapter` (candidates from the user's retriever,
  for :mod:`pipeline.client.langchain` and :mod:`pipeline.client.llamaindex`).

A front calls :meth:`ServingCore.arm` before it searches (so that the arm's policy's
features can be computed during the search), then :meth:`ServingCore.serve` with the
candidates found, then :meth:`ServingCore.event` for the event to publish.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from models.serving.params import ServingParams
from pipeline.client.choice import Choice, Noise, choose, coupled
from pipeline.client.serving import ServingValues, follow
from pipeline.client.subscriber import LoadedPolicy
from topics.events import Features, RetrievalEvent

log = logging.getLogger(__name__)

# The chance an exploratory request gives each dropped candidate back (docs/contract.md §6, step 3b);
# CausalRetriever's ``explore_revive`` defaults to the same value.
EXPLORE_REVIVE = 0.1
SHOWN_CANDIDATES = 10  # memory texts go out for the selected memories and the first candidates (the evaluator's)

ArmName = Literal["serving", "canary", "coupled"]


@dataclass(frozen=True)
class Arm:
    """Which policy serves one request: ``"serving"``, ``"canary"`` (an A/B canary serves it,
    contract 1.4) or ``"coupled"`` (the serving policy and ``other``, the canary, both draw,
    contract 1.5). The canary is read once here, so that another thread ending it cannot
    change a request half-way."""

    policy: LoadedPolicy | None
    values: ServingValues
    name: ArmName
    other: LoadedPolicy | None = None
    other_values: ServingValues | None = None
    # Contract 1.9: while a (not coupled) canary is held, the request was drawn from a mixture:
    # the other policy's version and the canary's share.
    mixture: tuple[int, float] | None = None
    # Contract 1.23: the probe whose manifest names ``policy`` as its base: this request, on the
    # share not explored, is drawn under the base and logged under the probe with ``base: true``.
    probe: LoadedPolicy | None = None


@dataclass(frozen=True)
class Found:
    """The candidates a front found for one request, in the search's order.

    ``labels``/``masks``: the event's slot numbers of the candidates and their masks under
    the arm's policy; ``scores``: their similarity (higher is better); ``fallback()``: what
    to serve when the hard drop keeps nothing (a *different* retriever's slots, or memory
    ids when ``ids`` is set); ``ids``: the candidates' memory ids when memories are named
    by id (contract 1.3); ``under(policy)``: the labels and masks under another policy (a
    coupled canary's).
    """

    labels: np.ndarray
    masks: np.ndarray
    scores: np.ndarray
    fallback: Callable[[], list[Any]]
    ids: list[str] | None = None
    under: Callable[[LoadedPolicy], tuple[np.ndarray, np.ndarray]] | None = None


@dataclass(frozen=True)
class Slate:
    """One request served: the served choice, its arm and the canary fields of its event."""

    choice: Choice
    arm: Arm
    canary_arm: str | None = None  # coupled requests: "tie", "canary" or "serving"
    unserved: Choice | None = None  # coupled requests whose slates differed: the other policy's
    by_id: bool = False

    @property
    def canary(self) -> bool | None:
        """``True`` when the canary's slate was served (absent otherwise, as the contract writes it)."""
        return True if self.arm.name == "canary" or self.canary_arm == "canary" else None

    @property
    def canary_version(self) -> int | None:
        return self.arm.other.version if self.canary_arm is not None and self.arm.other is not None else None

    @property
    def canary_rate(self) -> float | None:
        return self.arm.mixture[1] if self.arm.mixture is not None and self.arm.mixture[1] < 1.0 else None

    @property
    def alternative_version(self) -> int | None:
        return self.arm.mixture[0] if self.canary_rate is not None and self.arm.mixture is not None else None

    @property
    def canary_other(self) -> list[int] | None:
        """The slate not served, by slot (labels by id are each policy's own, so clients by id leave it out)."""
        if self.unserved is None or self.by_id:
            return None
        return list(self.unserved.selected) or None


def scaled(values: ServingValues, scale: float) -> ServingValues:
    """``values`` with the hard drop's threshold times ``scale`` (a fixed τ, or the dynamic drop's ratio).

    >>> v = scaled(ServingValues(0.05, 0.2, 0.01, 0.0, 0.25), 2.0)
    >>> v.drop, v.drop_ratio
    (0.4, 0.02)
    """
    if scale == 1.0:
        return values
    drop = values.drop if isinstance(values.drop, str) else float(values.drop) * scale
    return dataclasses.replace(values, drop=drop, drop_ratio=values.drop_ratio * scale)


class ServingCore:
    """A client's serving state, and one request served under it.

    Parameters
    ----------
    k
        Memories served per request.
    explicit
        Serving values the client fixes (``temperature``, ``drop``, ``explore_rate``,
        ``explore_temperature``, ``canary_rate``); the rest follow the loaded manifest's
        ``serving`` (:func:`pipeline.client.serving.follow`).
    explore_revive
        The chance an exploratory request gives each dropped candidate back (0: never).
    seed
        Of the random generator every draw of every request comes from.
    """

    def __init__(
        self, *, k: int, explicit: Mapping[str, Any], explore_revive: float = EXPLORE_REVIVE, seed: int | None = None
    ) -> None:
        self.k = k
        self.explicit = {name: value for name, value in explicit.items() if value is not None}
        self.values = follow(None, self.explicit)
        self.explore_revive = explore_revive
        self.policy: LoadedPolicy | None = None
        self.canary: LoadedPolicy | None = None  # contract 1.4: served on canary_rate of the requests
        self.canary_values: ServingValues | None = None  # how the canary is served (its own manifest's)
        # Contract 1.23: the certified version a probe's manifest names, served on the share not explored.
        self.base: LoadedPolicy | None = None
        self.rng = np.random.default_rng(seed)

    def set_policy(self, policy: LoadedPolicy | None) -> None:
        """Serve ``policy``, by its manifest's ``serving`` except where the client fixed a value.

        A probe over a certified version (contract 1.23) names the version served before it as its
        base: the core keeps that one and serves it on the share not explored. A client that does
        not hold it (it started while the probe serves) cannot serve the probe as the learner
        values it: it keeps serving what it serves, as a reader before 1.23 does, and says so.
        """
        params = policy.serving if policy is not None else None
        wanted = params.base if params is not None else None
        held = [p for p in (self.policy, self.base) if p is not None and p.version == wanted]
        if wanted is not None and not held and policy is not None:
            now = f"v{self.policy.version}" if self.policy is not None else "no policy (the index's own ranking)"
            log.warning("client: v%d is a probe over v%d, which this client does not hold: it keeps serving %s",
                        policy.version, wanted, now)  # fmt: skip
            return
        self.base = held[0] if held else None
        self.policy = policy
        if params is not None:
            self.follow(params)

    def follow(self, params: ServingParams) -> None:
        """Serve by ``params`` except where the client fixed a value."""
        self.values = follow(params, self.explicit)

    def set_canary(self, canary: LoadedPolicy | None) -> None:
        """Hold the learner's canary (None: it ended), served as its own manifest says."""
        self.canary_values = follow(canary.serving, self.explicit) if canary is not None else None
        self.canary = canary

    def arm(self) -> Arm:
        """This request's arm; the canary's arms take ``canary_rate`` of the requests (one draw, only
        while a canary is held and the rate is above 0)."""
        canary, values, own, policy = self.canary, self.canary_values, self.values, self.policy
        if canary is None or values is None or own.canary_rate <= 0:
            return self._own(Arm(policy, own, "serving"))
        split = policy is not None and canary is not policy and not own.canary_coupled
        if self.rng.random() < own.canary_rate:
            if canary is policy:
                return Arm(canary, values, "serving")
            if own.canary_coupled:
                return self._own(Arm(policy, own, "coupled", canary, values))
            mixture = (policy.version, own.canary_rate) if split and policy is not None else None
            return Arm(canary, values, "canary", mixture=mixture)
        return self._own(Arm(policy, own, "serving", mixture=(canary.version, own.canary_rate) if split else None))

    def _own(self, arm: Arm) -> Arm:
        """The serving policy's arm; under a probe over a certified version (contract 1.23), the
        exploration coin tossed here: the explored share draws under the probe, the rest under its base."""
        if self.base is None or arm.policy is None:
            return arm
        if arm.values.explore_rate > 0 and self.rng.random() < arm.values.explore_rate:
            return dataclasses.replace(arm, values=dataclasses.replace(arm.values, explore_rate=1.0))
        values = dataclasses.replace(arm.values, explore_rate=0.0)
        return dataclasses.replace(arm, policy=self.base, values=values, probe=arm.policy)

    def serve(self, arm: Arm, found: Found, drop_scale: float = 1.0, k: int | None = None) -> Slate:
        """Serve one request from ``found`` under ``arm`` (``drop_scale``: the hard drop's threshold times
        it; ``k``: this request's number of memories, None: :attr:`k`)."""
        k = self.k if k is None else k
        noise = Noise(self.rng, shared=arm.name == "coupled")
        c = self._choose(arm.policy, scaled(arm.values, drop_scale), found.labels, found.masks, found, noise, k)
        if arm.name == "coupled" and arm.other is not None and arm.other_values is not None:
            if found.under is None:
                raise ValueError("a coupled canary needs the candidates' masks under the canary (Found.under)")
            labels, masks = found.under(arm.other)
            o = self._choose(arm.other, scaled(arm.other_values, drop_scale), labels, masks, found, noise, k)
            served, canary_arm, unserved = coupled(c, o, self.rng)
            return Slate(served, arm, canary_arm, unserved, by_id=found.ids is not None)
        return Slate(c, arm, by_id=found.ids is not None)

    def _choose(
        self,
        policy: LoadedPolicy | None,
        values: ServingValues,
        labels: np.ndarray,
        masks: np.ndarray,
        found: Found,
        noise: Noise,
        k: int,
    ) -> Choice:
        return choose(
            policy, values, labels, masks, found.scores, k, noise, self.explore_revive, found.fallback, found.ids
        )

    def event(
        self,
        slate: Slate,
        *,
        policy_name: str,
        query_id: str,
        step: int,
        features: Features,
        ts: float | None = None,
        query_text: str | None = None,
        text_of: Callable[[int], str | None] | None = None,
        text_limit: int | None = None,
    ) -> RetrievalEvent:
        """The RetrievalEvent that logs ``slate`` (docs/contract.md §2).

        ``text_of(label)``: a memory's text (None: the front sends no memory texts); texts go
        out for the selected memories and the first :data:`SHOWN_CANDIDATES` candidates, cut
        at ``text_limit`` characters.
        """
        c = slate.choice
        # Contract 1.23: drawn under a probe's base (a coupled canary's slate is the canary's own).
        probe = slate.arm.probe if c.policy is slate.arm.policy else None
        drawn_by_base = probe is not None
        memory_texts: dict[int, str] | None = None
        if text_of is not None:
            shown = dict.fromkeys([*c.selected, *c.candidates[:SHOWN_CANDIDATES]])
            texts = {s: text_of(s) for s in shown}
            memory_texts = {s: t[:text_limit] for s, t in texts.items() if t is not None} or None
        return RetrievalEvent(
            event_id=uuid.uuid4().hex,
            query_id=query_id,
            step=step,
            ts=time.time() if ts is None else ts,
            features=features,
            candidates=c.candidates,
            scores=c.cand_scores,
            selected=c.selected,
            temperature=c.temperature,
            logprob=float(c.logprob),
            fallback=c.fallback,
            policy=policy_name,
            policy_version=probe.version if probe is not None else c.version,
            mask_max=float(c.masks.max()) if len(c.masks) and np.isfinite(c.masks).all() else None,
            query_text=query_text,
            memory_texts=memory_texts,
            dropped=[int(s) for s in c.labels[~c.keep]],
            candidate_masks=c.cand_masks,
            candidate_probs=c.probs,
            candidate_ids=[c.id_of[s] for s in c.candidates] if slate.by_id else None,
            canary=slate.canary,
            canary_arm=slate.canary_arm,
            canary_version=slate.canary_version,
            canary_other=slate.canary_other,
            canary_rate=slate.canary_rate,
            alternative_version=slate.alternative_version,
            incumbent=True if c.incumbent else None,
            base=True if drawn_by_base and not c.fallback else None,
        )
