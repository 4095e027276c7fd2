"""The promotion rule: one promise, one state machine, ``decide(state, event) → (state, actions)``.

**The promise.** With probability ≥ 1 − δ, at every moment of a run of any length and any
number of candidates, the policy served (as its manifest says to serve it) is

* not worse than similarity-only retrieval (the client's own ranking) by more than ε, and
* the anchors only ever improve, after at most one step within ε of similarity-only: a
  version becomes the anchor only when the log shows it better than the anchor before it.

So the served policy is never worse than similarity-only, nor than any anchor before, by
more than ε: the margin is spent once and does not add up over promotions. Each step is a test
of its own, and all tests hold together at every moment (anytime-valid sequences whose error
rates add up to δ), so the sum of the steps' lower bounds is a valid bound too.

**The rule.** Each candidate the learner publishes starts a *trial*: an anytime-valid
confidence sequence (:class:`models.offpolicy.confidence.GainSequence`) for its gain over the
anchor, fed with the decisions the learner applies *after* the candidate was published — data
the candidate was not trained on, so it is always tested on data it was not chosen on (a
Seldonian safety test, Thomas et al. 2019), and the learner still trains on every decision.
Trial j of a learner's run gets the error rate s/2 · 1/(j(j+1)), s the run's share of δ
(**Restarts**, below; :func:`models.offpolicy.confidence.spend`): the rates of all trials add up
to s/2, the guardrail has the other half, and each trial may be looked at after every batch. A new
candidate starts a trial only once the newest open one has had its ``trial_decisions`` (it
takes the place of one that has seen none); otherwise it is passed over. The newest trial's
candidate is the canary, so each trial keeps the canary's draws, the evidence it needs, until
it has had a fair test.
After each batch, the newest trial whose lower bound is

* above 0 (the candidate is shown better than the anchor), or, when the anchor is
  similarity-only, above −ε,

and for which the anchor's *margin* (its own certified lower bound over similarity-only, 0 for
similarity-only) plus that lower bound stays above −ε, is **promoted**: served, and the new
anchor, with that sum as its margin (``improved`` where the bound is above 0, else
``within-epsilon``). So ε is spent at most once: after a version served within ε of
similarity-only, every promotion must improve on the version served, and each served version
is compared with the one clients serve now, whose reads the log shows. A trial whose upper
bound is below 0 is **refused** with evidence that the candidate is worse than the anchor
(``worse``): its trial ends and nothing else changes. The learner trains on: its later
candidates start trials of their own (sending training back to the serving weights threw away
what it learnt, docs/promotion.md). A trial neither promoted nor refused
**waits**, and its bounds say what it waits for; it is never evidence against the candidate.
Older trials than one promoted end (``superseded``); newer ones start again against the new
anchor (or end too, where the promotion goes out as a copy: **Probes**, below).

**Probes.** While nothing is certified (clients serve an *incumbent*: their own ranking but on
the exploration share), each candidate whose trial opens after decisions were gathered is first
served as a :class:`Probe`: an incumbent carrying its weights, so that the exploration share
draws from the candidate, which is the evidence its trial needs where clients serve no canary.
Once a version is certified, a probe is served over it (contract 1.23: the anchor on the share not
explored). A probe takes a version above every open trial's candidate, and clients refuse a
serving version older than one they hold: a candidate promoted after a probe is published again,
its weights under a new version (``Action.republish``): the candidate is the anchor at once, and
its copy, once served, the served version and the anchor (:attr:`State.awaiting`).

**The guardrail.** What clients served as the serving manifest asks, on the decisions logged
while it served, is compared with similarity-only by the same kind of sequence, two ways
(:class:`Guard`): its gain valued on those decisions, and, for a version served without a test
of its own (a probe, an operator's command), its value there (on-policy) against
similarity-only's measured while clients served an incumbent (:attr:`State.baseline`: valid
while queries and utilities come as they came then). Where either shows it worse by more than
ε, it is **rolled back** to the anchor (or to the first policy, when the served version is the
anchor): the learner publishes that version's weights again, and the guardrail watches what
clients serve until the copy comes. This is a check on what is actually served, under whatever
the estimators' inputs got wrong.

**Restarts.** Each start of a learner (its epoch e) spends δ/(e(e+1)) of δ (:attr:`State.share`),
so the tests of all runs add up to δ; a learner restarted while a certified version serves
starts from it as the anchor, with the margin its promotion recorded (:meth:`State.start`).

The learner's async code only gathers the evidence (the probabilities, under each version
as served, of the sets each decision read) and carries out the actions; the lab
calls the same :func:`decide`.

>>> s = State.start(serving=1)
>>> s, acts = decide(s, Candidate(2), Rule())
>>> [a.kind for a in acts], s.trials[0].version
(['trial'], 2)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from models.offpolicy.confidence import MIN_DECISIONS, GainSequence, spend
from topics.fields import PROBE

SIMILARITY = 0  # the version number of similarity-only retrieval (plain top-k): the first anchor
# Checkpoints served at once, without a trial: the first policy, a rollback, a drift reset (the
# detector has just shown that the served policy no longer agrees with human judgement), shadow
# mode's cut-over, a "do not use" (pipeline/learner/control.py) and a probe (below, :class:`Probe`).
SERVED_AT_ONCE = ("init", "rollback", "reset", "cutover", "suppress", PROBE)

ActionKind = Literal["trial", "promote", "refuse", "wait", "rollback", "superseded", "copy"]


def is_candidate(reason: str, gated: bool) -> bool:
    """Whether a checkpoint published for ``reason`` starts a trial (else it is served at once).

    A label fine-tune is a candidate like any other: what experts answered is served once the
    rule shows it better, as everything served is.

    >>> is_candidate("periodic", True), is_candidate("label", True), is_candidate("reset", True)
    (True, True, False)
    >>> is_candidate("periodic", False)  # no gate: every checkpoint serves
    False
    """
    return gated and reason not in SERVED_AT_ONCE


@dataclass(frozen=True)
class Rule:
    """The rule's parameters.

    Parameters
    ----------
    delta
        The error rate of the whole run's promise.
    epsilon
        The margin: how much worse than the anchor (utility units) a promoted version may be.
    max_trials
        Trials open at once; a newer candidate ends the oldest (``superseded``).
    trial_decisions
        The decisions the newest trial is fed before a newer candidate may start one (and take
        the canary). A trial passed over after ~200 decisions kept the canary's draws for only
        that long, and its bounds stayed ±1 on the demo's world; at 2,000 the served version lagged
        the learner on the real-data world (docs/promotion.md, rule 2).
    """

    delta: float = 0.05
    epsilon: float = 0.02
    max_trials: int = 3
    trial_decisions: int = 1000

    def __post_init__(self) -> None:
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), not {self.delta!r}")
        if not self.epsilon >= 0.0:
            raise ValueError(f"epsilon must be >= 0, not {self.epsilon!r}")
        if self.max_trials < 1:
            raise ValueError("max_trials must be >= 1")
        if self.trial_decisions < MIN_DECISIONS:
            raise ValueError(f"trial_decisions must be >= {MIN_DECISIONS} (what a bound needs)")


@dataclass(frozen=True)
class Trial:
    """A candidate under test: its gain over ``anchor``, from the decisions applied after it started."""

    version: int
    anchor: int
    index: int  # the trial's number in the run (its share of δ)
    bounds: GainSequence

    def interval(self) -> tuple[float, float] | None:
        """The gain's interval after the decisions seen so far (None before a bound)."""
        b = self.bounds
        return (b.low, b.high) if b.n >= MIN_DECISIONS else None

    def describe(self) -> str:
        b = self.bounds
        if b.n == 0:
            return f"v{self.version}: no decisions yet"
        return f"v{self.version} over v{self.anchor}: gain in [{b.low:+.4f}, {b.high:+.4f}] after {b.n} decisions"


