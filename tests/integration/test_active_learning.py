"""Active learning through the real worker: the error trigger in both orders, once; uncertainty; answers."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path

import orjson
import pytest
from causalmem_lab.procs import Child

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from pipeline.metrics import Metrics
from pipeline.promtext import metric
from pipeline.worker.join import JoinStage
from tests.conftest import settings_env
from tests.helpers import feedback, label, retrieval_event, until
from topics.internal import decode_experience
from topics.labels import decode_active_learning_sample

pytestmark = [pytest.mark.broker, pytest.mark.slow]

T0 = 1_767_225_600.0


async def _samples(s: Settings) -> list:
    msgs = await kafka.read_all(s.bootstrap, s, s.topics().active_learning.name)
    return [decode_active_learning_sample(m.value, s.limits(), m.key) for m in msgs]


async def test_error_samples_both_orders_once_and_answers_reach_the_learner(settings: Settings, tmp_path: Path) -> None:
    s = settings.replace(topic_prefix=f"a{uuid.uuid4().hex[:6]}.", join_window_s=86400.0)
    env = {**settings_env(s), "CAUSALMEM_LABEL_WINDOW_S": str(10 * 86400)}
    await kafka.create_topics(s.bootstrap, s)
    worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker.log")
    try:
        await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 60, "worker")
        async with EventPublisher(s.bootstrap, s) as pub:

            async def step(qid: str, u: float, t: float, step_no: int = 0) -> None:
                ev = retrieval_event(s, qid, step=step_no, ts=t)
                ev.query_text = f"question {qid}"
                ev.memory_texts = {c: f"memory {c}" for c in ev.candidates}
                await pub.publish(ev)
                await pub.publish(feedback(qid, step_no, ts=t + 1, utility=u))

            # verdict after the bad step → a sample
            await step("after", -0.8, T0)
            await pub.flush()
            await asyncio.sleep(1.0)
            await pub.publish(label("after", "verdict", ts=T0 + 5, answer_correct=False))
            # verdict before the bad step → a sample
            await pub.publish(label("before", "verdict", ts=T0 + 10, answer_correct=False))
            await pub.flush()
            await asyncio.sleep(1.0)
            await step("before", -0.9, T0 + 11)
            # not otherwise: a correct answer, or a good step
            await step("correct", -0.9, T0 + 20)
            await pub.publish(label("correct", "verdict", ts=T0 + 25, answer_correct=True))
            await step("good", 0.4, T0 + 30)
            await pub.publish(label("good", "verdict", ts=T0 + 35, answer_correct=False))
            # the same step delivered twice, and a second verdict: still one sample
            dup = retrieval_event(s, "dup", ts=T0 + 40)
            await pub.publish(dup)
            await pub.publish(dup)
            await pub.publish(feedback("dup", ts=T0 + 41, utility=-0.7))
            await pub.publish(label("dup", "verdict", ts=T0 + 45, answer_correct=False))
            await pub.publish(label("dup", "verdict", ts=T0 + 46, answer_correct=False))
        await until(lambda: metric(worker.metrics(), "causalmem_al_samples_total") >= 3, 60, "three samples")
        await asyncio.sleep(3.0)  # anything extra would show up now
        samples = await _samples(s)
        assert sorted(x.query_id for x in samples) == ["after", "before", "dup"]
        after = next(x for x in samples if x.query_id == "after")
        assert after.reason == "error" and after.utility == pytest.approx(-0.8)
        assert after.query_text == "question after" and after.memory_texts and after.top_slots
        assert after.scores is not None and after.temperature == 0.5
        # An answer to the sample becomes a label experience for the learner.
        async with EventPublisher(s.bootstrap, s) as pub:
            answer = label(
                "after",
                "memory_choice",
                ts=T0 + 60,
                sample_id=after.sample_id,
                correct_memories=[after.candidates[0]],
                rating=4,
            )
            await pub.publish(answer)

        async def label_experiences() -> list:
            msgs = await kafka.read_all(s.bootstrap, s, s.topics().experiences.name)
            exps = [decode_experience(m.value, s.limits()) for m in msgs]
            return [e for e in exps if e.kind == "label"]

        for _ in range(60):
            found = await label_experiences()
            if found:
                break
            await asyncio.sleep(0.5)
        assert len(found) == 1 and found[0].correct_memories == [after.candidates[0]]
        assert found[0].event.candidates == after.candidates
    finally:
        worker.stop()


async def test_uncertainty_trigger_respects_its_budget(topics_ready: Settings) -> None:
    s = topics_ready.replace(al_uncertainty_budget=0.25, al_uncertainty_margin=0.05)
    stage = JoinStage(s.join(), s.bootstrap, Metrics())
    await stage.start()
    task = asyncio.create_task(stage.run())
    try:
        async with EventPublisher(s.bootstrap, s) as pub:
            for i in range(40):
                ev = retrieval_event(s, f"u{i}", ts=T0 + i)
                n = len(ev.candidates)
                # every step is uncertain: the two most likely candidates are almost tied
                ev.candidate_probs = [0.3, 0.29] + [0.41 / (n - 2)] * (n - 2)
                await pub.publish(ev)
                await pub.publish(feedback(f"u{i}", ts=T0 + i + 1, utility=0.2))
        await until(lambda: stage.joined_total == 40, 30, "joins")
    finally:
        await stage.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    msgs = await kafka.read_all(s.bootstrap, s, s.topics().outcomes.name)
    records = [r for m in msgs for r in orjson.loads(m.value)["records"]]
    uncertain = [r for r in records if r.get("al") == "uncertain"]
    assert len(records) == 40
    assert 0 < len(uncertain) <= 0.25 * 40
    # Each uncertain step carries its sample, encoded once by the join, as the topic gets it.
    samples = [decode_active_learning_sample(r["sample"].encode(), s.limits(), r["query_id"]) for r in uncertain]
    assert all(x.reason == "uncertain" and x.step == r["step"] for x, r in zip(samples, uncertain, strict=True))
