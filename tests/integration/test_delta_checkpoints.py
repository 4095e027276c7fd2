"""Delta checkpoints (contract 1.3, docs/contract.md §7.1): format, chains, clients, old readers.

No broker except the last test: the learner's ``Publishing`` writes to a recording
producer, and ``PolicySubscriber.handle`` reads its log; a client's re-fetch from the topic
(a replay) reads the same log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from models.policy.delta import apply_delta, changed_rows, decode_delta, encode_delta, state_sha256
from models.policy.network import Arch, init_policy
from models.policy.trainer import PolicyTrainer, TrainerConfig
from models.policy.weights import to_safetensors, verify_and_load
from models.serving.params import ServingParams
from pipeline.client import chain
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Connection, GateConfig, LearnerConfig, Settings
from pipeline.learner.publishing import Publishing
from pipeline.learner.store import LocalStore
from pipeline.metrics import Metrics
from pipeline.modeltopic import ModelTopicIndex, check_blob
from tests.paths import TEST_DATA
from topics.delta import DeltaManifest, decode_delta_manifest, delta_key
from topics.fields import Rejected, encode
from topics.manifest import CheckpointError, Manifest, decode_manifest, sha256_hex

ARCH = Arch(embedding_dim=8, slots=32, hidden=16)


class RecordingProducer:
    def __init__(self) -> None:
        self.log: list[tuple[int, bytes | None, bytes | None]] = []

    async def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int = 0) -> Any:
        self.log.append((len(self.log), key, value))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def learner(tmp_path: Path, full_every: int = 3, producer: Any = None, **kw: Any) -> tuple[Publishing, PolicyTrainer]:
    kw.setdefault("delta_max_share", 0.9)  # this tiny network's backbone is a quarter of a full snapshot
    kw.setdefault("gate", None)
    config = LearnerConfig(
        connection=Connection.of(None),
        trainer=TrainerConfig(ARCH.embedding_dim, ARCH.slots, hidden=ARCH.hidden),
        full_every=full_every,
        **kw,
    )
    publishing = Publishing(producer or RecordingProducer(), config, LocalStore(tmp_path), ARCH, Metrics())
    return publishing, PolicyTrainer(config.trainer)


@torch.no_grad()
def train(trainer: PolicyTrainer, rows: list[int], step: float = 0.1) -> None:
    """What a sparse learner step does: some output rows and the backbone change."""
    net = trainer.net
    net.out.weight[rows] += step
    net.out.bias[rows] -= step
    net.hidden.weight.add_(step / 10)
    net.alpha.add_(0.01)
    net.changed.mark(np.asarray(rows, dtype=np.int64))  # what the trainer's own writes record


async def publish(p: Publishing, t: PolicyTrainer, reason: str = "periodic", **kw: Any) -> Manifest:
    """Publish as the learner's loop does: with the rows written since the last checkpoint."""
    kw.setdefault("changed_rows", t.take_changed_rows())
    return (await p.publish(t, reason=reason, metrics={}, input_offsets={}, **kw)).manifest


def subscriber(
    log: list[tuple[int, bytes | None, bytes | None]],
    monkeypatch: pytest.MonkeyPatch,
    failing: dict[int, int] | None = None,
) -> PolicySubscriber:
    """A subscriber whose re-fetches from the topic read ``log`` (``failing``: version -> fetches that fail)."""
    failing = failing if failing is not None else {}

    async def fetch_blob(bootstrap: str, conn: Any, index: ModelTopicIndex, manifest: Manifest, topic: Any) -> bytes:
        if failing.get(manifest.version, 0) > 0:
            failing[manifest.version] -= 1
            raise CheckpointError("missing_chunk", f"v{manifest.version} (a transient failure)")
        offsets = index.offsets_of(manifest)
        if any(i not in offsets for i in range(manifest.chunks)):
            raise CheckpointError("missing_chunk", f"v{manifest.version}")
        return check_blob(b"".join(log[offsets[i]][2] or b"" for i in range(manifest.chunks)), manifest)

    monkeypatch.setattr(chain, "fetch_blob", fetch_blob)
    return PolicySubscriber("127.0.0.1:1", conn=Connection.of(None))


