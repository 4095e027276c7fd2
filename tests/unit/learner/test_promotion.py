"""The promotion rule's state machine (pipeline/learner/promotion.py), on a world of known values.

Each context offers five memory sets; a version is a distribution over them (as served), and
a set's utility has a known mean: every version's true value is known, so the promise (never
below the anchor, nor similarity-only, by more than ε) can be checked at every step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pipeline.config import GateConfig
from pipeline.learner.promotion import (
    SIMILARITY,
    Candidate,
    Evidence,
    Probe,
    Rule,
    ServedAtOnce,
    State,
    Withdrawn,
    canary,
    decide,
    opens_trial,
    probe_base,
    probes,
)

MEANS = np.array([0.2, 0.5, -0.5, 0.1, 0.0])  # set 0 is similarity-only's top-k set
TOPK = np.array([1.0, 0.0, 0.0, 0.0, 0.0])
EXPLORE = np.full(5, 0.2)
RULE = Rule(delta=0.05, epsilon=0.02, trial_decisions=250)  # these worlds decide within a few hundred


def served(p: np.ndarray) -> np.ndarray:
    """A version as clients serve it: 90% its own draw, 10% exploration."""
    return 0.9 * p + 0.1 * EXPLORE


def value(p: np.ndarray) -> float:
    return float(served(p) @ MEANS)


class World:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.versions: dict[int, np.ndarray] = {SIMILARITY: TOPK, 1: TOPK}

    def evidence(self, serving: int, n: int = 400) -> Evidence:
        logging = served(self.versions[serving])
        s = self.rng.choice(5, size=n, p=logging)
        u = MEANS[s] + self.rng.uniform(-1.0, 1.0, n)
        probs = {v: (p if v == SIMILARITY else served(p))[s] for v, p in self.versions.items()}
        return Evidence(u, logging[s], np.full(n, serving), probs)


def test_a_better_candidate_becomes_the_anchor_and_a_worse_one_is_refused() -> None:
    world = World(0)
    world.versions[2] = np.array([0.0, 1.0, 0.0, 0.0, 0.0])  # reads set 1: +0.27
    world.versions[3] = np.array([0.0, 0.0, 1.0, 0.0, 0.0])  # reads set 2: −0.63
    state = State.start(serving=1)
    state, _ = decide(state, Candidate(2), RULE)
    state, _ = decide(state, world.evidence(1, n=250), RULE)  # v2's trial has had its decisions
    state, _ = decide(state, Candidate(3), RULE)
    assert [t.version for t in state.trials] == [2, 3]
    kinds: list[tuple[str, int, str]] = []
    for _ in range(60):
        state, actions = decide(state, world.evidence(state.serving), RULE)
        kinds += [(a.kind, a.version, a.path) for a in actions if a.kind in ("promote", "refuse")]
        if state.anchor == 2 and ("refuse", 3, "worse") in kinds:
            break
    # v3 refused on evidence that it is worse; v2 served (within ε of similarity-only, or shown
    # better): the new anchor, its margin its lower bound.
    assert ("refuse", 3, "worse") in kinds
    assert [k[:2] for k in kinds if k[1] == 2] == [("promote", 2)]
    assert state.serving == state.anchor == 2 and state.margin > -RULE.epsilon


def test_after_a_step_within_epsilon_only_an_improvement_is_promoted() -> None:
    world = World(2)
    world.versions[2] = np.array([0.0, 1.0, 0.0, 0.0, 0.0])  # reads set 1: +0.27
    state = replace(State.start(serving=1), serving=2, anchor=2, margin=-0.015)  # v2 served within ε
    state, _ = decide(state, Candidate(3), RULE)
    world.versions[3] = world.versions[2]  # the same policy: a gain of 0
    for _ in range(40):
        state, actions = decide(state, world.evidence(state.serving), RULE)
        assert not any(a.kind == "promote" for a in actions)  # not shown better: never served
    assert [t.version for t in state.trials] == [3] and state.trials[0].bounds.low > -RULE.epsilon
    assert state.serving == 2 and state.anchor == 2


def test_decide_does_not_change_the_state_it_is_given() -> None:
    world = World(1)
    world.versions[2] = TOPK
    state, _ = decide(State.start(serving=1), Candidate(2), RULE)
    before = state.trials[0].bounds.n
    decide(state, world.evidence(1), RULE)
    assert state.trials[0].bounds.n == before == 0


def test_an_undecided_trial_waits_and_says_what_it_has() -> None:
    world = World(2)
    world.versions[2] = np.array([0.6, 0.4, 0.0, 0.0, 0.0])  # close to serving
    state, _ = decide(State.start(serving=1), Candidate(2), RULE)
    state, actions = decide(state, world.evidence(1, n=50), RULE)
    assert [a.kind for a in actions] == ["wait"]
    assert "v2 over v0: gain in [" in actions[0].reason and "after 50 decisions" in actions[0].reason
    assert [t.describe() for t in state.trials] == [actions[0].reason]  # what status shows


def test_candidates_take_turns_so_that_every_trial_can_decide() -> None:
    world = World(4)
    for v in range(2, 9):
        world.versions[v] = TOPK
    state = State.start(serving=1)
    for v in (2, 3):  # v2 saw no decision: v3 takes its place, and its share of δ
        state, actions = decide(state, Candidate(v), RULE)
    assert [t.version for t in state.trials] == [3] and state.tests == 1
    assert ("superseded", 2) in [(a.kind, a.version) for a in actions]
    state, _ = decide(state, world.evidence(1, n=50), RULE)
    state, actions = decide(state, Candidate(4), RULE)  # v3 has had 50 of its 250 decisions
    assert [t.version for t in state.trials] == [3] and actions[0].kind == "superseded"
    assert "had 50 of its 250 decisions" in actions[0].reason
    for v in (5, 6, 7, 8):  # each with enough decisions behind the newest: at most three open
        state, _ = decide(state, world.evidence(1, n=250), RULE)
        state, _ = decide(state, Candidate(v), RULE)
    assert len(state.trials) == RULE.max_trials and state.trials[-1].version == 8
    state, actions = decide(state, Candidate(1), RULE)  # not newer than serving
    assert actions[0].kind == "superseded"
    state = State(serving=7, anchor=7, first=1)
    state, ended = decide(state, ServedAtOnce(8, reanchor=True), RULE)
    assert state.serving == 8 and state.anchor == SIMILARITY and ended == []


def test_the_newest_trial_keeps_the_canary_until_it_has_had_its_decisions() -> None:
    """The newest trial's candidate is the canary, whose draws are what a near-greedy log lacks.
    A newer candidate opened a trial as soon as the newest had the 200 decisions a bound needs,
    and took the canary: no trial kept its draws for longer, and on the demo's world the bounds
    stayed ±1.5 after 600 decisions. At the defaults it now waits for 1,000 (2,000 until 2026-12-08)."""
    world = World(5)
    world.versions[2] = world.versions[3] = world.versions[4] = TOPK
    rule = Rule()
    state, _ = decide(State.start(serving=1), Candidate(2), rule)
    state, _ = decide(state, world.evidence(1, n=400), rule)  # a bound, not yet a fair test
    state, actions = decide(state, Candidate(3), rule)
    assert [t.version for t in state.trials] == [2] and canary(state, 0.2) == 2
    assert [a.kind for a in actions] == ["superseded"]
    assert f"of its {rule.trial_decisions} decisions" in actions[0].reason
    while state.trials[-1].bounds.n < rule.trial_decisions:
        state, _ = decide(state, world.evidence(1, n=400), rule)
    state, _ = decide(state, Candidate(4), rule)
    assert [t.version for t in state.trials] == [2, 4] and canary(state, 0.2) == 4


def test_the_rules_defaults_are_the_settings() -> None:
    gate = GateConfig()
    assert Rule() == Rule(delta=gate.delta, epsilon=gate.epsilon, trial_decisions=gate.trial_decisions)


def test_a_drift_reset_is_served_as_the_first_policy_again() -> None:
    """What was certified described the world before the change: a reset published as an
    incumbent makes similarity-only the anchor and is the first policy from then on, so probes
    start again, and a rollback goes back to it, not to the run's start."""
    certified = State(serving=7, anchor=7, first=1, margin=0.05)
    state, _ = decide(certified, ServedAtOnce(8, reanchor=True, incumbent=True), RULE)
    assert (state.serving, state.first, state.anchor, state.margin, state.incumbent) == (8, 8, SIMILARITY, 0.0, True)
    assert probes(state, RULE)
    state, _ = decide(certified, ServedAtOnce(8, reanchor=True), RULE)  # gate off at publication: as before
    assert (state.first, state.incumbent) == (1, False)


