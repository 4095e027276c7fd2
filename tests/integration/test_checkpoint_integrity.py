"""Checkpoint integrity on the client side (docs/contract.md).

A :class:`PolicySubscriber` is fed crafted model-topic messages through its public
``handle(offset, key, value)``: after a valid v1, every corrupted, incomplete, foreign,
older, tombstoned, candidate or unparseable checkpoint must leave v1 serving and be
recorded with its reason; a valid v6 is then swapped in. Chunks that are no longer held
in memory are re-fetched from the broker by offset (the real model topic is used for
that). That no path reading Kafka data unpickles anything is tested in
tests/integration/test_no_unpickling.py.
"""

from __future__ import annotations

import io
import pickle
import struct
import time
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import torch
from safetensors.torch import save as st_save

from models.policy.network import TENSOR_NAMES, Arch, init_policy
from models.policy.weights import to_safetensors
from pipeline import kafka
from pipeline.client.subscriber import LoadedPolicy, PolicySubscriber
from pipeline.config import Settings
from pipeline.modeltopic import CheckpointPublisher
from tests.helpers import publish_tensors
from topics.fields import encode
from topics.manifest import Manifest, candidate_key, chunk_key, serving_key, sha256_hex, split_chunks

CHUNK = 1024  # small chunks: a D=8, S=32, H=16 policy is ~3 KiB, so 3-4 chunks


# --------------------------------------------------------------------------- building checkpoints


@dataclass
class Ckpt:
    version: int
    tensors: dict[str, torch.Tensor]
    blob: bytes
    chunks: list[bytes]
    manifest: Manifest


def make_ckpt(
    s: Settings,
    version: int,
    seed: int = 0,
    embedding_dim: int | None = None,
    blob: bytes | None = None,
    policy: str | None = None,
    reason: str = "periodic",
) -> Ckpt:
    d = embedding_dim or s.embedding_dim
    net = init_policy(d, s.slots, s.hidden, seed=seed)
    tensors = net.tensors()
    blob = to_safetensors(tensors) if blob is None else blob
    chunks = split_chunks(blob, CHUNK)
    manifest = Manifest(
        policy=policy or s.policy,
        version=version,
        created_ts=time.time(),
        reason=reason,
        arch=Arch(d, s.slots, s.hidden).to_dict(),
        alpha=float(tensors["alpha"][0]),
        baseline=0.0,
        sha256=sha256_hex(blob),
        size=len(blob),
        chunks=len(chunks),
    )
    return Ckpt(version, tensors, blob, chunks, manifest)


class Feeder:
    """Feeds crafted model-topic messages to a subscriber with increasing offsets."""

    def __init__(self, sub: PolicySubscriber, start: int = 0) -> None:
        self.sub = sub
        self.offset = start

    async def send(self, key: str | bytes | None, value: bytes | None) -> None:
        k = key.encode() if isinstance(key, str) else key
        await self.sub.handle(self.offset, k, value)
        self.offset += 1

    async def chunks(self, ck: Ckpt, skip: tuple[int, ...] = (), replace_with: dict[int, bytes] | None = None) -> None:
        for i, chunk in enumerate(ck.chunks):
            if i in skip:
                continue
            await self.send(chunk_key(ck.manifest.policy, ck.version, i), (replace_with or {}).get(i, chunk))

    async def manifest(self, ck: Ckpt, key: str | None = None, body: bytes | None = None) -> None:
        key = key if key is not None else serving_key(ck.manifest.policy)
        await self.send(key, body if body is not None else encode(ck.manifest.to_dict()))

    async def checkpoint(self, ck: Ckpt, **kwargs: Any) -> None:
        await self.chunks(ck)
        await self.manifest(ck, **kwargs)


def same_weights(loaded: LoadedPolicy, ck: Ckpt) -> bool:
    got = loaded.net.tensors()
    return all(torch.equal(got[n], ck.tensors[n]) for n in TENSOR_NAMES)


# --------------------------------------------------------------------------- the subscriber


