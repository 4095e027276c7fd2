"""Queue integrity: a labeler needs no model configuration and never consumes a sample silently.

Reproduces the reported loss: samples queued by a deployment with 8-dimensional embeddings,
read by a labeler left at the default settings (384). Before the fix, the labeler logged
each one as unreadable, committed past it, and the shared group lost them all.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.config import Settings
from pipeline.labeling.queue import LabelQueue
from topics.events import Features
from topics.fields import encode
from topics.labels import ActiveLearningSample

DEPLOYED = Settings(embedding_dim=8, slots=2048)  # what the worker that queued the samples used
LABELER = Settings()  # a labeler started with the defaults (384, 1024 slots)
TP = TopicPartition(LABELER.topics().active_learning.name, 0)
BASE_TS = 1_767_225_600.0


def sample(sid: str, slot: int = 3) -> ActiveLearningSample:
    return ActiveLearningSample(
        sample_id=sid,
        query_id=f"q-{sid}",
        step=0,
        ts=BASE_TS,
        reason="error",
        utility=-0.8,
        policy_version=1,
        features=Features(np.ones(DEPLOYED.embedding_dim, dtype=np.float32), 0.5, 1.2),
        candidates=[slot, 1500],
        selected=[slot],
        top_slots=[{"slot": slot, "prob": 0.6}, {"slot": 1500, "prob": 0.4}],
        query_text="which port?",
        memory_texts={slot: "the port is 9092", 1500: "a slot beyond the labeler's default count"},
    )


def key_of(value: bytes) -> bytes:
    try:
        return str(orjson.loads(value)["query_id"]).encode()
    except (orjson.JSONDecodeError, KeyError):
        return b"k"


class Consumer:
    def __init__(self, values: list[bytes]) -> None:
        self.msgs = [SimpleNamespace(value=v, key=key_of(v), offset=i) for i, v in enumerate(values)]
        self.commits: list[int] = []

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
        return {TP: [self.msgs.pop(0)]} if self.msgs else {}

    async def commit(self, offsets: dict[Any, Any]) -> None:
        self.commits.append(offsets[TP].offset)

    def assignment(self) -> set[Any]:
        return {TP}


class Producer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, Any]]] = []

    async def send(self, topic: str, value: bytes, **kw: Any) -> Any:
        self.sent.append((topic, value, kw))
        fut: Any = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def queue_of(monkeypatch: pytest.MonkeyPatch, values: list[bytes]) -> LabelQueue:
    async def read_all(*_: Any, **__: Any) -> list[Any]:
        return []

    monkeypatch.setattr(kafka, "read_all", read_all)
    q = LabelQueue("127.0.0.1:1", LABELER, "ann")
    q._consumer, q._producer = Consumer(values), Producer()
    return q


def encoded(s: ActiveLearningSample) -> bytes:
    raw = orjson.loads(encode(s.to_dict()))
    raw["features"]["query_embedding"] = [1.0] * DEPLOYED.embedding_dim
    return orjson.dumps(raw)


async def test_a_labeler_with_other_model_sizes_reads_every_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six samples with 8-dim embeddings and slots past 1024: the default labeler reads all six."""
    q = await queue_of(monkeypatch, [encoded(sample(f"s{i}")) for i in range(6)])
    got = []
    for _ in range(6):
        item = await q.next(timeout=1)
        assert item is not None, "a sample was lost to the labeler's embedding size"
        got.append(item.sample.sample_id)
        assert item.sample.memory_texts == {3: "the port is 9092", 1500: "a slot beyond the labeler's default count"}
        await q.answer(item, [1500], rating=4)
    assert got == [f"s{i}" for i in range(6)]
    assert q.bad == 0 and q._consumer.commits == [1, 2, 3, 4, 5, 6]
    topics = [t for t, _, _ in q._producer.sent]
    assert topics == [LABELER.topics().human_labels.name] * 6


async def test_an_unreadable_sample_goes_to_dead_letter_before_its_offset_is_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broken = orjson.loads(encoded(sample("bad")))
    del broken["candidates"]
    q = await queue_of(monkeypatch, [orjson.dumps(broken), b"not json", encoded(sample("good"))])
    item = await q.next(timeout=1)
    assert item is not None and item.sample.sample_id == "good"
    assert q.bad == 2
    dead = [(t, orjson.loads(v)) for t, v, _ in q._producer.sent]
    assert [t for t, _ in dead] == [LABELER.topics().dead_letter.name] * 2
    assert [d["reason"] for _, d in dead] == ["missing_field", "bad_json"]
    assert all(d["source"]["topic"] == TP.topic for _, d in dead)
    # each committed only after its dead letter was acknowledged; the good sample is not committed yet
    assert q._consumer.commits == [1, 2]


async def test_causalmem_label_dead_letters_an_empty_embedding_and_passes_over_its_own_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: an empty embedding raised ValueError (Limits(embedding_dim=0)) out of next(),
    stopping the labeler. A sample this labeler answered before is committed past, not shown."""
    empty = orjson.loads(encoded(sample("empty")))
    empty["features"]["query_embedding"] = []
    q = await queue_of(monkeypatch, [orjson.dumps(empty), encoded(sample("mine")), encoded(sample("new"))])
    q.answered.add("mine")
    item = await q.next(timeout=1)
    assert item is not None and item.sample.sample_id == "new"
    ((topic, value, _),) = q._producer.sent
    assert topic == LABELER.topics().dead_letter.name and orjson.loads(value)["reason"] == "embedding_length"
    assert q.bad == 1 and q.repeats == 1 and q._consumer.commits == [1, 2]


@pytest.mark.broker
async def test_the_reported_loss_through_the_broker(topics_ready: Settings) -> None:
    """Six samples from a deployment with 8-dim embeddings and one that is not an object. A labeler
    at the default 384 answers all six in the shared group; the broken one is in dead-letter."""
    from tests.integration.test_labeling import al_sample, labels_on_topic, produce, queue_samples

    s = topics_ready  # embedding_dim 8
    await queue_samples(s, [al_sample(s, f"six-{i}", f"q-six-{i}") for i in range(6)])
    await produce(s, s.topics().active_learning.name, [("q-broken", "not a sample")])
    default_labeler = s.replace(embedding_dim=384, slots=1024)
    got = []
    async with LabelQueue(s.bootstrap or "", default_labeler, "ann") as q:
        for _ in range(6):
            item = await q.next(timeout=15)
            assert item is not None, f"lost after {got}"
            got.append(item.sample.sample_id)
            await q.answer(item, [1])
        assert await q.next(timeout=2) is None
        assert q.bad == 1
    assert sorted(got) == [f"six-{i}" for i in range(6)]
    assert len(await labels_on_topic(s)) == 6
    dead = await kafka.read_all(s.bootstrap or "", s, s.topics().dead_letter.name)
    reasons = [orjson.loads(m.value) for m in dead]
    assert [(d["reason"], d["source"]["topic"]) for d in reasons] == [("not_object", s.topics().active_learning.name)]
