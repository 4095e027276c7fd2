"""A step reused by a new event is dead-lettered (``step_reused``), a retransmission is not.

Reported (trust boundaries): a client that restarts and reuses its query ids sends new
events (new ``event_id``) for steps the worker has already joined; the join counted them in
``causalmem_duplicates_total`` and dropped them, so the client's operator never learned that
those steps were lost, nor why. Now a message whose ``event_id`` is new but whose
``(query_id, step)`` is already joined, or already held waiting by another event of the same
topic, goes to dead-letter with reason ``step_reused`` (docs/contract.md §2, §5) and is never
joined; the duplicates metric counts true retransmissions (the same ``event_id`` again) only.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from pipeline.config import Settings
from pipeline.worker.join import JoinStage, step_verdict
from tests.helpers import feedback, retrieval_event
from tests.join_fakes import FakeProducer, Inputs, stage_with_fakes
from topics.fields import JOIN_REASONS
from topics.internal import decode_experience

S = Settings(embedding_dim=8, slots=32, partitions=4)
QUERY = "conv-812"  # the id the client used before its restart, and again after it


def _dead(producer: FakeProducer, s: Settings) -> list[dict[str, Any]]:
    return [orjson.loads(v) for v in producer.values(s.topics().dead_letter.name)]


def _experience_ids(producer: FakeProducer, s: Settings) -> list[str]:
    return [decode_experience(v, s.limits()).id for v in producer.values(s.topics().experiences.name)]


def _count(stage: JoinStage, metric: str, topic: str, **labels: str) -> float:
    value: float = getattr(stage.metrics, metric).labels(topic=topic, **labels)._value.get()
    return value


async def test_five_steps_reused_after_a_restart_are_dead_lettered_and_a_retransmission_is_not() -> None:
    s = S
    t = s.topics()
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    before = [retrieval_event(s, QUERY, step=k, ts=now - 60 + k) for k in range(5)]
    await stage.process(inputs.batch([("r", 0, ev) for ev in before]))
    await stage.process(inputs.batch([("f", 0, feedback(QUERY, k, ts=now - 59 + k)) for k in range(5)]))
    assert stage.joined_total == 5 and _dead(producer, s) == []
    # The client restarts and numbers its steps from 0 again, under the same query id.
    after = [retrieval_event(s, QUERY, step=k, ts=now - 10 + k) for k in range(5)]
    await stage.process(inputs.batch([("r", 0, ev) for ev in after]))
    dead = _dead(producer, s)
    assert [d["reason"] for d in dead] == ["step_reused"] * 5, dead
    assert "step_reused" in JOIN_REASONS
    for k, (d, old, new) in enumerate(zip(dead, before, after, strict=True)):
        assert d["source"] == {"topic": t.retrieval_events.name, "partition": 0, "offset": 5 + k}
        assert orjson.loads(d["original"])["event_id"] == new.event_id
        detail = d["detail"]
        assert f"step {k} " in detail and repr(QUERY) in detail, detail
        assert repr(old.event_id) in detail and repr(new.event_id) in detail, detail
        assert "unique across restarts" in detail and "contract.md §2" in detail, detail
    assert _count(stage, "rejected", t.retrieval_events.name, reason="step_reused") == 5
    assert stage.metrics.dead_letters._value.get() == 5
    assert _count(stage, "duplicates", t.retrieval_events.name) == 0  # not counted as retransmissions
    # Never joined: the steps' experiences are the first client's, once each.
    assert stage.joined_total == 5 and _experience_ids(producer, s) == [ev.event_id for ev in before]
    # Their feedback (new ids too) is dead-lettered the same way, not joined.
    await stage.process(inputs.batch([("f", 0, feedback(QUERY, k, ts=now - 9 + k)) for k in range(5)]))
    assert [d["reason"] for d in _dead(producer, s)] == ["step_reused"] * 10
    assert _count(stage, "rejected", t.llm_feedback.name, reason="step_reused") == 5
    assert stage.joined_total == 5
    # A true retransmission (an original event's id again) stays silent: a duplicate, once.
    await stage.process(inputs.batch([("r", 0, before[2])]))
    assert len(_dead(producer, s)) == 10
    assert _count(stage, "duplicates", t.retrieval_events.name) == 1
    assert stage.joined_total == 5 and len(_experience_ids(producer, s)) == 5


async def test_a_new_event_for_a_waiting_step_is_dead_lettered_and_the_waiting_one_still_joins() -> None:
    s = S
    t = s.topics()
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    waiting = retrieval_event(s, QUERY, step=3, ts=now - 20)
    other = retrieval_event(s, QUERY, step=3, ts=now - 19)  # another event, the same step
    await stage.process(inputs.batch([("r", 1, waiting), ("r", 1, other), ("r", 1, waiting)]))
    [dead] = _dead(producer, s)
    assert dead["reason"] == "step_reused" and dead["source"]["offset"] == 1
    assert repr(waiting.event_id) in dead["detail"] and repr(other.event_id) in dead["detail"]
    assert _count(stage, "duplicates", t.retrieval_events.name) == 1  # the retransmission only
    assert stage.state[1].pending() == 1
    await stage.process(inputs.batch([("f", 1, feedback(QUERY, 3, ts=now - 18))]))
    assert stage.joined_total == 1 and _experience_ids(producer, s) == [waiting.event_id]


async def test_a_new_feedback_for_a_waiting_step_is_dead_lettered_too() -> None:
    s = S
    t = s.topics()
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    first, second = feedback(QUERY, 1, ts=now - 20, utility=0.7), feedback(QUERY, 1, ts=now - 19, utility=-0.7)
    await stage.process(inputs.batch([("f", 2, first), ("f", 2, second), ("f", 2, first)]))
    [dead] = _dead(producer, s)
    assert dead["reason"] == "step_reused" and dead["source"]["topic"] == t.llm_feedback.name
    assert repr(first.event_id) in dead["detail"] and repr(second.event_id) in dead["detail"]
    assert _count(stage, "duplicates", t.llm_feedback.name) == 1
    ev = retrieval_event(s, QUERY, step=1, ts=now - 21)
    await stage.process(inputs.batch([("r", 2, ev)]))
    [exp] = [decode_experience(v, s.limits()) for v in producer.values(t.experiences.name)]
    assert exp.id == ev.event_id and abs(exp.utility - 0.7) < 1e-9  # the first feedback's


async def test_a_retransmission_stays_silent_after_its_id_was_forgotten() -> None:
    """The remembered ids may go before the joined step (older, or shed): the step remembers its ids."""
    s = S
    t = s.topics()
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    ev, fb = retrieval_event(s, QUERY, ts=now - 30), feedback(QUERY, ts=now - 1)
    await stage.process(inputs.batch([("r", 3, ev), ("f", 3, fb)]))
    st = stage.state[3]
    st.seen_retrieval.pop(ev.event_id), st.seen_feedback.pop(fb.event_id)
    await stage.process(inputs.batch([("r", 3, ev), ("f", 3, fb)]))
    assert _dead(producer, s) == [] and stage.joined_total == 1
    assert _count(stage, "duplicates", t.retrieval_events.name) == 1
    assert _count(stage, "duplicates", t.llm_feedback.name) == 1


async def test_distinct_steps_and_queries_still_join() -> None:
    s = S
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    events = [retrieval_event(s, f"{QUERY}-{q}", step=k, ts=now - 50 + k) for q in range(3) for k in range(3)]
    await stage.process(inputs.batch([("r", 0, ev) for ev in events]))
    await stage.process(inputs.batch([("f", 0, feedback(ev.query_id, ev.step, ts=ev.ts + 1)) for ev in events]))
    assert stage.joined_total == 9 and _dead(producer, s) == []


def test_the_verdict() -> None:
    assert step_verdict("e2", seen=False, holder=None) == "new"
    assert step_verdict("e1", seen=True, holder="e1") == "duplicate"
    assert step_verdict("e1", seen=False, holder="e1") == "duplicate"  # its id forgotten, its step not
    assert step_verdict("e2", seen=True, holder="e1") == "duplicate"  # e2 already seen (e.g. shed step)
    assert step_verdict("e2", seen=False, holder="e1") == "step_reused"
