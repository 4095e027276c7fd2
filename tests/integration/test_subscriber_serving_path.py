"""The subscriber and the memory follower on the service's request path: they never wait on the
caller, and never make it wait.

Each test is a failure a user saw: a fresh subscriber replayed every version of the topic's
history through ``on_update`` (v1 → v46 over ~5 s, serving stale versions meanwhile); the
README's service snippet, whose blocking LLM call kept the event loop busy, never got a new
policy; and without a broker, ``async with PolicySubscriber(...)`` (and ``MemoryFollower``) raised at once.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from models.policy.network import Arch, init_policy
from pipeline import kafka
from pipeline.broker import free_port
from pipeline.client.follower import MemoryFollower
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.modeltopic import CheckpointPublisher, scan_model_topic
from tests.helpers import publish_tensors


async def _publish(s: Settings, versions: int) -> None:
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    try:
        pub = CheckpointPublisher(producer, s.connection().topics.policy_checkpoints.name, s.policy, keep_versions=50)
        pub.adopt(await scan_model_topic(s.bootstrap or "", s))
        arch = Arch(s.embedding_dim, s.slots, s.hidden)
        for seed in range(versions):
            tensors = init_policy(s.embedding_dim, s.slots, s.hidden, seed=seed).tensors()
            await publish_tensors(pub, tensors, arch=arch, reason="periodic", baseline=0.0)
    finally:
        await producer.stop()


@pytest.mark.broker
def test_a_late_subscriber_loads_the_newest_version_only(topics_ready: Settings) -> None:
    s = topics_ready

    async def run() -> list[int]:
        await _publish(s, 12)
        loaded: list[int] = []
        async with PolicySubscriber(s.bootstrap or "", conn=s, on_update=lambda p: loaded.append(p.version)) as sub:
            await sub.wait_for_policy(12, timeout=30)
            await asyncio.sleep(0.5)  # anything else it would load arrives here
            await _publish(s, 1)
            await sub.wait_for_policy(13, timeout=30)
        return loaded

    assert asyncio.run(run()) == [12, 13]


@pytest.mark.broker
def test_new_policies_arrive_while_the_callers_loop_is_blocked(topics_ready: Settings) -> None:
    s = topics_ready

    async def run() -> int:
        async with PolicySubscriber(s.bootstrap or "", conn=s) as sub:
            await _publish(s, 2)
            deadline = time.monotonic() + 30
            # A synchronous LLM call in the service's handler: the loop does nothing else meanwhile.
            while (sub.current is None or sub.current.version < 2) and time.monotonic() < deadline:
                time.sleep(0.05)
            return sub.current.version if sub.current is not None else 0

    assert asyncio.run(run()) == 2


def test_starts_without_a_broker_and_says_so() -> None:
    async def run() -> str:
        async with PolicySubscriber(f"127.0.0.1:{free_port()}") as sub:  # nothing listens there
            with pytest.raises(TimeoutError):
                await sub.wait_for_policy(timeout=1.0)
            assert sub.current is None  # the caller serves its own ranking meanwhile
            return sub.health()

    assert asyncio.run(run()).startswith("degraded: no broker since ")


def test_the_memory_follower_starts_without_a_broker_and_says_so() -> None:
    retriever = CausalRetriever.by_id(8, k=2)

    async def run() -> str:
        async with MemoryFollower(f"127.0.0.1:{free_port()}", retriever) as follower:
            with pytest.raises(TimeoutError):
                await follower.wait_caught_up(timeout=1.0)
            return follower.health()

    assert asyncio.run(run()).startswith("degraded: no broker since ")
