"""Kafka clients configured for this product, on Apache Kafka and on the embedded broker.

Every client is made here so that DESIGN §8's settings and the SASL/TLS configuration
reach all of them:

- group timeouts: the embedded broker holds a JoinGroup reply for session_timeout/2, so
  a 6 s session (1 s heartbeat) makes a consumer start within ~3 s;
- no idempotent producer and no transactions (the embedded broker rejects
  InitProducerId): delivery is at-least-once, processing is idempotent (dedupe on ids,
  offsets in checkpoint manifests);
- positions come from fetch high watermarks, never from ``end_offsets`` (wrong there).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from pipeline.config import KafkaSecurity, Settings
from topics.names import TopicSpec

log = logging.getLogger(__name__)

SESSION_TIMEOUT_MS = 6000
HEARTBEAT_INTERVAL_MS = 1000
MAX_REQUEST_BYTES = 2 * 1024 * 1024


def security_kwargs(sec: KafkaSecurity) -> dict[str, Any]:
    """aiokafka keyword arguments for SASL/TLS (empty for PLAINTEXT)."""
    out: dict[str, Any] = {"security_protocol": sec.security_protocol}
    if "SSL" in sec.security_protocol:
        out["ssl_context"] = ssl_context(sec)
    if sec.security_protocol.startswith("SASL"):
        out["sasl_mechanism"] = sec.sasl_mechanism or "PLAIN"
        out["sasl_plain_username"] = sec.sasl_username
        out["sasl_plain_password"] = sec.sasl_password
    return out


def ssl_context(sec: KafkaSecurity) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=sec.ssl_cafile)
    if sec.ssl_certfile:
        ctx.load_cert_chain(sec.ssl_certfile, sec.ssl_keyfile)
    return ctx


def faust_credentials(sec: KafkaSecurity) -> Any:
    """The same settings as faust ``broker_credentials`` (None for PLAINTEXT)."""
    import faust

    if sec.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        return faust.SASLCredentials(
            username=sec.sasl_username,
            password=sec.sasl_password,
            mechanism=sec.sasl_mechanism or "PLAIN",
            ssl_context=ssl_context(sec) if sec.security_protocol == "SASL_SSL" else None,
        )
    if sec.security_protocol == "SSL":
        return faust.SSLCredentials(ssl_context(sec))
    return None


def producer(bootstrap: str, settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    kwargs: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "acks": "all",
        "enable_idempotence": False,  # the embedded broker rejects InitProducerId (DESIGN §8)
        "linger_ms": 5,
        "max_batch_size": 262144,
        "max_request_size": MAX_REQUEST_BYTES,
        "client_id": "causalmem",
        **security_kwargs(settings.security),
    }
    kwargs.update(overrides)
    return AIOKafkaProducer(**kwargs)


def consumer(bootstrap: str, settings: Settings, *topics: str, **overrides: Any) -> AIOKafkaConsumer:
    kwargs: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "session_timeout_ms": SESSION_TIMEOUT_MS,
        "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS,
        "max_partition_fetch_bytes": MAX_REQUEST_BYTES,
        "fetch_max_bytes": 16 * MAX_REQUEST_BYTES,
        "client_id": "causalmem",
        **security_kwargs(settings.security),
    }
    kwargs.update(overrides)
    return AIOKafkaConsumer(*topics, **kwargs)


def admin(bootstrap: str, settings: Settings) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, client_id="causalmem-admin", **security_kwargs(settings.security)
    )


async def create_topics(bootstrap: str, settings: Settings, specs: list[TopicSpec] | None = None) -> dict[str, str]:
    """Create the product's topics (idempotent). Returns ``{name: "created"|"exists"|error}``.

    Topics must exist before any client asks for metadata: the embedded broker would
    auto-create them with 4 partitions, breaking co-partitioning.
    """
    specs = specs if specs is not None else settings.topics().all()
    client = admin(bootstrap, settings)
    await client.start()
    result: dict[str, str] = {}
    try:
        existing = set(await client.list_topics())
        todo = [s for s in specs if s.name not in existing]
        for s in specs:
            if s.name in existing:
                result[s.name] = "exists"
        if todo:
            try:
                resp = await client.create_topics(
                    [NewTopic(s.name, s.partitions, 1, topic_configs=s.configs) for s in todo]
                )
                errors = {t[0]: t[1] for t in getattr(resp, "topic_errors", [])}
            except TopicAlreadyExistsError:
                errors = {}
            for s in todo:
                code = errors.get(s.name, 0)
                result[s.name] = "created" if code in (0, 36) else f"error {code}"
        # Verify partition counts: a topic auto-created earlier may have the wrong number.
        described = await client.describe_topics([s.name for s in specs])
        counts = {d["topic"]: len(d["partitions"]) for d in described}
        for s in specs:
            if counts.get(s.name) not in (None, s.partitions):
                result[s.name] = f"wrong partition count {counts[s.name]} (want {s.partitions})"
    finally:
        await client.close()
    return result


async def wait_for_broker(bootstrap: str, settings: Settings, timeout: float = 30.0) -> None:
    """Return once the broker answers a metadata request; raise TimeoutError otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Exception | None = None
    while loop.time() < deadline:
        client = admin(bootstrap, settings)
        try:
            await asyncio.wait_for(client.start(), timeout=5)
            await client.list_topics()
            return
        except (TimeoutError, KafkaError, OSError) as exc:
            last = exc
        finally:
            try:
                await client.close()
            except Exception:
                pass
        await asyncio.sleep(0.3)
    raise TimeoutError(f"no Kafka broker answered at {bootstrap} within {timeout:.0f} s ({last!r})")


