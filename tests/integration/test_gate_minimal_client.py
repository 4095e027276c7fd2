"""A client that fills only the contract's required fields (no candidate_probs, no canary)
sees the serving version rise: the learner computes the logging probabilities its rule needs."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from models.policy.network import PolicyNetwork
from pipeline import kafka
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from tests.helpers import until
from tests.integration.test_gate import _send, learner_running, log_of


@pytest.mark.broker
async def test_a_minimal_clients_serving_version_rises(topics_ready: Settings) -> None:
    # The rule at its defaults (no canary); the client sends what the contract
    # requires, nothing more, serving the first policy until the learner promotes another.
    s = topics_ready.replace(gate=True, lr=1e-2, batch_size=16, checkpoint_interval_s=0.3, serve_canary_rate=0.0)
    assert s.bootstrap is not None
    loaded: list[int] = []
    sub = PolicySubscriber(s.bootstrap, s.policy, s, on_update=lambda p: loaded.append(p.version))
    async with learner_running(s) as learner, sub:
        gate = learner.gate
        assert gate is not None
        first = await sub.wait_for_policy(1, timeout=30)
        served = PolicyNetwork.from_tensors(learner.trainer.tensors())  # what v1 serves
        for seed in range(3, 12):  # in rounds, until a promotion
            minimal = [
                dataclasses.replace(
                    e, event=dataclasses.replace(e.event, policy_version=first.version, candidate_probs=None)
                )
                for e in log_of(served, 600, seed=seed, policy=s.policy, questions=20)
            ]
            await _send(s, minimal)
            if any(d.decision == "promoted" for d in gate.decisions):
                break
            await until(lambda: not learner.dirty, 30, "a checkpoint")
        await until(lambda: any(d.decision == "promoted" for d in gate.decisions), 60, "a promotion")
        await until(lambda: max(loaded) > first.version, 30, "the client to load the promoted version")
        recomputed = learner.metrics.registry.get_sample_value(
            "causalmem_gate_logging_probs_total", {"source": "recomputed"}
        )
        assert recomputed is not None and recomputed > 0  # the events it was judged on
        assert (
            learner.metrics.registry.get_sample_value("causalmem_gate_logging_mismatch_total", {"field": "logprob"})
            is None
        )


@pytest.mark.broker
async def test_a_client_that_logs_another_temperature_is_dead_lettered_and_still_trains(
    topics_ready: Settings,
) -> None:
    # A client that draws at T = 1 but logs T = 0.5: its logprob is not what the named version
    # gives at the logged temperature. The gate leaves such events out; the operator sees each
    # one on dead-letter (contract 1.8 logging_mismatch), and the learner still trains on them.
    s = topics_ready.replace(gate=True, lr=1e-2, batch_size=16, checkpoint_interval_s=0.3)
    assert s.bootstrap is not None
    sub = PolicySubscriber(s.bootstrap, s.policy, s)
    async with learner_running(s) as learner, sub:
        first = await sub.wait_for_policy(1, timeout=30)
        served = PolicyNetwork.from_tensors(learner.trainer.tensors())
        lying = [
            dataclasses.replace(
                e,
                event=dataclasses.replace(e.event, policy_version=first.version, candidate_probs=None, temperature=0.5),
            )
            for e in log_of(served, 300, seed=4, temperature=1.0, policy=s.policy)
        ]
        await _send(s, lying)
        mismatch = {"field": "logprob"}
        count = learner.metrics.registry.get_sample_value
        await until(lambda: (count("causalmem_gate_logging_mismatch_total", mismatch) or 0) > 0, 90, "a judgement")
        applied = count("causalmem_learner_experiences_total", {"kind": "feedback"}) or 0
    dead = [
        orjson.loads(m.value)
        for m in await kafka.read_all(s.bootstrap, s, s.topics().dead_letter.name)
        if m.value is not None
    ]
    copies = [d for d in dead if d["reason"] == "logging_mismatch"]
    assert copies, [d["reason"] for d in dead]
    assert len(copies) == len({d["original"] for d in copies})  # each event once
    assert all(d["source"]["topic"] == s.topics().experiences.name and d["source"]["offset"] == -1 for d in copies)
    sent = {e.id for e in lying}
    assert {orjson.loads(d["original"])["id"] for d in copies} <= sent
    assert "logprob disagrees" in copies[0]["detail"]
    assert applied >= len(copies)  # left out of the gate, not out of training
