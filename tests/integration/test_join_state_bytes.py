"""Through the broker: a ``causalmem worker`` keeps each partition's join state within its bytes.

Large retrieval events with distinct query ids, never answered, on one partition of a
worker whose ``CAUSALMEM_JOIN_STATE_MAX_BYTES`` gives each partition 1 MiB: the oldest are
shed as the newest arrive, counted on ``/metrics`` (``causalmem_join_shed_total``), never
dead-lettered, and a kept event still joins its feedback
(tests/unit/worker/test_join_state_bytes.py has the rules one batch at a time).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from causalmem_lab.procs import Child

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from pipeline.promtext import metric
from pipeline.worker.partitions import key_partition
from tests.conftest import settings_env
from tests.helpers import feedback, retrieval_event, until
from topics.events import RetrievalEvent

pytestmark = pytest.mark.broker

MIB = 1024 * 1024
EVENTS = 20


def _large_events(s: Settings, now: float) -> list[RetrievalEvent]:
    """EVENTS events of ~200 KiB each (the texts of 12 selected memories), all on partition 0."""
    qids = [q for q in (f"flood-{i}" for i in range(10_000)) if key_partition(q, s.partitions) == 0][:EVENTS]
    out = []
    for i, q in enumerate(qids):
        ev = retrieval_event(s, q, ts=now - 120 + i)
        ev.candidates = list(range(12))
        ev.scores = ev.scores[:1].repeat(12)
        ev.selected = list(range(12))
        ev.memory_texts = {c: f"{q}:{c} " + "m" * 16_000 for c in range(12)}
        out.append(ev)
    return out


async def test_a_worker_sheds_the_oldest_pending_events_past_its_partitions_bytes(
    settings: Settings, tmp_path: Path
) -> None:
    s = settings.replace(topic_prefix=f"m{uuid.uuid4().hex[:6]}.", partitions=2)
    cap = s.replace(join_state_max_bytes=2 * MIB).join().partition_max_bytes
    assert cap == MIB
    env = {**settings_env(s), "CAUSALMEM_JOIN_STATE_MAX_BYTES": str(2 * MIB), "CAUSALMEM_DRIFT_RESET": "0"}
    await kafka.create_topics(s.bootstrap, s)
    events = _large_events(s, time.time())
    worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker.log")
    try:
        await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") == 2, 60, "worker")
        async with EventPublisher(s.bootstrap, s) as pub:
            for ev in events:
                await pub.publish(ev)
            await pub.flush()
        topic = s.topics().retrieval_events.name

        def seen() -> bool:
            return metric(worker.metrics(), "causalmem_events_in_total", topic=topic) >= EVENTS

        await until(seen, 60, "every event read")
        await until(lambda: metric(worker.metrics(), "causalmem_join_shed_total") > 0, 30, "shedding")
        m = worker.metrics()
        kept = metric(m, "causalmem_join_pending")
        assert 1 <= kept <= 5  # ~200 KiB each in 1 MiB
        assert metric(m, "causalmem_join_shed_total", buffer="retrieval", reason="max_bytes") == EVENTS - kept
        assert 0 < metric(m, "causalmem_join_state_bytes") <= cap
        assert metric(m, "causalmem_dead_letter_total") == 0
        # The newest event was kept: its feedback joins.
        async with EventPublisher(s.bootstrap, s) as pub:
            await pub.publish(feedback(events[-1].query_id, ts=events[-1].ts + 1))
            await pub.flush()
        await until(lambda: metric(worker.metrics(), "causalmem_joins_total") == 1, 30, "the newest joins")
        assert "join: shed the oldest entries" in worker.log_tail(20_000)
    finally:
        worker.stop()
