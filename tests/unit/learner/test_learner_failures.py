"""The learner's failure model without a broker: forged manifests, bad control
details, the dedupe horizon at a high rate, a far-future experience in reorder mode,
epoch fencing rules, supervision and local restores."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from models.policy.network import init_policy
from models.policy.trainer import PolicyTrainer
from models.policy.weights import to_safetensors
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.learner.fence import Fence
from pipeline.learner.inbox import Inbox
from pipeline.learner.restore import newest_local
from pipeline.learner.store import LocalStore
from pipeline.learner.supervise import supervise
from topics.events import Features, RetrievalEvent
from topics.fields import Limits, Rejected, encode
from topics.internal import Experience, decode_control
from topics.manifest import (
    MAX_VERSION_JUMP,
    EpochClaim,
    Manifest,
    chunk_key,
    decode_manifest,
    epoch_key,
    sha256_hex,
    split_chunks,
)

BASE_TS = 1_767_225_600.0
S = Settings(embedding_dim=4, slots=8, hidden=8, device="cpu")
ARCH = {"input_dim": 6, "hidden": 8, "slots": 8, "embedding_dim": 4}
KEY = b"test-signing-key"


def exp(ident: str, ts: float) -> Experience:
    ev = RetrievalEvent(
        ident, f"q-{ident}", 0, ts, Features(np.zeros(4, np.float32), 0.0, 0.0), [0, 1], np.array([0.9, 0.8]),
        [0], 1.0, -0.1, False, policy="default",
    )  # fmt: skip
    return Experience(ident, "feedback", ev, utility=0.5)


def checkpoint(version: int, seed: int = 0, epoch: int | None = None, **changes: object) -> tuple[list[bytes], dict]:
    blob = to_safetensors(init_policy(4, 8, 8, seed=seed).tensors())
    chunks = split_chunks(blob, 1024)
    m = Manifest("default", version, time.time(), "periodic", ARCH, 0.5, 0.0, sha256_hex(blob), len(blob), len(chunks))
    m.epoch = epoch
    d = m.to_dict()
    d.update(changes)
    return chunks, d


async def feed(sub: PolicySubscriber, offset: int, version: int, chunks: list[bytes], manifest: dict) -> int:
    for i, c in enumerate(chunks):
        await sub.handle(offset, chunk_key("default", version, i).encode(), c)
        offset += 1
    await sub.handle(offset, b"default", encode(manifest))
    return offset + 1


# --------------------------------------------------------------------------- 5: forged manifests


async def test_forged_manifests_neither_freeze_nor_cost_a_client() -> None:
    sub = PolicySubscriber("127.0.0.1:1", "default", S)
    off = await feed(sub, 0, 1, *checkpoint(1))
    assert sub.current is not None and sub.current.version == 1
    # A copy republished as version 2^62: rejected, so the real v2 is still "newer".
    chunks, forged = checkpoint(1)
    forged["version"] = 2**62
    off = await feed(sub, off, 2**62, chunks, forged)
    assert sub.current.version == 1 and "version" in sub.rejections[-1][1]
    forged["version"] = 2 + MAX_VERSION_JUMP  # within 2^53, but a jump no learner makes
    off = await feed(sub, off, 2 + MAX_VERSION_JUMP, chunks, forged)
    assert sub.current.version == 1 and "jumps beyond" in sub.rejections[-1][1]
    off = await feed(sub, off, 2, *checkpoint(2, seed=1))
    assert sub.current.version == 2
    # 10^7 chunks: rejected by the decoder (bounded by the size the arch implies), at once.
    _, huge = checkpoint(3, chunks=10**7)
    t0 = time.perf_counter()
    await sub.handle(off, b"default", encode(huge))
    assert time.perf_counter() - t0 < 0.5
    assert sub.current.version == 2 and "chunks" in sub.rejections[-1][1]
    with pytest.raises(Rejected):  # a size the arch cannot need
        decode_manifest(encode(checkpoint(3, size=10**9, chunks=2000)[1]))


async def test_signed_manifests_unsigned_and_forged_ones_are_rejected() -> None:
    sub = PolicySubscriber("127.0.0.1:1", "default", S, signing_key=KEY)
    chunks, unsigned = checkpoint(1)
    off = await feed(sub, 0, 1, chunks, unsigned)
    assert sub.current is None and "signature" in sub.rejections[-1][1]
    m = decode_manifest(encode(unsigned)).signed(b"another key", role="serving")
    off = await feed(sub, off, 1, chunks, m.to_dict())
    assert sub.current is None
    good = decode_manifest(encode(unsigned)).signed(KEY, role="serving")  # signed for the key it comes under
    off = await feed(sub, off, 1, chunks, good.to_dict())
    assert sub.current is not None and sub.current.version == 1
    # Changing a signed field (here the sha256 of forged bytes) breaks the signature.
    chunks2, d2 = checkpoint(2, seed=5)
    tampered = dict(good.to_dict(), version=2, sha256=d2["sha256"], size=d2["size"], chunks=d2["chunks"])
    await feed(sub, off, 2, chunks2, tampered)
    assert sub.current.version == 1
    # Settings carry the key to the subscriber.
    assert PolicySubscriber("127.0.0.1:1", conn=S.replace(checkpoint_signing_key="k")).signing_key == b"k"


async def test_readers_ignore_an_older_epoch_and_a_fenced_writers_late_chunks() -> None:
    sub = PolicySubscriber("127.0.0.1:1", "default", S)
    off = await feed(sub, 0, 13, *checkpoint(13, epoch=1))
    await sub.handle(off, epoch_key("default").encode(), EpochClaim("default", 2, "new", time.time()).to_bytes())
    off += 1
    chunks14, m14 = checkpoint(14, seed=1, epoch=2)
    new_chunks_at = off
    off = await feed(sub, off, 14, chunks14, m14)
    assert sub.current is not None and sub.current.version == 14
    # The paused writer of epoch 1 wakes up: its v14 chunks and manifest change nothing.
    old_chunks, old14 = checkpoint(14, seed=9, epoch=1)
    off = await feed(sub, off, 14, old_chunks, old14)
    assert sub.current.version == 14 and sub.current.manifest.sha256 == m14["sha256"]
    assert any("stale epoch" in why for _, why in sub.rejections)
    assert sub.index.chunk_offsets[("default", 14)][0] == new_chunks_at  # not overwritten
    # The learner's own fence sees the same thing.
    fence = Fence("127.0.0.1:1", S.connection(), None, None)
    fence.epoch = 1
    fence.observe(epoch_key("default").encode(), EpochClaim("default", 2, "new", time.time()).to_bytes())
    assert fence.lost


# --------------------------------------------------------------------------- 2: control details


@pytest.mark.parametrize(
    "details",
    [{"to_version": "x"}, {"to_version": None}, {}, {"to_version": 0}, {"to_version": 1.5}],
)
def test_control_details_are_validated_by_the_codec(details: dict) -> None:
    raw = encode({"schema": "control/v1", "command": "rollback", "ts": BASE_TS, "details": details})
    with pytest.raises(Rejected):
        decode_control(raw, Limits())
    bad_reset = encode({"schema": "control/v1", "command": "reset", "ts": BASE_TS, "details": {"since_ts": "x"}})
    with pytest.raises(Rejected):
        decode_control(bad_reset, Limits())
    ok = encode({"schema": "control/v1", "command": "rollback", "ts": BASE_TS, "details": {"to_version": 3}})
    assert decode_control(ok, Limits()).details["to_version"] == 3


# --------------------------------------------------------------------------- 6: dedupe horizon


def test_dedupe_covers_the_join_and_reread_windows_at_a_high_rate() -> None:
    """At 1,200 pairs/s the old 200k-id memory covered under 3 minutes; the horizon is event time."""
    horizon = S.learner().dedupe_horizon_s
    assert horizon >= 2 * S.join_window_s
    inbox = Inbox("experiences", "control", batch_size=64, dedupe_horizon_s=horizon)
    rate = 1200.0
    n = int(rate * S.join_window_s * 0.5)  # 360,000 ids in 300 s of event time
    for i in range(n):
        inbox.mark_seen(f"e{i}", BASE_TS + i / rate)
    # The worker re-reads its pending window after a takeover: the first ids come again.
    assert inbox.accept(0, exp("e0", BASE_TS)) == "duplicate"
    assert inbox.accept(1, exp(f"e{n // 2}", BASE_TS + n / 2 / rate)) == "duplicate"
    # Ids beyond the horizon are forgotten: memory follows event time, not a count.
    inbox.mark_seen("later", BASE_TS + n / rate + horizon + 1)
    assert not inbox.seen_before("e0") and inbox.seen_before("later")


# --------------------------------------------------------------------------- 8: far future, reorder mode


def test_a_far_future_experience_is_refused_in_reorder_mode() -> None:
    now = BASE_TS + 100
    inbox = Inbox("experiences", "control", batch_size=2, reorder_s=5.0, max_future_s=300.0)
    assert inbox.accept(0, exp("a", BASE_TS), now=now) is None
    assert inbox.accept(1, exp("future", BASE_TS + 10 * 86400), now=now) == "ts_in_future"
    assert inbox.watermark == BASE_TS  # the bad timestamp moved nothing
    for i in range(1, 20):
        assert inbox.accept(1 + i, exp(f"b{i}", BASE_TS + i), now=now) is None
    inbox.release(force=True)
    applied = [e.id for chunk in inbox.batches(force=True) for e in chunk]
    assert applied == ["a"] + [f"b{i}" for i in range(1, 20)]
    assert inbox.applied_key == (BASE_TS + 19, "b19")  # what a manifest would record


# --------------------------------------------------------------------------- supervision


async def test_a_failing_supervised_task_is_reported_and_a_cancelled_one_is_not() -> None:
    failures: list[BaseException] = []

    async def boom() -> None:
        await asyncio.sleep(0)
        raise ValueError("to_version 'x'")

    async def forever() -> None:
        await asyncio.sleep(3600)

    supervise(asyncio.create_task(boom()), failures.append, "boom")
    quiet = supervise(asyncio.create_task(forever()), failures.append, "forever")
    await asyncio.sleep(0.05)
    quiet.cancel()
    await asyncio.sleep(0.01)
    assert [type(f) for f in failures] == [ValueError]


async def test_a_task_returning_while_stopping_is_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    """The learner's training loop returns once stopped: no CRITICAL "ended" line at every stop."""
    failures: list[BaseException] = []
    stopping = asyncio.Event()

    async def returns() -> None:
        await asyncio.sleep(0)

    stopping.set()
    supervise(asyncio.create_task(returns()), failures.append, "training", stopping=stopping.is_set)
    await asyncio.sleep(0.05)
    assert failures == [] and not [r for r in caplog.records if r.levelname == "CRITICAL"]
    stopping.clear()  # the same return while not stopping is a failure
    supervise(asyncio.create_task(returns()), failures.append, "training", stopping=stopping.is_set)
    await asyncio.sleep(0.05)
    assert [type(f) for f in failures] == [RuntimeError]


