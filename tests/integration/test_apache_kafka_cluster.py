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
- a labeler cannot write ``control`` or ``policy-checkpoints``.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from collections.abc import Iterator

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAuthorizationFailedError

from pipeline import cli, kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from tests.helpers import retrieval_event
from tests.kafka_cluster import KafkaCluster
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


# --------------------------------------------------------------------------- helpers


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
