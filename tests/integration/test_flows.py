"""Integration tests through a real broker: join, learner, checkpoints, subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import numpy as np
import orjson
import pytest
import torch

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.client.subscriber import PolicySubscriber, fetch_checkpoint
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from pipeline.modeltopic import scan_model_topic
from pipeline.worker.join import JoinStage
from pipeline.worker.partitions import key_partition
from tests.helpers import experience, feedback, retrieval_event, running, until
from topics.fields import Rejected, encode
from topics.internal import decode_experience
from topics.names import Topics

pytestmark = pytest.mark.broker


async def _read(s, topic: str) -> list:
    return await kafka.read_all(s.bootstrap, s, topic)


async def test_join_either_order_duplicates_and_dead_letter(topics_ready) -> None:
    s = topics_ready
    metrics = Metrics()
    async with running(JoinStage(s.join(), s.bootstrap, metrics)) as stage, EventPublisher(s.bootstrap, s) as pub:
        events = [retrieval_event(s, f"q{i}", step=i % 3) for i in range(20)]
        for i, ev in enumerate(events):
            fb = feedback(ev.query_id, ev.step)
            first, second = (ev, fb) if i % 2 == 0 else (fb, ev)  # both arrival orders
            await pub.publish(first)
            await pub.publish(second)
        for ev in events[:5]:
            await pub.publish(ev)  # the same event_id again: applied once
        await pub.send_raw("retrieval-events", b"{truncated", "qbad")
        await pub.send_raw(
            "llm-feedback", encode({**feedback("qbad").to_dict(), "utility": None, "nll_with": None}), "qbad"
        )
        bad_emb = retrieval_event(s, "qbad2").to_dict()
        bad_emb["features"]["query_embedding"] = [0.1] * (s.embedding_dim + 1)
        await pub.send_raw("retrieval-events", encode(bad_emb), "qbad2")
        await pub.flush()
        await until(lambda: metrics.joins._value.get() >= 20 and metrics.dead_letters._value.get() >= 3, 30, "joins")
        await asyncio.sleep(1.5)  # anything extra would arrive now
        assert stage.joined_total == 20
    exps = [decode_experience(m.value, s.limits()) for m in await _read(s, s.topics().experiences.name)]
    assert sorted(e.id for e in exps) == sorted(e.event_id for e in events)
    assert all(abs(e.utility - 0.5) < 1e-9 for e in exps)
    dead = [orjson.loads(m.value) for m in await _read(s, s.topics().dead_letter.name)]
    assert sorted(d["reason"] for d in dead) == ["bad_json", "embedding_length", "missing_field"]
    assert all(d["source"]["topic"].startswith(s.topic_prefix) for d in dead)
    outcomes = [orjson.loads(m.value) for m in await _read(s, s.topics().outcomes.name)]
    assert sum(len(o["records"]) for o in outcomes) == 20


async def test_unmatched_events_expire_after_the_window(topics_ready) -> None:
    s = topics_ready.replace(join_window_s=100.0)
    metrics = Metrics()
    # Expiry follows each partition's own event time: the three queries share a partition.
    part = key_partition("lonely", s.partitions)
    orphan, later = (
        next(f"{n}{i}" for i in range(1000) if key_partition(f"{n}{i}", s.partitions) == part)
        for n in ("orphan", "later")
    )
    async with running(JoinStage(s.join(), s.bootstrap, metrics)) as stage, EventPublisher(s.bootstrap, s) as pub:
        await pub.publish(retrieval_event(s, "lonely", ts=1_000.0))
        await pub.publish(feedback(orphan, ts=1_001.0))
        await pub.flush()
        await until(lambda: sum(st.pending() for st in stage.state.values()) == 2, 20, "pending")
        # Event time moves on (another pair far later): both halves are now too old.
        ev = retrieval_event(s, later, ts=5_000.0)
        await pub.publish(ev)
        await pub.publish(feedback(later, ts=5_000.0))
        await pub.flush()
        await until(lambda: metrics.join_expired.labels(side="retrieval")._value.get() == 1, 20, "expiry")
        assert metrics.join_expired.labels(side="feedback")._value.get() == 1
        assert metrics.joins._value.get() == 1


async def test_learner_checkpoints_reach_a_subscriber(topics_ready) -> None:
    s = topics_ready
    versions: list[int] = []
    sub = PolicySubscriber(s.bootstrap, s.policy, s, on_update=lambda p: versions.append(p.version))
    async with running(Learner(s.learner(), s.bootstrap, Metrics())) as learner, sub:
        init = await sub.wait_for_policy(1, timeout=30)
        assert init.manifest.reason == "init"
        producer = kafka.producer(s.bootstrap, s)
        await producer.start()
        for i in range(40):
            await producer.send(s.topics().experiences.name, encode(experience(s, i).to_dict()), partition=0)
        await producer.flush()
        await producer.stop()
        await until(lambda: learner.trainer.experiences == 40, 30, "experiences applied")
        loaded = await sub.wait_for_policy(2, timeout=30)
        await until(lambda: not learner.dirty, 10, "a checkpoint after the last update")
        loaded = await sub.wait_for_policy(learner.version, timeout=30)
        # What the client runs is exactly what the learner has.
        for name, tensor in learner.trainer.tensors().items():
            assert torch.equal(loaded.net.tensors()[name], tensor), name
        assert loaded.manifest.input_offsets[f"{s.topics().experiences.name}:0"] == 40
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
    index = await scan_model_topic(s.bootstrap, s)
    serving = index.serving[s.policy]
    # The learner published a shutdown checkpoint only if something changed since.
    assert serving.version >= loaded.version
    tensors = await fetch_checkpoint(s.bootstrap, s, index, serving)
    assert set(tensors) >= {"norm.weight", "hidden.weight", "out.weight", "alpha"}


async def test_learner_restart_resumes_after_recorded_offsets(topics_ready) -> None:
    s = topics_ready
    topic = s.topics().experiences.name
    producer = kafka.producer(s.bootstrap, s)
    await producer.start()
    try:
        for i in range(24):
            await producer.send(topic, encode(experience(s, i).to_dict()), partition=0)
        await producer.flush()
        first = Learner(s.learner(), s.bootstrap, Metrics())
        await first.start()
        task = asyncio.create_task(first.run())
        await until(lambda: first.trainer.experiences == 24 and not first.dirty, 30, "first learner checkpoint")
        # Crash: no shutdown checkpoint, no goodbye.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await first.stop(publish=False)
        for i in range(24, 40):
            await producer.send(topic, encode(experience(s, i).to_dict()), partition=0)
        # A repeated experience (e.g. a join re-emitted after a worker takeover) is applied once.
        await producer.send(topic, encode(experience(s, 3).to_dict()), partition=0)
        await producer.flush()
    finally:
        await producer.stop()
    async with running(Learner(s.learner(), s.bootstrap, Metrics())) as second:
        await until(lambda: second.active.is_set(), 30, "second learner active")
        assert second.restored_from.startswith("topic")
        await until(lambda: second.trainer.experiences == 40 and not second.dirty, 30, "second learner applied all")
        assert second.metrics.learner_skipped.labels(reason="duplicate")._value.get() == 1
        assert second.input_offsets()[f"{topic}:0"] == 41


def test_topic_layout_is_co_partitioned() -> None:
    t = Topics.build(prefix="x.", partitions=6)
    joined = [t.retrieval_events, t.llm_feedback, t.human_labels, t.outcomes]
    assert {spec.partitions for spec in joined} == {6}
    assert t.policy_checkpoints.partitions == 1 and t.experiences.partitions == 1
    assert t.policy_checkpoints.configs["cleanup.policy"] == "compact"


def test_rejected_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        raise Rejected("bad_json")


async def _learn_from(s, messages: list[tuple[str, object]], n_pairs: int) -> dict:
    """Publish input messages, run a join stage and a learner in this process; final tensors."""
    async with EventPublisher(s.bootstrap, s) as pub:
        for _, value in messages:
            await pub.publish(value)
    metrics = Metrics()
    async with (
        running(JoinStage(s.join(), s.bootstrap, metrics)),
        running(Learner(s.learner(), s.bootstrap, Metrics())) as learner,
    ):
        await until(
            lambda: learner.trainer.experiences == n_pairs and not learner.dirty and not learner.held,
            60,
            "all experiences applied",
        )
        return learner.trainer.tensors()


async def test_duplicated_and_shuffled_delivery_learns_the_same_policy(topics_ready) -> None:
    base = topics_ready.replace(reorder_s=3600.0, batch_size=16, join_window_s=3600.0)
    rng = np.random.default_rng(5)
    pairs = []
    for i in range(240):
        ev = retrieval_event(base, f"r{i}", ts=1_767_225_600.0 + i, rng=np.random.default_rng(i), event_id=f"ev{i}")
        fb = feedback(ev.query_id, ts=ev.ts + 1, utility=float(rng.uniform(-1, 1)))
        fb.event_id = f"fb{i}"
        pairs.append((ev, fb))
    in_order = [m for ev, fb in pairs for m in (("r", ev), ("f", fb))]
    twice = in_order + in_order
    shuffled = []
    for start in range(0, len(twice), 60):  # shuffled within windows of 60 messages
        block = twice[start : start + 60]
        shuffled += [block[j] for j in rng.permutation(len(block))]
    results = []
    for name, messages in (("once", in_order), ("twice", shuffled)):
        s = base.replace(topic_prefix=f"{name}{uuid.uuid4().hex[:6]}.")
        await kafka.create_topics(s.bootstrap, s)
        results.append(await _learn_from(s, messages, len(pairs)))
    a, b = results
    for key in a:
        assert torch.equal(a[key], b[key]), key


async def test_reorder_mode_restart_applies_each_experience_once(topics_ready) -> None:
    """In reorder mode a crashed learner resumes from the oldest unapplied offset and skips what it applied."""
    base = topics_ready.replace(reorder_s=50.0, batch_size=8, checkpoint_interval_s=0.2)
    rng = np.random.default_rng(11)
    exps = [experience(base, i, utility=float(rng.uniform(-1, 1)), ts=1_767_225_600.0 + i) for i in range(300)]
    # shuffle locally (within 20 positions) so that every arrival stays inside the slack
    local = sorted(range(len(exps)), key=lambda i: i + rng.uniform(0, 20))
    results = []
    for crash in (False, True):
        s = base.replace(topic_prefix=f"ro{int(crash)}{uuid.uuid4().hex[:6]}.")
        await kafka.create_topics(s.bootstrap, s)
        producer = kafka.producer(s.bootstrap, s)
        await producer.start()
        for i in local:
            await producer.send(s.topics().experiences.name, encode(exps[i].to_dict()), partition=0)
        await producer.flush()
        await producer.stop()
        if crash:
            first = Learner(s.learner(), s.bootstrap, Metrics())
            await first.start()
            task = asyncio.create_task(first.run())
            await until(lambda f=first: f.trainer.experiences >= 100 and not f.dirty, 30, "a checkpoint mid-stream")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await first.stop(publish=False)
        async with running(Learner(s.learner(), s.bootstrap, Metrics())) as learner:
            await until(
                lambda lr=learner: lr.trainer.experiences == len(exps) and not lr.dirty and not lr.held,
                60,
                "all applied once",
            )
            await asyncio.sleep(1.0)
            assert learner.trainer.experiences == len(exps)  # nothing applied twice
            results.append(learner.trainer.tensors())
    a, b = results
    for key in a:
        assert torch.equal(a[key], b[key]), key