@dataclass
class Guard:
    """The guardrail's view of the served version (its decisions since it was served), two ways,
    each with its own share of the guardrail's δ:

    - ``gain``: its gain over similarity-only, both valued on its own decisions (similarity-only's
      reads are those the served version's draws happened to share with plain top-k);
    - ``value``: its own value, on those decisions (on-policy: as clients served it), to set
      against similarity-only's value measured under an incumbent (:attr:`State.baseline`), on
      earlier decisions: valid while queries and utilities come as they came then.

    A near-greedy served version rarely reads plain top-k's sets, so the first way can stay
    unsure however far below similarity-only it is; the second sees it, where the run began
    with an incumbent. The second judges only a version served without a test of its own (a
    probe, an operator's command), not a certified anchor.
    """

    gain: GainSequence
    value: GainSequence

    def high(self, baseline: GainSequence | None) -> float:
        """The gain's upper bound, the tighter of the two ways."""
        against = self.value.high - baseline.low if baseline is not None else math.inf
        return min(self.gain.high, against)

    def low(self, baseline: GainSequence | None) -> float:
        against = self.value.low - baseline.high if baseline is not None else -math.inf
        return max(self.gain.low, against)


@dataclass(frozen=True)
class State:
    """What the rule knows: the version served, the anchor, the open trials and the guardrail."""

    serving: int
    anchor: int = SIMILARITY
    first: int = 1  # the first policy of the run (what a rollback of the anchor itself goes to)
    # The first policy's certified margin, where a restarted learner started from a certified
    # version (State.start): a rollback to it makes it the anchor again. None: not certified.
    first_margin: float | None = None
    trials: tuple[Trial, ...] = ()
    tests: int = 0  # trials started in the run (δ spent)
    # The anchor's certified lower bound over similarity-only (0 for similarity-only itself): the
    # sum of the lower bounds of the promotions that led to it, each from a test of its own.
    margin: float = 0.0
    guard: Guard | None = None  # the served version against similarity-only, on its own decisions
    guards: int = 0  # guardrail sequences started (their own share of δ)
    # Similarity-only's value, measured while clients served it: on the decisions logged under an
    # incumbent (``incumbents``), which read the client's own ranking but on the exploration share.
    baseline: GainSequence | None = None
    baselines: int = 0  # baseline sequences started (a drift reset starts one: the world changed)
    incumbents: frozenset[int] = frozenset()
    # The served version is an incumbent (contract 1.17): clients serve their own ranking but on
    # the exploration share, which draws from its weights (the first policy's, or a probe's, 1.19).
    incumbent: bool = False
    # The incumbent a probe replaced: decisions logged under it (a canary mixed with it among
    # them) are still arriving, and are valued only while its probabilities are.
    before: int | None = None
    # The served version is a probe over this certified anchor (contract 1.23): clients serve the
    # anchor on the share not explored, the probe's weights on the exploration share.
    base: int | None = None
    # The version the rule asked to be published again under a new version (a rollback's target, a
    # promotion after a newer probe: Action.republish), until that copy is served (ServedAtOnce) or
    # the learner gives up on it (Withdrawn). Served at once, the copy ends every trial, so none
    # opens meanwhile; nor is a probe published (clients must hold the version a probe names).
    # Until the copy is served, clients serve what they held: ``serving`` (and ``incumbent``,
    # ``base``, ``before``, the guardrail's view) still describe it, so a copy that never comes
    # leaves the guardrail watching what is actually served.
    awaiting: int | None = None
    # This learner run's share of δ: the learner's epoch e (each start of a learner is one) spends
    # 1/(e(e+1)) of it, so the tests of all runs of a deployment add up to δ as well (State.start;
    # the default, the whole δ, is for a state built by hand).
    share: float = 1.0

    @classmethod
    def start(
        cls,
        serving: int,
        incumbent: bool = False,
        *,
        margin: float | None = None,
        epoch: int = 1,
        baseline: GainSequence | None = None,
    ) -> State:
        """The state at a learner's start: ``serving`` served at once, similarity-only the anchor;
        or, where ``serving`` was certified (``margin``: its certified lower bound over
        similarity-only, as its promotion recorded it), ``serving`` the anchor: a restarted learner
        goes on from what was certified. Trials against similarity-only, whose reads a near-greedy
        log does not show, would never decide (docs/promotion.md). ``baseline``: similarity-only's
        value as an earlier run measured it under an incumbent (:attr:`baseline`), which the
        guardrail goes on judging by (a certified version is served near-greedily: no incumbent
        measures it again).

        >>> s = State.start(7, margin=0.03, epoch=2)
        >>> s.anchor, s.margin, round(s.share, 4)
        (7, 0.03, 0.1667)
        """
        anchor = serving if margin is not None else SIMILARITY
        return cls(
            serving=serving,
            anchor=anchor,
            first=serving,
            margin=margin or 0.0,
            first_margin=margin,
            incumbent=incumbent,
            incumbents=frozenset([serving] * incumbent),
            share=spend(epoch, 1.0),
            baseline=baseline,
        )

    def versions(self) -> set[int]:
        """The versions whose probabilities the next evidence must carry."""
        out = {SIMILARITY, self.serving, self.anchor}
        out.update(v for v in (self.before, self.base, self.awaiting) if v is not None)
        if self.incumbent:
            out.add(self.first)  # a client before 1.19 rejects the probes and serves the first policy
        for t in self.trials:
            out.update((t.version, t.anchor))
        return out


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Candidate:
    """The learner published candidate ``version``."""

    version: int


