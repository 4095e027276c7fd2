"""The browser's labeling pool keeps flowing: redelivered answered samples and unreadable ones.

The pool runs on stand-ins for its Kafka clients that record what is sent, committed and
sought; no broker.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition

from pipeline.config import Settings
from pipeline.labeling.queue import read_sample
from pipeline.ui.pool import LabelError, SamplePool
from tests.queue_fakes import RecordingProducer, SampleConsumer
from topics.events import Features
from topics.fields import Limits, Rejected, encode
from topics.labels import ActiveLearningSample, decode_active_learning_sample

S = Settings(embedding_dim=8, slots=64, partitions=1)
TP = TopicPartition(S.topics().active_learning.name, 0)


def sample(sid: str, dim: int = 8) -> ActiveLearningSample:
    return ActiveLearningSample(
        sample_id=sid,
        query_id=f"q-{sid}",
        step=1,
        ts=1_767_225_600.0,
        reason="error",
        utility=-0.7,
        policy_version=3,
        features=Features(np.zeros(dim, dtype=np.float32), 0.5, 1.0),
        candidates=[4, 9],
        selected=[4],
        top_slots=[{"slot": 4, "prob": 0.6}, {"slot": 9, "prob": 0.4}],
    )


class Pool(SamplePool):
    def __init__(self, samples: list[ActiveLearningSample], overlap: int = 1) -> None:
        super().__init__("127.0.0.1:1", S.connection(), overlap=overlap, lease_s=60.0, clock=lambda: 0.0)
        self._consumer, self._producer = SampleConsumer(samples, TP), RecordingProducer()


async def test_redelivered_samples_answered_already_are_committed_past_and_the_queue_flows() -> None:
    """Before: the 16 answered samples were held for nobody, pinned the commit at 0 and
    filled the prefetch, so nothing after them was ever fetched."""
    pool = Pool([sample(f"s{i}") for i in range(20)])
    pool.answered["ann"] = {f"s{i}" for i in range(17)}  # read from human-labels at start
    leased = await pool.lease("ann", wait_s=0)
    assert leased is not None and leased[0].sample.sample_id == "s17"
    assert pool._consumer.commits[-1] == 17 and pool.repeats == 17  # passed over, up to the first unanswered
    await pool.submit("ann", "s17", leased[1].token, correct=[9])
    assert pool._consumer.commits[-1] == 18
    leased = await pool.lease("ann", wait_s=0)
    assert leased is not None and leased[0].sample.sample_id == "s18"


async def test_an_earlier_answer_counts_towards_the_overlap() -> None:
    pool = Pool([sample("s1")], overlap=2)
    pool.answered["bob"] = {"s1"}  # bob answered before the app restarted
    leased = await pool.lease("ann", wait_s=0)
    assert leased is not None and leased[0].open_slots(2) == 0  # ann's lease and bob's answer
    assert await pool.lease("carl", wait_s=0) is None
    await pool.submit("ann", "s1", leased[1].token, correct=[9])
    assert pool._consumer.commits == [1] and not pool.entries


async def test_an_empty_embedding_is_dead_lettered_and_the_rest_of_its_batch_served() -> None:
    """Before: Limits(embedding_dim=0) raised ValueError out of the fetch (the page answered
    500) and the samples after it in the batch were lost."""
    pool = Pool([sample("s1"), sample("empty", dim=0), sample("s3")])
    leased = await pool.lease("ann", wait_s=0)
    assert leased is not None and leased[0].sample.sample_id == "s1"
    ((topic, value),) = pool._producer.sent
    assert topic == S.topics().dead_letter.name and orjson.loads(value)["reason"] == "embedding_length"
    assert pool.unreadable == 1 and pool._consumer.commits == [0]  # s1 is held: nothing past it
    assert set(pool.entries) == {"s1", "s3"}
    await pool.submit("ann", "s1", leased[1].token, correct=[9])
    assert pool._consumer.commits[-1] == 2  # s1 answered, the dead letter safe: up to s3


async def test_a_failed_dead_letter_write_commits_nothing_past_the_sample() -> None:
    pool = Pool([sample("s1"), sample("empty", dim=0), sample("s3")])
    sought: list[int] = []
    pool._consumer.seek = lambda tp, offset: sought.append(offset)  # type: ignore[attr-defined]

    async def down(topic: str, value: bytes, **kw: Any) -> Any:
        raise ConnectionError("broker away")

    pool._producer.send = down  # type: ignore[method-assign]
    leased = await pool.lease("ann", wait_s=0)
    assert leased is not None and sought == [1] and set(pool.entries) == {"s1"}
    assert pool._next[TP] == 1 and pool._consumer.commits == []


async def test_a_non_ascii_lease_token_is_a_stale_lease_not_a_crash() -> None:
    pool = Pool([sample("s1")])
    assert await pool.lease("ann", wait_s=0) is not None
    with pytest.raises(LabelError, match="lease"):
        await pool.submit("ann", "s1", "é-not-the-token", correct=[9])


def test_the_codec_rejects_an_empty_embedding_and_readers_reject_any_parse_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw = encode(sample("empty", dim=0).to_dict())
    with pytest.raises(Rejected) as rej:
        decode_active_learning_sample(raw, Limits(), any_shape=True)
    assert rej.value.reason == "embedding_length"

    def broken(*a: Any, **kw: Any) -> Any:
        raise KeyError("a decoder bug")

    monkeypatch.setattr("pipeline.labeling.queue.decode_active_learning_sample", broken)
    with pytest.raises(Rejected):  # the web app and causalmem label dead-letter it
        read_sample(encode(sample("s1").to_dict()), Limits(), b"q-s1")