async def feed(sub: PolicySubscriber, log: list[tuple[int, bytes | None, bytes | None]]) -> None:
    for offset, key, value in log:
        await sub.handle(offset, key, value)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- format


def test_delta_blob_round_trip_and_checks() -> None:
    net = init_policy(ARCH.embedding_dim, ARCH.slots, hidden=ARCH.hidden)
    base = {k: v.clone() for k, v in net.tensors().items()}
    with torch.no_grad():
        net.out.weight[[3, 30]] += 1.0
        net.out.bias[7] = 2.0
        net.norm.weight.mul_(1.5)
    rows = changed_rows(net.tensors(), base)
    assert rows.tolist() == [3, 7, 30]
    blob = encode_delta(net.tensors(), rows, "b" * 64)
    delta = decode_delta(blob, sha256_hex(blob), len(blob), ARCH, "b" * 64)
    state = {k: v.clone() for k, v in base.items()}
    apply_delta(state, delta)
    assert same(state, net.tensors())
    assert state_sha256(state) == sha256_hex(to_safetensors(net.tensors()))
    assert len(blob) < 0.5 * len(to_safetensors(base))  # at this size the backbone dominates

    def reason(b: bytes, base_sha: str = "b" * 64, sha: str | None = None) -> str:
        with pytest.raises(CheckpointError) as exc:
            decode_delta(b, sha or sha256_hex(b), len(b), ARCH, base_sha)
        return exc.value.reason

    assert reason(blob, sha="0" * 64) == "sha256_mismatch"
    assert reason(blob, base_sha="c" * 64) == "base_mismatch"  # the blob names another base
    good = {n: t for n, t in st_load_all(blob).items()}
    bad_rows = dict(good, rows=torch.tensor([30, 3, 7]))  # not sorted
    assert reason(st_save(bad_rows, metadata={"base_sha256": "b" * 64})) == "bad_rows"
    out_of_range = dict(good, rows=torch.tensor([3, 7, 32]))
    assert reason(st_save(out_of_range, metadata={"base_sha256": "b" * 64})) == "bad_rows"
    nan = dict(good, **{"out.bias.rows": torch.tensor([0.0, float("nan"), 1.0])})
    assert reason(st_save(nan, metadata={"base_sha256": "b" * 64})) == "non_finite"
    assert reason(st_save({k: v for k, v in good.items() if k != "alpha"}, metadata={"base_sha256": "b" * 64})) == (
        "missing_tensor"
    )