@dataclass(frozen=True)
class ServedAtOnce:
    """A version served without a trial (a rollback, a drift reset, an operator's command).

    ``reanchor``: the anchor goes back to similarity-only (a drift reset: what was certified
    describes the world before the change); else it stays. ``incumbent``: its manifest says so.
    A drift reset served as an incumbent is the run's first policy from then on: nothing is
    certified, as at the start, and a rollback goes back to it. So is an incumbent served at
    once while nothing is certified (a rollback to the first policy is republished as a copy of
    it): the guardrail judges it no more than it judges the first policy. ``copy_of``: the
    version whose weights it republishes (a rollback): a copy of the anchor is the anchor, with
    its margin, and a copy of the first policy, while it is the anchor or nothing is certified,
    the first policy; the guardrail judges neither as a version served without a test.
    """

    version: int
    reanchor: bool = False
    incumbent: bool = False
    copy_of: int | None = None


@dataclass(frozen=True)
class Probe:
    """The learner published ``version``, a *probe* (contract 1.19): an incumbent whose weights are
    those of the candidate it publishes next. Clients serve their own ranking on the share not
    explored, as under the first policy, and draw the exploration share from the candidate's
    weights, which is the evidence a trial needs where clients serve no canary. Served at once
    (as served it differs from the incumbent before it only on the exploration share, which the
    guardrail watches); the trials go on. One the rule did not ask for (:func:`probes`: a learner
    restarted under a probe over a version it does not take as certified) is served all the same,
    and judged as any version served at once (``incumbent``: its manifest says so)."""

    version: int
    incumbent: bool = True