def test_a_probe_serves_a_candidates_weights_as_the_incumbent_while_the_trials_go_on() -> None:
    world = World(1)
    world.versions[2] = world.versions[4] = TOPK  # probes: their share not explored is the client's own ranking
    world.versions[3] = np.array([0.0, 1.0, 0.0, 0.0, 0.0])
    state = State.start(serving=1, incumbent=True)
    assert probes(state, RULE)
    state, acts = decide(state, Probe(2), RULE)
    assert acts == [] and (state.serving, state.anchor, state.before, state.incumbent) == (2, SIMILARITY, 1, True)
    state, _ = decide(state, Candidate(3), RULE)
    state, _ = decide(state, world.evidence(2, n=250), RULE)
    state, acts = decide(state, Probe(4), RULE)
    assert acts == [] and [t.version for t in state.trials] == [3] and state.trials[0].bounds.n == 250
    # The first policy (what a client before 1.19 serves) and the probe replaced are still valued.
    assert {1, 2, 3, 4} <= state.versions()
    # A version served without a test over a certified anchor (an operator's command): no probe.
    # One published all the same (a learner restarted under it) is what clients serve: judged as
    # any version served at once, it ends the trials.
    commanded = replace(State(serving=6, anchor=5, first=1, margin=0.03), trials=state.trials)
    assert not probes(commanded, RULE)
    after, acts = decide(commanded, Probe(7, incumbent=False), RULE)
    assert (after.serving, after.anchor, after.base, after.incumbent, after.trials) == (7, 5, None, False, ())
    assert [(a.kind, a.version) for a in acts] == [("superseded", 3)]
    older, acts = decide(commanded, Probe(6), RULE)
    assert older == commanded and [a.kind for a in acts] == ["superseded"]


