"""Who a labeler is, and that a labeler answers a sample once.

The queue is driven through stand-ins for its Kafka clients, then (the last test) against
a real broker.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.cli import build_parser
from pipeline.cli import label as label_cli
from pipeline.config import KafkaSecurity, Settings
from pipeline.labeling.queue import LabelQueue, labeler_identity
from tests.integration.test_labeling import al_sample, labels_on_topic, queue_samples
from topics.events import Features
from topics.fields import encode
from topics.labels import ActiveLearningSample, HumanLabel

S = Settings(embedding_dim=8, slots=32, partitions=2)
SASL = Settings(
    embedding_dim=8, slots=32, partitions=2, security=KafkaSecurity("SASL_PLAINTEXT", "SCRAM-SHA-512", "ann", "pw")
)
TP = TopicPartition(S.topics().active_learning.name, 0)


def sample(sid: str) -> ActiveLearningSample:
    return ActiveLearningSample(
        sample_id=sid,
        query_id=f"q-{sid}",
        step=0,
        ts=1_800_000_000.0,
        reason="error",
        utility=-0.8,
        policy_version=1,
        features=Features(np.zeros(8, dtype=np.float32), 0.5, 1.2),
        candidates=[0, 1, 2],
        selected=[0],
        top_slots=[{"slot": 0, "prob": 0.5}],
        query_text="q?",
    )


def answer(sid: str, who: str) -> HumanLabel:
    return HumanLabel(f"e-{sid}-{who}", f"q-{sid}", 1.0, who, "memory_choice", sample_id=sid, correct_memories=[1])


class Consumer:
    """Hands out the queued samples one per poll and records commits."""

    def __init__(self, samples: list[ActiveLearningSample]) -> None:
        self.msgs = [
            SimpleNamespace(value=encode(s.to_dict()), key=s.query_id.encode(), offset=i) for i, s in enumerate(samples)
        ]
        self.commits: list[int] = []

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[Any, Any]:
        return {TP: [self.msgs.pop(0)]} if self.msgs else {}

    async def commit(self, offsets: dict[Any, Any]) -> None:
        self.commits.append(offsets[TP].offset)

    def assignment(self) -> set[Any]:
        return {TP}


class Producer:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send(self, topic: str, value: bytes, key: bytes) -> Any:
        self.sent.append(value)
        fut: Any = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def queue_with(
    monkeypatch: pytest.MonkeyPatch, labeler: str, on_topic: list[HumanLabel], queued: list[str], settings: Settings = S
) -> LabelQueue:
    async def read_all(*_: Any, **__: Any) -> list[Any]:
        return [SimpleNamespace(value=encode(x.to_dict()), key=x.query_id.encode()) for x in on_topic]

    monkeypatch.setattr(kafka, "read_all", read_all)
    q = LabelQueue("127.0.0.1:1", settings, labeler)
    q.answered |= await q._own_answers()
    q._consumer, q._producer = Consumer([sample(s) for s in queued]), Producer()
    return q


async def test_a_sample_this_labeler_answered_before_is_passed_over_and_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ann answered s1 earlier (another group, or before a crash): she is never shown it again;
    bob's answer to s2 does not hide s2 from her."""
    q = await queue_with(monkeypatch, "ann", [answer("s1", "ann"), answer("s2", "bob")], ["s1", "s2", "s3"])
    assert q.answered == {"s1"}
    item = await q.next(timeout=1)
    assert item is not None and item.sample.sample_id == "s2"
    assert q.repeats == 1 and q._consumer.commits == [1]  # s1 committed, not shown
    await q.answer(item, [1])
    assert q.answered == {"s1", "s2"}
    third = await q.next(timeout=1)
    assert third is not None and third.sample.sample_id == "s3"


async def test_a_sample_answered_in_this_session_is_not_shown_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sample delivered twice (a crash of the commit, a second group): answered once."""
    q = await queue_with(monkeypatch, "ann", [], ["s1", "s1"])
    item = await q.next(timeout=1)
    assert item is not None
    await q.skip(item, "not sure")
    assert await q.next(timeout=0.2) is None
    assert q.repeats == 1 and len(q._producer.sent) == 1


def test_identity_is_the_sasl_principal() -> None:
    conn = SASL.connection()
    assert labeler_identity(conn, None) == labeler_identity(conn, " ann ") == "ann"
    with pytest.raises(ValueError, match="not the authenticated principal"):
        LabelQueue("127.0.0.1:1", SASL, "mallory")
    assert LabelQueue("127.0.0.1:1", SASL, "").labeler == "ann"
    assert LabelQueue("127.0.0.1:1", S, "bob").labeler == "bob"


def test_the_cli_takes_the_principal_and_refuses_another_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in {
        "CAUSALMEM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "CAUSALMEM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "CAUSALMEM_KAFKA_SASL_USERNAME": "ann",
        "CAUSALMEM_KAFKA_SASL_PASSWORD": "pw",
        "USER": "someone-else",
    }.items():
        monkeypatch.setenv(key, value)
    argv = ["label", "--bootstrap", "127.0.0.1:1", "--labeler", "mallory"]
    assert label_cli.run(build_parser(argv).parse_args(argv)) == 2
    assert "'mallory' is not the authenticated principal 'ann'" in capsys.readouterr().err

    seen: dict[str, Any] = {}

    async def fake_label(bootstrap: str, conn: Any, labeler: str, *a: Any, **k: Any) -> int:
        seen["labeler"] = labeler
        return 0

    monkeypatch.setattr(label_cli.terminal, "label", fake_label)
    argv = ["label", "--bootstrap", "127.0.0.1:1"]
    assert label_cli.run(build_parser(argv).parse_args(argv)) == 0
    assert seen["labeler"] == "ann"  # the principal, not $USER


@pytest.mark.broker
async def test_a_labeler_never_answers_a_sample_twice_even_in_another_group(topics_ready: Settings) -> None:
    """Another consumer group gets every sample again, but not for the labeler who answered
    it: alice's own labels are read at start and her answered samples are passed over
    (committed, never shown). bob, in a third group, still gets both."""
    s = topics_ready
    bootstrap = s.bootstrap or ""
    await queue_samples(s, [al_sample(s, "again-1", "qa1"), al_sample(s, "again-2", "qa2")])
    async with LabelQueue(bootstrap, s, "alice") as alice:
        for _ in range(2):
            item = await alice.next(timeout=15)
            assert item is not None
            await alice.answer(item, [1], rating=3)
    async with LabelQueue(bootstrap, s, "alice", group=f"{s.topic_prefix}causalmem-labelers-2") as again:
        assert again.answered == {"again-1", "again-2"}
        assert await again.next(timeout=3) is None
        assert again.repeats == 2 and again.done == 0
    async with LabelQueue(bootstrap, s, "bob", group=f"{s.topic_prefix}causalmem-labelers-3") as bob:
        got = []
        for _ in range(2):
            item = await bob.next(timeout=15)
            assert item is not None
            got.append(item.sample.sample_id)
            await bob.answer(item, [2])
    assert sorted(got) == ["again-1", "again-2"]
    labels = await labels_on_topic(s)
    assert sorted((x.sample_id, x.labeler) for x in labels) == [
        ("again-1", "alice"),
        ("again-1", "bob"),
        ("again-2", "alice"),
        ("again-2", "bob"),
    ]
