"""The learner's memory-id map with a signing key (contract 1.7): the records it publishes are
signed, and its restore keeps only records signed with its key (a forged record that moves a
memory to another slot is ignored)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from models.policy.trainer import PolicyTrainer, TrainerConfig
from pipeline import kafka
from pipeline.config import Settings
from pipeline.learner.memories import MemoryBank
from topics.lifecycle import MemoryRecord
from topics.slotmap import SlotRecord, decode_slot_record

KEY = b"learner-key"
S, D, H = 8, 4, 6
TS = 1_767_225_600.0


def _settings() -> Settings:
    return Settings(embedding_dim=D, slots=S, hidden=H, checkpoint_signing_key=KEY.decode())


def _trainer() -> PolicyTrainer:
    return PolicyTrainer(TrainerConfig(embedding_dim=D, slots=S, hidden=H, lr=0.05))


class _Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes]] = []

    async def send(self, topic: str, value: bytes, key: bytes, partition: int = 0) -> asyncio.Future[None]:
        self.sent.append((key, value))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


class _Publisher:
    def __init__(self) -> None:
        self.producer, self.topic, self.signing_key, self.before_send = _Producer(), "model", KEY, None

    def next_version(self) -> int:
        return 3


class _Msg:
    def __init__(self, key: bytes, value: bytes) -> None:
        self.key, self.value, self.headers = key, value, ()


def test_the_learner_signs_the_map_it_publishes() -> None:
    bank = MemoryBank.of(_settings().learner())
    assert bank.signing_key == KEY
    t = _trainer()
    bank.handle(0, b"doc-a", MemoryRecord("add", "doc-a", TS, text="a").to_bytes(), t)
    publisher = _Publisher()
    assert asyncio.run(bank.publish(publisher)) == 1  # type: ignore[arg-type]
    ((key, value),) = publisher.producer.sent
    record = decode_slot_record(value, key=key, signing_key=KEY)
    assert (record.memory_id, record.slot) == ("doc-a", 0) and record.signature


def test_a_restore_ignores_map_records_not_signed_with_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    bank = MemoryBank.of(_settings().learner())
    good = SlotRecord("default", 0, "doc-a", live=True, version=1, since=1, ts=TS)
    forged = [
        SlotRecord("default", 1, "doc-b", live=True, version=1, since=1, ts=TS).to_bytes(),  # unsigned
        SlotRecord("default", 2, "doc-c", live=True, version=1, since=1, ts=TS).to_bytes(b"another key"),
    ]
    msgs = [_Msg(good.key.encode(), good.to_bytes(KEY))]
    msgs += [_Msg(f"default/slot/{slot}".encode(), value) for slot, value in zip((1, 2), forged, strict=True)]

    async def read_all(*_: Any, **__: Any) -> list[_Msg]:
        return msgs

    monkeypatch.setattr(kafka, "read_all", read_all)
    asyncio.run(bank.restore("127.0.0.1:1", None, _trainer()))
    assert bank.allocator.live == {"doc-a": 0}
