"""Event time per partition: a far-future timestamp cannot stop the join.

One contract-valid event with ``ts`` near 1e11 used to move the join's single clock: on the
other partitions no pair joined again, and the table prune would have deleted per-query
state. Now each partition has its own watermark and a ``ts`` more than
``max_future_skew_s`` ahead of the wall clock goes to dead-letter (``ts_in_future``).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import orjson

from pipeline.config import Settings
from pipeline.metrics import Metrics
from pipeline.worker.records import QueryUtility
from pipeline.worker.upkeep import Upkeep
from tests.helpers import feedback, retrieval_event
from tests.join_fakes import Inputs, stage_with_fakes
from topics.fields import REASONS

S = Settings(embedding_dim=8, slots=32, partitions=4)


def _dead(producer, s: Settings) -> list[dict]:
    return [orjson.loads(v) for v in producer.values(s.topics().dead_letter.name)]


async def test_a_far_future_event_is_dead_lettered_and_pairs_on_every_partition_still_join() -> None:
    s = S.replace(join_window_s=600.0)
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    bad = retrieval_event(s, "from-the-future", ts=1e11 - 1)  # valid for the codec (ts ≤ 1e11)
    await stage.process(inputs.batch([("r", 0, bad)]))
    [dead] = _dead(producer, s)
    assert "ts_in_future" in REASONS and dead["reason"] == "ts_in_future"
    assert dead["source"] == {"topic": s.topics().retrieval_events.name, "partition": 0, "offset": 0}
    assert stage.metrics.rejected.labels(topic=s.topics().retrieval_events.name, reason="ts_in_future")._value.get()
    assert all(st.watermark is None and st.pending() == 0 for st in stage.state.values())
    # 50 pairs, halves in separate batches, on every partition (the bad one's included).
    events = [retrieval_event(s, f"q{i}", ts=now - 100 + i) for i in range(50)]
    await stage.process(inputs.batch([("r", i % 4, ev) for i, ev in enumerate(events)]))
    fbs = [feedback(ev.query_id, ts=ev.ts + 1, utility=0.2) for ev in events]
    await stage.process(inputs.batch([("f", i % 4, fb) for i, fb in enumerate(fbs)]))
    assert stage.joined_total == 50
    assert stage.metrics.join_expired.labels(side="retrieval")._value.get() == 0
    assert sum(st.pending() for st in stage.state.values()) == 0
    # The bad event's partition commits past it: nothing is stuck behind it.
    retrieval0 = next(tp for tp in inputs.offsets if tp.partition == 0 and tp.topic.endswith("retrieval-events"))
    assert stage.state[0].commit_offset("retrieval") == inputs.offsets[retrieval0]


async def test_expiry_follows_each_partitions_own_watermark() -> None:
    s = S.replace(join_window_s=60.0)  # max_future_skew_s: 300 by default
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    waiting = retrieval_event(s, "waiting", ts=now - 30)  # partition 1: waits for its feedback
    old = retrieval_event(s, "old", ts=now - 100)  # partition 0: never answered
    await stage.process(inputs.batch([("r", 1, waiting), ("r", 0, old)]))
    # Partition 0's producer runs 200 s ahead (within the allowed skew): its clock moves on.
    ahead = retrieval_event(s, "ahead", ts=now + 200)
    await stage.process(inputs.batch([("r", 0, ahead), ("f", 0, feedback("ahead", ts=now + 201))]))
    expired_now = stage.metrics.join_expired.labels(side="retrieval")._value.get()
    await stage.process(inputs.batch([("f", 1, feedback("waiting", ts=now - 29))]))
    assert stage.joined_total == 2 and _dead(producer, s) == []
    assert expired_now == 1  # "old", by partition 0's clock; "waiting" on partition 1 stays
    assert stage.state[0].watermark == now + 201 and stage.state[1].watermark == now - 29
    assert stage.event_clock() == now - 29  # the slowest partition


class MemoryTable(dict[bytes, Any]):
    """A table on the memory store, as far as the prune looks (items, deletion, no serialized store)."""

    data: Any = None


async def test_the_table_prune_clock_ignores_a_far_future_event() -> None:
    """The prune's clock is the slowest partition's watermark; a bad event cannot move it."""
    s = S.replace(label_window_s=3600.0)
    stage, _ = stage_with_fakes(s)
    inputs = Inputs(s)
    now = time.time()
    await stage.process(inputs.batch([("r", 0, retrieval_event(s, "bad", ts=1e11 - 1))]))
    await stage.process(inputs.batch([("r", 1, retrieval_event(s, "q", ts=now - 10))]))
    entry = QueryUtility(sum=0.5, n=1, steps=[0], ts=now - 100)  # well inside the label window
    stale = QueryUtility(sum=0.5, n=1, steps=[0], ts=now - 7200)  # older than the label window
    names = ("query_util", "verdicts", "ratings", "al_pending", "al_sent", "al_samples", "labels_seen")
    tables = SimpleNamespace(**{name: MemoryTable({b"q": entry, b"old": stale}) for name in names})
    upkeep = Upkeep(s.worker(), tables, stage, Metrics(), app=None, stage_topics=frozenset())  # type: ignore[arg-type]
    await upkeep.prune()
    assert all(list(getattr(tables, name)) == [b"q"] for name in names)