def test_a_probe_over_a_certified_version_is_guarded_and_ends_at_a_promotion() -> None:
    """Contract 1.23: clients serving a certified version near-greedily never read a candidate's
    sets, so a probe over it draws the exploration share from the candidate while the certified
    version serves the rest. It is not an incumbent (similarity-only is not measured under it);
    the guardrail rolls a harmful one back to the certified version, and a promotion ends it."""
    world = World(3)
    world.versions[5] = np.array([0.0, 0.6, 0.0, 0.0, 0.4])  # certified: +0.14 over similarity-only
    certified = State(serving=5, anchor=5, first=1, margin=0.03)
    assert probes(certified, RULE) and probe_base(certified) == 5
    state, acts = decide(certified, Probe(6), RULE)
    assert acts == [] and (state.serving, state.anchor, state.base, state.before) == (6, 5, 5, 5)
    assert not state.incumbent and 6 not in state.incumbents and {5, 6} <= state.versions()
    assert probe_base(state) == 5 and probes(state, RULE)  # the next candidate's probe is over v5 too
    # A harmful probe (as served it reads set 2, −0.5): rolled back to the certified version.
    world.versions[6] = np.array([0.0, 0.0, 1.0, 0.0, 0.0])
    harmful, rolled = state, None
    for _ in range(20):
        harmful, actions = decide(harmful, world.evidence(harmful.serving, n=100), RULE)
        rolled = next((a for a in actions if a.kind == "rollback"), rolled)
        if rolled is not None:
            break
    assert rolled is not None and (rolled.version, rolled.to, rolled.path) == (6, 5, "guardrail")
    # Clients serve v6 until the learner's copy of v5 comes; then the copy is the anchor.
    assert (harmful.serving, harmful.anchor, harmful.base, harmful.awaiting) == (6, 5, 5, 5)
    harmful, _ = decide(harmful, ServedAtOnce(9, copy_of=5), RULE)
    assert (harmful.serving, harmful.anchor, harmful.base, harmful.margin) == (9, 9, None, 0.03)
    # A better candidate promoted while a probe serves: served as any version, the probe ended.
    world.versions[6] = np.array([0.0, 0.5, 0.0, 0.0, 0.5])  # near the certified version, as served
    world.versions[7] = np.array([0.0, 1.0, 0.0, 0.0, 0.0])  # reads set 1: better than v5
    state, _ = decide(state, Candidate(7), RULE)
    for _ in range(60):
        state, actions = decide(state, world.evidence(state.serving, n=200), RULE)
        if any(a.kind == "promote" for a in actions):
            break
    assert (state.serving, state.anchor, state.base) == (7, 7, None) and state.margin > 0.03
    assert not next(a for a in actions if a.kind == "promote").republish  # v7 is newer than the probe


