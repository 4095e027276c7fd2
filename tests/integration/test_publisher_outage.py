"""Publishing through a broker that is away at start, then comes back, goes again and returns.

The events put while it is away are delivered once it is back, without a restart of the
publisher; while it is away nothing raises or waits, and every event is counted as sent or
dropped. (Away: the broker process stopped, so connections hang rather than fail, as a
partitioned network does; a broker that refuses connections is tests/unit/client/
test_publisher_no_broker.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from pipeline import kafka
from pipeline.broker import EmbeddedBroker, free_port
from pipeline.client.publisher import SyncEventPublisher
from pipeline.config import Connection, Settings
from tests.helpers import retrieval_event

pytestmark = [pytest.mark.broker, pytest.mark.timeout(240)]


def _ids_on_topic(s: Settings, bootstrap: str, expected: int, timeout: float = 30.0) -> set[str]:
    async def read() -> set[str]:
        topic = Connection.of(s).topics.by_short_name("retrieval-events").name
        consumer = kafka.consumer(bootstrap, s, topic, group_id=None)
        await consumer.start()
        seen: set[str] = set()
        try:
            deadline = time.monotonic() + timeout
            while len(seen) < expected and time.monotonic() < deadline:
                for msgs in (await consumer.getmany(timeout_ms=500)).values():
                    for m in msgs:
                        seen.add(m.key.decode())
        finally:
            await consumer.stop()
        return seen

    return asyncio.run(read())


def test_events_wait_for_the_broker_and_resume_after_it_returns(tmp_path: Path) -> None:
    s = Settings(bootstrap="")
    broker = EmbeddedBroker(port=free_port(), log_path=tmp_path / "broker.log")
    broker.start()
    asyncio.run(kafka.create_topics(broker.bootstrap, s))
    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGSTOP)  # away (frozen: connections hang rather than fail)
    pub = SyncEventPublisher(broker.bootstrap, s)  # starts anyway
    try:
        first = [f"away-{i}" for i in range(50)]
        for q in first:
            pub.publish(retrieval_event(s, q))  # neither raises nor waits
        assert pub.flush(timeout=1) is False
        os.kill(broker.pid, signal.SIGCONT)
        assert pub.flush(timeout=90)
        assert _ids_on_topic(s, broker.bootstrap, len(first)) == set(first)

        os.kill(broker.pid, signal.SIGSTOP)  # and away again, mid-stream
        gone = [f"gone-{i}" for i in range(200)]
        for q in gone:
            pub.publish(retrieval_event(s, q))
        assert pub.flush(timeout=1) is False
        os.kill(broker.pid, signal.SIGCONT)
        assert pub.flush(timeout=90)
        assert _ids_on_topic(s, broker.bootstrap, len(first) + len(gone)) == set(first + gone)
        assert (pub.sent, pub.dropped) == (250, 0)
        assert pub.health() == "ok"
    finally:
        os.kill(broker.pid, signal.SIGCONT)
        pub.close(timeout=1)
        broker.stop()


def test_events_handed_to_a_frozen_broker_and_given_up_are_counted_in_doubt(tmp_path: Path) -> None:
    """A request the broker received but never answered (it froze) may still be written once it
    thaws: an event given up after that is counted ``in_doubt``, never ``dropped``, so every
    event counted dropped is missing from the topic and every missing one is counted."""
    s = Settings(bootstrap="")
    broker = EmbeddedBroker(port=free_port(), log_path=tmp_path / "broker.log")
    broker.start()
    asyncio.run(kafka.create_topics(broker.bootstrap, s))
    assert broker.pid is not None
    # A small buffer and a short request timeout, so that the test need not wait 40 s per try.
    pub = SyncEventPublisher(broker.bootstrap, s, max_events=100, request_timeout_ms=1500)
    try:
        pub.publish(retrieval_event(s, "warm-0"))
        assert pub.flush(timeout=30)  # connected: the next requests reach the broker's socket
        os.kill(broker.pid, signal.SIGSTOP)
        handed = [f"handed-{i}" for i in range(50)]
        for q in handed:
            pub.publish(retrieval_event(s, q))
        deadline = time.monotonic() + 30
        while pub.health() == "ok" and time.monotonic() < deadline:  # until a request timed out
            time.sleep(0.1)
        assert pub.health().startswith("degraded")
        later = [f"later-{i}" for i in range(200)]
        for q in later:
            pub.publish(retrieval_event(s, q))  # pushes the oldest out, the handed ones first
        os.kill(broker.pid, signal.SIGCONT)
        assert pub.flush(timeout=90)
        published = 1 + len(handed) + len(later)
        on_topic = _ids_on_topic(s, broker.bootstrap, published, timeout=10)
        assert pub.sent + pub.dropped + pub.in_doubt == published
        assert pub.in_doubt > 0 and pub.dropped > 0
        missing = published - len(on_topic)
        assert pub.dropped <= missing <= pub.dropped + pub.in_doubt
    finally:
        os.kill(broker.pid, signal.SIGCONT)
        pub.close(timeout=1)
        broker.stop()
