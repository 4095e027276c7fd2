"""Signatures only the learner can make, bound to the key they were made for (contract 1.11).

Two findings of a review, on a real broker: anyone who could write the model topic re-sent a
signed *candidate*'s manifest, byte for byte, under the serving key, and every
signature-checking subscriber served it (the HMAC covered the manifest, not its key); and every
client held the one HMAC secret it verified with, so any client could sign. Now the role is
signed with the rest, and with an Ed25519 pair the readers hold a key that cannot sign.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.policy.network import Arch, init_policy
from pipeline import kafka
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from pipeline.modeltopic import CheckpointPublisher, scan_model_topic
from tests.helpers import publish_tensors
from topics.fields import encode
from topics.manifest import Manifest, canary_key, serving_key
from topics.signing import generate_pem, load_key, sign

pytestmark = pytest.mark.broker

HMAC_KEY = b"the-learner's-shared-secret"


async def _publisher(s: Settings, key: object) -> tuple[object, CheckpointPublisher]:
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    topic = s.connection().topics.policy_checkpoints.name
    pub = CheckpointPublisher(producer, topic, s.policy, keep_versions=10, signing_key=key)  # type: ignore[arg-type]
    pub.adopt(await scan_model_topic(s.bootstrap or "", s, signing_key=key))  # type: ignore[arg-type]
    return producer, pub


async def _publish(pub: CheckpointPublisher, s: Settings, seed: int, candidate: bool) -> Manifest:
    arch = Arch(s.embedding_dim, s.slots, s.hidden)
    tensors = init_policy(s.embedding_dim, s.slots, s.hidden, seed=seed).tensors()
    return await publish_tensors(pub, tensors, arch=arch, reason="periodic", baseline=0.0, candidate=candidate)  # type: ignore[no-any-return]


async def _send(s: Settings, key: bytes, value: bytes) -> None:
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    try:
        await (await producer.send(s.connection().topics.policy_checkpoints.name, value, key=key, partition=0))
    finally:
        await producer.stop()


async def _served_after(s: Settings, reader_key: object, replay: tuple[bytes, bytes]) -> int | None:
    """The version a signature-checking subscriber serves after ``replay`` was sent."""
    await _send(s, *replay)
    async with PolicySubscriber(s.bootstrap or "", conn=s, signing_key=reader_key) as sub:  # type: ignore[arg-type]
        await sub.wait_for_policy(1, timeout=30)
        await asyncio.sleep(1.0)
        return sub.current.version if sub.current is not None else None


@pytest.mark.parametrize("scheme", ["hmac", "ed25519"])
def test_a_signed_candidate_replayed_under_the_serving_key_is_not_served(topics_ready: Settings, scheme: str) -> None:
    s = topics_ready
    private, public = (HMAC_KEY, HMAC_KEY) if scheme == "hmac" else tuple(load_key(p) for p in generate_pem())

    async def run() -> tuple[int | None, int | None]:
        producer, pub = await _publisher(s, private)
        try:
            await _publish(pub, s, 0, candidate=False)  # v1 serves
            candidate = await _publish(pub, s, 1, candidate=True)  # v2: held back by the gate
            replay = (serving_key(s.policy).encode(), encode(candidate.to_dict()))  # its exact signed bytes
            as_canary = (canary_key(s.policy).encode(), encode(candidate.to_dict()))
        finally:
            await producer.stop()  # type: ignore[attr-defined]
        return await _served_after(s, public, replay), await _served_after(s, public, as_canary)

    served, with_canary = asyncio.run(run())
    assert served == 1 and with_canary == 1


def test_a_reader_holds_a_key_that_cannot_sign(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "causalmem"), "keygen", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "checkpoint-signing.pem").stat().st_mode & 0o077 == 0  # the learner's alone
    learner = Settings(checkpoint_signing_key_file=str(tmp_path / "checkpoint-signing.pem"))
    client = Settings(checkpoint_verify_key_file=str(tmp_path / "checkpoint-verify.pem"))
    reader_key = client.verify_key()
    assert reader_key is not None and client.signing_key() is None
    with pytest.raises(ValueError, match="only the learner's private key signs"):
        sign({"policy": "default", "version": 9}, reader_key)
    learner_key = learner.signing_key()
    assert learner_key is not None
    m = Manifest("default", 9, 0.0, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1).signed(learner_key, role="serving")
    forged = Manifest("default", 9, 0.0, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1)
    forged.signed(load_key(generate_pem()[0]), role="serving")  # another pair's private key
    from topics.signing import verify_signature

    assert verify_signature(m.to_dict(), reader_key)
    assert not verify_signature(forged.to_dict(), reader_key)
    assert not verify_signature({**m.to_dict(), "version": 10}, reader_key)


def test_the_learner_signs_with_its_private_key_and_a_client_with_only_the_public_key_serves_it(
    topics_ready: Settings, tmp_path: Path
) -> None:
    private_pem, public_pem = generate_pem()
    (tmp_path / "learner.pem").write_bytes(private_pem)
    (tmp_path / "readers.pem").write_bytes(public_pem)
    s = topics_ready.replace(checkpoint_interval_s=0.3, checkpoint_signing_key_file=str(tmp_path / "learner.pem"))
    client = topics_ready.replace(checkpoint_verify_key_file=str(tmp_path / "readers.pem"))

    async def run() -> tuple[Manifest, list[tuple[int, str]]]:
        learner = Learner(s.learner(), s.bootstrap or "", Metrics())
        await learner.start()
        task = asyncio.create_task(learner.run())
        try:
            async with PolicySubscriber(s.bootstrap or "", conn=client) as sub:
                loaded = await sub.wait_for_policy(1, timeout=60)
                return loaded.manifest, sub.rejections
        finally:
            await learner.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    manifest, rejections = asyncio.run(run())
    assert (manifest.signature or "").startswith("ed25519:") and manifest.role == "serving"
    assert rejections == []


def test_the_learner_does_not_start_unsigned_outside_the_embedded_broker(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAUSALMEM_")}
    env.update(CAUSALMEM_BOOTSTRAP="10.1.2.3:9092", CAUSALMEM_STATE_DIR=str(tmp_path))
    done = subprocess.run(
        [str(Path(sys.executable).parent / "causalmem"), "learner"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "NOT signed" in done.stderr and "CAUSALMEM_CHECKPOINT_UNSIGNED_OK" in done.stderr
