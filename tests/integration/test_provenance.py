"""Through a real broker (contract 1.15): each experience names the principals that produced
its event and its feedback, as the clients' publishers stamped them; a value with a malformed
principal goes to ``dead-letter`` with its reason and is counted, and the join goes on.
"""

from __future__ import annotations

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


async def test_experiences_name_the_principals_of_their_event_and_feedback(topics_ready: Settings) -> None:
    s = topics_ready
    t = s.topics()
    metrics = Metrics()
    now = time.time()
    events = [retrieval_event(s, f"conv-{i}", step=0, ts=now - 30 + i) for i in range(4)]
    async with (
        running(JoinStage(s.join(), s.bootstrap, metrics)) as stage,
        EventPublisher(s.bootstrap, s, principal="svc-a") as client,
        EventPublisher(s.bootstrap, s, principal="evaluator@ops") as evaluator,
        EventPublisher(s.bootstrap, s) as anonymous,
    ):
        for i, ev in enumerate(events[:3]):
            await client.publish(ev)
            fb = feedback(ev.query_id, ev.step, ts=ev.ts + 1)
            await (evaluator if i < 2 else anonymous).publish(fb)
        await anonymous.publish(events[3])  # an older client: no principal at all
        await anonymous.publish(feedback(events[3].query_id, 0, ts=events[3].ts + 1))
        # A malformed principal, sent past the publisher's own check.
        bad = dict(feedback("conv-bad", 0, ts=now).to_dict(), principal="svc a; drop")
        await anonymous.send_raw("llm-feedback", orjson.dumps(bad), "conv-bad")
        for pub in (client, evaluator, anonymous):
            await pub.flush()
        await until(lambda: stage.joined_total == 4, 30, "four joins")
        await until(lambda: metrics.dead_letters._value.get() >= 1, 30, "the dead letter")
    exps = {
        e.id: e
        for e in (
            decode_experience(m.value, s.limits()) for m in await kafka.read_all(s.bootstrap, s, t.experiences.name)
        )
    }
    got = {ev.query_id: (exps[ev.event_id].event_principal, exps[ev.event_id].feedback_principal) for ev in events}
    assert got == {
        "conv-0": ("svc-a", "evaluator@ops"),
        "conv-1": ("svc-a", "evaluator@ops"),
        "conv-2": ("svc-a", None),
        "conv-3": (None, None),
    }
    assert exps[events[3].event_id].principal == "anonymous"
    dead = [orjson.loads(m.value) for m in await kafka.read_all(s.bootstrap, s, t.dead_letter.name)]
    assert [(d["reason"], "principal" in d["detail"]) for d in dead] == [("out_of_range", True)]
    assert metrics.rejected.labels(topic=t.llm_feedback.name, reason="out_of_range")._value.get() == 1
