"""One hostile message on the model topic, on a real broker: a key whose version is a Unicode
digit (``default/²/0``: ``str.isdigit`` says yes, ``int`` raises) and a manifest whose signature
is not ASCII (``hmac.compare_digest`` raised TypeError on it). Every reader rejects them and goes
on: a running subscriber and a new one load the next good checkpoint, the learner's restore path
and fence read past them, and ``causalmem status`` and ``causalmem rollback`` answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

import pipeline.cli as cli
from models.policy.network import Arch, init_policy
from pipeline import kafka
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.learner.fence import Fence
from pipeline.learner.loop import Learner
from pipeline.learner.restore import find_version
from pipeline.learner.store import LocalStore
from pipeline.metrics import Metrics
from pipeline.modeltopic import CheckpointPublisher, scan_model_topic
from tests.helpers import publish_tensors
from topics.manifest import Manifest, sha256_hex

pytestmark = pytest.mark.broker

HOSTILE_KEY = "default/²/0".encode()


def _hostile_manifest(policy: str, s: Settings) -> bytes:
    arch = Arch(s.embedding_dim, s.slots, s.hidden).to_dict()
    m = Manifest(policy, 9, time.time(), "periodic", arch, 0.5, 0.0, sha256_hex(b"x"), 1, 1)
    return orjson.dumps({**m.to_dict(), "signature": "hmac-sha256:é"})


async def _send(s: Settings, messages: list[tuple[bytes, bytes]]) -> None:
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    try:
        for key, value in messages:
            await (await producer.send(s.connection().topics.policy_checkpoints.name, value, key=key, partition=0))
    finally:
        await producer.stop()


async def _publish(s: Settings, versions: int, signing_key: bytes | None = None) -> None:
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    try:
        topic = s.connection().topics.policy_checkpoints.name
        pub = CheckpointPublisher(producer, topic, s.policy, keep_versions=10, signing_key=signing_key)
        pub.adopt(await scan_model_topic(s.bootstrap or "", s, signing_key=signing_key))
        arch = Arch(s.embedding_dim, s.slots, s.hidden)
        for seed in range(versions):
            await publish_tensors(
                pub,
                init_policy(s.embedding_dim, s.slots, s.hidden, seed=seed).tensors(),
                arch=arch,
                reason="periodic",
                baseline=0.0,
            )
    finally:
        await producer.stop()


async def _subscribers(s: Settings) -> tuple[int, int, list[Any]]:
    """A subscriber running before the hostile messages and one started after them: the versions they load."""
    async with PolicySubscriber(s.bootstrap or "", conn=s, signing_key=b"k") as running:
        await _publish(s, 1, signing_key=b"k")
        await running.wait_for_policy(1, timeout=30)
        await _send(s, [(HOSTILE_KEY, b"x"), (s.policy.encode(), _hostile_manifest(s.policy, s))])
        await _publish(s, 1, signing_key=b"k")
        first = (await running.wait_for_policy(2, timeout=30)).version
        async with PolicySubscriber(s.bootstrap or "", conn=s, signing_key=b"k") as late:
            second = (await late.wait_for_policy(2, timeout=30)).version
            return first, second, late.rejections


def test_subscribers_reject_the_hostile_messages_and_load_the_next_checkpoint(topics_ready: Settings) -> None:
    first, second, rejections = asyncio.run(_subscribers(topics_ready))
    assert (first, second) == (2, 2)
    assert any("signature" in why for _, why in rejections)  # the non-ASCII signature: rejected, not a TypeError


def test_restore_fence_status_and_rollback_read_past_the_hostile_messages(
    topics_ready: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = topics_ready
    asyncio.run(_publish(s, 1))
    asyncio.run(_send(s, [(HOSTILE_KEY, b"x"), (f"{s.policy}/slot/²".encode(), b"x")]))
    asyncio.run(_publish(s, 1))
    conn = s.connection()
    arch = Arch(s.embedding_dim, s.slots, s.hidden)

    async def learner_side() -> tuple[Any, str]:
        tensors = await find_version(s.bootstrap or "", conn, LocalStore(tmp_path / "store"), arch, 1)
        fence = Fence(s.bootstrap or "", conn, None, None)
        await fence.follow(1, 0)  # reads the whole topic, the hostile messages included
        try:
            await fence.check()
        finally:
            await fence.close()
        return tensors, fence.lost

    tensors, lost = asyncio.run(learner_side())
    assert tensors is not None and lost == ""

    common = ["--bootstrap", s.bootstrap or "", "--prefix", s.topic_prefix, "--policy", s.policy]
    assert cli.main(["status", *common, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == []
    assert report["checkpoints"]["serving"]["version"] == 2

    cli.main(["rollback", *common, "--to", "1", "--timeout", "1"])  # no learner runs: it waits, then says so
    out = capsys.readouterr().out
    assert f"rolling policy {s.policy!r} back to v1 (on the model topic" in out


async def _learner_restores(s: Settings) -> tuple[str, int, bool]:
    learner = Learner(s.learner(), s.bootstrap or "", Metrics())
    await learner.start()
    task = asyncio.create_task(learner.run())
    try:
        for _ in range(600):  # elected, restored and active, or the task ended (it used to: ValueError)
            if learner.active.is_set() or task.done():
                break
            await asyncio.sleep(0.1)
        return learner.restored_from, learner.version, task.done()
    finally:
        await learner.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_signed_learner_restores_past_the_hostile_messages(topics_ready: Settings) -> None:
    s = topics_ready.replace(checkpoint_signing_key="k")
    asyncio.run(_publish(s, 1, signing_key=b"k"))
    hostile = [
        (HOSTILE_KEY, b"x"),
        (f"{s.policy}/slot/²".encode(), b"x"),
        (s.policy.encode(), _hostile_manifest(s.policy, s)),
    ]
    asyncio.run(_send(s, hostile))
    restored_from, version, ended = asyncio.run(_learner_restores(s))
    assert not ended
    assert (restored_from, version) == ("topic v1", 1)
