"""The learner's gate (pipeline/learner/gate.py), without a broker:
the decisions it observes go through the promotion rule, and its actions are carried out."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.offpolicy.confidence import MIN_DECISIONS, GainSequence
from models.policy.network import SUPPRESSED_BIAS, PolicyNetwork, init_policy
from models.policy.trainer import PolicyTrainer
from models.serving.params import ServingParams
from pipeline.config import GateConfig, Settings
from pipeline.learner import evidence
from pipeline.learner.evidence import PER_LOOK
from pipeline.learner.gate import BASELINE, RuleGate, certified, resume
from pipeline.learner.promotion import SIMILARITY, Rule, State, probe_base
from pipeline.learner.publishing import FRESH_TEMPERATURE, Publishing
from pipeline.learner.store import LocalStore
from pipeline.metrics import Metrics
from tests.integration.test_delta_checkpoints import RecordingProducer
from tests.integration.test_gate import BAD, GOOD, D, H, S, tilted
from tests.unit.learner.test_evidence import recurring
from topics.fields import PROBE
from topics.internal import Experience
from topics.manifest import Manifest, check_probe


def manifest(version: int, reason: str = "periodic") -> Manifest:
    return Manifest("default", version, 0.0, reason, {}, 0.5, 0.0, "0" * 64, 1, 1)


class Publisher:
    def __init__(self, epoch: int | None = None) -> None:
        self.promoted: list[int] = []
        self.serving: Manifest | None = None  # the last manifest promoted, as published
        self.canaries: list[int | None] = []
        self.head: tuple[int, str] | None = (1, "link")
        self.pinned: set[int] = set()
        self.epoch = epoch

    async def promote(self, m: Manifest) -> None:
        self.promoted.append(m.version)
        self.serving = m
        self.head = (m.version, "link")

    async def set_canary(self, m: Manifest | None) -> None:
        self.canaries.append(m.version if m is not None else None)


def gate_of(canary_rate: float = 0.0) -> tuple[RuleGate, Publisher, PolicyNetwork]:
    pub = Publisher()
    gate = RuleGate(GateConfig(), pub, Metrics(), serving=ServingParams(canary_rate=canary_rate))  # type: ignore[arg-type]
    serving = init_policy(D, S, H, seed=1)
    gate.set_serving(manifest(1, "init"), serving.tensors())
    return gate, pub, serving


def logged(net: PolicyNetwork, n: int, seed: int) -> list[Experience]:
    """Decisions the serving v1 logged (exploring at T = 0.5) on a few recurring questions."""
    return [
        dataclasses.replace(e, event=dataclasses.replace(e.event, policy_version=1)) for e in recurring(net, n, seed)
    ]


async def with_v2_promoted() -> tuple[RuleGate, Publisher, PolicyNetwork]:
    """A gate whose better candidate v2 has been promoted on the decisions logged after it."""
    gate, pub, serving = gate_of()
    await gate.consider(manifest(2), tilted(serving, GOOD).tensors())
    for seed in range(10):
        gate.observe(logged(serving, PER_LOOK, seed))
        await gate.reconsider()
        if pub.promoted:
            break
    return gate, pub, serving


async def test_a_better_candidate_is_promoted_on_the_decisions_after_it() -> None:
    """Also from a client that fills only the required fields (no candidate_probs, no canary):
    the learner computes the logging probabilities the rule needs."""
    gate, pub, serving = gate_of()
    await gate.consider(manifest(2), tilted(serving, GOOD).tensors())
    assert gate.state is not None and [t.version for t in gate.state.trials] == [2]
    assert gate.decisions[-1].decision == "insufficient" and "no decisions yet" in gate.decisions[-1].reason
    sent = 0
    for seed in range(10):
        minimal = [
            dataclasses.replace(e, event=dataclasses.replace(e.event, candidate_probs=None))
            for e in logged(serving, PER_LOOK, seed)  # a look values them all
        ]
        gate.observe(minimal)
        sent += len(minimal)
        await gate.reconsider()
        if pub.promoted:
            break
    assert pub.promoted == [2]
    assert gate.serving_manifest is not None and gate.serving_manifest.version == 2
    last = gate.decisions[-1]
    assert last.decision == "promoted" and last.path in ("improved", "within-epsilon")
    value = gate.metrics.registry.get_sample_value
    assert value("causalmem_gate_logging_probs_total", {"source": "recomputed"}) == sent
    # The certified lower bound of the promotion, for "gain per promotion" on a dashboard.
    assert value("causalmem_gate_promoted_gain_count") == 1
    assert value("causalmem_gate_promoted_gain_sum") > (-0.02 if last.path == "within-epsilon" else 0.0)


async def test_a_learner_restarted_under_a_promoted_version_goes_on_from_it() -> None:
    """The promotion records the version's certified margin in the manifest it publishes
    (contract 1.21); a learner restarted on that manifest (a new epoch) has it as the anchor, so
    its candidates are tried against it and not against similarity-only, whose reads a
    near-greedy log of it does not show (there nothing was ever certified after a restart)."""
    gate, pub, serving = await with_v2_promoted()
    assert pub.promoted == [2] and pub.serving is not None and gate.state is not None
    margin = pub.serving.metrics["gate"]["certified_margin"]
    assert margin == gate.state.margin > -GateConfig().epsilon
    restarted = RuleGate(GateConfig(), Publisher(epoch=2), Metrics())  # type: ignore[arg-type]
    restarted.set_serving(pub.serving, tilted(serving, GOOD).tensors())
    assert restarted.state is not None and (restarted.state.anchor, restarted.state.margin) == (2, margin)
    await restarted.consider(manifest(3), tilted(serving, GOOD, amount=0.5).tensors())
    assert [(t.version, t.anchor) for t in restarted.state.trials] == [(3, 2)]
    assert restarted.state.trials[0].bounds.alpha == pytest.approx(GateConfig().delta / 2 / 2 / 6)  # epoch 2: δ/6
    # A manifest without the record (a learner before 1.21 promoted it) starts as before.
    plain = dataclasses.replace(pub.serving, metrics={})
    before = RuleGate(GateConfig(), Publisher(epoch=2), Metrics())  # type: ignore[arg-type]
    before.set_serving(plain, tilted(serving, GOOD).tensors())
    assert before.state is not None and before.state.anchor == 0
    # Nor one certified under a larger ε than this learner's (outside its promise).
    wide = RuleGate(GateConfig(epsilon=0.001), Publisher(epoch=2), Metrics())  # type: ignore[arg-type]
    wide.set_serving(certified(pub.serving, State(2, anchor=2, margin=-0.005)), tilted(serving, GOOD).tensors())
    assert wide.state is not None and wide.state.anchor == 0


def test_a_promoted_manifest_carries_the_guardrails_measure_of_similarity_only() -> None:
    """The measure of similarity-only a run took under an incumbent rides in the promoted
    manifest (contract 1.22) and a learner restarted on it goes on with it; a record that is not
    a confidence sequence is ignored (measured afresh), never an error."""
    baseline = GainSequence(0.001)
    baseline.update(np.linspace(-1.0, 2.0, 400))
    state = State(3, anchor=3, margin=0.02, baseline=baseline)
    promoted = certified(manifest(3), state)
    assert promoted.metrics["gate"][BASELINE]["n"] == 400
    again = resume(promoted, Rule(), epoch=2)
    assert again.baseline == baseline and (again.anchor, again.margin) == (3, 0.02)
    assert BASELINE not in certified(manifest(3), State(3, anchor=3)).metrics["gate"]  # nothing measured
    recorded = promoted.metrics["gate"][BASELINE]
    # Not a sequence, or one that spent more of δ than this learner's promise allows.
    for bad in ({}, {**recorded, "n": 12}, "x", {**recorded, "low": 9}, {**recorded, "alpha": 0.5}):
        spoilt = dataclasses.replace(promoted, metrics={"gate": {**promoted.metrics["gate"], BASELINE: bad}})
        assert resume(spoilt, Rule(), epoch=2).baseline is None


async def test_a_rollbacks_copy_of_the_anchor_is_the_anchor_and_carries_its_certification() -> None:
    """A rollback to the anchor republishes its weights under a new version, with what the
    anchor's promotion recorded (:meth:`RuleGate.certification`): the copy is the rule's anchor,
    and a learner restarted under it goes on from it as from the anchor."""
    gate, _, serving = await with_v2_promoted()
    assert gate.state is not None and gate.state.anchor == 2
    margin = gate.state.margin
    assert gate.certification(2)["certified_margin"] == margin and gate.certification(1) == {}
    copy = dataclasses.replace(manifest(5, "rollback"), metrics={"rolled_back_to": 2, "gate": gate.certification(2)})
    await gate.serve_at_once(copy, tilted(serving, GOOD).tensors())
    assert (gate.state.serving, gate.state.anchor, gate.state.margin) == (5, 5, margin)
    restarted = resume(copy, Rule(), epoch=2)
    assert (restarted.anchor, restarted.margin) == (5, margin)


def probe(version: int) -> Manifest:
    """A probe over the certified v1 (contract 1.23)."""
    return dataclasses.replace(manifest(version, PROBE), serving=ServingParams(base=1).to_wire())


async def promoted_after_a_probe(
    republish: Callable[[int, str], Coroutine[Any, Any, bool]],
) -> tuple[RuleGate, Publisher, dict[str, torch.Tensor], PolicyNetwork]:
    """A gate over the certified v1 whose candidate v3 is promoted after the newer probe v4."""
    pub = Publisher()
    gate = RuleGate(GateConfig(trial_decisions=MIN_DECISIONS), pub, Metrics())  # type: ignore[arg-type]
    serving = init_policy(D, S, H, seed=1)
    gate.set_serving(certified(manifest(1, "init"), State(serving=1, anchor=1)), serving.tensors())
    good = tilted(serving, GOOD).tensors()
    gate.on_republish = republish
    gate.set_serving(probe(2), good)
    await gate.consider(manifest(3), good)
    gate.observe(logged(serving, MIN_DECISIONS + 50, seed=0))  # logged under v1, the probes' base
    await gate.reconsider()
    assert gate.state is not None and [(t.version, t.bounds.n) for t in gate.state.trials] == [(3, 250)]
    gate.set_serving(probe(4), good)  # the trial had its decisions: the next candidate's probe
    await gate.consider(manifest(5), serving.tensors())  # no better than v1: v3 decides first
    for seed in range(1, 10):
        gate.observe(logged(serving, PER_LOOK, seed))
        await gate.reconsider()
        if gate.state.anchor == 3:
            break
    await asyncio.sleep(0)  # the learner's task starts
    return gate, pub, good, serving


async def test_a_candidate_promoted_after_a_newer_probe_is_published_again_and_its_copy_is_the_anchor() -> None:
    """A probe takes a version above the open trials' candidates; clients refuse a serving version
    older than one they hold, so a trial that decides after the probe was promoted in vain: through
    the pipeline each run had one, and two ended on the probe it was refused for. The gate asks
    the learner to publish the candidate's weights again (no probe meanwhile: clients must hold
    what a probe names; no trial either: the copy ends them), and takes the copy as the anchor."""
    asked: list[int] = []
    release = asyncio.Event()

    async def republish(version: int, reason: str) -> bool:
        asked.append(version)
        await release.wait()
        return True

    gate, pub, good, _ = await promoted_after_a_probe(republish)
    assert gate.state is not None
    assert asked == [3] and pub.promoted == []  # not promoted under v3: clients hold v4
    assert (gate.state.serving, gate.state.anchor) == (4, 3)  # clients serve the probe until the copy
    assert gate.serving_manifest is not None and gate.serving_manifest.version == 4
    published: list[int] = []

    async def publish() -> tuple[Manifest, dict[str, torch.Tensor]]:
        published.append(6)
        return probe(6), good

    assert not await gate.probe(publish) and published == []  # the copy is not out yet
    await gate.consider(manifest(7), good)  # its trial would end at the copy, unjudged: passed over
    assert 7 not in {t.version for t in gate.state.trials} and 7 not in gate.versions
    release.set()
    await asyncio.sleep(0)
    margin = gate.state.margin
    copy = dataclasses.replace(manifest(8, "rollback"), metrics={"rolled_back_to": 3, "gate": gate.certification(3)})
    assert copy.metrics["gate"]["certified_margin"] == margin
    await gate.serve_at_once(copy, good)
    assert (gate.state.serving, gate.state.anchor, gate.state.margin) == (8, 8, margin)
    assert probe_base(gate.state) == 8 and gate.state.awaiting is None  # probes and trials go on


@pytest.mark.parametrize("failure", ["raises", "declines"])
async def test_a_copy_the_learner_could_not_publish_does_not_hold_the_trials_up(failure: str) -> None:
    """While the copy is on its way every candidate is passed over: one that never comes (the
    publication failed, or the learner found the rule had moved on) must not leave the rule
    waiting for good."""

    asked: list[str] = []

    async def republish(version: int, reason: str) -> bool:
        asked.append(reason)
        if failure == "raises":
            raise ConnectionError("the model topic is away")
        return False

    gate, _, good, serving = await promoted_after_a_probe(republish)
    await asyncio.sleep(0)  # the task fails, and the rule stops waiting
    assert gate.state is not None and gate.state.anchor == 3 and gate.state.awaiting is None
    # Clients keep the probe v4: the rule still says so (the guardrail watches it), and holds v3.
    assert gate.state.serving == 4 and {3, 4} <= set(gate.versions)
    await gate.consider(manifest(7), good)
    assert [t.version for t in gate.state.trials] == [7]
    # The next look asks for v3's copy again: the promotion is carried out until it is served.
    gate.observe(logged(serving, 50, seed=11))
    await gate.reconsider()
    await asyncio.sleep(0)
    assert asked[1:] == ["v3's copy was not published: asked for again"]
    assert [look.decision for look in gate.decisions].count("promoted") == 1  # the copy is no promotion


async def test_a_worse_candidate_is_refused_and_serving_stays() -> None:
    gate, pub, serving = gate_of()
    await gate.consider(manifest(2), tilted(serving, BAD).tensors())
    for seed in range(30):  # the bounds narrow as the table learns the sets the candidate reads
        gate.observe(logged(serving, 300, seed))
        await gate.reconsider()
        if gate.decisions[-1].decision == "refused":
            break
    assert pub.promoted == [] and gate.state is not None and gate.state.trials == ()
    assert gate.decisions[-1].decision == "refused" and gate.decisions[-1].candidate_version == 2
    assert gate.serving_manifest is not None and gate.serving_manifest.version == 1


async def test_a_waiting_full_candidate_is_the_canary_until_its_trial_ends() -> None:
    gate, pub, serving = gate_of(canary_rate=0.2)
    await gate.consider(manifest(2), tilted(serving, GOOD, amount=0.01).tensors())  # barely different
    assert pub.canaries[-1] == 2 and gate.canary == 2
    await gate.serve_at_once(manifest(3, "rollback"), serving.tensors())  # ends every trial
    assert pub.canaries[-1] is None and gate.canary is None


def test_every_feedback_is_evidence_and_no_label_is() -> None:
    gate, _, serving = gate_of()
    exps = logged(serving, 40, 0)
    label = Experience("l", "label", exps[0].event, 0.0, correct_memories=[1])
    gate.observe([*exps, label])
    assert gate.gathered == exps  # labels are never evidence
    assert not gate.pending  # nothing under trial, nothing served but the first policy


async def test_a_trial_is_fed_only_decisions_observed_after_its_candidate() -> None:
    """The decisions observed before a candidate is considered (those it was trained on) go to
    the trials already open: the new trial starts with none."""
    gate, _, serving = gate_of()
    gate.rule = dataclasses.replace(gate.rule, trial_decisions=200)  # about which trial is fed, not when one opens
    await gate.consider(manifest(2), tilted(serving, GOOD, amount=0.01).tensors())
    gate.observe(logged(serving, 250, 0))  # applied after v2 was published: v2's evidence
    await gate.consider(manifest(3), tilted(serving, GOOD).tensors())  # v2 has had its 200: v3's trial starts
    assert gate.state is not None
    seen = {t.version: t.bounds.n for t in gate.state.trials}
    assert seen[3] == 0 and seen[2] > 0


def test_a_look_values_a_uniform_sample_of_at_most_its_budget() -> None:
    items = list(range(10_000))
    kept = evidence.sample(items, 500)
    assert len(kept) == 500 and kept == sorted(kept)  # in their logged order
    assert 3_000 < sum(kept) / 500 < 7_000  # spread over the whole batch, not its head
    assert evidence.sample(items[:10], 500) == items[:10]


async def test_a_learner_restarted_under_a_probe_it_cannot_take_as_one_judges_it_with_its_base() -> None:
    """Contract 1.23: a learner restarted while a probe over v4 serves, v4 not certified for this
    learner (no certified margin recorded): the probe is judged as a version served at once, valued
    with the version it names, which the gate keeps and pins. Its first look raised KeyError."""
    from tests.unit.client.test_probe_over_certified import CERTIFIED, PROBE, _retriever, _served

    pub = Publisher(epoch=2)
    gate = RuleGate(GateConfig(), pub, Metrics())  # type: ignore[arg-type]
    gate.set_serving(CERTIFIED.manifest, CERTIFIED.net.tensors())
    gate.set_serving(PROBE.manifest, PROBE.net.tensors())
    assert gate.state is not None and (gate.state.serving, gate.state.base) == (PROBE.version, None)
    r = _retriever(6)
    r.set_policy(CERTIFIED)
    r.set_policy(PROBE)
    rng = np.random.default_rng(8)
    gate.observe([Experience(ev.event_id, "feedback", ev, float(rng.normal())) for _, ev in _served(r, 300, seed=7)])
    await gate.reconsider()
    assert gate.state.guard is not None and gate.state.guard.gain.n > 0  # the guardrail valued what was served
    assert CERTIFIED.version in gate.versions and CERTIFIED.version in pub.pinned


async def test_a_guardrail_rollback_to_an_incumbent_first_policy_is_published_as_an_incumbent(tmp_path: Path) -> None:
    """The guardrail rolled v3 back to the first policy, which clients served as an incumbent: the
    learner's copy is served as the first policy was (an incumbent again; with the served v3's way
    it went out near-greedy, and no probe followed it), and its trainer goes on untouched (loading
    the first policy's weights sent a T = 1 client's training back to them at every rollback)."""
    config = Settings(embedding_dim=4, slots=8, hidden=8, device="cpu").learner()
    trainer = PolicyTrainer(config.trainer)
    pub = Publishing(RecordingProducer(), config, LocalStore(tmp_path), trainer.net.arch, Metrics())
    first = await pub.publish(trainer, reason="init", metrics={}, input_offsets={}, changed_rows=np.zeros(0))
    await pub.settle(first)
    assert pub.gate is not None and pub.gate.state is not None and pub.gate.state.incumbent
    # v3, certified within ε of similarity-only and served near-greedily, then shown below it.
    pub.gate.state = dataclasses.replace(pub.gate.state, serving=3, anchor=SIMILARITY, incumbent=False, awaiting=1)
    v1_bias = first.tensors["out.bias"].clone()
    with torch.no_grad():
        trainer.net.out.bias.add_(1.0)  # what the learner learnt since
    learnt = trainer.net.tensors()
    # An operator suppressed slot 3 since v1 ("do not use"): the copy of v1 must not serve it again.
    copy = await pub.republish(
        1, reason="guardrail: v3 below similarity-only", metrics={}, input_offsets={}, suppressed=[3]
    )
    assert copy is not None and copy.manifest.reason == "rollback" and copy.manifest.metrics["rolled_back_to"] == 1
    assert float(copy.tensors["out.bias"][3]) == SUPPRESSED_BIAS and not copy.tensors["out.weight"][3].any()
    assert torch.equal(copy.tensors["out.bias"][:3], v1_bias[:3])  # the others are v1's
    assert ServingParams.from_wire(copy.manifest.serving) == ServingParams.from_wire(first.manifest.serving)
    assert ServingParams.from_wire(copy.manifest.serving).incumbent
    assert all(torch.equal(t, learnt[k]) for k, t in trainer.net.tensors().items())  # the trainer goes on
    assert not torch.equal(copy.tensors["out.bias"], learnt["out.bias"])  # the copy is the first policy's
    await pub.settle(copy)
    assert (pub.gate.state.serving, pub.gate.state.awaiting, pub.gate.state.incumbent) == (
        copy.manifest.version,
        None,
        True,
    )


async def test_a_copy_of_a_probe_whose_base_the_learner_could_not_read_is_served_as_an_incumbent(
    tmp_path: Path,
) -> None:
    """A learner restarted under a probe over v1 that it could not read takes the probe as its
    first policy; the guardrail's rollback to it asks for a copy. Only a probe may name
    ``serving.base`` (contract 1.23), so a copy naming it was rejected by every reader and never
    served: the copy is served as an incumbent, the client's own ranking but on the exploration
    share."""
    config = Settings(embedding_dim=4, slots=8, hidden=8, device="cpu").learner()
    trainer = PolicyTrainer(config.trainer)
    pub = Publishing(RecordingProducer(), config, LocalStore(tmp_path), trainer.net.arch, Metrics())
    assert pub.gate is not None
    over_v1 = dataclasses.replace(
        manifest(2, PROBE), serving=ServingParams(temperature=0.05, explore_rate=0.1, base=1).to_wire()
    )
    pub.gate.set_serving(over_v1, trainer.net.tensors())
    assert pub.gate.state is not None and pub.gate.state.first == 2
    copy = await pub.republish(2, reason="guardrail: v2 below similarity-only", metrics={}, input_offsets={})
    assert copy is not None and copy.manifest.reason == "rollback"
    check_probe(copy.manifest.reason, copy.manifest.serving, copy.manifest.version)  # what readers check
    served = ServingParams.from_wire(copy.manifest.serving)
    assert (served.base, served.incumbent, served.explore_rate) == (None, True, 0.1)
    assert served.temperature == FRESH_TEMPERATURE  # as every incumbent's (clients before 1.17 serve it)
