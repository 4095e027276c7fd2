"""Crash and restart: the learner killed mid-stream, the embedded broker restarted."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import pytest
import torch
from causalmem_lab.procs import Child

from pipeline import kafka
from pipeline.broker import EmbeddedBroker
from pipeline.client.publisher import EventPublisher
from pipeline.client.subscriber import PolicySubscriber, fetch_checkpoint
from pipeline.config import Settings
from pipeline.modeltopic import scan_model_topic
from pipeline.promtext import metric
from tests.conftest import settings_env
from tests.helpers import experience, feedback, retrieval_event, until
from topics.fields import encode

pytestmark = [pytest.mark.broker, pytest.mark.slow]


async def _final_tensors(s: Settings) -> tuple[int, dict[str, torch.Tensor], dict]:
    index = await scan_model_topic(s.bootstrap, s)
    newest = index.newest(s.policy)
    assert newest is not None
    return newest.version, await fetch_checkpoint(s.bootstrap, s, index, newest), newest.metrics


async def _produce_experiences(s: Settings, n: int) -> None:
    p = kafka.producer(s.bootstrap, s)
    await p.start()
    try:
        for i in range(n):
            await p.send(s.topics().experiences.name, encode(experience(s, i).to_dict()), partition=0)
        await p.flush()
    finally:
        await p.stop()


def _applied(child: Child) -> float:
    return metric(child.metrics(), "causalmem_learner_experiences_total", kind="feedback")


async def test_sigkilled_learner_resumes_to_the_same_policy(settings: Settings, tmp_path: Path) -> None:
    """A learner SIGKILLed mid-stream and restarted ends with the parameters of one never stopped."""
    n = 3000
    runs = {}
    for name in ("uninterrupted", "killed"):
        s = settings.replace(
            topic_prefix=f"{name[:4]}{uuid.uuid4().hex[:6]}.",
            state_dir=str(tmp_path / name),
            checkpoint_interval_s=0.2,
            batch_size=8,
        )
        await kafka.create_topics(s.bootstrap, s)
        await _produce_experiences(s, n)  # all input first: batches are then formed by count alone
        env = settings_env(s)
        child = Child("learner", s.bootstrap, env, log_path=tmp_path / f"{name}.log")
        try:
            if name == "killed":
                await until(lambda c=child: _applied(c) >= n // 3, 90, "a third applied")
                child.kill()  # SIGKILL: no shutdown checkpoint, no goodbye
                child = Child("learner", s.bootstrap, env, log_path=tmp_path / f"{name}-2.log")
            await until(lambda c=child: _applied(c) >= 1, 90, "learning")
            version0 = (await scan_model_topic(s.bootstrap, s)).newest(s.policy).version

            for _ in range(300):  # until a checkpoint after the last experience is on the topic
                v, _, m = await _final_tensors(s)
                if v > version0 and m.get("experiences") == n:
                    break
                await asyncio.sleep(0.3)

        finally:
            child.stop()
        runs[name] = await _final_tensors(s)
        assert runs[name][2]["experiences"] == n, runs[name][2]
    (_, a, ma), (_, b, mb) = runs["uninterrupted"], runs["killed"]
    assert ma["updates"] == mb["updates"]
    # Same checkpoint, same Adam moments (local directory), same offsets, batches formed by
    # count: the restarted learner makes exactly the updates the crashed one would have.
    for key in a:
        assert torch.equal(a[key], b[key]), (key, float((a[key] - b[key]).abs().max()))


async def test_embedded_broker_restart_is_detected_and_recovered(tmp_path: Path) -> None:
    broker = EmbeddedBroker(log_path=tmp_path / "broker.log")
    bootstrap = broker.start()
    s = Settings(
        bootstrap=bootstrap,
        topic_prefix="r.",
        partitions=2,
        embedding_dim=8,
        slots=32,
        hidden=16,
        state_dir=str(tmp_path / "state"),
        checkpoint_interval_s=0.3,
        batch_size=8,
        gate=False,
        join_window_s=86400.0,
    )
    env = settings_env(s)
    worker = learner = None
    try:
        await kafka.create_topics(bootstrap, s)
        worker = Child("worker", bootstrap, env, log_path=tmp_path / "worker.log")

        learner = Child("learner", bootstrap, env, log_path=tmp_path / "learner.log", args=["--log-level", "debug"])
        await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 60, "worker")

        async def traffic(tag: str, n: int) -> None:
            async with EventPublisher(bootstrap, s) as pub:
                for i in range(n):
                    ev = retrieval_event(s, f"{tag}{i}")
                    await pub.publish(ev)
                    await pub.publish(feedback(ev.query_id, utility=0.3))

        await traffic("a", 40)
        await until(lambda: metric(learner.metrics(), "causalmem_learner_experiences_total") >= 40, 60, "applied")
        sub = PolicySubscriber(bootstrap, s.policy, s)
        await sub.start()
        try:
            await until(lambda: sub.current is not None and sub.current.version >= 2, 60, "a learnt policy")
            before = sub.current
            broker.restart()  # memory only: every topic, group and offset is gone
            await until(
                lambda: "cluster reset detected" in (tmp_path / "learner.log").read_text(), 60, "learner notices"
            )
            await until(lambda: "cluster reset detected" in (tmp_path / "worker.log").read_text(), 60, "worker notices")
            # The learner republishes its local checkpoint above the version clients run.
            await until(lambda: sub.current is not None and sub.current is not before, 90, "republished policy")
            after = sub.current
            assert after.version > before.version and after.manifest.metrics.get("restored_from") == "local"
            assert all(torch.equal(after.net.tensors()[k], v) for k, v in before.net.tensors().items())
            # Consumers start again from the beginning of the new topics: new traffic is learnt.
            await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 90, "worker")
            await traffic("b", 40)
            await until(lambda: metric(learner.metrics(), "causalmem_learner_experiences_total") >= 40, 90, "relearn")
            await until(lambda: sub.current.version > after.version, 60, "a new checkpoint after the reset")
        finally:
            await sub.stop()
    finally:
        for child in (worker, learner):
            if child is not None:
                child.stop(sig=signal.SIGTERM)
        broker.stop()
