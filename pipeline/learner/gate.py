"""The learner's promotion gate: an async shell around the promotion rule.

Everything the gate decides is :func:`pipeline.learner.promotion.decide`'s: this class only
gathers its evidence and carries its actions out. It

- keeps the networks of the versions the rule refers to (the serving one, the anchor, the
  candidates under trial), and the serving parameters each was published with;
- takes every decision the learner applies (:meth:`observe`), as evidence on the trials opened
  before it was applied (so on candidates that were not trained on it), at most
  :data:`pipeline.learner.evidence.PER_LOOK` a look (a sample where more came: a look's cost
  is bounded), completes their logging probabilities where a client did not send them
  (:class:`pipeline.learner.logging_policy.LoggingPolicies`, which also dead-letters the events
  whose logged probabilities disagree with the serving rule), and turns them into the rule's
  evidence (:mod:`pipeline.learner.evidence`) in a worker thread;
- carries the actions out: ``promote`` republishes the candidate under the serving key (or,
  where clients hold a newer version since, asks the learner to publish its weights again under
  a new one: ``Action.republish``);
  ``refuse`` (the candidate shown worse than the anchor) ends its trial; ``rollback`` (the
  guardrail) asks the learner to roll back; while a full candidate's trial waits and the
  serving parameters give clients a ``canary_rate``, the newest such candidate is the canary
  (contract 1.4), whose requests are evidence like any other (the draw's own probabilities
  are its logging probabilities);
- records each look (``decisions``: what ``status`` and the manifests' ``metrics.gate`` show)
  and its metrics.

docs/promotion.md states the promise and the rule.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.offpolicy.confidence import MIN_DECISIONS, GainSequence, spend
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from pipeline.config import GateConfig
from pipeline.learner import evidence
from pipeline.learner.logging_policy import LoggingPolicies
from pipeline.learner.promotion import (
    SIMILARITY,
    Action,
    Candidate,
    Probe,
    Rule,
    ServedAtOnce,
    State,
    Withdrawn,
    baseline_rate,
    canary,
    decide,
    opens_trial,
    probes,
)
from pipeline.metrics import Metrics
from pipeline.modeltopic import CheckpointPublisher
from topics.delta import DeltaManifest
from topics.fields import PROBE
from topics.internal import Experience
from topics.manifest import Manifest

log = logging.getLogger(__name__)

DECISION_OF = {"promote": "promoted", "refuse": "refused", "rollback": "refused", "wait": "insufficient"}
CERTIFIED = "certified_margin"  # in a promoted manifest's metrics.gate (contract 1.21)
BASELINE = "similarity_value"  # beside it: the guardrail's measure of similarity-only (1.22)


@dataclass
class Look:
    """One look of the rule at the evidence, as ``status`` shows it (newest last in ``decisions``)."""

    decision: str  # "promoted" | "refused" | "insufficient"
    candidate_version: int
    serving_version: int
    reason: str
    path: str = ""


Probed = tuple[Manifest, dict[str, torch.Tensor]]  # a probe as published: its manifest and weights


def incumbent_of(manifest: Manifest) -> bool:
    """Whether ``manifest`` says clients serve it as an incumbent (contract 1.17)."""
    return ServingParams.from_wire(manifest.serving).incumbent


def certified(manifest: Manifest, state: State) -> Manifest:
    """``manifest`` as its promotion (to ``state``'s anchor) republishes it:
    ``metrics.gate.certified_margin`` records its certified lower bound over similarity-only
    (contract 1.21), from which a restarted learner goes on (:func:`certified_margin`), and
    ``metrics.gate.similarity_value`` the guardrail's measure of similarity-only (1.22), by which
    it goes on judging what is served without a test (:func:`resume`)."""
    gate = manifest.metrics.get("gate")
    record = {**(gate if isinstance(gate, dict) else {}), **certification(state.margin, state.baseline)}
    return dataclasses.replace(manifest, metrics={**manifest.metrics, "gate": record})


def certification(margin: float, baseline: GainSequence | None) -> dict[str, Any]:
    """What ``metrics.gate`` carries of a certified version (:func:`certified`)."""
    measured = baseline.record() if baseline is not None else None
    return {CERTIFIED: margin, **({BASELINE: measured} if measured is not None else {})}


def copy_of(manifest: Manifest) -> int | None:
    """The version whose weights ``manifest`` republishes (a rollback's ``rolled_back_to``), if any.

    >>> m = Manifest("p", 9, 0.0, "rollback", {}, 0.5, 0.0, "a" * 64, 1, 1, metrics={"rolled_back_to": 4})
    >>> copy_of(m), copy_of(dataclasses.replace(m, metrics={"rolled_back_to": True}))
    (4, None)
    """
    of = manifest.metrics.get("rolled_back_to") if manifest.reason == "rollback" else None
    return of if isinstance(of, int) and not isinstance(of, bool) else None


def certified_margin(manifest: Manifest) -> float | None:
    """The margin a promotion recorded in ``manifest`` (None: not certified, or not readable).

    >>> m = Manifest("p", 3, 0.0, "periodic", {}, 0.5, 0.0, "a" * 64, 1, 1)
    >>> certified_margin(m), certified_margin(certified(m, State(serving=3, anchor=3, margin=-0.01)))
    (None, -0.01)
    """
    gate = manifest.metrics.get("gate")
    margin = gate.get(CERTIFIED) if isinstance(gate, dict) else None
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin):
        return None
    return float(margin)


def resume(manifest: Manifest, rule: Rule, epoch: int) -> State:
    """The rule's state of a learner (in ``epoch``) that starts on ``manifest``, the version served:
    the anchor where its promotion certified it within ``rule``'s ε (a margin from a larger ε
    is outside this learner's promise), else similarity-only; and the guardrail's measure of
    similarity-only where the promotion recorded one (an anytime-valid sequence goes on after a
    pause, on the error rate it started with). The learner's gate and the lab's restarts both
    start here.

    >>> m = Manifest("p", 3, 0.0, "periodic", {}, 0.5, 0.0, "a" * 64, 1, 1)
    >>> s = resume(certified(m, State(serving=3, anchor=3, margin=0.01)), Rule(), epoch=2)
    >>> s.anchor, s.margin, s.baseline, resume(m, Rule(), epoch=1).anchor
    (3, 0.01, None, 0)
    """
    incumbent = incumbent_of(manifest)
    margin = None if incumbent else certified_margin(manifest)
    if margin is not None and margin <= -rule.epsilon:
        log.warning("gate: v%d certified at %+.4f, not within ε: not the anchor", manifest.version, margin)
        margin = None
    if margin is not None:
        log.info("gate: v%d was certified (%+.4f over similarity-only): the anchor", manifest.version, margin)
    gate = manifest.metrics.get("gate")
    recorded = gate.get(BASELINE) if isinstance(gate, dict) and not incumbent else None
    baseline = GainSequence.restore(recorded)
    # No run's measure spends more than a first run's first: one that did was measured under a
    # looser promise than this learner's.
    if baseline is not None and baseline.alpha > baseline_rate(spend(1, 1.0), 1, rule):
        baseline = None
    if recorded is not None and baseline is None:
        log.warning("gate: v%d's %s is not a sequence within δ: measured afresh", manifest.version, BASELINE)
    return State.start(manifest.version, incumbent, margin=margin, epoch=epoch, baseline=baseline)


def network(tensors: dict[str, torch.Tensor]) -> PolicyNetwork:
    """A checkpoint's policy, on CPU, for judging."""
    return PolicyNetwork.from_tensors({k: v.cpu() for k, v in tensors.items()}).eval()


class RuleGate:
    """Owned by the learner (through :class:`pipeline.learner.publishing.Publishing`)."""

    def __init__(
        self,
        config: GateConfig,
        publisher: CheckpointPublisher,
        metrics: Metrics,
        serving: ServingParams | None = None,
    ) -> None:
        self.config = config
        self.params = serving or ServingParams()
        self.rule = Rule(delta=config.delta, epsilon=config.epsilon, trial_decisions=config.trial_decisions)
        self.publisher = publisher
        self.metrics = metrics
        self.state: State | None = None
        self.versions: dict[int, tuple[Manifest, PolicyNetwork]] = {}
        self.gathered: list[Experience] = []
        self.decisions: list[Look] = []
        self.logging_policies = LoggingPolicies(metrics)
        self.table = evidence.RewardTable()  # the gain terms' direct model
        self.canary: int | None = None
        self._canary_cleared = False  # a canary left on the topic by an earlier learner run is ended once
        self._deciding = asyncio.Lock()
        # Set by the learner: where events with disagreeing logging probabilities go (dead-letter);
        # how it rolls back to a version; how it publishes a promoted version's weights again
        # under a new one (Action.republish).
        self.on_mismatch: Callable[[Experience, str], None] | None = None
        self.on_rollback: Callable[[int, str], Coroutine[Any, Any, bool]] | None = None
        self.on_republish: Callable[[int, str], Coroutine[Any, Any, bool]] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ what the learner reads
    @property
    def serving_manifest(self) -> Manifest | None:
        held = self.versions.get(self.state.serving) if self.state else None
        return held[0] if held else None

    @property
    def serving_net(self) -> PolicyNetwork | None:
        held = self.versions.get(self.state.serving) if self.state else None
        return held[1] if held else None

    @property
    def pending(self) -> bool:
        """The rule has something to look at: open trials, or a served version the guardrail watches."""
        s = self.state
        return s is not None and bool(s.trials or s.serving != s.first or s.anchor != SIMILARITY)

    def observe(self, experiences: Sequence[Experience], weights: Sequence[float] | np.ndarray | None = None) -> None:
        """Experiences the learner applies now: evidence for the next look. Call it before the
        learner publishes the checkpoint trained on them: a trial is fed only what arrives after
        its candidate was published. ``weights``: their influence weights (contract 1.15), by
        which they are thinned (:func:`pipeline.learner.evidence.thin`)."""
        feedback = [e for e in experiences if e.kind == "feedback"]
        if weights is not None:
            feedback = evidence.thin(
                feedback, [w for e, w in zip(experiences, weights, strict=True) if e.kind == "feedback"]
            )
        self.gathered.extend(feedback)

    # ------------------------------------------------------------------ events
    def set_serving(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
        """Serve ``manifest`` without a trial (the learner's start): the rule starts from it, with it
        as the anchor where its promotion certified it (:func:`certified_margin`).
        A probe (contract 1.19) after its incumbent is that incumbent's probe, as it was published
        (one the rule would not have published, e.g. over a version this learner does not take as
        certified, is served at once all the same)."""
        self._hold(manifest, network(tensors))
        self.logging_policies.hold(manifest, self.versions[manifest.version][1])
        if self.state is None:
            self.state = self._resume(manifest)
        elif manifest.reason == PROBE:
            self.state, _ = decide(self.state, Probe(manifest.version, incumbent_of(manifest)), self.rule)
        else:
            event = ServedAtOnce(manifest.version, incumbent=incumbent_of(manifest), copy_of=copy_of(manifest))
            self.state, _ = decide(self.state, event, self.rule)

    async def serve_at_once(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
        """A checkpoint served without a trial (init, rollback, reset, an operator's command)."""
        async with self._deciding:
            self._hold(manifest, network(tensors))
            if self.state is None:
                self.state = self._resume(manifest)
            else:
                reset, incumbent = manifest.reason == "reset", incumbent_of(manifest)
                event = ServedAtOnce(manifest.version, reset, incumbent, copy_of(manifest))
                self.state, actions = decide(self.state, event, self.rule)
                await self._carry(actions)
            self._serving_metrics(manifest)

    async def probe(self, publish: Callable[[], Coroutine[Any, Any, Probed]]) -> bool:
        """Before a candidate: while clients serve an incumbent and the candidate would start a
        trial, ``publish`` its weights as a probe (contract 1.19, :class:`~pipeline.learner.promotion.Probe`),
        which is served at once. The rule first looks at what the incumbent logged (valued while
        it is still served); all of it under one judgement, so no promotion comes in between.
        Returns whether a probe was published."""
        async with self._deciding:
            await self._look()
            if self.state is None or not probes(self.state, self.rule):
                return False
            manifest, tensors = await publish()
            self._hold(manifest, network(tensors))
            self.state, actions = decide(self.state, Probe(manifest.version, incumbent_of(manifest)), self.rule)
            await self._carry(actions)
            self._serving_metrics(manifest)
            over = f" over the certified v{self.state.base}" if self.state.base is not None else ""
            log.info(
                "gate: v%d is a probe%s: clients explore with the next candidate's weights", manifest.version, over
            )
            return True

    async def consider(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> Look | None:
        """A new candidate: the rule looks at the evidence gathered so far, then its trial starts
        (a trial is fed only decisions logged after it started)."""
        async with self._deciding:
            if self.state is None:  # nothing served yet (a learner whose serving version is unreadable)
                self._hold(manifest, network(tensors))
                await self.publisher.promote(manifest)
                self.state = self._resume(manifest)
                self._serving_metrics(manifest)
                return None
            look = await self._look()
            self._hold(manifest, network(tensors))
            self.state, actions = decide(self.state, Candidate(manifest.version), self.rule)
            await self._carry(actions)
            if look is None and self.state.trials:
                # Nothing to look at yet: status still says what the newest trial waits for.
                newest = self.state.trials[-1]
                look = Look("insufficient", newest.version, self.state.serving, newest.describe())
                self._record(look)
            return look

    def certification(self, version: int) -> dict[str, Any]:
        """What a copy of ``version`` (a rollback to it) carries in ``metrics.gate`` where it is
        the certified anchor (:func:`certified`; the rule takes such a copy as the anchor): a
        learner restarted under the copy goes on from it as from the anchor."""
        s = self.state
        if s is not None and version == s.anchor != SIMILARITY:
            return certification(s.margin, s.baseline)
        return {}

    def next_opens_trial(self) -> bool:
        """Whether a candidate published now would start a trial: it is then a full snapshot. It
        may be the canary, which a client loads as no delta (the trial would go without the
        canary's draws), and once certified it is the version probes name, which a client
        started under a probe loads alone (contract 1.25: its chain's first snapshot is not kept)."""
        return self.state is not None and opens_trial(self.state, self.rule)

    async def reconsider(self) -> Look | None:
        """Look at the evidence that arrived since the last look (at the checkpoint cadence)."""
        async with self._deciding:
            return await self._look()

    async def end_canary(self) -> None:
        """Tell clients to stop serving the canary (also one left by an earlier learner run)."""
        if self.canary is not None or not self._canary_cleared:
            await self.publisher.set_canary(None)
            self.metrics.checkpoint_version.labels(role="canary").set(0)
        self.canary, self._canary_cleared = None, True

    # ------------------------------------------------------------------ the look
    async def _look(self) -> Look | None:
        if self.state is None or not self.gathered:
            return None
        gathered, self.gathered = self.gathered, []
        wanted = self.state.versions()
        wanted |= self._bases(wanted)  # a probe is valued with the version it names (1.23)
        versions = {
            v: (net, ServingParams.from_wire(m.serving))
            for v in wanted
            if v != SIMILARITY and (held_v := self.versions.get(v)) is not None
            for m, net in [held_v]
        }
        # Seconds of numpy on a batch: off the event loop, which keeps consuming meanwhile.
        complete = self.logging_policies.complete
        ev = await asyncio.to_thread(evidence.of_look, gathered, versions, self.params, self.table, complete)
        for event, detail in self.logging_policies.take_mismatched():
            if self.on_mismatch is not None:
                self.on_mismatch(event, detail)
        self.state, actions = decide(self.state, ev, self.rule)
        return await self._carry(actions)

    async def _carry(self, actions: list[Action]) -> Look | None:
        """Carry the rule's actions out and record them: each promotion, refusal and rollback, else
        one wait (the newest trial's); the last record is returned."""
        assert self.state is not None
        m = self.metrics
        records: list[Look] = []
        waiting: Look | None = None
        for a in actions:
            m.gate_actions.labels(kind=a.kind, path=a.path or "-").inc()
            if a.kind == "promote":
                manifest, net = self.versions[a.version]
                manifest = certified(manifest, self.state)  # a.version is the new anchor
                self._hold(manifest, net)
                if a.republish:  # clients hold a newer version (a probe): a copy under a new one
                    self._ask(a.version, self.on_republish, f"promoted v{a.version}: {a.reason}")
                else:
                    await self.publisher.promote(manifest)
                    self._serving_metrics(manifest)  # holds its logging policy too
                if a.interval is not None:
                    m.gate_promoted_gain.observe(a.interval[0])
                log.info("gate: promoted v%d (%s): %s", a.version, a.path, a.reason)
            elif a.kind == "refuse":
                log.warning("gate: refused v%d, shown worse than the anchor: %s", a.version, a.reason)
            elif a.kind == "rollback" and a.to is not None:
                log.warning("gate: guardrail: %s; rolling back to v%d", a.reason, a.to)
                self._ask(a.to, self.on_rollback, a.reason)
            elif a.kind == "copy":
                log.warning("gate: %s", a.reason)
                self._ask(a.version, self.on_republish, a.reason)
            elif a.kind == "wait":
                log.debug("gate: v%d waits: %s", a.version, a.reason)
            if a.kind in DECISION_OF:
                look = Look(DECISION_OF[a.kind], a.version, self.state.serving, a.reason, a.path)
                if a.kind == "wait":
                    waiting = look
                else:
                    records.append(look)
        for look in records or ([waiting] if waiting else []):
            self._record(look)
        record = records[-1] if records else waiting
        await self._withdraw_stale_deltas()
        await self._update_canary()
        keep = self.state.versions() | {self.state.first} | ({self.canary} if self.canary else set())
        keep |= self._bases(keep)
        self.versions = {v: held for v, held in self.versions.items() if v in keep}
        # On the topic too, while an incumbent serves: what a learner restarted under a probe
        # rebuilds the rule's state from (the first policy, the probe a probe replaced). The
        # serving one too: a probe published next replaces it before the next pin is set.
        s = self.state
        restart: set[int | None] = set()
        if s.incumbent:
            restart = {s.first, s.before, s.serving}
        elif s.base is not None:  # a probe over a certified version (1.23): that version, the probe it replaced
            restart = {s.anchor, s.before, s.serving}
        # And the version any held probe is served with (1.23), whichever way the rule took it.
        restart |= self._bases({v for v in (s.serving, s.before) if v is not None})
        self.publisher.pinned = {t.version for t in self.state.trials} | {v for v in restart if v is not None}
        return record

    def _ask(self, version: int, publish: Callable[[int, str], Coroutine[Any, Any, bool]] | None, reason: str) -> None:
        """Have the learner publish ``version``'s weights again (``publish``: a rollback, a promoted
        version's copy), as a task outside this judgement: its checkpoint comes back here, served at
        once, and ends the rule's wait (:attr:`~pipeline.learner.promotion.State.awaiting`). Where
        it is not published, the wait ends without it (``Withdrawn``): trials go on, and clients
        keep what they hold."""
        assert self.state is not None
        if publish is None:  # a gate without a learner behind it (tests)
            log.warning("gate: nothing publishes v%d's weights again: %s", version, reason)
            self.state, _ = decide(self.state, Withdrawn(version), self.rule)
            return
        work = publish(version, reason)

        async def run() -> None:
            try:
                published = await work
            except Exception:
                log.exception("gate: v%d's weights, asked for by the rule, were not published", version)
                published = False
            if not published:
                async with self._deciding:
                    if self.state is not None:
                        self.state, _ = decide(self.state, Withdrawn(version), self.rule)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)  # a reference, so the task is not collected while it runs
        task.add_done_callback(self._tasks.discard)

    def _bases(self, versions: set[int]) -> set[int]:
        """The versions that the held ones among ``versions`` are served with (contract 1.23: a
        probe over a certified version names it in ``serving.base``)."""
        out: set[int] = set()
        for v in versions:
            held = self.versions.get(v)
            base = ServingParams.from_wire(held[0].serving).base if held is not None else None
            if base is not None:
                out.add(base)
        return out

    async def _withdraw_stale_deltas(self) -> None:
        """A delta candidate is promotable only on the base it was published on: once another
        version serves, its trial ends (clients could not load it)."""
        assert self.state is not None
        head = self.publisher.head
        for t in self.state.trials:
            manifest = self.versions[t.version][0]
            if isinstance(manifest, DeltaManifest) and (head is None or manifest.base_version != head[0]):
                self.state, _ = decide(self.state, Withdrawn(t.version), self.rule)
                log.info("gate: v%d withdrawn: a delta on v%d, no longer served", t.version, manifest.base_version)

    async def _update_canary(self) -> None:
        """The newest full candidate under trial is the canary, where clients serve canaries."""
        assert self.state is not None
        want = canary(self.state, self.params.canary_rate, lambda v: not isinstance(self.versions[v][0], DeltaManifest))
        if want == self.canary and self._canary_cleared:
            return
        if want is None:
            await self.end_canary()
            return
        manifest, net = self.versions[want]
        await self.publisher.set_canary(manifest)
        self.logging_policies.hold(manifest, net, canary=True)  # its requests' logging probabilities
        self.canary, self._canary_cleared = want, True
        self.metrics.checkpoint_version.labels(role="canary").set(want)
        log.info("gate: v%d is the canary, served on %.0f%% of requests", want, 100 * self.params.canary_rate)

    # ------------------------------------------------------------------ bookkeeping
    def _resume(self, manifest: Manifest) -> State:
        """:func:`resume` in this learner's epoch (claimed before it serves anything)."""
        return resume(manifest, self.rule, self.publisher.epoch or 1)

    def _hold(self, manifest: Manifest, net: PolicyNetwork) -> None:
        self.versions[manifest.version] = (manifest, net)

    def _serving_metrics(self, manifest: Manifest) -> None:
        self.logging_policies.hold(manifest, self.versions[manifest.version][1])
        self.metrics.checkpoint_version.labels(role="serving").set(manifest.version)
        self.metrics.checkpoint_timestamp.labels(role="serving").set(manifest.created_ts)

    def _record(self, look: Look) -> None:
        m = self.metrics
        m.gate_decisions.labels(decision=look.decision).inc()
        for name in ("promoted", "refused", "insufficient"):
            m.gate_last_decision.labels(decision=name).set(1.0 if name == look.decision else 0.0)
        newest = self.state.trials[-1] if self.state and self.state.trials else None
        m.gate_ess.set(newest.bounds.n if newest else 0.0)  # decisions of the newest trial
        m.gate_ess_needed.set(MIN_DECISIONS)
        if newest is not None and newest.bounds.n >= MIN_DECISIONS:
            m.gate_estimate.labels(policy="gain_low").set(newest.bounds.low)
            m.gate_estimate.labels(policy="gain_high").set(newest.bounds.high)
        self.decisions = [*self.decisions[-99:], look]