def test_a_candidate_promoted_after_a_newer_probe_is_served_as_a_copy_that_stays_the_anchor() -> None:
    """A probe takes a version above the open trials' candidates, and clients refuse a serving
    version older than one they hold: through the pipeline each run had a promotion refused so,
    and two ended on the probe it was refused for. Its weights go out again under a new version
    (a copy of it), which the rule takes as the anchor with the margin its promotion certified."""
    world = World(4)
    world.versions[5] = np.array([0.0, 0.6, 0.0, 0.0, 0.4])  # certified
    world.versions[6] = world.versions[7] = np.array([0.0, 1.0, 0.0, 0.0, 0.0])  # probe v6, candidate v7: better
    state, _ = decide(State(serving=5, anchor=5, first=1, margin=0.03), Probe(6), RULE)
    state, _ = decide(state, Candidate(7), RULE)
    state, _ = decide(state, world.evidence(6, n=RULE.trial_decisions), RULE)
    assert probes(state, RULE) and [t.version for t in state.trials] == [7]
    world.versions[8] = world.versions[9] = world.versions[7]  # the next probe and its candidate
    state, _ = decide(state, Probe(8), RULE)
    state, _ = decide(state, Candidate(9), RULE)
    promoted = None
    for _ in range(60):
        state, actions = decide(state, world.evidence(state.serving, n=200), RULE)
        promoted = next((a for a in actions if a.kind == "promote"), None)
        if promoted is not None:
            break
    assert promoted is not None and promoted.version == 7 and promoted.republish
    # Clients serve the probe v8 (over v5) until the copy comes: the rule says so.
    assert (state.serving, state.anchor, state.base, state.awaiting) == (8, 7, 5, 7)
    # v9's trial ends with the promotion: the copy would end it, so it spends nothing on a restart.
    assert state.trials == () and [(a.kind, a.version) for a in actions if a.kind != "wait"] == [
        ("promote", 7),
        ("superseded", 9),
    ]
    # Until the copy is served: a trial would end at it unjudged, and a probe would name v7,
    # which clients do not hold yet.
    assert not probes(state, RULE) and not opens_trial(state, RULE)
    waited, actions = decide(state, Candidate(11), RULE)
    assert waited.trials == state.trials and [(a.kind, a.version) for a in actions] == [("superseded", 11)]
    # Where the copy is not published, clients keep the probe: no probe names v7, which they do not
    # hold; the next look asks for the copy again (a promotion is carried out until it is served),
    # and the guardrail goes on watching the probe meanwhile (a harmful one is rolled back to v7).
    failed, _ = decide(state, Withdrawn(7), RULE)
    assert (failed.serving, failed.anchor, failed.base, failed.awaiting) == (8, 7, 5, None)
    assert not probes(failed, RULE) and failed.guard is not None
    harmful = World(5)
    harmful.versions.update({7: world.versions[7], 8: np.array([0.0, 0.0, 1.0, 0.0, 0.0])})
    asked = []
    for _ in range(20):
        failed, actions = decide(failed, harmful.evidence(8, n=100), RULE)
        asked += [a.version for a in actions if a.kind == "copy"]
        if any(a.kind == "rollback" for a in actions):
            break
        assert failed.awaiting == 7 and not probes(failed, RULE) and not opens_trial(failed, RULE)
        failed, _ = decide(failed, Withdrawn(7), RULE)  # and not published again
    assert asked and set(asked) == {7}
    assert [(a.version, a.to) for a in actions if a.kind == "rollback"] == [(8, 7)] and failed.awaiting == 7
    margin = state.margin
    state, _ = decide(state, ServedAtOnce(10, copy_of=7), RULE)  # the copy, under the next version
    assert (state.serving, state.anchor, state.margin, state.base) == (10, 10, margin, None)
    assert probes(state, RULE) and probe_base(state) == 10  # clients hold it: the next probe is over it


def test_a_candidate_refused_under_a_probe_ends_its_trial_and_changes_nothing_else() -> None:
    """A refusal is evidence that this candidate is worse, not that the learner is: training went
    back to the serving weights, and on the real-data world, whose early candidates are truly
    below similarity-only, each refusal threw the learning away (0% of the gap after 41)."""
    world = World(2)
    world.versions[2] = TOPK  # the probe: its share not explored is the client's own ranking
    world.versions[3] = np.array([0.0, 0.0, 1.0, 0.0, 0.0])  # reads set 2: −0.63
    state, _ = decide(State.start(serving=1, incumbent=True), Probe(2), RULE)
    state, _ = decide(state, Candidate(3), RULE)
    refused = None
    for _ in range(60):
        state, acts = decide(state, world.evidence(state.serving), RULE)
        refused = next((a for a in acts if a.kind == "refuse"), None)
        if refused:
            break
    assert refused is not None and refused.path == "worse" and refused.to is None
    assert (state.serving, state.anchor, state.trials) == (2, SIMILARITY, ())


