"""The join's state is bounded in bytes per partition, not only in entries.

Reported (trust boundaries): 1,500 retrieval events of 220 KiB with distinct query ids held
the worker at 512 MB for the whole 600 s join window, since the only bound was 500,000
pending events per partition and side. Now each partition's pending halves and remembered
ids are counted for the heap they hold and kept within ``join_state_max_bytes`` /
``partitions`` bytes; past it the oldest entries go first, whichever buffer holds them,
each counted in ``causalmem_join_shed_total{buffer,reason}`` and logged at most every few
seconds, never dead-lettered (as the count caps always did).
"""

from __future__ import annotations

import gc
import logging
import time
import tracemalloc
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from aiokafka import TopicPartition
from prometheus_client import generate_latest

from pipeline.config import Settings
from pipeline.metrics import Metrics
from pipeline.promtext import metric, parse
from pipeline.worker import partitions
from pipeline.worker.join import JoinStage, join_state_metrics
from pipeline.worker.partitions import JoinedStep, PartitionState, Pending
from tests.helpers import feedback, retrieval_event
from tests.join_fakes import FakeConsumer, Inputs, stage_with_fakes
from topics.events import RetrievalEvent
from topics.fields import encode

MIB = 1024 * 1024
# The documented default: 512 MiB for the whole worker's join state, split evenly over the
# partitions (8 by default), so a worker owning every partition stays within it.
PARTITION_BUDGET = 512 * MIB // 8


def _large_event(s: Settings, i: int, ts: float) -> RetrievalEvent:
    """A valid retrieval event of about 220 KiB on the wire (texts of the selected memories)."""
    ev = retrieval_event(s, f"flood-{i:06d}", ts=ts)
    ev.candidates = list(range(14))
    ev.scores = ev.scores[:1].repeat(14)
    ev.selected = list(range(13))
    ev.memory_texts = {c: f"{i}:{c} " + "m" * 16_000 for c in range(13)}
    ev.query_text = "q" * 8_000
    ev.answer_text = "a" * 4_000
    return ev


def _shed(stage: JoinStage, buffer: str, reason: str = "max_bytes") -> float:
    return stage.state_metrics.shed.labels(buffer=buffer, reason=reason)._value.get()


def _dead(producer: Any, s: Settings) -> list[bytes]:
    return producer.values(s.topics().dead_letter.name)


@pytest.mark.slow  # ~6 s: 330 MB of events decoded under tracemalloc
async def test_large_unanswered_events_hold_at_most_the_partitions_byte_budget() -> None:
    s = Settings()  # the defaults: 8 partitions, D = 384
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    assert 215 * 1024 < len(encode(_large_event(s, 0, now).to_dict())) < 230 * 1024
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for first in range(0, 1_500, 100):  # one partition, in fetched batches of 100
            await stage.process(
                inputs.batch([("r", 0, _large_event(s, i, now - 300 + i / 10)) for i in range(first, first + 100)])
            )
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    st = stage.state[0]
    pending = st.pending()
    assert held <= PARTITION_BUDGET, f"the join holds {held / MIB:.0f} MiB ({pending} events) on one partition"
    assert s.join().partition_max_bytes == PARTITION_BUDGET and st.held_bytes() <= PARTITION_BUDGET
    assert held <= st.held_bytes()  # what is counted is at least what is held
    # The newest stayed; every other event was shed, counted, and not dead-lettered.
    assert ("flood-001499", 0) in st.retrieval and ("flood-000000", 0) not in st.retrieval
    assert _shed(stage, "retrieval") + pending == 1_500 and _dead(producer, s) == []
    assert stage.state_metrics.state_bytes._value.get() == st.held_bytes()


S = Settings(embedding_dim=8, slots=32, partitions=4, join_state_max_bytes=4 * MIB)  # 1 MiB per partition


