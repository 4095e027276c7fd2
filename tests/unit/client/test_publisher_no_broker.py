"""The publishers with no broker to reach: they start, never raise or wait, and count what they drop.

Before the sender had a buffer and a thread of its own, ``SyncEventPublisher(...)`` and
``EventPublisher.start()`` raised ``KafkaConnectionError`` at once without a broker, and with the
broker gone, ``publish`` waited ~40 s for metadata every few hundred calls.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pipeline.broker import free_port
from pipeline.client.publisher import EventPublisher, SyncEventPublisher
from topics.events import Features, RetrievalEvent
from topics.fields import Rejected, encode


def _event(i: int, dim: int = 384) -> RetrievalEvent:
    return RetrievalEvent(
        event_id=f"e{i}",
        query_id=f"q{i}",
        step=0,
        ts=1.0,
        features=Features(np.zeros(dim, dtype=np.float32), 0.0, 0.0),
        candidates=[1, 2, 3],
        scores=np.array([0.9, 0.5, 0.1]),
        selected=[1, 2],
        temperature=0.05,
        logprob=-0.1,
        fallback=False,
    )


def _nowhere() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


def test_sync_publisher_starts_buffers_and_counts_drops_without_a_broker() -> None:
    pub = SyncEventPublisher(_nowhere(), max_events=100)
    try:
        for i in range(1_000):
            pub.publish(_event(i))  # neither raises nor waits for the broker
        assert pub.sender.buffered == 100
        assert pub.dropped == 900  # exactly the oldest that no longer fit
        deadline = time.monotonic() + 10
        while pub.health() == "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pub.health().startswith("degraded: no broker since ")
        assert pub.flush(timeout=0.2) is False  # a deadline, not a wait for the broker
    finally:
        pub.close(timeout=0.2)
    assert pub.sent == 0
    assert pub.dropped == 1_000  # what was still buffered at close is counted too
    pub.close()  # idempotent


def test_bad_values_are_still_rejected_at_once() -> None:
    pub = SyncEventPublisher(_nowhere())
    try:
        with pytest.raises(Rejected):
            pub.publish_dict({"schema": "nonsense"})
        assert pub.sender.buffered == 0
    finally:
        pub.close(timeout=0.1)


def test_byte_bound_drops_oldest() -> None:
    pub = SyncEventPublisher(_nowhere(), max_bytes=20_000)
    try:
        for i in range(50):
            pub.publish(_event(i))
        size = len(encode(_event(0).to_dict())) + len(b"q0")  # one event's value and key
        assert pub.sender.buffered == 20_000 // size
        assert pub.dropped == 50 - 20_000 // size
    finally:
        pub.close(timeout=0.1)


def test_async_publisher_starts_and_stops_within_its_deadline_without_a_broker() -> None:
    async def run() -> tuple[int, int, bool]:
        async with EventPublisher(_nowhere(), max_events=10) as pub:
            for i in range(25):
                await pub.publish(_event(i))
            flushed = await pub.flush(timeout=0.1)
        return pub.sent, pub.dropped, flushed

    sent, dropped, flushed = asyncio.run(run())
    assert (sent, dropped, flushed) == (0, 25, False)