def test_the_guardrail_rolls_back_a_served_version_shown_below_similarity() -> None:
    world = World(3)
    world.versions[2] = TOPK
    world.versions[6] = np.array([0.0, 0.0, 1.0, 0.0, 0.0])  # −0.63 below similarity-only
    # v6 is served (say, by an earlier promotion on evidence that no longer holds), v2 is the anchor.
    state = State(serving=6, anchor=2, first=1)
    rolled = None
    for _ in range(30):
        state, actions = decide(state, world.evidence(state.serving), RULE)
        rolled = next((a for a in actions if a.kind == "rollback"), rolled)
        if rolled:
            break
    assert rolled is not None and rolled.to == 2 and rolled.path == "guardrail"
    # The learner publishes v2's weights again; clients serve v6 until that copy comes.
    assert (state.serving, state.anchor, state.awaiting) == (6, 2, 2)
    assert not probes(state, RULE) and not opens_trial(state, RULE)
    waiting, actions = decide(state, world.evidence(6), RULE)  # the copy is on its way: no second rollback
    assert waiting.awaiting == 2 and not [a for a in actions if a.kind == "rollback"]
    # Where it cannot, the wait ends without the copy: trials go on (they would otherwise wait for good).
    state, actions = decide(state, Withdrawn(2), RULE)
    assert state.awaiting is None and actions == [] and opens_trial(state, RULE)
    world.versions[7] = TOPK
    state, _ = decide(state, Candidate(7), RULE)
    assert [t.version for t in state.trials] == [7]
    # v6 is still what clients serve, and the guardrail still watches it: the rollback is asked again.
    state, actions = decide(state, world.evidence(6), RULE)
    assert [(a.kind, a.version, a.to) for a in actions] == [("rollback", 6, 2), ("superseded", 7, None)]
    assert (state.serving, state.awaiting, state.trials) == (6, 2, ())


@pytest.mark.slow
def test_the_promise_holds_over_runs_of_random_candidates() -> None:
    """30 runs of 12 candidates each, a third of them worse than similarity-only: the served
    value is never below similarity-only − ε, nor below the anchor − ε (at most δ of runs)."""
    broken = 0
    promoted = 0
    for seed in range(30):
        world = World(100 + seed)
        state = State.start(serving=1)
        rng = np.random.default_rng(seed)
        unsafe = False
        for v in range(2, 14):
            world.versions[v] = rng.dirichlet(np.full(5, 0.5))
            state, _ = decide(state, Candidate(v), RULE)
            for _ in range(3):
                state, actions = decide(state, world.evidence(state.serving), RULE)
                promoted += sum(a.kind == "promote" for a in actions)
                floor = max(value(TOPK), value(world.versions[state.anchor]))
                unsafe |= value(world.versions[state.serving]) < floor - RULE.epsilon
        broken += unsafe
    assert broken <= 3  # δ = 5% of 30 is 1.5
    assert promoted > 0


def test_the_guardrail_counts_the_canarys_share_of_what_is_served() -> None:
    """The promise is about the policy as its manifest says to serve it, and with a canary that is
    the mix: 80% the serving version, 20% the canary. The guardrail watched the serving version's
    own draws only, so a canary far below similarity-only (its share worth −0.18 of the mix) went
    unseen by it; it now values the mix, and rolls back."""
    rng = np.random.default_rng(7)
    serving, canary, share = TOPK, np.array([0.0, 0.0, 1.0, 0.0, 0.0]), 0.2  # the canary reads set 2: −0.5
    mix = (1 - share) * served(serving) + share * served(canary)
    assert value(serving) - float(TOPK @ MEANS) > -RULE.epsilon  # the serving version alone: within ε
    assert float(mix @ MEANS) - float(TOPK @ MEANS) < -5 * RULE.epsilon  # the mix served: well below

    def look(counted: bool, n: int = 400) -> Evidence:
        s = rng.choice(5, size=n, p=mix)
        arm = rng.random(n) < share * served(canary)[s] / mix[s]  # which arm drew each set
        u = MEANS[s] + rng.uniform(-1.0, 1.0, n)
        probs = {SIMILARITY: TOPK[s], 2: served(serving)[s], 3: served(canary)[s]}
        version = np.where(arm, 3, 2)
        if not counted:  # the evidence as before: no record of the mix each draw came from
            return Evidence(u, mix[s], version, probs)
        return Evidence(u, mix[s], version, probs, mixed_with=np.where(arm, 2, 3), mix_share=np.full(n, share))

    for counted in (False, True):
        state = replace(State.start(serving=1), serving=2, anchor=2, margin=0.0)
        rollbacks = []
        for _ in range(30):
            state, actions = decide(state, look(counted), RULE)
            rollbacks += [a for a in actions if a.kind == "rollback"]
        if counted:
            assert [(a.version, a.path, a.to) for a in rollbacks][:1] == [(2, "guardrail", 1)]
        else:
            assert not rollbacks  # the serving version's own draws: within ε, nothing to see


