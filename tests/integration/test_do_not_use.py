""" "Do not use": a labeler's mark is a proposal; an operator's ``suppress`` command (capped,
rate-limited, audited, undone by ``unsuppress``) makes the learner pin the memory's mask near 0
and serve that at once, through drift resets too."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch
from aiokafka import AIOKafkaProducer

from models.policy.trainer import PolicyTrainer, TrainerConfig
from pipeline.cli.suppress import change_suppression
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from pipeline.probes import total
from pipeline.worker.labels import LabelsStage
from pipeline.worker.outcomes import OutcomesStage
from pipeline.worker.tables import Outputs, Tables
from tests.helpers import experience, label, until
from tests.join_fakes import FakeTopic
from topics.fields import Limits, Rejected, encode
from topics.internal import SUPPRESS_COMMAND, UNSUPPRESS_COMMAND, Control, Experience, decode_control
from topics.labels import DO_NOT_USE_PREFIX, HumanLabel

S = Settings(embedding_dim=8, slots=32, hidden=16)


def test_suppress_and_unsuppress_need_slots() -> None:
    for command in (SUPPRESS_COMMAND, UNSUPPRESS_COMMAND):
        ok = encode({"schema": "control/v1", "command": command, "ts": 1.0, "details": {"slots": [3], "by": "ops"}})
        assert decode_control(ok, Limits()).details["slots"] == [3]
        for details in ({}, {"slots": []}, {"slots": ["x"]}, {"slots": [10**6]}, {"slots": [3], "by": 7}):
            bad = encode({"schema": "control/v1", "command": command, "ts": 1.0, "details": details})
            with pytest.raises(Rejected):
                decode_control(bad, Limits())


async def test_a_labelers_do_not_use_is_a_proposal_not_a_command() -> None:
    """The reported attack: one label naming slots 0…31, an invented query id and another
    labeler's name. It used to become a ``suppress`` command; now nothing reaches ``control``."""
    tables = Tables(**{name: {} for name in Tables.__dataclass_fields__})
    outputs = Outputs(**{name: FakeTopic() for name in Outputs.__dataclass_fields__})
    metrics = Metrics()
    outcomes = OutcomesStage(tables, outputs, metrics, S.limits())
    stage = LabelsStage(tables, outputs, metrics, outcomes, S.topics(), S.limits())
    attack = HumanLabel(
        "forged-1",
        "invented-query",
        1_767_225_602.0,
        "someone-else",
        "memory_choice",
        sample_id=f"{DO_NOT_USE_PREFIX}0",
        correct_memories=[],
        harmful_memories=list(range(32)),
    )
    await stage.on_label(attack)
    for i in range(20):  # twenty such labels used to force twenty checkpoints
        mark = label(
            f"q{i}", "memory_choice", sample_id=f"{DO_NOT_USE_PREFIX}5", correct_memories=[], harmful_memories=[5]
        )
        await stage.on_label(mark)
    assert outputs.control.sent == []  # type: ignore[attr-defined]
    assert outputs.experiences.sent == []  # type: ignore[attr-defined]
    assert total(metrics.do_not_use_proposals) == 21, "each mark is counted as a proposal for an operator"


async def test_the_verb_refuses_a_command_over_the_cap_before_sending() -> None:
    # No broker at this address: the verb must refuse before connecting.
    status = await change_suppression(
        "127.0.0.1:1", S, SUPPRESS_COMMAND, list(range(32)), by="ops", reason="", timeout=1.0, max_slots=8, per_hour=4
    )
    assert status == 2


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
async def test_an_operators_suppression_is_served_at_once_capped_rate_limited_and_undone(
    topics_ready: Settings,
) -> None:
    s = topics_ready.replace(
        gate=True, checkpoint_interval_s=0.3, suppress_max_slots=4, suppress_checkpoints_per_hour=2
    )
    learner = Learner(s.learner(), s.bootstrap, Metrics())
    sub = PolicySubscriber(s.bootstrap, s.policy, s)
    producer = AIOKafkaProducer(bootstrap_servers=s.bootstrap)
    verdicts = learner.metrics.suppressions

    async def send(command: str, slots: list[int], cid: str) -> None:
        ctl = Control(command=command, ts=1.0, reason="test", details={"slots": slots, "by": "ops"}, id=cid)
        await producer.send_and_wait(s.topics().control.name, encode(ctl.to_dict()), partition=0)

    async with sub:
        await learner.start()
        task = asyncio.create_task(learner.run())
        await producer.start()
        try:
            first = await sub.wait_for_policy(1, timeout=30)
            # over the cap (4 here): refused by the learner, nothing applied, no checkpoint
            await send(SUPPRESS_COMMAND, list(range(32)), "c-over")
            await until(lambda: total(verdicts, verdict="refused") == 1, what="the over-cap command refused")
            assert learner.progress.suppressed == [] and learner.version == first.version
            assert float(learner.trainer.net.out.bias[4].detach()) > -20
            # within the cap, through the operator's verb: served at once although the gate is on
            by_verb = change_suppression(
                s.bootstrap, s, SUPPRESS_COMMAND, [4], by="ops", reason="leaks", timeout=30, max_slots=4, per_hour=2
            )
            assert await by_verb == 0
            served = await sub.wait_for_policy(first.version + 1, timeout=30)
            assert served.manifest.reason == SUPPRESS_COMMAND
            assert served.manifest.metrics["suppressed"] == [4]
            [entry] = served.manifest.metrics["suppression_audit"]
            assert (entry["command"], entry["slots"], entry["by"], entry["reason"]) == ("suppress", [4], "ops", "leaks")
            assert float(served.net.out.bias[4].detach()) < -20
            await learner.control.reset("test")
            reset_version = learner.version
            assert float(learner.trainer.net.out.bias[4].detach()) < -20  # a fresh last layer keeps it suppressed
            # the undo: a neutral row again (mask ≈ 1), served at once, audited
            undo = change_suppression(
                s.bootstrap, s, UNSUPPRESS_COMMAND, [4], by="ops", reason="fixed", timeout=30, max_slots=4, per_hour=2
            )
            assert await undo == 0
            # Past the reset's version: the verb may see the learner's checkpoint on the topic before
            # the learner's own ``version`` moves on.
            restored = await sub.wait_for_policy(reset_version + 1, timeout=30)
            assert restored.manifest.reason == SUPPRESS_COMMAND and restored.manifest.metrics["suppressed"] == []
            assert [e["command"] for e in restored.manifest.metrics["suppression_audit"]] == ["suppress", "unsuppress"]
            mask = torch.nn.functional.softplus(restored.net.out.bias[4].detach())
            assert abs(float(mask) - 1.0) < 1e-3
            # the rate limit (2 suppressions per hour here) holds: the undo did not count, a third is refused
            before = learner.version
            await send(SUPPRESS_COMMAND, [7], "c-second")
            await until(lambda: learner.version > before, what="the second suppression served")
            version = learner.version
            await send(SUPPRESS_COMMAND, [8], "c-third")
            await until(lambda: total(verdicts, verdict="refused") == 2, what="the third suppression refused")
            assert learner.version == version and learner.progress.suppressed == [7]
            # and an undo is never refused for the rate: a mistaken suppression can always be taken back
            await send(UNSUPPRESS_COMMAND, [7], "c-undo")
            await until(lambda: learner.version > version, what="the undo served beyond the limit")
            assert learner.progress.suppressed == [] and total(verdicts, verdict="apply") == 4
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
