"""The cluster watch restarts processes only on a broker's answer that the data is gone.

A fetch that nobody answers (a partition without a leader while a replicated cluster
elects one, a broker that is slow or restarting) used to read as "the epoch topic is
empty", which restarted every process. These tests drive :class:`ClusterWatch` through a
stand-in consumer that answers (or does not) exactly as told. The last test checks that
topic creation asks for the configured replication.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError

from pipeline import kafka
from pipeline.config import Settings
from pipeline.kafka import ClusterWatch

S = Settings(topic_prefix="w.")
EPOCH = S.topics().epoch.name


class Broker:
    """What the stand-in consumers see: the topic list and the epoch partition's watermark."""

    def __init__(self, topics: set[str] | None = None, hw: int | None = 1, reachable: bool = True) -> None:
        self.topics = {EPOCH} if topics is None else topics
        self.hw = hw  # None: no fetch is ever answered
        self.reachable = reachable
        self.fetches = 0


class StandInConsumer:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    async def start(self) -> None:
        if not self.broker.reachable:
            raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]")

    async def stop(self) -> None:
        return None

    async def topics(self) -> set[str]:
        return set(self.broker.topics)

    def assign(self, tps: Any) -> None:
        return None

    async def seek_to_beginning(self, *tps: Any) -> None:
        return None

    async def getmany(self, *tps: Any, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
        self.broker.fetches += 1
        await asyncio.sleep(0)
        return {}

    def highwater(self, tp: Any) -> int | None:
        return self.broker.hw


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Broker:
    b = Broker()
    monkeypatch.setattr(kafka, "consumer", lambda *a, **k: StandInConsumer(b))
    return b


def watch(calls: list[list[str]], seen: bool = True) -> ClusterWatch:
    return ClusterWatch("127.0.0.1:1", S, ["w.a", "w.b"], on_reset=calls.append, interval=0.01, marker_seen=seen)


async def test_a_fetch_nobody_answers_is_not_a_reset(stub: Broker) -> None:
    """The epoch topic exists but no fetch is answered (no leader): look again, restart nothing."""
    calls: list[list[str]] = []
    w = watch(calls)
    stub.hw = None
    assert await w.check() is None
    assert stub.fetches > 0  # it did ask
    async with w:
        await asyncio.sleep(0.3)
    assert calls == [] and w.resets == 0
    stub.hw = 1  # the leader is back, the marker is still there
    assert await w.check() is None


async def test_an_unreachable_broker_is_not_a_reset(stub: Broker) -> None:
    calls: list[list[str]] = []
    w = watch(calls)
    stub.reachable = False
    assert await w.check() is None
    async with w:
        await asyncio.sleep(0.2)
    assert calls == []


async def test_a_timeout_while_asking_is_not_a_reset(stub: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    async def hangs(*_: Any, **__: Any) -> Any:
        raise TimeoutError

    monkeypatch.setattr(kafka, "_fetched_high_watermark", hangs)
    calls: list[list[str]] = []
    w = watch(calls)
    stub.hw = 0
    assert await w.check() is None


async def test_an_empty_epoch_topic_after_the_marker_is_a_reset(stub: Broker) -> None:
    calls: list[list[str]] = []
    w = watch(calls, seen=False)
    assert await w.check() is None  # holds the marker: seen
    stub.hw = 0  # a real fetch answer: the partition is empty
    async with w:
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.02)
    assert calls == [["w.a", "w.b"]] and w.resets == 1


async def test_an_epoch_topic_missing_from_the_metadata_is_a_reset(stub: Broker) -> None:
    calls: list[list[str]] = []
    w = watch(calls)
    stub.topics = {"w.a"}  # the broker lists its topics, and the epoch topic is not among them
    assert await w.check() == ["w.a", "w.b"]
    assert await w.check() is None  # once per reset, until the marker is seen again


async def test_an_empty_epoch_topic_never_seen_with_its_marker_is_not_a_reset(stub: Broker) -> None:
    calls: list[list[str]] = []
    w = watch(calls, seen=False)
    stub.hw = 0
    assert await w.check() is None


async def test_silence_does_not_make_a_wrong_partition_count_repairable(stub: Broker) -> None:
    """create_topics deletes a mis-sized topic only when every partition answered empty."""
    stub.hw = None
    assert await kafka._is_empty("127.0.0.1:1", S, EPOCH, 2) is False
    stub.hw = 0
    assert await kafka._is_empty("127.0.0.1:1", S, EPOCH, 2) is True


async def test_the_watch_stops_even_when_a_cancellation_meets_a_finishing_check(stub: Broker) -> None:
    """On Python 3.11 ``wait_for`` can swallow a cancellation that arrives as its inner call
    finishes; stopping must still end the watch (it once hung a test run for good)."""
    stub.reachable = False  # each check finishes at once
    for i in range(60):
        w = ClusterWatch("127.0.0.1:1", S, ["w.a"], on_reset=lambda m: None, interval=0.01, marker_seen=True)
        await w.start()
        await asyncio.sleep(0.013 * (i % 7))
        stopping = asyncio.ensure_future(w.stop())
        done, _ = await asyncio.wait({stopping}, timeout=5)
        assert done, f"the watch did not stop (round {i})"


async def test_create_topics_asks_for_the_replication_factor_and_min_insync(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(topic_prefix="r.", partitions=2, replication_factor=3, min_insync_replicas=2)
    asked: list[Any] = []

    class Admin:
        async def start(self) -> None:
            return None

        async def close(self) -> None:
            return None

        async def list_topics(self) -> list[str]:
            return []

        async def create_topics(self, new: list[Any]) -> Any:
            asked.extend(new)
            return None

        async def describe_topics(self, names: list[str]) -> list[dict[str, Any]]:
            by_name = {t.name: t.num_partitions for t in asked}
            return [{"topic": n, "partitions": list(range(by_name[n]))} for n in names if n in by_name]

    async def no_marker(*_: Any) -> None:
        return None

    monkeypatch.setattr(kafka, "admin", lambda *a, **k: Admin())
    monkeypatch.setattr(kafka, "_mark_epoch", no_marker)
    result = await kafka.create_topics("127.0.0.1:1", s)
    assert set(result.values()) == {"created"}
    assert {t.name for t in asked} == {spec.name for spec in s.topics().all()}
    for t in asked:
        assert t.replication_factor == 3 and t.topic_configs["min.insync.replicas"] == "2", t.name
