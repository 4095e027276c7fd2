"""The learner's canary: a pending candidate judged on the requests it serves itself.

Off-policy estimates cannot judge what the logs do not cover: once the policy has
converged, its successors read sets that near-greedy traffic hardly ever read, and on LM
utilities (not additive over the memories read) the slate estimators' reward model is
wrong where they would need it (docs/learning.md, "The promotion gate"). So when the gate
cannot decide on a full candidate, it makes it the *canary* (contract 1.4): its manifest
is republished under ``"{policy}/canary"``, and clients serve it, as its manifest says,
on ``serving.canary_rate`` of their requests, marking their events ``canary: true``.

:class:`CanaryRun` reads the arms back from the learner's replay — the canary's events,
and the serving policy's events that arrived since the canary started — and judges
the difference of their mean utilities with a time-uniform interval
(:mod:`models.offpolicy.canary`), each utility adjusted by what earlier traffic says of its query.
The gate's rule applies: promoted when the lower bound is above −ε, refused when the
upper bound is below −ε; an undecided canary gives way to a newer candidate after
``canary_max`` canary decisions (or after the serving decisions that many canary
decisions should have come with, if clients do not serve canaries).

Where the serving parameters say ``canary_coupled`` (contract 1.5), clients draw both
slates on those requests instead, and the run judges the canary on them alone
(:mod:`models.offpolicy.coupled`), predicting each slate with a reward model fit on the window
before the canary started; a coupled canary gives way after ``canary_max`` requests
whose two slates differed.

Where clients serve no canary at all, :func:`canary_plan` stops starting them after
:data:`IDLE_CANARIES` canaries in a row that saw no canary decision, probes with one every
:data:`PROBE_AFTER_S`, and resumes once one sees canary decisions (:class:`CanaryBackoff`
keeps that state in the gate and logs each change once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from models.offpolicy.canary import CanaryArms, canary_verdict, neighbour_covariate
from models.offpolicy.coupled import CoupledArms, prior_second_moment
from models.offpolicy.estimators import Estimate
from models.offpolicy.logged import LoggedDecisions
from models.offpolicy.reward_model import AdditiveRewardModel
from models.policy.network import PolicyNetwork
from pipeline.config import Settings
from topics.internal import Experience
from topics.manifest import Manifest

log = logging.getLogger(__name__)


def is_canary(e: Experience) -> bool:
    """An experience of a request that a canary served or that a coupled canary drew
    (contract 1.5): not the serving policy's behaviour alone."""
    return bool(e.event.canary) or e.event.canary_arm is not None


