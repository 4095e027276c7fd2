"""Memories by id end to end on a broker: lifecycle → learner slots → map with checkpoints → subscriber → retriever."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer

from models.policy.trainer import PolicyTrainer
from pipeline.client.follower import MemoryFollower
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.learner.loop import Learner
from pipeline.learner.memories import MemoryBank
from pipeline.learner.publishing import Progress
from pipeline.learner.restore import Restored
from pipeline.metrics import Metrics
from tests.helpers import until
from tests.paths import REPO_ROOT
from topics.events import Features, RetrievalEvent
from topics.internal import experience_bytes
from topics.lifecycle import MemoryRecord

BASE_TS = 1_767_225_600.0
CONSUMER = REPO_ROOT / "examples" / "contract_consumer.py"


def unit(dim: int, i: int) -> np.ndarray:
    v = np.full(dim, 0.05, np.float32)
    v[i % dim] = 1.0
    return v / np.linalg.norm(v)


def by_id_event(s: Settings, event_id: str, ids: list[str]) -> RetrievalEvent:
    return RetrievalEvent(
        event_id, f"q-{event_id}", 0, BASE_TS, Features(unit(s.embedding_dim, 0), 0.0, 0.0),
        candidates=list(range(len(ids))), scores=np.full(len(ids), 0.5), selected=[0],
        temperature=0.5, logprob=-0.7, fallback=False, policy=s.policy, candidate_ids=ids,
    )  # fmt: skip


def rejected(learner: Learner, topic: str, reason: str) -> float:
    return float(learner.metrics.rejected.labels(topic=topic, reason=reason)._value.get())


@pytest.mark.broker
async def test_a_memory_added_by_id_is_assigned_published_served_and_removed(topics_ready: Settings) -> None:
    s = topics_ready
    t = s.topics()
    learner = Learner(s.learner(), s.bootstrap, Metrics())
    retriever = CausalRetriever.by_id(s.embedding_dim, k=2, seed=0, conn=s)
    sub = PolicySubscriber(s.bootstrap, s.policy, s, on_update=retriever.set_policy)
    follower = MemoryFollower(s.bootstrap, retriever, s)
    producer = AIOKafkaProducer(bootstrap_servers=s.bootstrap)
    await producer.start()
    await learner.start()
    task = asyncio.create_task(learner.run())
    try:
        async with sub, follower:
            await sub.wait_for_policy(1, timeout=30)

            async def lifecycle(record: MemoryRecord) -> None:
                await producer.send_and_wait(t.memory_lifecycle.name, record.to_bytes(), key=record.key, partition=0)

            for i, mid in enumerate(["m-a", "m-b", "m-c"]):
                await lifecycle(MemoryRecord("add", mid, BASE_TS + i, text=f"memory {mid}", embedding=unit(8, i)))
            await lifecycle(MemoryRecord("remove", "ghost", BASE_TS + 3))  # an id that does not exist
            await follower.wait_for("m-c")
            # Searchable at once, before any checkpoint holds its row.
            assert "m-a" in (retriever.retrieve(unit(8, 0), query_id="q0").ids or [])
            await until(lambda: sub.current is not None and sub.current.slot_of("m-c") is not None, 20, "the map")
            assert sub.current is not None
            slots = {mid: sub.current.slot_of(mid) for mid in ("m-a", "m-b", "m-c")}
            assert slots == {mid: learner.memories.allocator.slot_of(mid) for mid in slots}  # type: ignore[union-attr]
            assert sorted(slots.values()) == [0, 1, 2]  # type: ignore[type-var]
            ev = retriever.retrieve(unit(8, 1), query_id="q1").event
            assert dict(zip(ev.candidate_ids or [], ev.candidates, strict=True))["m-b"] == slots["m-b"]
            assert rejected(learner, t.memory_lifecycle.name, "unknown_memory") == 1

            # Events by id: a live id trains its slot; an unknown id is dead-lettered, never reaches the model.
            applied = learner.trainer.experiences
            for eid, ids in (("e1", ["m-b", "m-a"]), ("e2", ["m-a", "nobody"])):
                value = experience_bytes(by_id_event(s, eid, ids), 0.8)
                await producer.send_and_wait(t.experiences.name, value, partition=0)
            await until(lambda: rejected(learner, t.experiences.name, "unknown_memory") == 1, 20, "dead letter")
            await until(lambda: learner.inbox.position == 2 and not learner.inbox.pending, 20, "both read")
            assert learner.trainer.experiences == applied + 1  # the by-id experience, not the unknown one
            assert learner.trainer.memory_stats.reads[slots["m-b"]] >= 1  # type: ignore[index]

            # Remove: gone from the index at once, and the map tombstones the slot with a later version.
            await lifecycle(MemoryRecord("remove", "m-a", BASE_TS + 10))
            await follower.wait_for("m-a", present=False)
            for i in range(5):
                assert "m-a" not in (retriever.retrieve(unit(8, 0), query_id=f"r{i}").event.candidate_ids or [])
            await until(lambda: sub.current is not None and sub.current.slot_of("m-a") is None, 20, "tombstone")

            # A restart rebuilds the map from the model topic alone (the published map is the saved state).
            await until(lambda: not learner.dirty and not learner.memories.pending, 20, "published")  # type: ignore[union-attr]
            bank = MemoryBank(s.connection(), s.slots, s.lifecycle_grace_s)
            resumed = Restored("test", learner.version, Progress(), None, learner.input_offsets())
            assert not await bank.restore(s.bootstrap, resumed, PolicyTrainer(s.trainer()))  # no rows ahead
            ours = learner.memories
            assert ours is not None and bank.allocator.live == ours.allocator.live == {"m-b": 1, "m-c": 2}
            assert bank.allocator.tombstones == ours.allocator.tombstones and bank.position == ours.position == 5

            # A reader of contract 1.2 (the minimal consumer) skips the slot-map keys.
            spec = importlib.util.spec_from_file_location("contract_consumer", CONSUMER)
            assert spec is not None and spec.loader is not None
            consumer = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(consumer)
            records = await consumer.read_model_topic(s.bootstrap, t.policy_checkpoints.name, 10.0)
            assert any(k is not None and b"/slot/" in k for _, k, _ in records)
            manifest, _, problems = consumer.newest_verified(records, s.policy)
            assert manifest["version"] >= sub.current.version and problems == []
    finally:
        await learner.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await producer.stop()