async def test_the_oldest_pending_events_are_shed_as_they_arrive_and_the_rest_still_join() -> None:
    s = S
    assert s.join().partition_max_bytes == MIB
    stage, producer = stage_with_fakes(s)
    stage._consumer = FakeConsumer({TopicPartition(s.topics().retrieval_events.name, p) for p in range(4)})
    inputs = Inputs(s)
    now = time.time()
    events = [_large_event(s, i, now - 100 + i) for i in range(20)]
    other = retrieval_event(s, "elsewhere", ts=now - 200)  # another partition: its own budget
    await stage.process(inputs.batch([("r", 1, other), *[("r", 0, ev) for ev in events]]))
    st = stage.state[0]
    kept = [ev for ev in events if (ev.query_id, 0) in st.retrieval]
    assert kept == events[-len(kept) :] and 1 <= len(kept) <= 5  # the newest; ~220 KiB each in 1 MiB
    assert st.held_bytes() <= MIB and _shed(stage, "retrieval") == 20 - len(kept)
    assert ("elsewhere", 0) in stage.state[1].retrieval
    assert _dead(producer, s) == []  # shed, not rejected: as the count cap always did
    # The partition's committed offset moves past the shed events, to the oldest one kept.
    assert stage.acked[TopicPartition(s.topics().retrieval_events.name, 0)] == 20 - len(kept)
    # A kept event still joins; a shed one's feedback waits for an event that is gone.
    await stage.process(
        inputs.batch([("f", 0, feedback(kept[-1].query_id, ts=now)), ("f", 0, feedback(events[0].query_id, ts=now))])
    )
    assert stage.joined_total == 1 and (events[0].query_id, 0) in st.feedback


async def test_many_distinct_ids_are_bounded_too() -> None:
    s = S.replace(join_state_max_bytes=4 * 256 * 1024)  # 256 KiB per partition
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    # Joined pairs leave three ids each (both event ids and the step); lone feedback with
    # 256-character ids waits, and is remembered.
    pairs = [retrieval_event(s, f"pair-{i}", ts=now - 500 + i / 100) for i in range(2_000)]
    for first in range(0, 2_000, 50):  # halves fetched close together: few events wait at a time
        chunk = pairs[first : first + 50]
        await stage.process(inputs.batch([("r", 0, ev) for ev in chunk]))
        await stage.process(inputs.batch([("f", 0, feedback(ev.query_id, ts=ev.ts)) for ev in chunk]))
    assert stage.joined_total == 2_000
    lone = []
    for i in range(2_000):
        fb = feedback("q" * 200 + f"{i:056d}", ts=now - 100 + i / 100)
        fb.event_id = uuid.uuid4().hex * 8
        lone.append(("f", 0, fb))
    await stage.process(inputs.batch(lone))
    st = stage.state[0]
    assert st.held_bytes() <= 256 * 1024
    for buffer in ("seen_retrieval", "seen_feedback", "joined", "feedback"):
        assert _shed(stage, buffer) > 0, buffer
    assert len(st.joined) == 0  # the pairs' ids were older than every lone feedback: they went first
    assert _dead(producer, s) == []


def test_shedding_takes_the_oldest_entry_whichever_buffer_holds_it() -> None:
    st = PartitionState()
    st.seen_retrieval.put("old-event", 1.0)
    st.joined.put(("old-query", 0), JoinedStep(2.0, "old-event", "old-feedback"))
    for i in range(3):
        st.retrieval.put((f"q{i}", 0), Pending(None, i, 10.0 + i, size=1_000))
    st.seen_feedback.put("recent-feedback", 11.5)
    shed = st.shed(st.held_bytes() - 1)  # one byte too many: the oldest entry goes
    assert dict(shed) == {"seen_retrieval": 1}
    shed = st.shed(st.held_bytes() - 1_200)  # then the step (2.0), then the event of 10.0
    assert dict(shed) == {"joined": 1, "retrieval": 1}
    assert list(st.retrieval) == [("q1", 0), ("q2", 0)] and "recent-feedback" in st.seen_feedback
    assert st.shed(0) and st.held_bytes() == 0 and st.pending() == 0


async def test_the_count_caps_are_counted_as_shed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(partitions, "MAX_PENDING_PER_PARTITION", 3)
    stage, _ = stage_with_fakes(S)
    inputs = Inputs(S)
    now = time.time()
    await stage.process(inputs.batch([("r", 0, retrieval_event(S, f"c{i}", ts=now - 10 + i)) for i in range(5)]))
    assert stage.state[0].pending() == 3
    assert _shed(stage, "retrieval", "max_count") == 2 and _shed(stage, "retrieval") == 0
    assert stage.metrics.join_expired.labels(side="retrieval")._value.get() == 0  # the window only