@dataclass
class CanaryRun:
    """One canary: the candidate, since when it runs, and its arms read from the replay.

    ``before`` (the gate's window when it started, canary events left out) is the
    covariate's reference; ``since`` the newest event time in it, so that only the
    serving policy's events after the start count as its arm.
    """

    manifest: Manifest
    net: PolicyNetwork
    serving_version: int
    before: Sequence[Experience]
    rate: float
    max_decisions: int
    since: float = field(init=False)
    arms: CanaryArms = field(init=False)
    coupled: CoupledArms = field(init=False)  # contract 1.5: the requests that drew both slates
    model: AdditiveRewardModel | None = field(init=False, default=None)  # predicts a coupled request's slates
    _seen: set[str] = field(init=False, default_factory=set)
    _last: Experience | None = field(init=False, default=None)  # the newest one observed

    def __post_init__(self) -> None:
        base = [e for e in self.before if e.kind == "feedback" and not is_canary(e)]
        self.since = max((e.event.ts for e in base), default=0.0)
        emb = [e.event.features.query_embedding for e in base]
        before_u = np.array([e.utility for e in base], float)
        self.arms = CanaryArms(np.stack(emb) if emb else np.zeros((0, 1), np.float32), before_u)
        self.coupled = CoupledArms(prior_second_moment(before_u))
        decisions = LoggedDecisions.from_experiences(base)
        if len(decisions):  # fit on what came before: independent of every coupled request's coin
            self.model = AdditiveRewardModel().fit(decisions)

    @property
    def version(self) -> int:
        return self.manifest.version

    def observe(self, experiences: Sequence[Experience]) -> None:
        """Add the arms' new decisions (each event once) from the learner's replay.

        The replay only grows at its end: what follows the newest experience observed last
        time is new, found from the end (the whole replay is read only if it was trimmed
        past that one, and ``_seen`` keeps an event from counting twice even then).
        """
        start = 0
        if self._last is not None:
            for i in range(len(experiences) - 1, -1, -1):
                if experiences[i] is self._last:
                    start = i + 1
                    break
        arms: list[bool] = []
        utilities: list[float] = []
        queries: list[np.ndarray] = []
        drawn: list[Experience] = []  # coupled
        for e in experiences[start:]:
            ev = e.event
            if e.kind != "feedback" or ev.event_id in self._seen:
                continue
            if ev.canary_arm is not None:
                if ev.canary_version == self.version:
                    self._seen.add(ev.event_id)
                    drawn.append(e)
                continue
            canary = bool(ev.canary) and ev.policy_version == self.version
            serving = not ev.canary and ev.policy_version == self.serving_version and ev.ts > self.since
            if canary or serving:
                self._seen.add(ev.event_id)
                arms.append(canary)
                utilities.append(e.utility)
                queries.append(ev.features.query_embedding)
        if experiences:
            self._last = experiences[-1]
        if arms:
            self.arms.extend(arms, utilities, np.stack(queries))
        if drawn:
            self._extend_coupled(drawn)

    def _extend_coupled(self, drawn: list[Experience]) -> None:
        """Coupled requests' terms: predicted by the reward model where the event logs the other
        slate, else by the query's covariate for both slates."""
        served, other = np.zeros(len(drawn)), np.zeros(len(drawn))
        model = self.model
        # (An empty fallback slate has nothing for the model to average.)
        predicted = [model is not None and bool(e.event.canary_other) and bool(e.event.selected) for e in drawn]
        for i, e in enumerate(drawn):
            if predicted[i]:
                assert model is not None and e.event.canary_other is not None
                served[i] = float(model.values(np.asarray(e.event.selected, np.int64)).mean())
                other[i] = float(model.values(np.asarray(e.event.canary_other, np.int64)).mean())
        rest = [i for i, p in enumerate(predicted) if not p]
        if rest:
            q = np.stack([drawn[i].event.features.query_embedding for i in rest])
            served[rest] = other[rest] = neighbour_covariate(self.arms.before, self.arms.before_u, q)
        self.coupled.extend([str(e.event.canary_arm) for e in drawn], [e.utility for e in drawn], served, other)

    def judge(self, replay: Sequence[Experience], epsilon: float) -> tuple[str | None, Estimate | None]:
        """:meth:`observe` the replay, then :meth:`verdict`."""
        self.observe(replay)
        return self.verdict(epsilon)

    def verdict(self, epsilon: float) -> tuple[str | None, Estimate | None]:
        """``("promoted" | "refused" | "retired" | None, gain)``: None keeps it running.

        Coupled requests (contract 1.5) decide once there are enough of them; until then,
        and with clients that split requests the 1.4 way, the A/B arms do. A coupled canary
        gives way after ``max_decisions`` requests on which its slate differed from serving's.
        """
        coupled = self.coupled.gain(epsilon)
        if coupled is not None:
            decided = canary_verdict(coupled, epsilon, self.coupled.differing, self.max_decisions)
            return decided, coupled
        gain = self.arms.gain(epsilon)
        decided = self.arms.verdict(epsilon, self.max_decisions, gain)
        # Clients that do not serve canaries (older ones, or canary_rate 0 where they are
        # configured) leave the canary arm empty: retire after the serving decisions that
        # ``max_decisions`` canary decisions come with at the configured rate, twice over.
        # (At a rate of ½ or more, as many serving decisions as canary ones: a client may
        # load the canary a moment later than the learner starts it.)
        expected = 2.0 * self.max_decisions * max(1.0 - self.rate, 0.5) / max(self.rate, 1e-9)
        if decided is None and not len(self.coupled) and len(self.arms.serving) >= expected:
            decided = "retired"
        return decided, gain

    def describe(self, gain: Estimate | None) -> str:
        n = f"{len(self.arms.canary)} canary / {len(self.arms.serving)} serving decisions"
        if gain is not None and gain.method == "coupled":
            n = f"{len(self.coupled)} coupled decisions, {self.coupled.differing} differing"
        if gain is None:
            return f"canary v{self.version}: {n}"
        return f"canary v{self.version}: gain {gain.value:+.4f} in [{gain.low:+.4f}, {gain.high:+.4f}] on {n}"


