"""A labeler's "do not use" (issue 17): the label becomes a ``suppress`` command, and the
learner pins the memory's mask near 0 and serves that at once, through drift resets too."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch
from aiokafka import AIOKafkaProducer

from models.policy.trainer import PolicyTrainer, TrainerConfig
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from pipeline.worker.labels import LabelsStage
from pipeline.worker.outcomes import OutcomesStage
from pipeline.worker.tables import Outputs, Tables
from tests.helpers import experience, label
from tests.join_fakes import FakeTopic
from topics.fields import Limits, Rejected, encode
from topics.internal import SUPPRESS_COMMAND, Control, Experience, decode_control
from topics.labels import DO_NOT_USE_PREFIX

S = Settings(embedding_dim=8, slots=16, hidden=16)


def test_suppress_needs_slots() -> None:
    ok = encode({"schema": "control/v1", "command": "suppress", "ts": 1.0, "details": {"slots": [3]}})
    assert decode_control(ok, Limits()).details["slots"] == [3]
    for details in ({}, {"slots": []}, {"slots": ["x"]}, {"slots": [10**6]}):
        bad = encode({"schema": "control/v1", "command": "suppress", "ts": 1.0, "details": details})
        with pytest.raises(Rejected):
            decode_control(bad, Limits())


async def test_a_do_not_use_label_becomes_a_suppress_command() -> None:
    tables = Tables(**{name: {} for name in Tables.__dataclass_fields__})
    outputs = Outputs(**{name: FakeTopic() for name in Outputs.__dataclass_fields__})
    metrics = Metrics()
    outcomes = OutcomesStage(tables, outputs, metrics, S.limits())
    stage = LabelsStage(tables, outputs, metrics, outcomes, S.topics(), S.limits())
    mark = label(
        "q1",
        "memory_choice",
        sample_id=f"{DO_NOT_USE_PREFIX}5",
        correct_memories=[],
        harmful_memories=[5],
        step=0,
    )
    await stage.on_label(mark)
    await stage.on_label(mark)  # marking twice is one command
    sent = outputs.control.sent  # type: ignore[attr-defined]
    assert len(sent) == 1
    ctl = decode_control(sent[0]["value"], S.limits())
    assert (ctl.command, ctl.details["slots"], ctl.id) == (SUPPRESS_COMMAND, [5], mark.event_id)
    assert outputs.experiences.sent == []  # type: ignore[attr-defined]


def test_a_suppressed_memory_stays_dropped_under_reinforce() -> None:
    t = PolicyTrainer(TrainerConfig(embedding_dim=8, slots=16, hidden=16, lr=1e-2))
    t.net.suppress([2])
    for i in range(20):  # rewards for reading it do not bring it back
        ev = experience(S, i).event
        ev.candidates, ev.selected, ev.scores = [1, 2, 3], [2], np.array([0.9, 0.8, 0.7])
        t.update([Experience(f"e{i}", "feedback", ev, utility=2.0)])
    h = t.net.features(torch.ones(1, 8), torch.zeros(1), torch.zeros(1))
    m = t.net.candidate_masks(h, torch.tensor([[1, 2, 3]]))[0].detach()
    assert float(m[1]) < 1e-6 < float(m[0])


@pytest.mark.broker
async def test_the_learner_serves_a_suppression_at_once_and_keeps_it_after_a_reset(topics_ready: Settings) -> None:
    s = topics_ready.replace(gate=True, checkpoint_interval_s=0.3)
    learner = Learner(s.learner(), s.bootstrap, Metrics())
    sub = PolicySubscriber(s.bootstrap, s.policy, s)
    producer = AIOKafkaProducer(bootstrap_servers=s.bootstrap)
    async with sub:
        await learner.start()
        task = asyncio.create_task(learner.run())
        await producer.start()
        try:
            first = await sub.wait_for_policy(1, timeout=30)
            ctl = Control(command=SUPPRESS_COMMAND, ts=1.0, reason="do not use (ann)", details={"slots": [4]}, id="l1")
            await producer.send_and_wait(s.topics().control.name, encode(ctl.to_dict()), partition=0)
            # The gate is on, and the suppression is served anyway, at once.
            served = await sub.wait_for_policy(first.version + 1, timeout=30)
            assert served.manifest.reason == SUPPRESS_COMMAND
            assert served.manifest.metrics["suppressed"] == [4]
            assert float(served.net.out.bias[4].detach()) < -20
            await learner.control.reset("test")
            assert float(learner.trainer.net.out.bias[4].detach()) < -20  # a fresh last layer keeps it suppressed
        finally:
            await producer.stop()
            await learner.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def test_an_answer_marking_a_memory_harmful_becomes_a_label_experience() -> None:
    """A queued sample answered with a harmful memory and nothing correct still teaches."""
    from pipeline.worker.records import StoredSamples
    from topics.convert import make_sample, sample_id_for
    from topics.internal import decode_experience

    tables = Tables(**{name: {} for name in Tables.__dataclass_fields__})
    outputs = Outputs(**{name: FakeTopic() for name in Outputs.__dataclass_fields__})
    metrics = Metrics()
    stage = LabelsStage(
        tables, outputs, metrics, OutcomesStage(tables, outputs, metrics, S.limits()), S.topics(), S.limits()
    )
    ev = experience(S, 0).event
    sample = make_sample(ev, -0.5, "error", ev.ts)
    sid = sample_id_for(ev.query_id, ev.step)
    tables.al_samples[ev.query_id.encode()] = StoredSamples(samples={sid: encode(sample.to_dict()).decode()}, ts=ev.ts)
    bad = ev.candidates[0]
    answer = label(
        ev.query_id, "memory_choice", sample_id=sid, correct_memories=[], harmful_memories=[bad], step=ev.step
    )
    await stage.on_label(answer)
    sent = outputs.experiences.sent  # type: ignore[attr-defined]
    assert len(sent) == 1
    exp = decode_experience(sent[0]["value"], S.limits())
    assert (exp.kind, exp.correct_memories, exp.harmful_memories) == ("label", [], [bad])


def test_fine_tuning_on_a_harmful_mark_lowers_that_memorys_probability() -> None:
    t = PolicyTrainer(TrainerConfig(embedding_dim=8, slots=16, hidden=16, label_lr=5e-2))
    ev = experience(S, 0).event
    ev.candidates, ev.selected, ev.scores = [1, 2, 3], [1], np.array([0.9, 0.8, 0.7])

    def p_first(slot: int) -> float:
        with torch.no_grad():
            from models.serving.rule import adjusted_logits_torch

            emb = torch.tensor(ev.features.query_embedding[None, :])
            h = t.net.features(emb, torch.zeros(1), torch.zeros(1))
            m = t.net.candidate_masks(h, torch.tensor([ev.candidates]))
            z = adjusted_logits_torch(
                torch.tensor(ev.scores[None, :], dtype=torch.float32), m, t.net.alpha, torch.ones(1)
            )
            return float(torch.softmax(z, dim=1)[0, ev.candidates.index(slot)])

    before = p_first(2)
    stats = t.fine_tune([Experience("l1", "label", ev, 0.0, correct_memories=[], harmful_memories=[2])], steps=20)
    assert stats.applied == 1
    assert p_first(2) < before