def st_load_all(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(blob)


def test_delta_manifest_round_trip_signature_and_bounds() -> None:
    m = DeltaManifest(
        "default", 5, 1_767_225_600.0, "periodic", ARCH.to_dict(), 0.5, 0.1, "a" * 64, 1000, 1,
        base_version=4, base_sha256="b" * 64, state_sha256="c" * 64, rows=3,
    )  # fmt: skip
    assert decode_delta_manifest(encode(m.to_dict())) == m
    key = b"secret"
    signed = encode(m.signed(key).to_dict())
    assert decode_delta_manifest(signed, signing_key=key).signature == m.signature
    tampered = json.loads(signed)
    tampered["base_sha256"] = "d" * 64
    with pytest.raises(Rejected):
        decode_delta_manifest(json.dumps(tampered).encode(), signing_key=key)
    with pytest.raises(Rejected):
        decode_delta_manifest(encode({**m.to_dict(), "base_version": 5}))  # a base must come before
    with pytest.raises(Rejected):
        decode_manifest(encode(m.to_dict()))  # not a full manifest: a 1.2 reader's decoder refuses it


def test_contract_vectors_delta() -> None:
    """tests/data/contract/delta.json: a base, a delta and the state it gives, as a client must compute it."""
    contract_dir = TEST_DATA / "contract"  # contract 1.3: no shared copy has them yet
    spec = json.loads((contract_dir / "delta.json").read_text())
    arch = Arch(spec["embedding_dim"], spec["slots"], spec["hidden"])
    base_blob = (contract_dir / "delta_base.safetensors").read_bytes()
    delta_blob = (contract_dir / "delta.safetensors").read_bytes()
    manifest = decode_delta_manifest(json.dumps(spec["manifest"]).encode())
    base = verify_and_load(base_blob, manifest.base_sha256, len(base_blob), arch)
    delta = decode_delta(delta_blob, manifest.sha256, manifest.size, arch, manifest.base_sha256)
    assert delta.rows.tolist() == spec["rows"]
    apply_delta(base, delta)
    assert state_sha256(base) == manifest.state_sha256
    out = torch.nn.functional.softplus(
        base["out.weight"] @ torch.tensor(spec["h"], dtype=torch.float32) + base["out.bias"]
    )
    assert np.allclose(out.numpy(), spec["out_for_h"], atol=1e-6)


# --------------------------------------------------------------------------- learner and client


async def test_learner_publishes_deltas_between_full_snapshots_and_a_client_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, t = learner(tmp_path, full_every=3)
    log = p.publisher.producer.log
    kinds = [type(await publish(p, t, "init")).__name__]
    for rows in ([1, 2], [2, 9], [4], [5, 6]):
        train(t, rows)
        kinds.append(type(await publish(p, t)).__name__)
    assert kinds == ["Manifest", "DeltaManifest", "DeltaManifest", "Manifest", "DeltaManifest"]
    index = ModelTopicIndex()
    for offset, key, value in log:
        index.observe(offset, key, value)
    assert index.deltas[("default", 3)].rows == 2  # rows changed since v2: 2 and 9
    assert index.serving["default"].version == 4 and index.serving_head("default").version == 5  # type: ignore[union-attr]
    sub = subscriber(log, monkeypatch)
    await feed(sub, log)
    assert sub.current is not None and sub.current.version == 5 and sub.replays == 0
    assert same(sub.current.net.tensors(), t.tensors())
    # the local copy of a delta version is its full state
    local = p.store.verified(5, ARCH)
    assert local is not None and same(local[1], t.tensors())
    # deltas before the serving full snapshot (v4) were tombstoned, the one after it stays
    tombstoned = {k.decode() for _, k, v in log if v is None and k is not None}
    assert "default/delta/2/0" in tombstoned and "default/delta/3/0" in tombstoned
    assert "default/delta/5/0" not in tombstoned


async def test_old_reader_gets_full_snapshots_only(tmp_path: Path) -> None:
    """A contract 1.2 reader follows only ``"{policy}"`` and chunk keys: it still loads every full snapshot."""
    p, t = learner(tmp_path, full_every=3)
    for i in range(5):
        train(t, [i])
        await publish(p, t, "init" if i == 0 else "periodic")
    chunks: dict[tuple[int, int], bytes] = {}
    served: list[int] = []
    for _, key, value in p.publisher.producer.log:  # what examples/contract_consumer.py does
        parts = (key or b"").decode().split("/")
        if len(parts) == 3 and parts[1].isdigit() and value is not None:
            chunks[(int(parts[1]), int(parts[2]))] = value
        elif parts == ["default"]:
            m = decode_manifest(value or b"")
            blob = b"".join(chunks[(m.version, i)] for i in range(m.chunks))
            verify_and_load(blob, m.sha256, m.size, ARCH)
            served.append(m.version)
    assert served == [1, 4]


async def test_missed_link_falls_back_to_the_full_snapshot_and_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, t = learner(tmp_path, full_every=10)
    log = p.publisher.producer.log
    for i, rows in enumerate(([0], [1, 2], [3], [4, 5])):
        train(t, rows)
        await publish(p, t, "init" if i == 0 else "periodic")
    # the client misses link v3 (its fetches fail, the delta's and the replay's): v4's base is not what it holds
    sub = subscriber(log, monkeypatch, failing={3: 2})
    for offset, key, value in log:
        if key == delta_key("default").encode() and b'"version":3' in (value or b""):
            sub._recent.clear()  # its bytes must come from the topic, and that fetch fails
        await sub.handle(offset, key, value)
        if sub.current is not None and sub.current.version == 2:
            held_v2 = {k: v.clone() for k, v in sub.current.net.tensors().items()}
    assert any("version 3" in why for _, why in sub.rejections) and held_v2
    assert sub.current is not None and sub.current.version == 4
    assert sub.replays == 2 and same(sub.current.net.tensors(), t.tensors())


async def test_a_delta_whose_base_is_not_on_the_topic_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, t = learner(tmp_path, full_every=10)
    log = p.publisher.producer.log
    await publish(p, t, "init")
    held = {k: v.clone() for k, v in t.tensors().items()}
    p.publisher.head = (1, "e" * 64)  # a tampered base: names a link that does not exist
    train(t, [3])
    await publish(p, t)
    sub = subscriber(log, monkeypatch)
    await feed(sub, log)
    assert sub.current is not None and sub.current.version == 1
    assert same(sub.current.net.tensors(), held)
    assert any("missing_link" in why for _, why in sub.rejections)


async def test_a_delta_with_a_wrong_state_hash_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p, t = learner(tmp_path, full_every=10)
    log = p.publisher.producer.log
    await publish(p, t, "init")
    held = {k: v.clone() for k, v in t.tensors().items()}
    train(t, [3])
    await publish(p, t)
    for i, (o, key, value) in enumerate(log):
        if key == delta_key("default").encode():
            wrong = json.loads(value or b"")
            wrong["state_sha256"] = "f" * 64
            log[i] = (o, key, json.dumps(wrong).encode())
    sub = subscriber(log, monkeypatch)
    await feed(sub, log)
    assert sub.current is not None and sub.current.version == 1
    assert same(sub.current.net.tensors(), held)
    assert any("state_mismatch" in why for _, why in sub.rejections) and sub.replays == 1


async def test_a_tampered_delta_chunk_is_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p, t = learner(tmp_path, full_every=10)
    log = p.publisher.producer.log
    await publish(p, t, "init")
    held = {k: v.clone() for k, v in t.tensors().items()}
    train(t, [3])
    await publish(p, t)
    i = next(i for i, (_, k, _) in enumerate(log) if k == b"default/delta/2/0")
    value = bytearray(log[i][2] or b"")
    value[-1] ^= 1
    log[i] = (log[i][0], log[i][1], bytes(value))
    sub = subscriber(log, monkeypatch)
    await feed(sub, log)
    assert sub.current is not None and sub.current.version == 1 and same(sub.current.net.tensors(), held)
    assert any("sha256_mismatch" in why for _, why in sub.rejections)


async def test_large_states_are_updated_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``state_check_bytes`` the served network is updated in place, checked by the chain alone."""
    p, t = learner(tmp_path, full_every=10)
    log = p.publisher.producer.log
    await publish(p, t, "init")
    for rows in ([3], [8, 9]):
        train(t, rows)
        await publish(p, t)
    sub = subscriber(log, monkeypatch)
    sub.state_check_bytes = 0
    await feed(sub, log[:2])  # v1's chunk and manifest
    assert sub.current is not None
    net = sub.current.net
    await feed(sub, log[2:])
    assert sub.current.version == 3 and sub.current.net is net and same(net.tensors(), t.tensors())


async def test_changed_rows_hint_accumulates_since_the_serving_version(tmp_path: Path) -> None:
    """With hints (``PolicyTrainer.take_changed_rows``), a delta carries every row written since its base."""
    p, t = learner(tmp_path, full_every=10)
    await publish(p, t, "init", changed_rows=np.arange(ARCH.slots))
    train(t, [2])
    m2 = await publish(p, t, changed_rows=np.array([2]))
    assert isinstance(m2, DeltaManifest) and m2.rows == 1
    # a candidate that is not promoted: the next delta's base stays v2 and carries its rows too
    train(t, [5])
    p.publisher.head = (m2.version, m2.sha256)
    m3 = await publish(p, t, changed_rows=np.array([5]))
    p.publisher.head = (m2.version, m2.sha256)  # as if v3 had been a refused candidate
    train(t, [7])
    m4 = await publish(p, t, changed_rows=np.array([7]))
    assert isinstance(m3, DeltaManifest) and isinstance(m4, DeltaManifest)
    assert m4.base_version == 2 and m4.rows == 2  # rows 5 and 7


async def test_a_delta_publish_hashes_the_full_state_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full blob's sha256 is the delta's ``state_sha256`` and its local copy's: computed once."""
    from pipeline.learner import publishing

    p, t = learner(tmp_path, full_every=10)
    await publish(p, t, "init")
    train(t, [4])
    full_size = len(to_safetensors(t.tensors()))
    sizes: list[int] = []
    real = publishing.sha256_hex

    def counting(data: bytes) -> str:
        sizes.append(len(data))
        return real(data)

    monkeypatch.setattr(publishing, "sha256_hex", counting)
    m = await publish(p, t)
    assert isinstance(m, DeltaManifest) and sizes.count(full_size) == 1
    local = p.store.verified(m.version, ARCH)
    assert local is not None and local[0]["manifest"]["sha256"] == m.state_sha256


def test_the_planner_needs_the_written_rows() -> None:
    """Deltas ship the rows the trainer recorded; there is no row-diffing path to fall back on."""
    import inspect

    from pipeline.learner.deltas import DeltaPlanner

    assert inspect.signature(DeltaPlanner.plan).parameters["changed_rows"].default is inspect.Parameter.empty
    assert inspect.signature(Publishing.publish).parameters["changed_rows"].default is inspect.Parameter.empty


async def test_too_large_a_delta_is_a_full_snapshot(tmp_path: Path) -> None:
    p, t = learner(tmp_path, full_every=10, delta_max_share=0.6)  # up to 13 of the 32 rows
    await publish(p, t, "init")
    train(t, list(range(ARCH.slots // 2)))
    assert type(await publish(p, t)) is Manifest
    train(t, [1])
    assert type(await publish(p, t)) is DeltaManifest


def test_settings_map_the_cadence() -> None:
    s = Settings.from_env({"CAUSALMEM_CHECKPOINT_FULL_EVERY": "20", "CAUSALMEM_CHECKPOINT_DELTA_MAX_SHARE": "0.1"})
    config = s.learner()
    assert (config.full_every, config.delta_max_share) == (20, 0.1)
    off = Settings.from_env({"CAUSALMEM_CHECKPOINT_FULL_EVERY": "1"}).learner()
    assert off.full_every == 1  # every checkpoint full: deltas off


def test_deltas_are_on_by_default_at_a_short_cadence() -> None:
    """The defaults (docs/operations.md): deltas between full snapshots every 50 versions, a 2 s cadence."""
    config = Settings().learner()
    assert (config.full_every, config.checkpoint_interval_s, config.delta_max_share) == (50, 2.0, 0.25)


# --------------------------------------------------------------------------- with a broker


@contextlib.asynccontextmanager
async def delta_publishing(
    settings: Settings, tmp_path: Path, full_every: int
) -> AsyncIterator[tuple[Publishing, PolicyTrainer]]:
    """A learner's publishing on the broker (no gate, deltas up to 90% of a full snapshot) and its trainer."""
    from pipeline import kafka

    conn = settings.connection()
    producer = kafka.producer(settings.bootstrap or "", conn)
    await producer.start()
    try:
        config = LearnerConfig(
            connection=conn,
            trainer=TrainerConfig(ARCH.embedding_dim, ARCH.slots, hidden=ARCH.hidden),
            gate=None,
            full_every=full_every,
            delta_max_share=0.9,
        )
        p = Publishing(producer, config, LocalStore(tmp_path), ARCH, Metrics())
        yield p, PolicyTrainer(config.trainer)
    finally:
        await producer.stop()


@pytest.mark.broker
async def test_broker_learner_publishes_full_and_deltas_and_a_subscriber_follows(
    topics_ready: Settings, tmp_path: Path
) -> None:
    conn = topics_ready.connection()
    async with delta_publishing(topics_ready, tmp_path, full_every=3) as (p, t):
        await publish(p, t, "init")
        async with PolicySubscriber(topics_ready.bootstrap or "", conn=conn) as sub:
            await sub.wait_for_policy(1, timeout=15)
            kinds = []
            for v, rows in enumerate(([1], [2, 3], [4], [5]), start=2):
                train(t, rows)
                kinds.append(type(await publish(p, t)).__name__)
                await sub.wait_for_policy(v, timeout=15)
                assert sub.current is not None and same(sub.current.net.tensors(), t.tensors())
            assert kinds == ["DeltaManifest", "DeltaManifest", "Manifest", "DeltaManifest"]
        # a client that starts now replays from the topic: the full snapshot v4, then v5
        async with PolicySubscriber(topics_ready.bootstrap or "", conn=conn) as late:
            loaded = await late.wait_for_policy(5, timeout=15)
            assert same(loaded.net.tensors(), t.tensors())


async def test_a_candidate_that_starts_a_trial_is_a_full_snapshot(tmp_path: Path) -> None:
    """The newest trial's candidate is the canary, and a client loads no delta as its canary: a
    delta that started a trial went without the canary's draws for all its decisions. Without
    canaries too (contract 1.25): once certified it is the version probes name, which a client
    started under a probe loads alone (the first snapshot of a delta's chain is not kept)."""
    kinds = {}
    for rate in (0.0, 0.2):
        p, t = learner(tmp_path / str(rate), gate=GateConfig(), serving=ServingParams(canary_rate=rate))
        t.updates = 12  # a restored, trained first policy: served as configured, not an incumbent (no probes)
        await p.settle(
            await p.publish(t, reason="init", metrics={}, input_offsets={}, changed_rows=t.take_changed_rows())
        )
        train(t, [1, 2])
        kinds[rate] = type(await publish(p, t)).__name__  # the first candidate: it starts a trial
    assert kinds == {0.0: "Manifest", 0.2: "Manifest"}


async def test_a_delta_candidate_is_promoted_under_the_delta_key_while_its_base_serves() -> None:
    from pipeline.modeltopic.publisher import CheckpointPublisher

    producer = RecordingProducer()
    pub = CheckpointPublisher(producer, "t", "default")
    net = init_policy(ARCH.embedding_dim, ARCH.slots, hidden=ARCH.hidden)
    full = to_safetensors(net.tensors())
    m1 = await pub.publish(full, alpha=0.5, reason="init", arch=ARCH.to_dict(), baseline=0.0)
    assert pub.head == (1, m1.sha256)
    blob = encode_delta(net.tensors(), np.array([1]), m1.sha256)
    delta = {"base_version": 1, "base_sha256": m1.sha256, "state_sha256": m1.sha256, "rows": 1}
    c2 = await pub.publish(
        blob, alpha=0.5, reason="periodic", arch=ARCH.to_dict(), baseline=0.0, delta=delta, candidate=True
    )
    assert producer.log[-1][1] == b"default/delta/candidate" and pub.head == (1, m1.sha256)
    c3 = await pub.publish(
        blob, alpha=0.5, reason="periodic", arch=ARCH.to_dict(), baseline=0.0, delta=delta, candidate=True
    )
    await pub.promote(c3)
    assert producer.log[-1][1] == b"default/delta" and pub.head == (3, c3.sha256)
    sent = len(producer.log)
    await pub.promote(c2)  # its base (v1) no longer serves: clients would refuse it
    assert len(producer.log) == sent and pub.head == (3, c3.sha256)


async def test_the_learner_restores_a_delta_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.learner.restore import from_topic

    p, t = learner(tmp_path / "a", full_every=10)
    log = p.publisher.producer.log
    await publish(p, t, "init")
    for rows in ([1], [2, 3]):
        train(t, rows)
        await publish(p, t)
    subscriber(log, monkeypatch)  # re-fetches read the log
    index = ModelTopicIndex()
    for offset, key, value in log:
        index.observe(offset, key, value)
    fresh = PolicyTrainer(TrainerConfig(ARCH.embedding_dim, ARCH.slots, hidden=ARCH.hidden))
    conn = Connection.of(None)
    restored = await from_topic("127.0.0.1:1", conn, index, fresh, LocalStore(tmp_path / "b"), ARCH)
    assert restored is not None and (restored.version, restored.source) == (3, "topic v3")
    assert same(fresh.tensors(), t.tensors())
    # the chain is broken on the topic (v2's chunk gone): the local copy of v3 (its full state) serves
    index.delta_chunk_offsets.pop(("default", 2))
    other = PolicyTrainer(TrainerConfig(ARCH.embedding_dim, ARCH.slots, hidden=ARCH.hidden))
    restored = await from_topic("127.0.0.1:1", conn, index, other, p.store, ARCH)
    assert restored is not None and restored.source == "local v3" and same(other.tensors(), t.tensors())
