"""Stand-ins for the labeling queue's Kafka clients: samples handed out in polls, sends recorded.

The pool and the pages under test are the product's own; only the consumer and producer they
are given are these (the broker tests use real ones).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition

from topics.fields import encode
from topics.labels import ActiveLearningSample


class SampleConsumer:
    """Hands out ``samples`` (at most ``max_records`` a poll, one by default) from ``tp`` and records commits."""

    def __init__(self, samples: list[ActiveLearningSample], tp: TopicPartition) -> None:
        self.tp = tp
        self.msgs = [
            SimpleNamespace(value=encode(s.to_dict()), key=s.query_id.encode(), offset=i) for i, s in enumerate(samples)
        ]
        self.commits: list[int] = []

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
        n = max_records or 1
        out, self.msgs = self.msgs[:n], self.msgs[n:]
        return {self.tp: out} if out else {}

    async def commit(self, offsets: dict[Any, Any]) -> None:
        self.commits.append(offsets[self.tp].offset)

    def assignment(self) -> set[Any]:
        return {self.tp}


class RecordingProducer:
    """Records every send as (topic, value); each send is acknowledged at once."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def send(self, topic: str, value: bytes, **kw: Any) -> Any:
        self.sent.append((topic, value))
        fut: Any = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut
