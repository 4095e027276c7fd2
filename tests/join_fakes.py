"""A producer and a consumer that record what the join stage sends and commits (unit tests only).

They stand in for aiokafka's clients around :meth:`JoinStage.process` and its commit path,
so that event-time and delivery rules can be checked batch by batch without a broker;
:class:`FakeTopic` stands in for a faust topic the stream stages send to.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from pipeline.config import Settings
from pipeline.deadletter import DeadLetterWriter
from pipeline.metrics import Metrics
from pipeline.worker.join import JoinStage
from topics.fields import encode


class FakeTopic:
    """A faust topic's ``send``: records the message and acknowledges it at once."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, **kwargs: Any) -> asyncio.Future[None]:
        self.sent.append(kwargs)
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ack.set_result(None)  # acknowledged at once, like faust's FutureMessage once delivered
        return ack


class FakeBatch:
    def __init__(self) -> None:
        self.values: list[bytes] = []

    def append(self, key: Any, value: bytes, timestamp: Any) -> object:
        self.values.append(value)
        return object()

    def record_count(self) -> int:
        return len(self.values)


class FakeProducer:
    """Acknowledges every send at once, or fails the sends to ``fail_topic``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int | None, bytes]] = []
        self.fail_topic: str | None = None

    def _ack(self, topic: str) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if topic == self.fail_topic:
            fut.set_exception(RuntimeError("MessageSizeTooLargeError (fake)"))
        else:
            fut.set_result(None)
        return fut

    def create_batch(self) -> FakeBatch:
        return FakeBatch()

    async def send_batch(self, batch: FakeBatch, topic: str, partition: int) -> asyncio.Future[None]:
        self.sent += [(topic, partition, v) for v in batch.values]
        return self._ack(topic)

    async def send(self, topic: str, value: bytes, key: Any = None, partition: int | None = None) -> Any:
        self.sent.append((topic, partition, value))
        return self._ack(topic)

    def values(self, topic: str) -> list[bytes]:
        return [v for t, _, v in self.sent if t == topic]


class FakeConsumer:
    def __init__(self, assigned: set[TopicPartition]) -> None:
        self.assigned = assigned
        self.commits: list[dict[TopicPartition, int]] = []
        self.seeks: dict[TopicPartition, int] = {}

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(dict(offsets))

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks[tp] = offset

    async def seek_to_beginning(self, tp: TopicPartition) -> None:
        self.seeks[tp] = 0

    async def committed(self, tp: TopicPartition) -> int | None:
        return None


def stage_with_fakes(s: Settings, metrics: Metrics | None = None) -> tuple[JoinStage, FakeProducer]:
    """A join stage whose outputs go to a :class:`FakeProducer` (not started: no broker)."""
    stage = JoinStage(s.join(), "127.0.0.1:9", metrics or Metrics())
    producer = FakeProducer()
    stage._producer = producer
    stage._dead = DeadLetterWriter(producer, s.topics().dead_letter.name, stage.metrics)
    return stage, producer


class Inputs:
    """Consumer records for the join's two input topics, with running offsets per partition."""

    def __init__(self, s: Settings) -> None:
        self.topics = {"r": s.topics().retrieval_events.name, "f": s.topics().llm_feedback.name}
        self.offsets: dict[TopicPartition, int] = {}

    def batch(self, items: list[tuple[str, int, Any]]) -> dict[TopicPartition, list[ConsumerRecord]]:
        """``(kind "r"|"f", partition, wire value)`` in order → one fetched batch."""
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        for kind, partition, value in items:
            tp = TopicPartition(self.topics[kind], partition)
            offset = self.offsets.get(tp, 0)
            self.offsets[tp] = offset + 1
            raw, key = encode(value.to_dict()), value.query_id.encode()
            rec = ConsumerRecord(tp.topic, partition, offset, 0, 0, key, raw, None, len(key), len(raw), [])
            out.setdefault(tp, []).append(rec)
        return out