@pytest.mark.broker
async def test_subscriber_keeps_serving_v1_through_bad_checkpoints_then_loads_v6(topics_ready: Settings) -> None:
    s = topics_ready
    updates: list[int] = []
    # The crafted messages' offsets are synthetic: nothing can be re-fetched from the broker
    # (which must then reject, see v4), so the subscriber keeps the bytes of every version it
    # saw. Re-fetching evicted chunks by real offsets is tested below.
    sub = PolicySubscriber(s.bootstrap, s.policy, s, on_update=lambda p: updates.append(p.version), keep_recent=64)
    feed = Feeder(sub)
    rejected = 0

    async def expect_rejected(fragment: str) -> None:
        nonlocal rejected
        assert sub.current is not None and sub.current.version == 1, "v1 must keep serving"
        assert len(sub.rejections) == rejected + 1, sub.rejections[rejected:]
        assert fragment in sub.rejections[-1][1], sub.rejections[-1]
        assert sub.rejections[-1][0] == feed.offset - 1, "the rejection names the manifest's offset"
        rejected += 1

    async def expect_ignored() -> None:
        assert sub.current is not None and sub.current.version == 1
        assert len(sub.rejections) == rejected, sub.rejections[rejected:]

    v1 = make_ckpt(s, 1, seed=1, reason="init")
    assert len(v1.chunks) >= 3
    await feed.checkpoint(v1)
    assert sub.current is not None and sub.current.version == 1 and same_weights(sub.current, v1)
    assert sub.rejections == []

    # v2: one chunk corrupted in transit (one bit flipped); the manifest is right.
    v2 = make_ckpt(s, 2, seed=2)
    flipped = bytearray(v2.chunks[1])
    flipped[len(flipped) // 2] ^= 0x01
    await feed.chunks(v2, replace_with={1: bytes(flipped)})
    await feed.manifest(v2)
    await expect_rejected("sha256_mismatch")

    # v3: intact chunks, the manifest's sha256 is wrong.
    v3 = make_ckpt(s, 3, seed=3)
    await feed.chunks(v3)
    await feed.manifest(v3, body=encode({**v3.manifest.to_dict(), "sha256": "0" * 64}))
    await expect_rejected("sha256_mismatch")

    # v4: a chunk never arrives; the subscriber looks for it on the broker and must give up.
    v4 = make_ckpt(s, 4, seed=4)
    await feed.chunks(v4, skip=(1,))
    await feed.manifest(v4)
    await expect_rejected("missing_chunk")

    # v5: a checkpoint for another architecture (embedding_dim 16 instead of 8).
    v5 = make_ckpt(s, 5, seed=5, embedding_dim=2 * s.embedding_dim)
    await feed.checkpoint(v5)
    await expect_rejected("arch_mismatch")

    # v0 after v1: serving versions only grow.
    v0 = make_ckpt(s, 0, seed=9)
    await feed.checkpoint(v0)
    await expect_rejected("older version 0 after 1")

    # A tombstone for a chunk of a version before its manifest arrives.
    v7 = make_ckpt(s, 7, seed=7)
    await feed.chunks(v7)
    await feed.send(chunk_key(s.policy, 7, 0), None)
    await expect_ignored()
    await feed.manifest(v7)
    await expect_rejected("missing_chunk")

    # A tombstone for a chunk of the version being served: v1 stays loaded.
    await feed.send(chunk_key(s.policy, 1, 0), None)
    await expect_ignored()

    # A candidate manifest (awaiting the promotion gate): clients follow only "{policy}".
    v8 = make_ckpt(s, 8, seed=8)
    await feed.chunks(v8)
    await feed.manifest(v8, key=candidate_key(s.policy))
    await expect_ignored()

    # Manifest bytes that are not JSON, then JSON that is not a manifest.
    await feed.send(serving_key(s.policy), b"\x00\x01 not json {")
    await expect_rejected("bad manifest: bad_json")
    await feed.send(serving_key(s.policy), orjson.dumps({**v8.manifest.to_dict(), "schema": "policy_checkpoint/v2"}))
    await expect_rejected("bad manifest: unknown_schema")
    await feed.send(serving_key(s.policy), orjson.dumps([v8.manifest.to_dict()]))
    await expect_rejected("bad manifest: not_object")

    # A manifest whose body names another policy than its key.
    await feed.manifest(v8, body=encode({**v8.manifest.to_dict(), "policy": "other"}))
    await expect_rejected("manifest policy differs from its key")

    # Another policy's serving manifest is not ours: ignored.
    other = make_ckpt(s, 9, seed=9, policy="other")
    await feed.checkpoint(other)
    await expect_ignored()

    # The manifest's size disagrees with the chunks (sha256 right).
    v10 = make_ckpt(s, 10, seed=10)
    await feed.chunks(v10)
    await feed.manifest(v10, body=encode({**v10.manifest.to_dict(), "size": v10.manifest.size - 1}))
    await expect_rejected("size_mismatch")

    # Blobs whose sha256 matches but whose content must not be loaded.
    good = make_ckpt(s, 0).tensors
    nan = {**good, "out.weight": torch.full_like(good["out.weight"], float("nan"))}
    inf = {**good, "alpha": torch.tensor([float("inf")])}
    pickled = io.BytesIO()
    torch.save(good, pickled)
    huge_header = struct.pack("<Q", 2**62) + b'{"x":1}'
    lying_header = orjson.dumps({"out.weight": {"dtype": "F32", "shape": [10**9, 10**9], "data_offsets": [0, 4]}})
    lying = struct.pack("<Q", len(lying_header)) + lying_header + b"\x00" * 4
    bad_blobs = [
        ("non_finite", to_safetensors(nan)),
        ("non_finite", to_safetensors(inf)),
        ("wrong_dtype", st_save({k: v.double() for k, v in good.items()})),
        ("missing_tensor", st_save({k: v for k, v in good.items() if k != "alpha"})),
        ("unreadable", bytes(range(256)) * 8),
        ("unreadable", pickled.getvalue()),  # torch.save: a pickle inside a zip
        ("unreadable", pickle.dumps(good)),
        ("unreadable", huge_header),  # a header length of 2**62 bytes
        ("unreadable", lying),  # a header promising a 10**18-element tensor in 4 bytes
    ]
    for version, (reason, blob) in enumerate(bad_blobs, start=11):
        await feed.checkpoint(make_ckpt(s, version, blob=blob))
        await expect_rejected(reason)

    # A chunk key that does not parse is ignored; so is a republished v1 manifest.
    await feed.send(f"{s.policy}/../1/0", b"x")
    await feed.send(f"{s.policy}/x/0", b"x")
    await feed.manifest(v1, body=encode({**v1.manifest.to_dict(), "sha256": "f" * 64}))
    await expect_ignored()

    # Finally a valid v6 is loaded and served.
    v6 = make_ckpt(s, 6, seed=6)
    await feed.checkpoint(v6)
    assert sub.current is not None and sub.current.version == 6 and same_weights(sub.current, v6)
    assert len(sub.rejections) == rejected
    assert updates == [1, 6]
    # The new policy runs and gives a finite, non-negative mask.
    m = sub.current.net(torch.randn(2, s.embedding_dim), torch.zeros(2), torch.zeros(2))
    assert m.shape == (2, s.slots) and bool(torch.isfinite(m).all()) and bool((m >= 0).all())


@pytest.mark.broker
async def test_subscriber_refetches_evicted_chunks_from_the_broker(topics_ready: Settings) -> None:
    """Chunks no longer held in memory are read back from the model topic by offset and verified."""
    s = topics_ready
    topic = s.topics().policy_checkpoints.name
    producer = kafka.producer(s.bootstrap, s)
    await producer.start()
    try:
        pub = CheckpointPublisher(producer, topic, s.policy, keep_versions=10)
        net = init_policy(s.embedding_dim, s.slots, s.hidden, seed=3)
        arch = Arch(s.embedding_dim, s.slots, s.hidden)
        for v in (1, 2, 3):
            with torch.no_grad():
                net.alpha.fill_(0.1 * v)
            await publish_tensors(pub, net.tensors(), reason="periodic", arch=arch, baseline=0.0)
        # A corrupted copy of v4's chunk 0 on the broker, then v4's real manifest.
        blob = to_safetensors(net.tensors())
        bad = bytearray(blob)
        bad[-1] ^= 0xFF
        await (await producer.send(topic, bytes(bad), key=chunk_key(s.policy, 4, 0).encode(), partition=0))
        manifest4 = Manifest(
            s.policy, 4, time.time(), "periodic", arch.to_dict(), 0.3, 0.0, sha256_hex(blob), len(blob), 1
        )
        await (await producer.send(topic, encode(manifest4.to_dict()), key=s.policy.encode(), partition=0))
    finally:
        await producer.stop()
    msgs = await kafka.read_all(s.bootstrap, s, topic, partitions=[0])
    chunks = [m for m in msgs if m.key.decode().count("/") == 2]
    manifests = {orjson.loads(m.value)["version"]: m for m in msgs if m.key == s.policy.encode()}

    # keep_recent=1: the bytes of versions 1 and 2 are dropped as newer chunks arrive.
    sub = PolicySubscriber(s.bootstrap, s.policy, s, keep_recent=1)
    for m in chunks:
        await sub.handle(m.offset, m.key, m.value)
    assert set(sub._recent) == {4}
    m2 = manifests[2]
    await sub.handle(m2.offset, m2.key, m2.value)
    assert sub.current is not None and sub.current.version == 2 and sub.rejections == []
    assert abs(sub.current.alpha - 0.2) < 1e-6
    m4 = manifests[4]
    await sub.handle(m4.offset, m4.key, m4.value)
    assert sub.current.version == 2
    assert "sha256_mismatch" in sub.rejections[-1][1]
    m3 = manifests[3]
    await sub.handle(m3.offset, m3.key, m3.value)
    assert sub.current.version == 3 and abs(sub.current.alpha - 0.3) < 1e-6
