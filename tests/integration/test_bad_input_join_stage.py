"""Bad input at the join stage (docs/contract.md), driven by Hypothesis with shrinking.

Any batch of good retrieval/feedback pairs and arbitrary messages (raw bytes, arbitrary
JSON, good messages with one field mutated): the join stage never raises, dead-letters
exactly what the codec rejects, with the codec's reason, and joins every good pair. The
scale test with real worker and learner processes is tests/integration/test_bad_input_scale.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from pipeline import kafka
from pipeline.config import Settings
from pipeline.deadletter import DeadLetterWriter
from pipeline.metrics import Metrics
from pipeline.worker.join import JoinStage
from tests.bad_input_cases import BASE_TS, DELETE, ODD_UNICODE, F, R, set_path
from topics.fields import REASONS, SCHEMA_FEEDBACK, SCHEMA_RETRIEVAL, Rejected
from topics.names import DECODERS

pytestmark = [pytest.mark.broker, pytest.mark.slow]

D_H, S_H = 8, 32
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5)
)


@st.composite
def good_event_st(draw: st.DrawFn, qid: str, eid: str) -> dict:
    cands = draw(st.lists(st.integers(0, S_H - 1), min_size=1, max_size=10, unique=True))
    sel = draw(st.lists(st.sampled_from(cands), unique=True, max_size=len(cands)))
    return {
        "schema": SCHEMA_RETRIEVAL,
        "event_id": eid,
        "query_id": qid,
        "step": draw(st.integers(0, 2**31)),
        "ts": draw(st.floats(BASE_TS, BASE_TS + 1e4)),
        "features": {
            "query_embedding": draw(st.lists(finite, min_size=D_H, max_size=D_H)),
            "last_step_loss": draw(finite),
            "last_step_entropy": draw(finite),
        },
        "candidates": cands,
        "scores": draw(st.lists(finite, min_size=len(cands), max_size=len(cands))),
        "selected": sel,
        "temperature": draw(st.floats(1e-6, 1e6)),
        "logprob": draw(st.floats(-1e6, 1e-6)),
        "fallback": False,
    }


@st.composite
def arbitrary_message(draw: st.DrawFn, n: int) -> tuple[str, bytes | None, bytes | None]:
    """(topic, key, value): raw bytes, arbitrary JSON, or a good event/feedback with one field mutated."""
    topic = draw(st.sampled_from([R, F]))
    qid = f"zz\u200b{n}"
    base = (
        draw(good_event_st(qid, f"x{n}"))
        if topic == R
        else {"schema": SCHEMA_FEEDBACK, "event_id": f"x{n}", "query_id": qid, "step": 0, "ts": BASE_TS, "utility": 0.1}
    )
    kind = draw(st.sampled_from(["bytes", "json", "mutate", "mutate", "nonjson"]))
    if kind == "bytes":
        value: bytes | None = draw(st.binary(max_size=300) | st.none())
    elif kind == "json":
        value = json.dumps(draw(json_value)).encode()
    else:
        paths = [*base, *(f"features.{k}" for k in base.get("features", {}))]
        path = draw(st.sampled_from(paths))
        new = DELETE if draw(st.booleans()) and kind == "mutate" else draw(json_value)
        # json.dumps writes NaN/Infinity literals (orjson would write null) and escapes lone surrogates.
        value = json.dumps(set_path(base, path, new)).encode()
    key = draw(st.sampled_from([qid.encode(), None, b"other", qid.encode() + b"\xff"]))
    return topic, key, value


@st.composite
def batch_st(draw: st.DrawFn) -> tuple[list[tuple[str, str, bytes]], list[tuple[str, bytes | None, bytes | None]]]:
    good = []
    for i in range(draw(st.integers(0, 5))):
        qid = draw(st.sampled_from(ODD_UNICODE)) + f"g{i}"
        ev = draw(good_event_st(qid, f"g{i}"))
        fb = {
            "schema": SCHEMA_FEEDBACK,
            "event_id": f"g{i}",  # a feedback may reuse its event's id
            "query_id": qid,
            "step": ev["step"],
            "ts": draw(st.floats(BASE_TS, BASE_TS + 1e4)),
            "utility": draw(st.floats(-1e6, 1e6)),
        }
        good += [(R, qid, orjson.dumps(ev)), (F, qid, orjson.dumps(fb))]
    good = draw(st.permutations(good))
    other = [draw(arbitrary_message(i)) for i in range(draw(st.integers(0, 12)))]
    return good, other


def _records(s: Settings, msgs: list[tuple[str, bytes | None, bytes | None]]) -> dict[TopicPartition, list]:
    batch: dict[TopicPartition, list] = {}
    for topic, key, value in msgs:
        tp = TopicPartition(s.topics().by_short_name(topic).name, 0)
        records = batch.setdefault(tp, [])
        records.append(
            ConsumerRecord(tp.topic, 0, len(records), 0, 0, key, value, None, len(key or b""), len(value or b""), [])
        )
    return batch


@hsettings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(batch=batch_st())
def test_join_stage_routes_any_batch_like_the_codec(topics_ready: Settings, batch: Any) -> None:
    """Any batch: the join stage never raises, dead-letters exactly what the codec rejects
    (with the codec's reason, on the dead-letter topic) and what lies in the future
    (``ts_in_future``), and joins every good pair."""
    s = topics_ready.replace(join_window_s=1e10)
    assert (s.embedding_dim, s.slots) == (D_H, S_H)
    good, other = batch
    limits = s.limits()
    msgs = [(t, q.encode(), v) for t, q, v in good] + list(other)
    expected: Counter = Counter()
    for topic, key, value in other:
        try:
            decoded = DECODERS[topic](value, limits, key)
        except Rejected as rej:
            expected[rej.reason] += 1
        else:  # valid, but the join also holds ts to its clock
            if decoded.ts > time.time() + s.max_future_skew_s:
                expected["ts_in_future"] += 1
    dl_topic = s.topics().dead_letter.name

    async def run() -> None:
        metrics = Metrics()
        stage = JoinStage(s.join(), s.bootstrap, metrics)
        # Only the stage's output side is started: the batch is handed to process() directly
        # (a consumer group join would cost seconds per example on the embedded broker).
        producer = kafka.producer(s.bootstrap, s)
        await producer.start()
        stage._producer = producer
        stage._dead = dead_writer = DeadLetterWriter(producer, dl_topic, metrics)
        try:
            before = await kafka.high_watermark(s.bootstrap, s, dl_topic)
            await stage.process(_records(s, msgs))
            await dead_writer.flush()
        finally:
            await producer.stop()
        assert stage.joined_total == len(good) // 2
        rejected: Counter = Counter()
        for topic in (s.topics().retrieval_events.name, s.topics().llm_feedback.name):
            for reason in REASONS:
                rejected[reason] += int(metrics.rejected.labels(topic=topic, reason=reason)._value.get())
        assert +rejected == expected
        dead = await kafka.read_all(s.bootstrap, s, dl_topic, start={0: before}, idle_s=0.5)
        assert Counter(orjson.loads(m.value)["reason"] for m in dead) == expected

    asyncio.run(run())