async def test_shedding_is_logged_at_most_every_few_seconds(caplog: pytest.LogCaptureFixture) -> None:
    stage, _ = stage_with_fakes(S)
    inputs = Inputs(S)
    now = time.time()
    caplog.set_level(logging.WARNING, logger="pipeline.worker.join")
    for b in range(5):  # five batches, each shedding
        await stage.process(inputs.batch([("r", 0, _large_event(S, b * 10 + i, now - 100 + b)) for i in range(10)]))
    warnings = [r for r in caplog.records if "shed" in r.getMessage()]
    assert len(warnings) == 1 and _shed(stage, "retrieval") >= 40
    assert "flood-" not in warnings[0].getMessage()  # counts only, never what a client wrote


def test_the_metrics_are_exported_by_a_worker_once_per_process() -> None:
    worker, learner = Metrics(role="worker"), Metrics(role="learner")
    first = JoinStage(S.join(), "127.0.0.1:9", worker)
    second = JoinStage(S.join(), "127.0.0.1:9", worker)  # two stages, one registry: no clash
    assert first.state_metrics is second.state_metrics is join_state_metrics(worker)
    text = generate_latest(worker.registry).decode()
    assert metric(parse(text), "causalmem_join_shed_total", buffer="retrieval", reason="max_bytes") == 0
    assert "causalmem_join_state_bytes" in text
    JoinStage(S.join(), "127.0.0.1:9", learner)
    assert "causalmem_join_shed" not in generate_latest(learner.registry).decode()


def test_the_setting_is_read_from_the_environment() -> None:
    s = Settings.from_env({"CAUSALMEM_JOIN_STATE_MAX_BYTES": str(64 * MIB), "CAUSALMEM_PARTITIONS": "16"})
    assert s.join().state_max_bytes == 64 * MIB and s.join().partition_max_bytes == 4 * MIB


# --------------------------------------------------------------------------- what is counted


def _wide(s: Settings, i: int, now: float) -> list[tuple[str, int, Any]]:
    ev = _large_event(s, i, now)  # one character outside the BMP: 4 bytes per character on the heap
    ev.memory_texts = {c: "\U0001f600" + "m" * 16_000 for c in range(13)}
    return [("r", 0, ev)]


def _many_candidates(s: Settings, i: int, now: float) -> list[tuple[str, int, Any]]:
    ev = retrieval_event(s, f"many-{i}", ts=now)  # small numbers: 2 bytes on the wire, 8 to 36 on the heap
    ev.candidates, ev.selected = list(range(1024)), [1023]
    ev.scores, ev.candidate_masks, ev.candidate_probs = np.zeros(1024), np.zeros(1024), np.full(1024, 1 / 1024)
    ev.candidate_ids = [f"m{c}" for c in range(1024)]
    return [("r", 0, ev)]


CASES: dict[str, tuple[Callable[[Settings, int, float], list[tuple[str, int, Any]]], int]] = {
    "events": (lambda s, i, now: [("r", 0, retrieval_event(s, f"e-{uuid.uuid4().hex}", ts=now))], 1_000),
    "feedback": (lambda s, i, now: [("f", 0, feedback(f"f-{uuid.uuid4().hex}", ts=now))], 3_000),
    "joined pairs": (
        lambda s, i, now: [
            ("r", 0, retrieval_event(s, f"p-{i}", ts=now)),
            ("f", 0, feedback(f"p-{i}", ts=now)),
        ],
        2_000,
    ),
    "wide texts": (_wide, 40),
    "1024 candidates": (_many_candidates, 100),
}


@pytest.mark.slow  # up to a few seconds each under tracemalloc
@pytest.mark.parametrize("case", sorted(CASES))
async def test_what_is_counted_is_at_least_what_the_heap_holds(case: str) -> None:
    make, n = CASES[case]
    s = Settings(partitions=4)  # D = 384, a budget far above these
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for first in range(0, n, 500):
            await stage.process(inputs.batch([m for i in range(first, min(n, first + 500)) for m in make(s, i, now)]))
        producer.sent.clear()  # the outputs are the fakes', not the state's
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = stage.state[0].held_bytes()
    assert held <= counted <= 2 * held, f"{case}: {held / n:.0f} B held, {counted / n:.0f} B counted per item"