def clipped(world: World, serving: int, n: int = 400) -> Evidence:
    """``world.evidence`` as the learner builds it (pipeline/learner/evidence.py): weights clipped
    at 20, and what a version reads beyond the clip valued at the utilities' extremes (a reward
    table that predicts 0)."""
    ev = world.evidence(serving, n)
    logging = served(world.versions[serving])
    worst, best = float(MEANS.min()) - 1.0, float(MEANS.max()) + 1.0
    low, high = {}, {}
    for v, p in world.versions.items():
        excess = float(np.maximum((p if v == SIMILARITY else served(p)) - 20.0 * logging, 0.0).sum())
        low[v], high[v] = np.full(n, excess * worst), np.full(n, excess * best)
    zero = {v: np.zeros(n) for v in world.versions}
    return replace(ev, fitted=np.zeros(n), direct=zero, low=low, high=high, clip=20.0)


def measured(world: World, incumbent: bool = True) -> State:
    """The first policy v1 served for three looks: similarity-only measured (1,200 decisions),
    where clients served it as an incumbent."""
    state = State.start(serving=1, incumbent=incumbent)
    for _ in range(3):  # clients serve their own ranking but on the exploration share
        state, _ = decide(state, clipped(world, 1), RULE)
    return state


def watched(state: State, world: World, shift: float = 0.0, *, first_only: bool = False) -> tuple[State, list[tuple]]:
    """Up to 20 looks at what ``state`` serves (every utility lowered by ``shift``), as the learner
    builds its evidence: the state after, and each rollback as (version, to, path); with
    ``first_only``, the looks stop at the first."""
    rolled: list[tuple] = []
    for _ in range(20):
        ev = clipped(world, state.serving)
        state, actions = decide(state, replace(ev, utility=ev.utility - shift) if shift else ev, RULE)
        rolled += [(a.version, a.to, a.path) for a in actions if a.kind == "rollback"]
        if rolled and first_only:
            break
    return state, rolled


def test_the_guardrail_sees_a_near_greedy_version_far_below_similarity_that_its_log_cannot_compare() -> None:
    """A version served at once (an operator's rollback to it, say) reads set 2 (−0.5) on 90% of
    requests and similarity-only's set on 2%: valued on its own decisions, similarity-only's read
    lies mostly beyond the clip, its bounds span the utilities' range, and the served version's
    gain over it stays unsure (the guardrail did not roll back a version 2.7 nats below
    similarity-only on the real-LM world in 6,000 decisions). Its own value, on-policy, against
    similarity-only's measured while an incumbent served, shows it at once."""
    for incumbent in (True, False):
        world = World(11)
        world.versions[6] = np.array([0.0, 0.0, 1.0, 0.0, 0.0])
        state, _ = decide(measured(world, incumbent), ServedAtOnce(6), RULE)
        state, rolled = watched(state, world)
        if incumbent:
            assert rolled == [(6, 1, "guardrail")]
            assert (state.serving, state.awaiting) == (6, 1)  # until the learner's copy of v1 comes
        else:  # no incumbent, no measure of similarity-only as served: the log alone cannot tell
            assert not rolled and state.serving == 6
            assert state.guard is not None and state.guard.gain.high > 0.0 and state.baseline is None


def test_a_shift_in_the_utilities_level_does_not_overturn_a_certified_anchor() -> None:
    """Similarity-only's value under the incumbent comes from earlier decisions; if every
    utility later falls by 0.3 (other queries, another scale), a version served without a test
    set against it looks 0.3 worse. A certified anchor is judged by its gain on its own
    decisions only: the shift is no evidence against it."""
    world = World(12)
    world.versions[6] = TOPK  # as good as similarity-only: its true gain is 0
    state = measured(world)
    assert state.baseline is not None and state.baseline.n == 1200
    before = state.baseline.n
    decide(state, clipped(world, 1), RULE)
    assert state.baseline.n == before  # decide changes a copy
    for anchor, expected in ((6, []), (SIMILARITY, [(6, 1, "guardrail")])):  # certified; without a test
        _, rolled = watched(replace(state, serving=6, anchor=anchor, margin=0.0), world, shift=0.3)
        assert rolled[:1] == expected


