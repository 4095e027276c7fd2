"""Through a real broker: a client that reuses its query ids after a restart sees dead letters.

Five steps joined, the client restarts and sends the same five ``(query_id, step)`` under new
event ids: five dead letters ``step_reused`` on ``dead-letter``, nothing joined twice; the
retransmission of an original event stays silent (a duplicate, applied once). The rules,
case by case: tests/unit/worker/test_join_step_reuse.py.
"""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from pipeline.metrics import Metrics
from pipeline.worker.join import JoinStage
from tests.helpers import feedback, retrieval_event, running, until
from topics.internal import decode_experience

pytestmark = pytest.mark.broker


async def test_steps_reused_after_a_client_restart_are_dead_lettered(topics_ready: Settings) -> None:
    s = topics_ready
    t = s.topics()
    metrics = Metrics()
    now = time.time()
    before = [retrieval_event(s, "conv-7", step=k, ts=now - 60 + k) for k in range(5)]
    after = [retrieval_event(s, "conv-7", step=k, ts=now - 10 + k) for k in range(5)]  # new event ids
    async with running(JoinStage(s.join(), s.bootstrap, metrics)) as stage, EventPublisher(s.bootstrap, s) as pub:
        for ev in before:
            await pub.publish(ev)
            await pub.publish(feedback(ev.query_id, ev.step, ts=ev.ts + 1))
        await pub.flush()
        await until(lambda: stage.joined_total == 5, 30, "the first client's joins")
        for ev in after:  # the client restarted: its steps count from 0 again
            await pub.publish(ev)
        await pub.publish(before[0])  # and a retransmission of an event joined before
        await pub.flush()
        await until(lambda: metrics.dead_letters._value.get() >= 5, 30, "dead letters")
        await until(lambda: metrics.duplicates.labels(topic=t.retrieval_events.name)._value.get() == 1, 30, "dup")
        await asyncio.sleep(1.0)  # anything extra would arrive now
        assert stage.joined_total == 5
    dead = [orjson.loads(m.value) for m in await kafka.read_all(s.bootstrap, s, t.dead_letter.name)]
    assert sorted(orjson.loads(d["original"])["event_id"] for d in dead) == sorted(ev.event_id for ev in after)
    assert all(d["reason"] == "step_reused" and "unique across restarts" in d["detail"] for d in dead), dead
    assert metrics.rejected.labels(topic=t.retrieval_events.name, reason="step_reused")._value.get() == 5
    exps = [decode_experience(m.value, s.limits()) for m in await kafka.read_all(s.bootstrap, s, t.experiences.name)]
    assert sorted(e.id for e in exps) == sorted(ev.event_id for ev in before)