# A learner whose clients serve no canary (a client written from the contract without 1.4, the
# adapters before they served one) would otherwise start a canary, retire it with "0 canary /
# N serving decisions", and start the next one, forever: each canary holds a full snapshot on
# every client and tells operators nothing. After this many canaries in a row that each ended
# with no canary decision, the learner starts none (the off-policy gate alone judges
# candidates) ...
IDLE_CANARIES = Settings.gate_canary_idle
# ... except one probe canary each time this long has passed since the last one ended: a
# client that starts serving canaries (an upgrade, a canary_rate turned on) shows up in it,
# and canaries resume once one sees canary decisions again.
PROBE_AFTER_S = Settings.gate_canary_probe_s


@dataclass(frozen=True)
class CanaryPlan:
    """Whether the gate may start a canary now, and whether canaries are paused (and why)."""

    start: bool
    paused: bool
    reason: str


def canary_plan(
    idle_streak: int,
    last_end: float | None,
    now: float,
    idle_canaries: int = IDLE_CANARIES,
    probe_after_s: float = PROBE_AFTER_S,
) -> CanaryPlan:
    """The canary back-off: ``idle_streak`` canaries in a row ended with no canary decision,
    the last of them at ``last_end``.

    >>> canary_plan(2, 100.0, 101.0).start
    True
    >>> p = canary_plan(3, 100.0, 101.0)
    >>> p.start, p.paused
    (False, True)
    >>> canary_plan(3, 100.0, 100.0 + PROBE_AFTER_S).start  # the probe
    True
    """
    if idle_streak < idle_canaries:
        return CanaryPlan(True, False, "")
    reason = (
        f"canaries paused: the last {idle_streak} canaries saw no canary decision (clients serve none); "
        f"the gate judges candidates on the logged decisions alone, one probe canary every {probe_after_s:.0f} s"
    )
    probe = last_end is None or now - last_end >= probe_after_s
    return CanaryPlan(probe, True, reason)


@dataclass
class CanaryBackoff:
    """The state :func:`canary_plan` decides on, kept by the gate across canaries; logs each change once."""

    idle_canaries: int = IDLE_CANARIES
    probe_after_s: float = PROBE_AFTER_S
    idle_streak: int = 0
    last_end: float | None = None

    def plan(self, now: float) -> CanaryPlan:
        return canary_plan(self.idle_streak, self.last_end, now, self.idle_canaries, self.probe_after_s)

    @property
    def paused(self) -> bool:
        return self.idle_streak >= self.idle_canaries

    def ended(self, run: CanaryRun, now: float) -> None:
        """A canary ended (by its own verdict): count it as idle if clients served it nowhere."""
        was = self.paused
        served = len(run.arms.canary) + len(run.coupled)
        self.idle_streak = 0 if served else self.idle_streak + 1
        self.last_end = now
        if self.paused and not was:
            log.warning("gate: %s", self.plan(now).reason)
        elif was and not self.paused:
            log.info("gate: canaries resume: canary v%d saw %d canary decisions", run.version, served)
