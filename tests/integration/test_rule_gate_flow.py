"""The promotion rule through the broker: the learner trains on every decision, the promotion
rule decides on those applied after each candidate, clients load only what it promotes."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from aiokafka import AIOKafkaProducer

from models.offpolicy.confidence import MIN_DECISIONS, GainSequence
from models.policy.network import NEUTRAL_BIAS, PolicyNetwork
from pipeline.cli.rollback import rollback
from pipeline.client.subscriber import PolicySubscriber
from pipeline.learner.gate import RuleGate
from pipeline.learner.promotion import SIMILARITY
from pipeline.modeltopic import scan_model_topic
from tests.helpers import until
from tests.integration.test_gate import BAD, _send, learner_running, log_of, tilted
from topics.fields import PROBE
from topics.internal import Experience
from topics.lifecycle import MemoryRecord


def served_by(exps: list[Experience], version: int) -> list[Experience]:
    return [dataclasses.replace(e, event=dataclasses.replace(e.event, policy_version=version)) for e in exps]


@pytest.mark.broker
async def test_the_rule_promotes_on_later_decisions_and_refuses_a_worse_candidate(topics_ready) -> None:
    s = topics_ready.replace(gate=True, lr=1e-2, batch_size=16, checkpoint_interval_s=0.3, serve_canary_rate=0.0)
    loaded: list[int] = []
    # Contract 1.19: incumbents whose exploration draws from the next candidate; 1.23: after a
    # promotion, probes over the certified version, which clients serve on the rest.
    probes: set[int] = set()
    bases: set[int] = set()

    def on_update(p: Any) -> None:
        loaded.append(p.version)
        if p.manifest.reason == PROBE:
            assert p.serving is not None and p.serving.incumbent != (p.serving.base is not None)
            assert p.serving.base is None or p.serving.base in promoted_so_far()
            probes.add(p.version)
            if p.serving.base is not None:
                bases.add(p.serving.base)

    def promoted_so_far() -> set[int]:
        return {d.candidate_version for d in learner.gate.decisions if d.decision == "promoted"}

    sub = PolicySubscriber(s.bootstrap, s.policy, s, on_update=on_update)
    async with learner_running(s) as learner, sub:
        gate = learner.gate
        assert isinstance(gate, RuleGate)
        await sub.wait_for_policy(1, timeout=30)
        init = PolicyNetwork.from_tensors(learner.trainer.tensors())
        sent = 0
        for seed in range(3, 12):  # traffic logged by the first policy, in rounds, until a promotion
            batch = served_by(log_of(init, 600, seed=seed, policy=s.policy, questions=20), 1)
            await _send(s, batch)
            sent += len(batch)
            if any(d.decision == "promoted" for d in gate.decisions):
                break
            await until(lambda: learner.trainer.experiences + len(gate.gathered) > 0, 30, "input read")
            await until(lambda: not learner.dirty, 30, "a checkpoint")
        await until(lambda: any(d.decision == "promoted" for d in gate.decisions), 60, "a promotion")
        # Evidence is not held out of training: the trainer saw every decision.
        await until(lambda: learner.trainer.experiences >= sent, 60, "training")
        promoted = {d.candidate_version for d in gate.decisions if d.decision == "promoted"}
        assert all(d.path in ("improved", "within-epsilon") for d in gate.decisions if d.decision == "promoted")
        await until(lambda: bool(set(loaded) & promoted), 30, "the client to load a promoted version")
        assert set(loaded) <= promoted | probes | {1}, (loaded, promoted)
        assert probes and min(probes) < min(promoted)  # clients explored with a candidate's weights first

        # The learner wanders off toward the harmful slots, round after round (a candidate
        # published while the newest trial gathers its decisions is passed over), while the client
        # explores at T = 1 (a log must read a candidate's sets to show it worse): a candidate is
        # refused on the decisions after it: its trial ends, and serving stays.
        def refusals() -> float:
            return float(learner.metrics.gate_actions.labels(kind="refuse", path="worse")._value.get())

        refused_before = refusals()
        for seed in range(20, 35):
            # Read together each round: a later promotion changes both (logged by one version's
            # weights but claimed under another's, the events were left out as logging_mismatch).
            serving, net = gate.serving_manifest, gate.serving_net
            assert serving is not None and net is not None
            learner.trainer.load(tilted(net, BAD).tensors())
            learner.dirty = True
            batch = log_of(net, 600, seed=seed, temperature=1.0, policy=s.policy, questions=20)
            await _send(s, served_by(batch, serving.version))
            if refusals() > refused_before:
                break
            await until(lambda: not learner.dirty, 30, "a checkpoint")
        # The record comes after the metric (the actions of one look are carried out in turn).
        await until(lambda: any(d.decision == "refused" for d in gate.decisions), 60, "a refusal")
        assert refusals() > refused_before
        refused = [d for d in gate.decisions if d.decision == "refused"]
        # A candidate after the promotion (probes over the promoted version, 1.23, may follow it).
        assert refused[-1].path == "worse" and refused[-1].candidate_version > max(promoted)
        assert gate.serving_manifest is not None
        assert gate.serving_manifest.version not in {d.candidate_version for d in refused}  # nothing worse served
        # The probes over the promoted version: it is under the base key too (contract 1.25).
        index = await scan_model_topic(s.bootstrap, s)
        assert bases and index.base[s.policy].version in bases


@pytest.mark.broker
async def test_a_learner_restarted_under_a_probe_keeps_the_incumbent_it_replaced(topics_ready) -> None:
    """A probe carries a candidate's weights on the exploration share (contract 1.19). A learner
    restarted while one serves holds the rule's state as it was: the probe served, the incumbent
    before it the first policy (what a rollback of the probe goes back to), not the probe in its
    place."""
    # A slow learner: its candidates stay within the intervals' width of the first policy, so none
    # is promoted and each trial that gathered its decisions (200 here) is followed by another probe.
    s = topics_ready.replace(
        gate=True, lr=1e-5, batch_size=16, checkpoint_interval_s=0.3, serve_canary_rate=0.0, gate_trial_decisions=200
    )
    async with learner_running(s) as learner:
        gate = learner.gate
        assert isinstance(gate, RuleGate)
        init = PolicyNetwork.from_tensors(learner.trainer.tensors())
        await _send(s, served_by(log_of(init, 300, seed=3, policy=s.policy, questions=20), 1))

        def probe_serves() -> bool:
            return gate.serving_manifest is not None and gate.serving_manifest.reason == PROBE

        await until(probe_serves, 60, "a probe served")
        assert gate.state is not None and gate.state.first == 1 and gate.state.before == 1
        for seed in range(4, 12):  # a second probe replaces the first (its trial gathered its decisions)
            if gate.state.before != 1:
                break
            await _send(s, served_by(log_of(init, 300, seed=seed, policy=s.policy, questions=20), 1))
            await until(lambda: not learner.dirty, 30, "a checkpoint")
        await until(lambda: probe_serves() and gate.state.before != 1, 60, "a probe after a probe")
        before = gate.state
    async with learner_running(s) as restarted:
        gate = restarted.gate
        assert isinstance(gate, RuleGate) and gate.state is not None
        assert (gate.state.serving, gate.state.first, gate.state.before) == (before.serving, 1, before.before)
        assert gate.serving_manifest is not None and gate.serving_manifest.reason == PROBE
        assert sorted(v for v in gate.versions if v <= before.serving) == [1, before.before, before.serving]


@pytest.mark.broker
async def test_a_learner_restarted_under_a_promoted_version_goes_on_from_it(topics_ready) -> None:
    """The promoted manifest on the model topic records the version's certified margin (contract
    1.21) and the guardrail's measure of similarity-only (1.22): a learner restarted while it
    serves has it as the anchor, with that margin, judges by that measure, and spends its own
    epoch's share of δ. Before, it started from it as from a first policy, against
    similarity-only, whose reads a near-greedy log does not show: nothing was promoted again."""
    s = topics_ready.replace(gate=True, lr=1e-2, batch_size=16, checkpoint_interval_s=0.3, serve_canary_rate=0.0)
    async with learner_running(s) as learner:
        gate = learner.gate
        assert isinstance(gate, RuleGate)
        init = PolicyNetwork.from_tensors(learner.trainer.tensors())
        sent = 0
        for seed in range(3, 12):
            await _send(s, served_by(log_of(init, 600, seed=seed, policy=s.policy, questions=20), 1))
            sent += 600
            if any(d.decision == "promoted" for d in gate.decisions):
                break
            await until(lambda: learner.trainer.experiences + len(gate.gathered) > 0, 30, "input read")
            await until(lambda: not learner.dirty, 30, "a checkpoint")
        await until(lambda: any(d.decision == "promoted" for d in gate.decisions), 60, "a promotion")
        # Everything sent applied and looked at: no later promotion comes in between.
        await until(
            lambda: learner.trainer.experiences >= sent and not learner.dirty and not gate.gathered,
            60,
            "everything applied and judged",
        )
        promoted = gate.state
        assert promoted is not None and promoted.anchor not in (SIMILARITY, 1)
        # Served, or a probe over it (contract 1.23) whose exploration share draws from the next candidate.
        assert promoted.serving == promoted.anchor or promoted.base == promoted.anchor
        # An operator's rollback to it republishes its weights under a new version: the anchor, and
        # what a restart goes on from, as the version itself.
        assert await rollback(s.bootstrap, s, promoted.anchor, "test", timeout=30) == 0
        await until(lambda: gate.state is not None and gate.state.serving > promoted.serving, 30, "the copy served")
        copy = gate.serving_manifest
        assert copy is not None and copy.reason == "rollback"
        assert (gate.state.anchor, gate.state.margin) == (copy.version, promoted.margin)
        assert copy.metrics["gate"]["certified_margin"] == promoted.margin
    # (Stopping publishes one more candidate and looks once more: what serves is read back.)
    async with learner_running(s) as restarted:
        gate = restarted.gate
        assert isinstance(gate, RuleGate) and gate.state is not None and gate.serving_manifest is not None
        state, serving = gate.state, gate.serving_manifest
        assert serving.version >= promoted.serving and serving.reason != "init"
        # Stopping may have published a probe over the copy (contract 1.23): the anchor is the copy.
        assert state.serving == serving.version and state.anchor >= copy.version
        assert state.serving == state.anchor or (serving.reason == PROBE and state.base == state.anchor)
        serving = gate.versions[state.anchor][0]
        assert state.margin == serving.metrics["gate"]["certified_margin"] > -s.gate_epsilon
        assert state.share == pytest.approx(1 / 6)  # epoch 2
        # Similarity-only as measured under the incumbent v1 (contract 1.22): the guardrail goes on
        # with it, where nothing would measure it again.
        measured = GainSequence.restore(serving.metrics["gate"]["similarity_value"])
        assert measured is not None and measured.n >= MIN_DECISIONS and state.baseline == measured


@pytest.mark.broker
async def test_a_promotion_clients_would_refuse_is_served_as_a_copy_and_the_trainer_goes_on(topics_ready) -> None:
    """A candidate promoted after a probe (a newer version) is published again under a new
    version (``Action.republish``), through the learner's own hook (here for the anchor it has
    promoted): clients load it; it holds the candidate's weights, but a neutral row for a memory
    given a slot since (the candidate's row there is an earlier owner's), and its certification;
    the rule takes it as the anchor; the trainer is not touched, and a restarted learner does
    not restore its trainer from it (it is not the trainer's state) but serves it as the anchor."""
    s = topics_ready.replace(gate=True, lr=1e-2, batch_size=16, checkpoint_interval_s=0.3, serve_canary_rate=0.0)
    t = s.topics()
    loaded: list[Any] = []
    sub = PolicySubscriber(s.bootstrap, s.policy, s, on_update=loaded.append)
    producer = AIOKafkaProducer(bootstrap_servers=s.bootstrap)
    await producer.start()
    try:
        async with learner_running(s) as learner, sub:
            gate = learner.gate
            assert isinstance(gate, RuleGate) and gate.on_republish is not None
            await sub.wait_for_policy(1, timeout=30)
            init = PolicyNetwork.from_tensors(learner.trainer.tensors())
            for seed in range(3, 12):  # traffic logged by the first policy, until a promotion
                await _send(s, served_by(log_of(init, 600, seed=seed, policy=s.policy, questions=20), 1))
                if any(d.decision == "promoted" for d in gate.decisions):
                    break
                await until(lambda: not learner.dirty, 30, "a checkpoint")
            await until(lambda: any(d.decision == "promoted" for d in gate.decisions), 60, "a promotion")
            record = MemoryRecord("add", "m-new", 1_767_225_600.0, text="new", embedding=np.ones(s.embedding_dim))
            await producer.send_and_wait(t.memory_lifecycle.name, record.to_bytes(), key=record.key, partition=0)
            await until(lambda: learner.memories.allocator.slot_of("m-new") is not None, 30, "the slot")
            # More training: the next checkpoint publishes the slot's record.
            await _send(s, served_by(log_of(init, 100, seed=20, policy=s.policy, questions=20), 1))
            slot = learner.memories.allocator.slot_of("m-new")
            await until(
                lambda: not learner.memories.pending and not learner.dirty and not gate.gathered,
                30,
                "the slot's record published, everything judged",
            )
            assert gate.state is not None
            anchor, margin, head = gate.state.anchor, gate.state.margin, learner.version
            source = gate.versions[anchor][1].tensors()
            trained = learner.trainer.tensors()

            assert await gate.on_republish(anchor, "test") is False  # the rule did not ask for it
            gate.state = dataclasses.replace(
                gate.state, awaiting=anchor
            )  # as a promotion after a newer probe leaves it
            assert await gate.on_republish(anchor, "test") is True
            await until(lambda: sub.current is not None and sub.current.version > head, 30, "the copy loaded")
            copy = sub.current
            metrics = copy.manifest.metrics
            assert copy.manifest.reason == "rollback" and metrics["rolled_back_to"] == anchor
            assert metrics["promotion_copy"] is True and metrics["gate"]["certified_margin"] == margin
            weights = copy.net.tensors()
            others = [r for r in range(source["out.weight"].shape[0]) if r != slot]
            assert torch.equal(weights["hidden.weight"], source["hidden.weight"])
            assert torch.equal(weights["out.weight"][others], source["out.weight"][others])
            assert float(weights["out.bias"][slot]) == pytest.approx(NEUTRAL_BIAS) and copy.slot_of("m-new") == slot
            assert all(torch.equal(v, learner.trainer.tensors()[k]) for k, v in trained.items())  # untouched
            assert (gate.state.serving, gate.state.anchor, gate.state.margin) == (copy.version, copy.version, margin)
        async with learner_running(s) as restarted:
            assert restarted.restored_from != f"topic v{copy.version}"
            assert restarted.gate is not None and restarted.gate.state is not None
            assert restarted.gate.state.anchor >= copy.version  # the copy, or a later promotion
    finally:
        await producer.stop()
