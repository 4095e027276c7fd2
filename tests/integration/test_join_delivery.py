"""Nothing lost on a crash: outcomes split by size, commits after acknowledgement.

A burst of feedback for 200 pending events used to become one ~3 MB ``outcomes`` message:
the send failed (MessageSizeTooLargeError), the worker exited, and the join group had
already committed past those events, so their steps never reached U_query or active
learning. Now outcomes are split under ``max_outcomes_bytes`` and an input offset is
committed only once every output of the inputs before it was acknowledged.

The kill tests SIGKILL the worker while its faust outcomes stage is working through the
burst, or as soon as the join has joined (before the stage has committed anything): every
step must reach U_query and active learning exactly once. They used to fail in some runs:
the stage's input offset could be committed before its changelog writes were
acknowledged, a RocksDB table could come back holding a write its changelog never got,
table recovery on the embedded broker stopped at the first record of a changelog's last
batch, a sample whose ``al-sent`` record was still in flight was sent again, and (the
last, 3 of 8 runs at the early kill point) the restarted worker dropped an ``outcomes``
message fetched just before faust's "seek to committed" (a no-op for a partition with no
committed offset) and committed past it (docs/architecture.md, "Nothing lost on a
crash"; the parts: tests/unit/worker/test_worker_delivery.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import orjson
import pytest
from causalmem_lab.procs import Child

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from pipeline.promtext import metric
from pipeline.worker.partitions import key_partition
from tests.conftest import settings_env
from tests.helpers import feedback, label, retrieval_event, until
from tests.join_fakes import FakeConsumer, Inputs, stage_with_fakes
from topics.events import RetrievalEvent
from topics.internal import decode_outcomes
from topics.labels import decode_active_learning_sample

S = Settings(embedding_dim=8, slots=32, partitions=4)
QUERIES, STEPS = 100, 2  # 200 pending events
LIMIT = 900 * 1024  # max_outcomes_bytes by default


def _big_events(s: Settings, now: float, partition: int | None = 0) -> list[RetrievalEvent]:
    """QUERIES × STEPS events with long texts (a candidate's sample is ~20 KB), on one partition."""
    qids = (f"burst-{i}" for i in range(100_000))
    chosen = [q for q in qids if partition is None or key_partition(q, s.partitions) == partition][:QUERIES]
    out = []
    for q in chosen:
        for step in range(STEPS):
            ev = retrieval_event(s, q, step=step, ts=now - 60 + step)
            ev.query_text = f"{q} " + "why " * 2000
            ev.memory_texts = {c: f"memory {c} " + "text " * 400 for c in ev.candidates}
            out.append(ev)
    return out


def _burst(events: list[RetrievalEvent]) -> list:
    return [feedback(ev.query_id, ev.step, ts=ev.ts + 1, utility=-0.8) for ev in events]


# --------------------------------------------------------------------------- unit


async def test_a_feedback_burst_is_split_into_outcomes_messages_under_the_limit() -> None:
    stage, producer = stage_with_fakes(S)
    inputs = Inputs(S)
    events = _big_events(S, time.time())
    await stage.process(inputs.batch([("r", 0, ev) for ev in events]))
    await stage.process(inputs.batch([("f", 0, fb) for fb in _burst(events)]))
    bodies = producer.values(S.topics().outcomes.name)
    assert sum(len(b) for b in bodies) > 3 * LIMIT  # one message would be far over
    assert all(len(b) <= LIMIT for b in bodies), [len(b) for b in bodies]
    records = [r for b in bodies for r in decode_outcomes(b, S.limits()).records]
    assert sorted((r.query_id, r.step) for r in records) == sorted((e.query_id, e.step) for e in events)
    assert all(r.al == "error" and r.sample for r in records)


async def test_a_failed_send_commits_nothing_past_its_inputs_and_a_rewind_rejoins_them() -> None:
    s = S
    stage, producer = stage_with_fakes(s)
    inputs = Inputs(s)
    events = _big_events(s, time.time())
    first = inputs.batch([("r", 0, ev) for ev in events])
    burst = inputs.batch([("f", 0, fb) for fb in _burst(events)])
    consumer = stage._consumer = FakeConsumer(set(first) | set(burst))
    await stage.process(first)  # all pending: the retrieval offset stays at the first event
    producer.fail_topic = s.topics().outcomes.name  # the broker refuses the burst's outcomes
    with pytest.raises(RuntimeError, match="MessageSizeTooLarge"):
        await stage.process(burst)
    await stage._flush_and_commit(force=True)  # what a stop or a revoke does
    [committed] = consumer.commits
    assert all(offset == 0 for offset in committed.values()), committed  # nothing past the lost steps
    # The run loop rewinds: state forgotten, every partition re-read from its acknowledged offset.
    await stage.rewind()
    assert stage.state == {} and all(consumer.seeks[tp] == 0 for tp in first)
    producer.fail_topic = None
    producer.sent.clear()
    await stage.process(first)
    await stage.process(burst)
    records = [r for b in producer.values(s.topics().outcomes.name) for r in decode_outcomes(b, s.limits()).records]
    assert len(records) == len(events)
    await stage._flush_and_commit(force=True)
    assert consumer.commits[-1] == {tp: len(recs) for tp, recs in {**first, **burst}.items()}


# --------------------------------------------------------------------------- through the real worker


async def _samples(s: Settings) -> list:
    msgs = await kafka.read_all(s.bootstrap, s, s.topics().active_learning.name, idle_s=0.5)
    return [decode_active_learning_sample(m.value, s.limits(), m.key) for m in msgs]


async def _u_query(s: Settings) -> dict[str, dict]:
    """The latest ``query-utility`` table value per query, from the table's changelog."""
    topic = f"{s.topic_prefix}causalmem-worker-query-utility-changelog"
    latest: dict[str, dict] = {}
    for m in await kafka.read_all(s.bootstrap, s, topic, idle_s=0.5):
        if m.value is not None:
            latest[m.key.decode().strip('"')] = orjson.loads(m.value)
    return latest


async def _burst_through_the_worker(settings: Settings, tmp_path: Path, kill: str | None) -> None:
    """``kill``: None, ``"stage"`` (once the outcomes stage sent a sample) or ``"joined"`` (once the join joined)."""
    s = settings.replace(topic_prefix=f"b{uuid.uuid4().hex[:6]}.", partitions=2, join_window_s=86400.0)
    env = {**settings_env(s), "CAUSALMEM_LABEL_WINDOW_S": str(10 * 86400), "CAUSALMEM_DRIFT_RESET": "0"}
    await kafka.create_topics(s.bootstrap, s)
    events = _big_events(s, time.time())
    queries = sorted({ev.query_id for ev in events})
    worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker-1.log")
    try:
        await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 60, "worker")
        async with EventPublisher(s.bootstrap, s) as pub:
            for q in queries:  # every error step becomes a sample at once
                await pub.publish(label(q, "verdict", ts=time.time() - 120, answer_correct=False))
            for ev in events:
                await pub.publish(ev)
        await until(lambda: metric(worker.metrics(), "causalmem_join_pending") == len(events), 60, "all pending")
        await until(lambda: metric(worker.metrics(), "causalmem_labels_total") >= len(queries), 60, "verdicts")
        async with EventPublisher(s.bootstrap, s) as pub:
            for fb in _burst(events):
                await pub.publish(fb)
        if kill == "stage":  # SIGKILL once the outcomes stage is mid-burst: outputs, table writes, commits in flight
            await until(
                lambda: metric(worker.metrics(), "causalmem_al_samples_total", reason="error") > 0, 60, "stage started"
            )
        elif kill == "joined":  # SIGKILL as soon as the join has the burst, before the stage sent a sample
            await until(lambda: metric(worker.metrics(), "causalmem_joins_total") > 0, 60, "the burst joined")
        if kill is not None:
            worker.kill()
            worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker-2.log")

        async def missing() -> str:
            u, samples = await _u_query(s), await _samples(s)
            short = [q for q in queries if u.get(q, {}).get("n") != STEPS]
            if len({x.sample_id for x in samples}) == len(events) and not short:
                return ""
            return f"{len(samples)} samples, {len(short)} queries short of U_query ({short[:3]})"

        # The join's part: every step is on ``outcomes`` again, each message under the limit.
        deadline = time.monotonic() + 120
        while True:
            outcomes = await kafka.read_all(s.bootstrap, s, s.topics().outcomes.name, idle_s=0.5)
            on_topic = {(r.query_id, r.step) for m in outcomes for r in decode_outcomes(m.value, s.limits()).records}
            if on_topic == {(e.query_id, e.step) for e in events}:
                break
            assert time.monotonic() < deadline, f"{len(on_topic)} steps on outcomes; {worker.log_tail(3000)}"
            assert worker.alive(), worker.log_tail(3000)
            await asyncio.sleep(1.0)
        assert len(outcomes) > 1 and all(len(m.value) <= s.max_outcomes_bytes for m in outcomes)
        # The stream stages' part: U_query and active learning, each step once.
        deadline = time.monotonic() + 90
        while gap := await missing():
            assert time.monotonic() < deadline, f"{gap}; worker log:\n{worker.log_tail(3000)}"
            assert worker.alive(), worker.log_tail(3000)
            await asyncio.sleep(1.0)
        await asyncio.sleep(3.0)  # a duplicate would show up now
        samples = await _samples(s)
        assert sorted((x.query_id, x.step) for x in samples) == sorted((e.query_id, e.step) for e in events)
        u = await _u_query(s)
        # Each step counted once; the record lists them as they came, and a join re-emitted after
        # the kill may bring step 1 before step 0.
        assert all(u[q]["n"] == STEPS and sorted(u[q]["steps"]) == list(range(STEPS)) for q in queries)
        assert all(u[q]["sum"] == pytest.approx(-0.8 * STEPS) for q in queries)
        assert worker.alive()
    finally:
        worker.stop()


@pytest.mark.broker
@pytest.mark.slow
async def test_a_feedback_burst_reaches_u_query_and_active_learning_once(settings: Settings, tmp_path: Path) -> None:
    await _burst_through_the_worker(settings, tmp_path, kill=None)


@pytest.mark.broker
@pytest.mark.slow
async def test_a_worker_sigkilled_mid_burst_loses_no_step_and_repeats_none(settings: Settings, tmp_path: Path) -> None:
    await _burst_through_the_worker(settings, tmp_path, kill="stage")


@pytest.mark.broker
@pytest.mark.slow
async def test_a_worker_sigkilled_as_soon_as_the_burst_joined_loses_no_step(settings: Settings, tmp_path: Path) -> None:
    """The earlier kill point: the restarted stage has no committed offset yet (3 of 8 runs lost a message before)."""
    await _burst_through_the_worker(settings, tmp_path, kill="joined")