@dataclass(frozen=True)
class Evidence:
    """A batch of decisions, in the order they were logged.

    ``probs[v]``: each decision's probability, under version ``v`` as served (its manifest's
    serving parameters; :data:`SIMILARITY` is plain top-k), of the set it read; ``logging``:
    the same under the policy that drew it; ``utility``: its utility; ``version``: the
    version that logged it.

    Bounds without a model of the reward (Thomas et al. 2015 clip importance weights for a lower
    bound on non-negative returns; here both ends): with weights clipped at ``clip``, the mean of
    ``min(w_v, clip)·u`` misses the probability a version puts beyond the clip (sets the log shows
    too rarely, or never), and that mass is valued at the utility's extremes, ``worst`` for the
    lower bound and ``best`` for the upper: ``low[v]`` and ``high[v]`` are those terms. A reward
    model, fit only on other decisions, is a control variate: ``direct[v]`` its value of what
    ``v`` reads within the clip, ``fitted`` its prediction for the set read (NaN: no correction),
    so the terms are ``direct_v + min(w_v, clip)·(u − fitted) + low_v`` (``high_v``), whose mean
    bounds V(v) whatever the model predicts.
    """

    utility: np.ndarray
    logging: np.ndarray
    version: np.ndarray
    probs: Mapping[int, np.ndarray]
    fitted: np.ndarray | None = None
    direct: Mapping[int, np.ndarray] = field(default_factory=dict)
    low: Mapping[int, np.ndarray] = field(default_factory=dict)
    high: Mapping[int, np.ndarray] = field(default_factory=dict)
    clip: float = float("inf")
    # Contract 1.9's canary mix each decision was drawn from: the other version of the mix (the
    # canary for a serving-arm draw, the serving version for a canary-arm one; -1: no mix) and
    # the canary's share ρ (None: no decision was drawn from a mix).
    mixed_with: np.ndarray | None = None
    mix_share: np.ndarray | None = None

    def weights(self, v: int) -> np.ndarray:
        p = self.probs[v]
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(self.logging > 0, p / self.logging, 0.0)
        out: np.ndarray = np.minimum(np.nan_to_num(w, nan=0.0, posinf=0.0), self.clip)
        return out

    def bounds(self, v: int) -> tuple[np.ndarray, np.ndarray]:
        """Each decision's terms of a lower and an upper bound on V(v) (without a model and
        unclipped, both are ``w_v·u``, whose mean is V(v))."""
        if self.fitted is None:
            plain: np.ndarray = self.weights(v) * self.utility
            return plain, plain
        residual = np.where(np.isnan(self.fitted), 0.0, self.utility - np.nan_to_num(self.fitted))
        known: np.ndarray = self.weights(v) * residual + self.direct.get(v, 0.0)
        zero = np.zeros(len(self.utility))
        return known + self.low.get(v, zero), known + self.high.get(v, zero)

    def gains(self, c: int, a: int) -> tuple[np.ndarray, np.ndarray]:
        """Each decision's terms of the gain V(c) − V(a): for its lower bound and for its upper bound.

        >>> ev = Evidence(np.array([1.0]), np.array([0.5]), np.array([1]), {1: np.array([0.5]), 2: np.array([1.0])})
        >>> [t.tolist() for t in ev.gains(2, 1)]  # (2 − 1)·(1 − 0)
        [[1.0], [1.0]]
        """
        (c_low, c_high), (a_low, a_high) = self.bounds(c), self.bounds(a)
        return c_low - a_high, c_high - a_low

    def subset(self, rows: np.ndarray) -> Evidence:
        return Evidence(
            self.utility[rows],
            self.logging[rows],
            self.version[rows],
            {v: p[rows] for v, p in self.probs.items()},
            None if self.fitted is None else self.fitted[rows],
            {v: d[rows] for v, d in self.direct.items()},
            {v: d[rows] for v, d in self.low.items()},
            {v: d[rows] for v, d in self.high.items()},
            self.clip,
            None if self.mixed_with is None else self.mixed_with[rows],
            None if self.mix_share is None else self.mix_share[rows],
        )

    def served_values(self, serving: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The value of what clients served as ``serving``'s manifest asked, per decision they
        served that way: (the decisions' rows, the lower bound's terms, the upper's). Where a
        decision came from a canary mix, what was served is the mix, ``(1 − ρ)·serving + ρ·canary``,
        and so are its terms (they are linear in the policy valued); a mix whose canary this
        evidence does not value is left out.

        >>> ev = Evidence(np.array([1.0, 0.0]), np.array([0.5, 0.5]), np.array([1, 2]),
        ...               {0: np.array([0.5, 0.5]), 1: np.array([0.5, 0.5]), 2: np.array([0.5, 0.5])},
        ...               mixed_with=np.array([2, 1]), mix_share=np.array([0.2, 0.2]))
        >>> rows, low, high = ev.served_values(1)
        >>> rows.tolist(), low.tolist()  # both arms of v1's mix with canary v2
        ([0, 1], [1.0, 0.0])
        """
        own = self.version == serving
        if self.mixed_with is None or self.mix_share is None:
            rows = np.flatnonzero(own)
            low, high = self.subset(rows).bounds(serving)
            return rows, low, high
        canary = np.where(own, self.mixed_with, self.version)
        served = own | (self.mixed_with == serving)
        valued = (canary < 0) | np.isin(canary, list(self.probs))
        rows = np.flatnonzero(served & valued)
        sub = self.subset(rows)
        low, high = (b.copy() for b in sub.bounds(serving))  # written in place below (both may be one array)
        share = np.where(canary[rows] >= 0, self.mix_share[rows], 0.0)
        for c in np.unique(canary[rows]):
            if c < 0 or c == serving:
                continue
            at = np.flatnonzero(canary[rows] == c)
            c_low, c_high = sub.subset(at).bounds(int(c))
            low[at] = (1.0 - share[at]) * low[at] + share[at] * c_low
            high[at] = (1.0 - share[at]) * high[at] + share[at] * c_high
        return rows, low, high

    def logged_under(self, versions: frozenset[int]) -> np.ndarray:
        """The rows drawn by one of ``versions`` (or by a canary mix with one)."""
        under = np.isin(self.version, list(versions))
        if self.mixed_with is not None:
            under |= np.isin(self.mixed_with, list(versions))
        return np.flatnonzero(under)


@dataclass(frozen=True)
class Withdrawn:
    """The learner can no longer serve ``version`` as published: a candidate's trial ends (a delta
    whose base is no longer served), or the copy the rule asked for (:attr:`State.awaiting`) was not
    published: trials go on, and clients keep what they hold (the guardrail asks for a rollback
    again where it still shows harm, and a look that promotes nothing for a promotion's copy
    (``copy``); no probe is published over a version they do not hold)."""

    version: int


Event = Candidate | ServedAtOnce | Probe | Withdrawn | Evidence


@dataclass(frozen=True)
class Action:
    """What the learner does: ``kind``, the version it is about, and why (the path taken)."""

    kind: ActionKind
    version: int
    reason: str
    path: str = ""  # promote: "improved" | "within-epsilon"; refuse: "worse"; rollback: "guardrail"
    to: int | None = None  # rollback: the version served instead
    # promote, refuse, wait: the trial's gain interval over its anchor at this look (None: no bound yet)
    interval: tuple[float, float] | None = None
    # promote: clients were told to serve a newer version since the candidate was published (a
    # probe), and versions only grow on the serving key: its weights are published again under a
    # new version (a copy, ``rolled_back_to`` it), which the rule then takes as the anchor.
    republish: bool = False


# --------------------------------------------------------------------------- decide


def decide(state: State, event: Event, rule: Rule) -> tuple[State, list[Action]]:
    """The next state and the actions, for one event. Pure: ``state`` is not changed."""
    if isinstance(event, Candidate):
        return _candidate(state, event, rule)
    if isinstance(event, Withdrawn):
        trials = tuple(t for t in state.trials if t.version != event.version)
        awaiting = None if event.version == state.awaiting else state.awaiting
        if len(trials) == len(state.trials):
            return replace(state, awaiting=awaiting), []
        return replace(state, trials=trials, awaiting=awaiting), [
            Action("superseded", event.version, "withdrawn by the learner")
        ]
    if isinstance(event, ServedAtOnce):
        anchor, margin = (SIMILARITY, 0.0) if event.reanchor else (state.anchor, state.margin)
        copy_of = None if event.reanchor else event.copy_of
        if copy_of is not None and copy_of == anchor != SIMILARITY:
            anchor = event.version  # the anchor's weights under a new version: still certified
        ended = [Action("superseded", t.version, f"v{event.version} served at once") for t in state.trials]
        served = replace(state, serving=event.version, anchor=anchor, margin=margin, trials=(), guard=None)
        # An incumbent served at once while nothing is certified (a drift reset, or the learner's copy of
        # the first policy that a rollback republishes) is the run's first policy from then on.
        fresh = event.incumbent and (event.reanchor or state.anchor == SIMILARITY)
        first, first_margin = (event.version, None) if fresh else (state.first, state.first_margin)
        if copy_of is not None and copy_of == state.first and anchor in (SIMILARITY, event.version):
            # Nothing else certified, or the first policy is the anchor (its margin stays): under
            # another anchor a copy of the first policy is judged as any version served at once.
            first = event.version
        if event.reanchor:  # a drift reset: similarity-only's value is measured again, in the new world
            served = replace(served, baseline=None, incumbents=frozenset())
        if event.incumbent:
            served = replace(served, incumbents=served.incumbents | {event.version})
        served = replace(served, incumbent=event.incumbent, before=None, base=None, awaiting=None)
        return replace(served, first=first, first_margin=first_margin), ended
    if isinstance(event, Probe):
        if event.version <= state.serving:
            return state, [Action("superseded", event.version, f"not newer than the served v{state.serving}")]
        if not probes(state, rule):  # clients serve it all the same
            return decide(state, ServedAtOnce(event.version, incumbent=event.incumbent), rule)
        if state.anchor != SIMILARITY:  # over the certified anchor (1.23): not an incumbent
            return replace(state, serving=event.version, before=state.serving, guard=None, base=state.anchor), []
        incumbents = state.incumbents | {event.version}
        return replace(state, serving=event.version, before=state.serving, guard=None, incumbents=incumbents), []
    return _evidence(state, event, rule)


def probes(state: State, rule: Rule) -> bool:
    """Whether the next candidate is preceded by a :class:`Probe`: while clients serve an
    incumbent and nothing is certified, or while they serve the certified anchor (or a probe over
    it, contract 1.23), when its trial opens after decisions were gathered (no trial yet, or the
    newest has had its ``trial_decisions``). One that takes the place of a trial that saw no
    decision is not: in a quiet deployment clients would load a probe per checkpoint. Nor is one
    while a version served without a test (an operator's command) serves over a certified anchor.

    >>> probes(State.start(1, incumbent=True), Rule()), probes(State.start(1), Rule())
    (True, False)
    >>> probes(State.start(4, margin=0.01), Rule())  # a certified version serves: a probe over it
    True
    """
    if state.awaiting is not None:
        return False
    newest = state.trials[-1] if state.trials else None
    gathered = newest is None or newest.bounds.n >= rule.trial_decisions
    if state.anchor == SIMILARITY:
        return state.incumbent and gathered
    return gathered and state.anchor in (state.serving, state.base)


def probe_base(state: State) -> int | None:
    """The version a probe published now names as its base (contract 1.23): the certified anchor;
    None while nothing is certified (the probe is an incumbent).

    >>> probe_base(State.start(1, incumbent=True)), probe_base(State.start(4, margin=0.01))
    (None, 4)
    """
    return state.anchor if state.anchor != SIMILARITY else None


def opens_trial(state: State, rule: Rule) -> bool:
    """Whether a candidate published now would start a trial (else it is passed over, :func:`decide`).

    >>> opens_trial(State.start(1), Rule()), opens_trial(replace(State.start(1), awaiting=1), Rule())
    (True, False)
    """
    if state.awaiting is not None:
        return False
    newest = state.trials[-1] if state.trials else None
    return newest is None or newest.bounds.n == 0 or newest.bounds.n >= rule.trial_decisions


def _trial(state: State, version: int, rule: Rule) -> tuple[State, Trial]:
    index = state.tests + 1
    bounds = GainSequence(spend(index, state.share * rule.delta / 2))  # half of the run's share of δ for trials
    return replace(state, tests=index), Trial(version, state.anchor, index, bounds)


def _candidate(state: State, event: Candidate, rule: Rule) -> tuple[State, list[Action]]:
    if event.version <= state.serving or any(t.version == event.version for t in state.trials):
        return state, [Action("superseded", event.version, f"not newer than the serving v{state.serving}")]
    if state.awaiting is not None:
        # Served at once, the copy the rule asked for would end this trial unjudged.
        return state, [Action("superseded", event.version, f"v{state.awaiting} is being published again")]
    newest = state.trials[-1] if state.trials else None
    actions: list[Action] = []
    if newest is not None and newest.bounds.n == 0:
        # Not looked at yet: nothing of δ was spent on it, so the newer candidate takes its place.
        actions.append(Action("superseded", newest.version, f"v{event.version} is newer (no decision seen yet)"))
        state = replace(state, trials=state.trials[:-1], tests=state.tests - 1)
    elif not opens_trial(state, rule):
        assert newest is not None
        # The newest trial keeps the canary until it has had a fair test: a trial per candidate
        # would end each before it could decide (and spend δ on every one).
        reason = f"v{newest.version}'s trial has had {newest.bounds.n} of its {rule.trial_decisions} decisions"
        return state, [Action("superseded", event.version, reason)]
    state, trial = _trial(state, event.version, rule)
    trials = (*state.trials, trial)
    actions.append(Action("trial", trial.version, f"trial {trial.index} against v{trial.anchor}"))
    while len(trials) > rule.max_trials:
        actions.append(Action("superseded", trials[0].version, f"v{event.version} is newer"))
        trials = trials[1:]
    return replace(state, trials=trials), actions


def _evidence(state: State, ev: Evidence, rule: Rule) -> tuple[State, list[Action]]:
    if len(ev.utility) == 0:
        return state, []
    state = copy.deepcopy(state)  # the sequences are updated in place: the caller's state stays as it was
    for t in state.trials:
        t.bounds.update(*ev.gains(t.version, t.anchor))
    actions: list[Action] = []
    state = _guard(state, ev, rule, actions)
    if any(a.kind == "rollback" for a in actions):
        return state, actions
    kept: list[Trial] = []
    for t in state.trials:
        if t.bounds.high < 0.0:
            actions.append(Action("refuse", t.version, t.describe(), "worse", interval=t.interval()))
        else:
            kept.append(t)
    promoted = next((t for t in reversed(kept) if _promotable(state, t, rule)), None)
    if promoted is None:
        actions += [Action("wait", t.version, t.describe(), interval=t.interval()) for t in kept]
        state = replace(state, trials=tuple(kept))
        if state.awaiting is None and state.before is not None and state.anchor not in (SIMILARITY, state.base):
            # Clients serve a probe over another version than the anchor: the anchor's copy, asked
            # for at its promotion, was not published. A promotion is carried out until it is.
            actions.append(Action("copy", state.anchor, f"v{state.anchor}'s copy was not published: asked for again"))
            state = replace(state, awaiting=state.anchor)
        return state, actions
    improved = promoted.bounds.low > 0.0
    republish = promoted.version < state.serving
    actions.append(
        Action(
            "promote",
            promoted.version,
            promoted.describe(),
            "improved" if improved else "within-epsilon",
            interval=promoted.interval(),
            republish=republish,
        )
    )
    # Older trials end; newer ones start again against the new anchor, unless the promotion goes out
    # as a copy, which, served at once, would end them: they spend nothing of δ on a fresh start.
    ended = [t for t in kept if t.version < promoted.version or (republish and t.version > promoted.version)]
    actions += [Action("superseded", t.version, f"v{promoted.version} promoted") for t in ended]
    newer = tuple(t for t in kept if t.version > promoted.version and not republish)
    margin = (state.margin if promoted.anchor == state.anchor else 0.0) + promoted.bounds.low
    state = replace(state, anchor=promoted.version, margin=margin, trials=newer)
    if republish:  # clients serve the probe until the copy comes (State.awaiting)
        return replace(state, awaiting=promoted.version), actions
    state = replace(state, serving=promoted.version, guard=None, base=None, incumbent=False, before=None, awaiting=None)
    return _new_anchor(state, rule, actions), actions


def _promotable(state: State, t: Trial, rule: Rule) -> bool:
    """Whether trial ``t``'s candidate may be served: shown better than the anchor, or, against
    similarity-only itself, not worse by more than ε; and, through the anchor's own margin, not
    worse than similarity-only by more than ε. So the margin is spent once: every promotion after
    a version served within ε must improve on it."""
    low = t.bounds.low
    margin = state.margin if t.anchor == state.anchor else 0.0
    return (low > 0.0 or t.anchor == SIMILARITY) and margin + low > -rule.epsilon


def _new_anchor(state: State, rule: Rule, actions: list[Action]) -> State:
    """The open trials were against the old anchor: each starts again against the new one (none
    is left open where the promotion goes out as a copy, :func:`_evidence`)."""
    trials: list[Trial] = []
    for t in state.trials:
        state, restarted = _trial(state, t.version, rule)
        trials.append(restarted)
        actions.append(Action("trial", t.version, f"trial {restarted.index} against the new anchor v{state.anchor}"))
    return replace(state, trials=tuple(trials))


def _guard(state: State, ev: Evidence, rule: Rule, actions: list[Action]) -> State:
    """Update the guardrail with what clients served as the serving manifest asks (the served
    version, and a canary's share of its mix: :meth:`Evidence.served_values`); roll back on
    evidence of harm. The guardrail's half of the run's share of δ: a quarter for the gain on the
    served version's decisions, an eighth each for its value there and for similarity-only's under
    an incumbent."""
    state = _baseline(state, ev, rule)
    if state.serving == state.first:
        return state  # nothing to fall back to (a probe falls back to the first policy)
    if state.serving not in ev.probs:
        return state  # not valued in this batch (a probe whose base the learner no longer holds)
    rows, low, high = ev.served_values(state.serving)
    if not len(rows):
        return state  # nothing served that way in this batch
    guard, guards = state.guard, state.guards
    if guard is None:
        guards += 1
        delta = state.share * rule.delta
        guard = Guard(GainSequence(spend(guards, delta / 4)), GainSequence(spend(guards, delta / 8)))
    similarity_low, similarity_high = ev.subset(rows).bounds(SIMILARITY)
    guard.gain.update(low - similarity_high, high - similarity_low)
    guard.value.update(low, high)
    state = replace(state, guard=guard, guards=guards)
    # The value against a baseline from another period holds while queries come as they came then:
    # it judges what was served without a test of its own (a probe, an operator's command), never a
    # certified anchor, whose own test a shift in the utilities' level must not overturn.
    baseline = state.baseline if state.serving != state.anchor else None
    # A copy already on its way ends what is served (a rollback asked for again, once it is withdrawn).
    if guard.high(baseline) < -rule.epsilon and state.awaiting is None:
        to = state.anchor if state.anchor not in (SIMILARITY, state.serving) else state.first
        bounds = f"[{guard.low(baseline):+.4f}, {guard.high(baseline):+.4f}]"
        reason = f"v{state.serving} below similarity-only: gain in {bounds} < −ε"
        actions.append(Action("rollback", state.serving, reason, "guardrail", to=to))
        for t in state.trials:
            actions.append(Action("superseded", t.version, f"rolled back to v{to}"))
        if state.anchor != state.serving:
            anchor, margin = state.anchor, state.margin
        elif state.first_margin is not None:  # back to a restarted learner's certified first version
            anchor, margin = state.first, state.first_margin
        else:
            anchor, margin = SIMILARITY, 0.0
        # The learner publishes ``to``'s weights again: clients serve this version until that copy
        # comes, and the guardrail goes on watching it (State.awaiting).
        state = replace(state, anchor=anchor, margin=margin, trials=(), awaiting=to)
    return state


def _baseline(state: State, ev: Evidence, rule: Rule) -> State:
    """Similarity-only's value on the decisions drawn under an incumbent, which read the client's
    own ranking but on the exploration share (and a canary's): small weights, a tight bound."""
    rows = ev.logged_under(state.incumbents)
    if not len(rows):
        return state
    baseline, baselines = state.baseline, state.baselines
    if baseline is None:
        baselines += 1
        baseline = GainSequence(baseline_rate(state.share, baselines, rule))
    baseline.update(*ev.subset(rows).bounds(SIMILARITY))
    return replace(state, baseline=baseline, baselines=baselines)


def baseline_rate(share: float, index: int, rule: Rule) -> float:
    """The error rate of a run's ``index``-th measure of similarity-only: an eighth of the run's
    ``share`` of δ, spent over its measures (a drift reset starts one).

    >>> baseline_rate(State.start(1).share, 1, Rule()) == Rule().delta / 32  # a first run's first
    True
    """
    return spend(index, share * rule.delta / 8)


def canary(state: State, rate: float, full: Callable[[int], bool] = lambda version: True) -> int | None:
    """The version clients serve as the canary (contract 1.4), where they serve one at all
    (``rate`` > 0): the newest candidate under trial that they can load beside the serving one
    (``full``: a full snapshot, not a delta). Its requests are evidence like any other.

    >>> trials = tuple(Trial(v, 0, j, GainSequence(0.01)) for j, v in enumerate((2, 3), 1))
    >>> s = replace(State.start(serving=1), trials=trials)
    >>> canary(s, 0.2), canary(s, 0.0), canary(s, 0.2, full=lambda v: v != 3)
    (3, None, 2)
    """
    if rate <= 0.0:
        return None
    loadable = [t.version for t in state.trials if full(t.version)]
    return loadable[-1] if loadable else None