def test_the_learners_copy_of_the_first_policy_after_a_rollback_is_the_first_policy() -> None:
    """The learner carries out a rollback to the first policy by republishing it under a new
    version, an incumbent while nothing is certified. Judged as any other served version, the
    copy was rolled back in turn wherever the first policy's exploration share, as served, is
    below similarity-only by more than ε; it is the first policy, which has nothing to fall back to."""
    world = World(13)
    world.versions[2] = TOPK
    state = State.start(serving=1, incumbent=True)
    state, _ = decide(state, Probe(2), RULE)
    state, _ = decide(state, ServedAtOnce(3, incumbent=True), RULE)  # the copy, after a rollback of the probe
    assert (state.serving, state.first, state.incumbent) == (3, 3, True)
    world.versions[3] = TOPK
    state, actions = decide(state, clipped(world, 3), RULE)
    assert state.guard is None and not [a for a in actions if a.kind == "rollback"]
    assert state.baseline is not None and state.baseline.n == 400  # still similarity-only's measure
    certified = replace(state, serving=7, anchor=7, margin=0.05, incumbent=False)
    state, _ = decide(certified, ServedAtOnce(8, incumbent=True), RULE)  # a rollback once certified: not the first
    assert state.first == 3


def test_a_restarted_learner_goes_on_from_the_certified_anchor() -> None:
    """A learner restarted while a certified version serves near-greedily: started from it as
    the first policy (what the learner did before contract 1.21), every later trial is against
    similarity-only, whose reads its log does not show, and none ever decides; started from it
    as the anchor, with the margin its promotion recorded, a better candidate is promoted."""
    outcomes = {}
    for margin in (None, 0.05):
        world = World(5)
        world.versions[2] = np.array([0.0, 0.7, 0.0, 0.3, 0.0])  # certified: +0.15 over similarity-only
        world.versions[3] = np.array([0.0, 1.0, 0.0, 0.0, 0.0])  # +0.11 over v2
        state = State.start(serving=2, margin=margin, epoch=2)
        state, actions = decide(state, Candidate(3), RULE)
        assert [(a.kind, state.trials[0].anchor) for a in actions] == [("trial", 2 if margin else SIMILARITY)]
        promoted = []
        for _ in range(30):
            state, actions = decide(state, clipped(world, state.serving), RULE)
            promoted += [(a.version, a.path) for a in actions if a.kind == "promote"]
            assert not any(a.kind == "rollback" for a in actions)  # nothing to fall back to
        outcomes[margin] = promoted
    assert outcomes[None] == []
    assert outcomes[0.05] == [(3, "improved")]


def test_a_rollback_to_a_restarted_learners_certified_first_version_keeps_it_the_anchor() -> None:
    """After a restart from certified v2, v3 is promoted, then shown below similarity-only (the
    world changed under it): the guardrail rolls back to v2, which is the anchor again with its
    margin, not similarity-only (whose reads a near-greedy log of v2 does not show)."""
    state = replace(State.start(2, margin=0.05, epoch=2), serving=3, anchor=3, margin=0.08)
    world = World(6)
    world.versions[2] = np.array([0.0, 0.7, 0.0, 0.3, 0.0])
    world.versions[3] = np.array([0.5, 0.0, 0.5, 0.0, 0.0])  # half similarity-only's set, half set 2: −0.33
    state, rolled = watched(state, world, first_only=True)
    assert rolled == [(3, 2, "guardrail")]
    assert (state.awaiting, state.anchor, state.margin) == (2, 2, 0.05)
    # A fresh first policy (a drift reset served as an incumbent) is not certified.
    state, _ = decide(state, ServedAtOnce(4, reanchor=True, incumbent=True), RULE)
    assert (state.first, state.first_margin, state.anchor) == (4, None, SIMILARITY)


def test_each_learner_run_spends_its_own_share_of_delta() -> None:
    """Epoch e (each start of a learner) spends δ/(e(e+1)) of the run's δ: all runs' tests add
    up to δ however often the learner restarts."""
    for epoch in (1, 2, 5):
        state, _ = decide(State.start(1, epoch=epoch), Candidate(2), RULE)
        assert state.trials[0].bounds.alpha == pytest.approx(RULE.delta / 2 / 2 / (epoch * (epoch + 1)))


