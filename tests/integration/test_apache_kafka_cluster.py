"""The product on Apache Kafka itself: three KRaft nodes, configured as deployed (tests/kafka_cluster.py).

One cluster for the module (~35-60 s to start on two cores, most of it the two dozen runs of
the ACL tool that deploy/kafka/acls.sh makes); skipped, with the reason, where Java, Maven or the
jars are missing. Every client is the product's own (``pipeline.kafka``, ``EventPublisher``),
configured through the ``CAUSALMEM_*`` environment that compose gives each role.

- ``causalmem init-topics``, as the operator, creates every topic with 3 replicas (all in
  sync) and ``min.insync.replicas`` 2;
- the service role writes ``retrieval-events`` (acknowledged by ``acks=all``) and reads only
  what deploy/kafka/acls.sh grants it;
- an unauthenticated client, and a wrong password, are refused;
- a labeler cannot write ``control`` or ``policy-checkpoints``;
- the whole matrix: each role writes and reads the product topics deploy/kafka/acls.sh's table
  says it does, and no other; only the operator creates topics.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid
from collections.abc import Iterator

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
)

from pipeline import cli, kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from tests.helpers import retrieval_event
from tests.kafka_cluster import ROLES, KafkaCluster
from topics.events import decode_retrieval_event

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def role_settings(cluster: KafkaCluster, role: str) -> Settings:
    """The settings a process of ``role`` reads from its environment (compose's variables)."""
    return Settings.from_env(cluster.env(role))


@pytest.fixture(scope="module")
def init_topics(kafka_cluster: KafkaCluster) -> Iterator[tuple[int, str]]:
    """``causalmem init-topics`` run as compose's init-topics container runs it: the operator's
    environment, ``--bootstrap``; its exit code and output."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in kafka_cluster.env("operator").items():
            mp.setenv(name, value)
        with contextlib.redirect_stdout(out):
            code = cli.main(["init-topics", "--bootstrap", kafka_cluster.bootstrap])
    yield code, out.getvalue()


async def test_init_topics_creates_every_topic_replicated(
    kafka_cluster: KafkaCluster, init_topics: tuple[int, str]
) -> None:
    code, out = init_topics
    assert code == 0, out
    operator = role_settings(kafka_cluster, "operator")
    specs = operator.topics().all()
    # Nothing else creates topics on this cluster (no auto-creation); "exists" is init-topics' own
    # retry after a creation the broker finished but answered late (seen under load on two cores).
    assert all(line.rstrip().endswith(("created", "exists")) for line in out.splitlines() if line.strip()), out
    assert len(out.splitlines()) == len(specs)

    client = kafka.admin(kafka_cluster.bootstrap, operator)  # the operator may describe them
    await client.start()
    try:
        described = {d["topic"]: d for d in await client.describe_topics([s.name for s in specs])}
        configs = await client.describe_configs([ConfigResource(ConfigResourceType.TOPIC, s.name) for s in specs])
    finally:
        await client.close()
    for spec in specs:
        topic = described[spec.name]
        assert topic["error_code"] == 0, topic
        assert len(topic["partitions"]) == spec.partitions
        for partition in topic["partitions"]:
            assert len(partition["replicas"]) == 3, (spec.name, partition)
            assert sorted(partition["isr"]) == sorted(partition["replicas"]), (spec.name, partition)
    min_isr = {
        resource[3]: {entry[0]: entry[1] for entry in resource[4]}["min.insync.replicas"]
        for response in configs
        for resource in response.resources
    }
    assert min_isr == {s.name: "2" for s in specs}


async def test_service_writes_events_and_reads_only_what_it_is_granted(
    kafka_cluster: KafkaCluster, init_topics: tuple[int, str]
) -> None:
    assert init_topics[0] == 0
    service = role_settings(kafka_cluster, "service")
    names = service.topics()
    event = retrieval_event(service, f"q-{uuid.uuid4().hex}")

    # the product's publisher, as a service runs it: acknowledged by 2+ in-sync replicas (acks=all)
    async with EventPublisher(kafka_cluster.bootstrap, service) as publisher:
        await publisher.publish(event)
        assert await publisher.flush(30.0)

    # the operator reads every product topic: the event is there
    operator = role_settings(kafka_cluster, "operator")
    seen = await kafka.read_all(kafka_cluster.bootstrap, operator, names.retrieval_events.name)
    assert event.event_id in {decode_retrieval_event(m.value, service.limits()).event_id for m in seen}

    # the service may read the model topic, not the events it writes
    allowed = await read_one(kafka_cluster, service, names.policy_checkpoints.name)
    assert allowed is None
    denied = await read_one(kafka_cluster, service, names.retrieval_events.name)
    assert isinstance(denied, TopicAuthorizationFailedError), denied

    # nor write what only operators, the worker and the learner write
    for topic in (names.control.name, names.policy_checkpoints.name, names.experiences.name):
        with pytest.raises(TopicAuthorizationFailedError):
            await send_one(kafka_cluster, service, topic)


async def test_unauthenticated_and_wrong_password_are_refused(kafka_cluster: KafkaCluster) -> None:
    plaintext = Settings.from_env({"CAUSALMEM_BOOTSTRAP": kafka_cluster.bootstrap})
    with pytest.raises(KafkaConnectionError):
        await start_admin(kafka_cluster.bootstrap, plaintext)

    wrong = kafka_cluster.env("service")
    wrong["CAUSALMEM_KAFKA_SASL_PASSWORD"] = "not-the-password"
    with pytest.raises(KafkaError):
        await start_admin(kafka_cluster.bootstrap, Settings.from_env(wrong))

    unknown = kafka_cluster.env("service")
    unknown["CAUSALMEM_KAFKA_SASL_USERNAME"] = "causalmem-nobody"
    with pytest.raises(KafkaError):
        await start_admin(kafka_cluster.bootstrap, Settings.from_env(unknown))


async def test_labeler_cannot_write_control_or_checkpoints(
    kafka_cluster: KafkaCluster, init_topics: tuple[int, str]
) -> None:
    assert init_topics[0] == 0
    labeler = role_settings(kafka_cluster, "labeler")
    names = labeler.topics()
    await send_one(kafka_cluster, labeler, names.human_labels.name)  # what a labeler may write
    for topic in (names.control.name, names.policy_checkpoints.name):
        with pytest.raises(TopicAuthorizationFailedError):
            await send_one(kafka_cluster, labeler, topic)


# deploy/kafka/acls.sh's table, as its header documents it: the product topics each role writes
# and reads (besides these, every role reads ``epoch`` and describes every topic).
WRITES: dict[str, set[str]] = {
    "service": {"retrieval-events", "llm-feedback", "memory-writes", "memory-lifecycle"},
    "labeler": {"human-labels"},
    "operator": {"control", "epoch"},
    "worker": {"outcomes", "experiences", "active-learning", "rating-pairs", "dead-letter", "control"},
    "learner": {"policy-checkpoints", "dead-letter"},
    "evaluator": {"llm-feedback", "dead-letter"},
    "writes": {"memory-writes-rejected", "memory-lifecycle", "dead-letter"},
    "ui": {"human-labels"},
}
EVERY_TOPIC = {t.name for t in Settings().topics().all()}
READS: dict[str, set[str]] = {
    "service": {"policy-checkpoints", "memory-lifecycle"},
    "labeler": {"active-learning", "human-labels"},
    "operator": EVERY_TOPIC,
    "worker": {"retrieval-events", "llm-feedback", "human-labels", "outcomes", "rating-pairs"},
    "learner": {"experiences", "control", "policy-checkpoints", "memory-lifecycle"},
    "evaluator": {"retrieval-events"},
    "writes": {"memory-writes"},
    "ui": {"retrieval-events", "experiences", "human-labels", "active-learning", "policy-checkpoints", "dead-letter"},
}


async def test_each_role_writes_and_reads_what_acls_sh_documents_and_nothing_else(
    kafka_cluster: KafkaCluster, init_topics: tuple[int, str]
) -> None:
    """The whole matrix, role × product topic × write/read (8 × 14 × 2 cases), against the ACLs
    deploy/kafka/acls.sh applied; only the operator may create the product's topics, and no role
    any other (the worker's faust topics aside, under its own prefix). Last in the module:
    it writes a record into every topic a role may write."""
    assert init_topics[0] == 0
    assert set(WRITES) == set(READS) == set(ROLES)

    async def check(role: str) -> list[str]:
        wrong: list[str] = []
        s = role_settings(kafka_cluster, role)
        assert s.topic_prefix == ""  # the cluster's ACLs name the topics without a prefix
        writable = await may_write(kafka_cluster, s, sorted(EVERY_TOPIC))
        readable = await may_read(kafka_cluster, s, sorted(EVERY_TOPIC))
        for topic in sorted(EVERY_TOPIC):
            if writable[topic] != (topic in WRITES[role]):
                wrong.append(f"{role} {'may' if writable[topic] else 'may not'} write {topic}")
            expected_read = topic in READS[role] or topic == "epoch"
            if readable[topic] != expected_read:
                wrong.append(f"{role} {'may' if readable[topic] else 'may not'} read {topic}")
        if await may_create(kafka_cluster, s, f"acl-matrix-{role}-{uuid.uuid4().hex[:6]}"):
            wrong.append(f"{role} may create a topic the product does not have")
        created = await may_create(kafka_cluster, s, s.topics().retrieval_events.name)
        if created != (role == "operator"):
            wrong.append(f"{role} {'may' if created else 'may not'} create the product's topics")
        return wrong

    wrong = [w for found in await asyncio.gather(*(check(role) for role in ROLES)) for w in found]  # roles at once
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------- helpers


async def may_write(cluster: KafkaCluster, settings: Settings, topics: list[str]) -> dict[str, bool]:
    """Per topic, whether the broker acknowledged one record (False: refused as unauthorized)."""
    out: dict[str, bool] = {}
    producer = kafka.producer(cluster.bootstrap, settings, request_timeout_ms=10_000)
    await producer.start()
    try:
        for topic in topics:
            try:
                await producer.send_and_wait(topic, b"{}", key=b"acl-matrix", partition=0)
                out[topic] = True
            except TopicAuthorizationFailedError:
                out[topic] = False
    finally:
        await producer.stop()
    return out


async def may_read(cluster: KafkaCluster, settings: Settings, topics: list[str]) -> dict[str, bool]:
    """Per topic, whether a fetch of partition 0 answered (False: refused as unauthorized)."""
    out: dict[str, bool] = {}
    consumer = kafka.consumer(cluster.bootstrap, settings)
    await consumer.start()
    try:
        for topic in topics:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            try:
                await consumer.seek_to_beginning(tp)
                for _ in range(40):  # until a fetch response gives the high watermark (10 s at most)
                    await consumer.getmany(tp, timeout_ms=250, max_records=1)
                    if consumer.highwater(tp) is not None:
                        out[topic] = True
                        break
                else:
                    raise AssertionError(f"{topic}: neither fetched nor refused within 10 s")
            except TopicAuthorizationFailedError:
                out[topic] = False
    finally:
        await consumer.stop()
    return out


async def may_create(cluster: KafkaCluster, settings: Settings, topic: str) -> bool:
    """Whether the broker lets ``settings``'s user create ``topic`` (one that exists already
    answers "exists" only to a user that may create it: authorization is checked first)."""
    client: AIOKafkaAdminClient = kafka.admin(cluster.bootstrap, settings)
    await client.start()
    try:
        resp = await client.create_topics([NewTopic(topic, num_partitions=1, replication_factor=3)])
    finally:
        await client.close()
    (code,) = {int(t[1]) for t in resp.topic_errors}
    if code in (0, TopicAlreadyExistsError.errno):
        return True
    assert code == TopicAuthorizationFailedError.errno, resp
    return False


async def start_admin(bootstrap: str, settings: Settings) -> None:
    client: AIOKafkaAdminClient = kafka.admin(bootstrap, settings)
    try:
        await client.start()
        await client.list_topics()
    finally:
        await client.close()


async def send_one(cluster: KafkaCluster, settings: Settings, topic: str) -> None:
    producer = kafka.producer(cluster.bootstrap, settings, request_timeout_ms=10_000)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"{}", key=b"k", partition=0)
    finally:
        await producer.stop()


async def read_one(cluster: KafkaCluster, settings: Settings, topic: str) -> KafkaError | None:
    """Fetch partition 0 of ``topic`` from its start (no group) for up to 3 s: the error, or None."""
    consumer = kafka.consumer(cluster.bootstrap, settings)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        try:
            await consumer.getmany(tp, timeout_ms=3000)
        except KafkaError as exc:
            return exc
        return None
    finally:
        await consumer.stop()
