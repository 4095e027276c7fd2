"""Shared fixtures: a real Kafka-protocol broker for every integration test.

A testcontainers Apache Kafka when a Docker engine answers, else the embedded Tansu
broker. Never a mock of Kafka. Each test gets its own topic prefix, so tests
share one broker without seeing each other's data.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.config import Settings
from tests.kafka_cluster import KafkaCluster, KafkaUnavailable

log = logging.getLogger(__name__)

SHARED_CONTRACT = Path(__file__).resolve().parents[2] / "shared" / "contract"
TEST_CONTRACT = Path(__file__).resolve().parent / "data" / "contract"


@dataclass
class BrokerInfo:
    bootstrap: str
    kind: str  # "testcontainers-kafka" or "embedded-tansu"


def _start_testcontainers_kafka() -> tuple[BrokerInfo, object] | None:
    if os.environ.get("CAUSALMEM_TEST_BROKER", "auto") == "embedded":
        return None
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:  # older testcontainers
        try:
            from testcontainers.kafka import KafkaContainer
        except ImportError:
            return None
    try:
        container = KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft()
        container.start()
    except Exception as exc:  # docker.errors.DockerException without an engine, within ms
        log.info("no Docker engine for testcontainers (%s); using the embedded broker", type(exc).__name__)
        return None
    return BrokerInfo(container.get_bootstrap_server(), "testcontainers-kafka"), container


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerInfo]:
    started = _start_testcontainers_kafka()
    if started is not None:
        info, container = started
        try:
            yield info
        finally:
            container.stop()  # type: ignore[attr-defined]
        return
    from pipeline.broker import EmbeddedBroker

    embedded = EmbeddedBroker(log_path=tmp_path_factory.mktemp("broker") / "broker.log")
    embedded.start()
    try:
        yield BrokerInfo(embedded.bootstrap, "embedded-tansu")
    finally:
        embedded.stop()


@pytest.fixture(scope="module")
def kafka_cluster() -> Iterator[KafkaCluster]:
    """Three Apache Kafka KRaft nodes on loopback, secured as deployed (SASL/SCRAM, the ACLs of
    deploy/kafka/acls.sh, replication 3), for one test module (tests/kafka_cluster.py); skipped,
    with the reason, where Java, Maven or Apache Kafka's jars are missing."""
    cluster = KafkaCluster()
    try:
        cluster.start()
    except KafkaUnavailable as exc:
        pytest.skip(f"no Apache Kafka cluster: {exc}")
    log.info("Apache Kafka %s cluster on %s: %s", cluster.version, cluster.bootstrap, cluster.timings)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def settings(broker: BrokerInfo, tmp_path: Path) -> Settings:
    """Small model, unique topic prefix, private state directory, fast cadence."""
    return Settings(
        bootstrap=broker.bootstrap,
        topic_prefix=f"t{uuid.uuid4().hex[:8]}.",
        partitions=4,
        embedding_dim=8,
        slots=32,
        hidden=16,
        state_dir=str(tmp_path / "state"),
        checkpoint_interval_s=0.5,
        batch_size=8,
        gate=False,  # tests of the gate turn it on
    )


@pytest.fixture
def topics_ready(settings: Settings) -> Settings:
    from pipeline import kafka

    asyncio.run(kafka.create_topics(settings.bootstrap or "", settings))
    return settings


def settings_env(s: Settings) -> dict[str, str]:
    """The environment that gives a child ``causalmem`` process these settings."""
    return {
        "CAUSALMEM_TOPIC_PREFIX": s.topic_prefix,
        "CAUSALMEM_PARTITIONS": str(s.partitions),
        "CAUSALMEM_EMBEDDING_DIM": str(s.embedding_dim),
        "CAUSALMEM_SLOTS": str(s.slots),
        "CAUSALMEM_HIDDEN": str(s.hidden),
        "CAUSALMEM_STATE_DIR": s.state_dir,
        "CAUSALMEM_CHECKPOINT_INTERVAL_S": str(s.checkpoint_interval_s),
        "CAUSALMEM_BATCH_SIZE": str(s.batch_size),
        "CAUSALMEM_JOIN_WINDOW_S": str(s.join_window_s),
        "CAUSALMEM_GATE": "1" if s.gate else "0",
    }


@pytest.fixture
def contract_dir() -> Path:
    """The contract test vectors (docs/contract.md) (the shared copy when present, else the one in tests/data)."""
    return SHARED_CONTRACT if (SHARED_CONTRACT / "vectors.json").exists() else TEST_CONTRACT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that gets the broker (directly or through ``settings``/``topics_ready``) carries
    the ``broker`` mark, so that ``-m "not broker"`` (``make check``) never starts one."""
    unmarked = [
        item.nodeid
        for item in items
        if "broker" in getattr(item, "fixturenames", ()) and item.get_closest_marker("broker") is None
    ]
    if unmarked:
        raise pytest.UsageError("tests that use the broker fixture need @pytest.mark.broker: " + ", ".join(unmarked))