def test_a_restarted_learners_guardrail_keeps_its_measure_of_similarity_only() -> None:
    """After a restart under a certified version nothing measures similarity-only again (no
    incumbent serves): without the measure an earlier run took (contract 1.22), an operator's
    command far below similarity-only, served near-greedily, was never rolled back (its log
    does not show similarity-only's reads: ``causalmem bench guardrail --restart-at``, 2.1 below
    it for 5,700 decisions on four seeds). With it, the second way sees it at once."""
    world = World(11)
    state = measured(world)
    assert state.baseline is not None and state.baseline.n == 1200
    world.versions[2] = np.array([0.0, 0.7, 0.0, 0.3, 0.0])  # certified before the restart
    world.versions[6] = np.array([0.0, 0.0, 1.0, 0.0, 0.0])  # the operator's command: −0.63
    outcomes = {}
    for kept in (False, True):
        restarted = State.start(serving=2, margin=0.05, epoch=2, baseline=state.baseline if kept else None)
        restarted, rolled = watched(decide(restarted, ServedAtOnce(6), RULE)[0], world)
        outcomes[kept] = (rolled, restarted.awaiting)
    assert outcomes[False] == ([], None)
    assert outcomes[True] == ([(6, 2, "guardrail")], 2)


def test_a_rollbacks_copy_of_the_anchor_is_the_anchor() -> None:
    """The learner carries out a rollback to the anchor by republishing its weights under a new
    version. Judged as a version served without a test, the copy was set against similarity-only's
    value from earlier decisions, and a fall in every utility's level (no evidence against a
    certified version) rolled it back to the anchor again, and again. As the anchor, with its
    margin, it is judged by its gain on its own decisions only; a copy of the first policy is
    the first policy."""
    world = World(12)
    world.versions[6] = world.versions[8] = TOPK  # as good as similarity-only: its true gain is 0
    certified = replace(measured(world), serving=6, anchor=6, margin=0.0, incumbent=False)
    outcomes = {}
    for of in (None, 6):
        copied, rolled = watched(decide(certified, ServedAtOnce(8, copy_of=of), RULE)[0], world, shift=0.3)
        outcomes[of] = (rolled[:1], copied.anchor, copied.margin)
    assert outcomes[None] == ([(8, 6, "guardrail")], 6, 0.0)
    assert outcomes[6] == ([], 8, 0.0)
    restarted = State.start(2, margin=0.05, epoch=2)
    copied, _ = decide(restarted, ServedAtOnce(9, copy_of=2), RULE)
    assert (copied.first, copied.first_margin, copied.anchor, copied.margin) == (9, 0.05, 9, 0.05)


def test_a_copy_of_a_version_that_is_not_the_anchor_is_judged_as_any_version_served_at_once() -> None:
    """An operator's rollback to the first policy (or any older version) while another version
    is the certified anchor: the copy is neither the anchor nor the first policy, and the
    guardrail rolls it back to the anchor once it is shown below similarity-only."""
    world = World(11)
    state = measured(world)
    world.versions[7] = np.array([0.0, 0.7, 0.0, 0.3, 0.0])  # certified
    world.versions[8] = np.array([0.0, 0.0, 1.0, 0.0, 0.0])  # the copy, as clients serve it: −0.63
    certified = replace(state, serving=7, anchor=7, margin=0.05, incumbent=False)
    for of in (1, 5):
        copied, _ = decide(certified, ServedAtOnce(8, copy_of=of), RULE)
        assert (copied.anchor, copied.first) == (7, 1)
        assert watched(copied, world)[1][:1] == [(8, 7, "guardrail")]


def test_a_rollback_to_an_incumbent_first_policy_serves_it_as_an_incumbent_again() -> None:
    """A version certified within ε of similarity-only, then shown below it: the guardrail
    rolls back to the first policy, which clients served as an incumbent (their own ranking but
    on the exploration share); the learner republishes it so, and its copy is the first policy."""
    world = World(6)
    world.versions[3] = np.array([0.5, 0.0, 0.5, 0.0, 0.0])  # −0.33 below similarity-only
    state = replace(State.start(serving=1, incumbent=True), serving=3, anchor=3, margin=-0.01, incumbent=False)
    state, rolled = watched(state, world, first_only=True)
    assert rolled == [(3, 1, "guardrail")] and (state.awaiting, state.anchor) == (1, SIMILARITY)
    state, _ = decide(state, ServedAtOnce(4, incumbent=True, copy_of=1), RULE)
    assert (state.serving, state.first, state.incumbent) == (4, 4, True)