# --------------------------------------------------------------------------- local restores


def test_newest_local_skips_a_corrupt_copy(tmp_path: object) -> None:
    store = LocalStore(tmp_path)  # type: ignore[arg-type]
    trainer = PolicyTrainer(S.trainer())
    arch = trainer.net.arch
    for v in (1, 2, 3):
        tensors = trainer.tensors()
        blob = to_safetensors(tensors)
        m = Manifest("default", v, 0.0, "periodic", ARCH, 0.5, 0.0, sha256_hex(blob), len(blob), 1)
        store.save(m, tensors, trainer.optimizer_tensors(), trainer.baseline.state(), blob)
    (store.root / "versions" / "3.safetensors").write_bytes(b"corrupt")
    local = newest_local(store, arch)
    assert local is not None and local[0]["manifest"]["version"] == 2
    assert store.versions() == [1, 2, 3]


def test_the_signing_key_comes_from_the_environment_or_a_file(tmp_path: object) -> None:
    assert Settings.from_env({}).signing_key() is None
    assert Settings.from_env({"CAUSALMEM_CHECKPOINT_SIGNING_KEY": "s3cret"}).signing_key() == b"s3cret"
    path = tmp_path / "key"  # type: ignore[operator]
    path.write_text("from-a-file\n")
    s = Settings.from_env({"CAUSALMEM_CHECKPOINT_SIGNING_KEY_FILE": str(path)})
    assert s.signing_key() == b"from-a-file" and s.learner().signing_key == b"from-a-file"
    assert "s3cret" not in repr(Settings(checkpoint_signing_key="s3cret"))
