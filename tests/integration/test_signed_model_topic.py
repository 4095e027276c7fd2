"""Signing covers the whole model topic, on a real broker (contract 1.7): with a signing key the
learner's chunk and canary tombstones carry a signature header and its slot-map records a
signature; a reader with the key follows those and rejects a forged map record or an unsigned
tombstone (which used to empty a version's chunk index or swap two memories' rows)."""

from __future__ import annotations

import asyncio
import time

import pytest

from models.policy.network import Arch, init_policy
from pipeline import kafka
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.modeltopic import CheckpointPublisher, scan_model_topic
from tests.helpers import publish_tensors
from topics.manifest import canary_key, chunk_key
from topics.slotmap import SlotRecord

pytestmark = pytest.mark.broker

KEY = b"the-learner's-key"


async def _publish(s: Settings, versions: int, keep: int) -> None:
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    try:
        topic = s.connection().topics.policy_checkpoints.name
        pub = CheckpointPublisher(producer, topic, s.policy, keep_versions=keep, signing_key=KEY)
        pub.adopt(await scan_model_topic(s.bootstrap or "", s, signing_key=KEY))
        arch = Arch(s.embedding_dim, s.slots, s.hidden)
        for seed in range(versions):
            net = init_policy(s.embedding_dim, s.slots, s.hidden, seed=seed)
            await publish_tensors(pub, net.tensors(), arch=arch, reason="periodic", baseline=0.0)
    finally:
        await producer.stop()


async def _send(s: Settings, messages: list[tuple[bytes, bytes | None]]) -> None:
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    try:
        for key, value in messages:
            await (await producer.send(s.connection().topics.policy_checkpoints.name, value, key=key, partition=0))
    finally:
        await producer.stop()


def _record(s: Settings, slot: int, memory_id: str, version: int) -> SlotRecord:
    return SlotRecord(s.policy, slot, memory_id, live=True, version=version, since=version, ts=time.time())


def test_signed_tombstones_count_and_forged_ones_do_not(topics_ready: Settings) -> None:
    s = topics_ready
    asyncio.run(_publish(s, 3, keep=1))  # v1's and v2's chunks are tombstoned, signed
    index = asyncio.run(scan_model_topic(s.bootstrap or "", s, signing_key=KEY))
    assert index.rejected == []
    assert index.chunk_offsets.get((s.policy, 1)) == {} and index.chunk_offsets.get((s.policy, 2)) == {}
    live = dict(index.chunk_offsets[(s.policy, 3)])
    assert live

    # A writer without the key tombstones v3's chunks and the canary.
    forged = [(chunk_key(s.policy, 3, i).encode(), None) for i in live]
    asyncio.run(_send(s, [*forged, (canary_key(s.policy).encode(), None)]))
    index = asyncio.run(scan_model_topic(s.bootstrap or "", s, signing_key=KEY))
    assert index.chunk_offsets[(s.policy, 3)] == live  # the index still finds every chunk of v3
    assert len(index.rejected) == len(live) + 1
    assert all("tombstone: signature missing" in why for _, why in index.rejected)
    unsigned = asyncio.run(scan_model_topic(s.bootstrap or "", s))  # without a key, tombstones are followed
    assert unsigned.chunk_offsets[(s.policy, 3)] == {}


async def _slot_map(s: Settings) -> tuple[int | None, int | None, list[tuple[int, str]]]:
    async with PolicySubscriber(s.bootstrap or "", conn=s, signing_key=KEY) as sub:
        await _publish(s, 1, keep=5)
        good = [_record(s, 3, "doc-a", 1), _record(s, 4, "doc-b", 1)]
        await _send(s, [(r.key.encode(), r.to_bytes(KEY)) for r in good])
        # A forger swaps the two memories' rows: unsigned, and signed with another key.
        swapped = [_record(s, 4, "doc-a", 1), _record(s, 3, "doc-b", 1)]
        await _send(s, [(swapped[0].key.encode(), swapped[0].to_bytes())])
        await _send(s, [(swapped[1].key.encode(), swapped[1].to_bytes(b"another key"))])
        await _publish(s, 1, keep=5)
        loaded = await sub.wait_for_policy(2, timeout=30)
        return loaded.slot_of("doc-a"), loaded.slot_of("doc-b"), sub.rejections


def test_a_forged_slot_map_record_is_rejected(topics_ready: Settings) -> None:
    slot_a, slot_b, rejections = asyncio.run(_slot_map(topics_ready))
    assert (slot_a, slot_b) == (3, 4)
    assert sum("slot-map record: inconsistent" in why for _, why in rejections) == 2
