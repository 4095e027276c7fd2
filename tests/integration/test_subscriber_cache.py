"""A service restarted while the broker is away serves the policy it served before (issue 39, item 2).

A subscriber with ``cache_dir=`` loads a signed policy from the model topic and keeps it on
local disk; the broker is stopped; a new subscriber on the same directory serves that policy
from the moment it has started (the retriever's events name its version), while its health
says the broker is away. The broker is this test's own (the session's is shared, and stays up).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from models.policy.network import Arch, init_policy
from pipeline import kafka
from pipeline.broker import EmbeddedBroker
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import LoadedPolicy, PolicySubscriber
from pipeline.config import Settings
from pipeline.modeltopic import CheckpointPublisher
from tests.helpers import publish_tensors
from topics.signing import generate_pem, load_key

PRIVATE, PUBLIC = (load_key(pem) for pem in generate_pem())


async def _publish(s: Settings, seeds: range) -> None:
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    try:
        topic = s.connection().topics.policy_checkpoints.name
        pub = CheckpointPublisher(producer, topic, s.policy, signing_key=PRIVATE)
        arch = Arch(s.embedding_dim, s.slots, s.hidden)
        for seed in seeds:
            tensors = init_policy(s.embedding_dim, s.slots, s.hidden, seed=seed).tensors()
            await publish_tensors(pub, tensors, arch=arch, reason="periodic", baseline=0.0)
    finally:
        await producer.stop()


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout} s")
        await asyncio.sleep(0.05)


@pytest.mark.broker
@pytest.mark.timeout(120)
def test_a_subscriber_started_without_the_broker_serves_the_cached_policy(tmp_path: Path) -> None:
    broker = EmbeddedBroker(log_path=tmp_path / "broker.log")
    broker.start()
    s = Settings(
        bootstrap=broker.bootstrap,
        topic_prefix=f"t{uuid.uuid4().hex[:8]}.",
        partitions=1,
        embedding_dim=8,
        slots=32,
        hidden=16,
        state_dir=str(tmp_path / "state"),
    )
    cache_dir = tmp_path / "policy-cache"
    rng = np.random.default_rng(0)
    memories = rng.standard_normal((32, 8)).astype(np.float32)
    memories /= np.linalg.norm(memories, axis=1, keepdims=True)

    async def before() -> dict[str, torch.Tensor]:
        await kafka.create_topics(broker.bootstrap, s)
        await _publish(s, range(2))
        async with PolicySubscriber(broker.bootstrap, conn=s, signing_key=PUBLIC, cache_dir=cache_dir) as sub:
            loaded = await sub.wait_for_policy(2, timeout=30)
            await _until(lambda: sub.cached_version == 2, 30, "written to the cache")
            return loaded.net.tensors()

    async def after() -> tuple[PolicySubscriber, list[int], int]:
        retriever = CausalRetriever(memories, texts=[f"memory {i}" for i in range(32)], k=3, conn=s)
        updates: list[int] = []

        def on_update(policy: LoadedPolicy) -> None:
            updates.append(policy.version)
            retriever.set_policy(policy)

        async with PolicySubscriber(
            broker.bootstrap, conn=s, signing_key=PUBLIC, cache_dir=cache_dir, on_update=on_update
        ) as sub:
            served = retriever.retrieve(memories[0], query_id="after-restart").event.policy_version
            await _until(lambda: sub.health().startswith("degraded: no broker since "), 30, "degraded")
            return sub, updates, served

    try:
        tensors = asyncio.run(before())
    finally:
        broker.stop()
    assert sorted(p.name for p in cache_dir.iterdir()) == ["default.v2.manifest.json", "default.v2.safetensors"]

    sub, updates, served = asyncio.run(after())
    assert updates == [2] and served == 2  # from start, before any broker answered
    assert sub.current is not None and sub.current.version == 2 and sub.from_cache == 2
    assert sub.cache_refused_total == 0 and sub.rejected_total == 0
    now = sub.current.net.tensors()
    assert all(torch.equal(now[n], t) for n, t in tensors.items())
