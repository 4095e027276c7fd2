"""Idempotent producers (``kafka_idempotence``): asked of the broker once, on where granted.

Apache Kafka grants producer ids (tests/integration/test_apache_kafka_flows.py checks that every
batch its processes write names one); the embedded broker refuses them, so ``auto`` (the default)
leaves them off there and the product's producers still deliver.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from aiokafka.errors import KafkaError

from pipeline import kafka
from pipeline.config import KafkaSecurity, Settings

NOWHERE = "127.0.0.1:9"  # nothing listens: connections are refused at once


def with_idempotence(s: Settings, value: str) -> Settings:
    return dataclasses.replace(s, security=dataclasses.replace(s.security, idempotence=value))


def test_the_setting_comes_from_the_environment_and_defaults_to_auto() -> None:
    assert Settings().security.idempotence == "auto"
    assert Settings.from_env({"CAUSALMEM_KAFKA_IDEMPOTENCE": "off"}).security.idempotence == "off"
    assert Settings.from_env({}, kafka_idempotence="on").security.idempotence == "on"


async def test_on_and_off_are_taken_as_said_without_asking_the_broker() -> None:
    s = Settings()
    assert await kafka.idempotence_granted(NOWHERE, with_idempotence(s, "on")) is True
    assert await kafka.idempotence_granted(NOWHERE, with_idempotence(s, "OFF")) is False


async def test_an_unknown_value_is_refused_with_the_variable_named() -> None:
    with pytest.raises(ValueError, match="CAUSALMEM_KAFKA_IDEMPOTENCE='sometimes'"):
        await kafka.idempotence_granted(NOWHERE, with_idempotence(Settings(), "sometimes"))


async def test_an_unreachable_broker_is_no_answer_and_is_asked_again() -> None:
    s = Settings(security=KafkaSecurity(sasl_username=f"nobody-{id(object())}"))
    for _ in range(2):  # not remembered as "refused": the second call asks again, and fails again
        with pytest.raises((KafkaError, OSError, TimeoutError)):
            await kafka.idempotence_granted(NOWHERE, s)


@pytest.mark.broker
async def test_auto_on_the_embedded_broker_is_off_and_the_products_producers_deliver(topics_ready: Settings) -> None:
    s = topics_ready
    assert s.security.idempotence == "auto"
    bootstrap = s.bootstrap or ""
    assert await kafka.idempotence_granted(bootstrap, s) is False
    producer = await kafka.start_producer(bootstrap, s)
    try:
        topic = s.topics().control.name
        md = await asyncio.wait_for(producer.send_and_wait(topic, b"{}", partition=0), 30)
    finally:
        await producer.stop()
    assert md.offset >= 0