async def high_watermark(bootstrap: str, settings: Settings, topic: str, partition: int = 0) -> int:
    """The log-end offset of a partition, from a fetch response (DESIGN §8: not end_offsets)."""
    c = consumer(bootstrap, settings, group_id=None)
    await c.start()
    try:
        tp = TopicPartition(topic, partition)
        c.assign([tp])
        await c.seek_to_beginning(tp)
        for _ in range(20):
            await c.getmany(tp, timeout_ms=250, max_records=1)
            hw = c.highwater(tp)
            if hw is not None:
                return int(hw)
        return 0
    finally:
        await c.stop()


async def read_all(
    bootstrap: str,
    settings: Settings,
    topic: str,
    partitions: list[int] | None = None,
    start: dict[int, int] | None = None,
    idle_s: float = 1.0,
) -> list[Any]:
    """Read a topic from the beginning (or ``start``) to its current high watermark.

    Uses fetch high watermarks (DESIGN §8: ``end_offsets`` is wrong on the embedded
    broker). Returns the records in offset order per partition.
    """
    c = consumer(bootstrap, settings, group_id=None, auto_offset_reset="earliest")
    await c.start()
    try:
        if partitions is None:
            parts = c.partitions_for_topic(topic)
            if parts is None:
                await c._client.force_metadata_update()
                parts = c.partitions_for_topic(topic) or set()
            partitions = sorted(parts)
        tps = [TopicPartition(topic, p) for p in partitions]
        if not tps:
            return []
        c.assign(tps)
        for tp in tps:
            if start and tp.partition in start:
                c.seek(tp, start[tp.partition])
            else:
                await c.seek_to_beginning(tp)
        out: list[Any] = []
        done: set[int] = set()
        loop = asyncio.get_running_loop()
        last_data = loop.time()
        while len(done) < len(tps):
            batch = await c.getmany(*tps, timeout_ms=200)
            for msgs in batch.values():
                out.extend(msgs)
                if msgs:
                    last_data = loop.time()
            for tp in tps:
                hw = c.highwater(tp)
                if hw is not None and await c.position(tp) >= hw:
                    done.add(tp.partition)
            if loop.time() - last_data > idle_s and all(
                c.highwater(tp) is None for tp in tps if tp.partition not in done
            ):
                break  # empty partitions report no watermark until a fetch returns
        return out
    finally:
        await c.stop()
