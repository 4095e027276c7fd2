"""Kafka clients configured for this product, on Apache Kafka and on the embedded broker.

Every client is made here so that the settings below (docs/operations.md has the
embedded broker's limits) and the SASL/TLS configuration reach all of them:

- group timeouts: the embedded broker holds a JoinGroup reply for session_timeout/2, so
  a 6 s session (1 s heartbeat) makes a consumer start within ~3 s;
- idempotent producers where the broker grants a producer id (Apache Kafka; the embedded
  broker refuses InitProducerId): setting ``kafka_idempotence``, resolved by
  :func:`idempotence_granted`; no transactions. Delivery is at-least-once, processing is
  idempotent (dedupe on ids, offsets in checkpoint manifests);
- positions come from fetch high watermarks, never from ``end_offsets`` (wrong there).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaError, NoError, TopicAlreadyExistsError, for_code
from aiokafka.protocol.transaction import InitProducerIdRequest

from pipeline.config import Connection, KafkaSecurity, Settings
from pipeline.service import Service
from topics.names import Topics, TopicSpec
from topics.principal import principal_signature
from topics.signing import Key

log = logging.getLogger(__name__)

SESSION_TIMEOUT_MS = 6000
HEARTBEAT_INTERVAL_MS = 1000
MAX_REQUEST_BYTES = 2 * 1024 * 1024
# The batch size of the product's producers, the worker's faust producer too (worker/app.py).
PRODUCER_BATCH_BYTES = 256 * 1024
# How long a producer waits to fill a batch; longer for the high-volume outputs (the join's
# experiences, a client's events), where fuller batches matter more than the milliseconds.
LINGER_MS = 5
BULK_LINGER_MS = 10


def _topics(conn: Connection | Settings) -> Topics:
    return Connection.of(conn).topics


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


IDEMPOTENCE_CHOICES = ("auto", "on", "off")
PROBE_TIMEOUT_S = 30.0
# What each broker answered to InitProducerId, per (bootstrap, SASL user): asked once a process.
_granted: dict[tuple[str, str | None], bool] = {}


async def idempotence_granted(bootstrap: str, settings: Connection | Settings) -> bool:
    """Whether this process's producers for ``bootstrap`` are idempotent (``kafka_idempotence``).

    ``on`` and ``off`` say so; ``auto`` (the default) asks the broker once for a producer id
    and remembers its answer: Apache Kafka grants one, the embedded broker refuses
    (UnknownServerError). Neither a broker that cannot be reached nor a retriable refusal
    that lasts :data:`PROBE_TIMEOUT_S` is an answer: the probe raises (``KafkaError``,
    ``OSError``, ``TimeoutError``) and the next call asks again.
    """
    sec = Connection.of(settings).security
    choice = (sec.idempotence or "auto").lower()
    if choice not in IDEMPOTENCE_CHOICES:
        raise ValueError(f"CAUSALMEM_KAFKA_IDEMPOTENCE={sec.idempotence!r}: one of {', '.join(IDEMPOTENCE_CHOICES)}")
    if choice != "auto":
        return choice == "on"
    key = (bootstrap, sec.sasl_username)
    if key not in _granted:
        _granted[key], answer = await asyncio.wait_for(_ask_producer_id(bootstrap, sec), PROBE_TIMEOUT_S)
        verdict = "on" if _granted[key] else f"off: the broker refuses InitProducerId ({answer})"
        log.info("idempotent producers %s (%s)", verdict, bootstrap)
    return _granted[key]


async def _ask_producer_id(bootstrap: str, sec: KafkaSecurity) -> tuple[bool, str]:
    """(granted, the broker's answer). A retriable refusal (a producer id block not yet
    allocated right after a cluster starts: COORDINATOR_LOAD_IN_PROGRESS) is asked again."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap, client_id="causalmem", **security_kwargs(sec))
    try:
        await client.bootstrap()
        while True:
            node = client.get_random_node()
            if node is None:
                raise KafkaError("no broker in the metadata")
            # No transactional id: the id an idempotent producer asks for (any broker answers it).
            resp = await client.send(node, InitProducerIdRequest(None, 60_000))
            error = for_code(int(resp.error_code))
            if error is NoError:
                return True, "granted"
            if not error.retriable:
                return False, error.__name__
            await asyncio.sleep(0.5)
    finally:
        await client.close()


async def start_producer(bootstrap: str, settings: Connection | Settings, **overrides: Any) -> AIOKafkaProducer:
    """A started :func:`producer`, idempotent as :func:`idempotence_granted` says: how the
    product's processes make theirs."""
    p = producer(bootstrap, settings, idempotent=await idempotence_granted(bootstrap, settings), **overrides)
    try:
        await p.start()
    except BaseException:
        await p.stop()  # its connections and sender task, even when start did not finish
        raise
    return p


async def send_control(bootstrap: str, conn: Connection, value: bytes, key: Key | None = None) -> None:
    """Write one ``control`` command (partition 0, the learner's order) and wait for the broker's
    acknowledgement; with ``key``, signed (contract 1.16's header, proving ``details.by``)."""
    headers = [principal_signature(value, key)] if key is not None else None
    p = await start_producer(bootstrap, conn)
    try:
        await (await p.send(conn.topics.control.name, value, partition=0, headers=headers))
    finally:
        await p.stop()


def producer(
    bootstrap: str, settings: Connection | Settings, *, idempotent: bool = False, **overrides: Any
) -> AIOKafkaProducer:
    """A producer with the product's settings, not started; idempotent only when asked
    (:func:`start_producer` asks the setting)."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "acks": "all",
        "enable_idempotence": idempotent,
        "linger_ms": LINGER_MS,
        "max_batch_size": PRODUCER_BATCH_BYTES,
        "max_request_size": MAX_REQUEST_BYTES,
        "client_id": "causalmem",
        **security_kwargs(settings.security),
    }
    kwargs.update(overrides)
    return AIOKafkaProducer(**kwargs)


def consumer(bootstrap: str, settings: Connection | Settings, *topics: str, **overrides: Any) -> AIOKafkaConsumer:
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


def admin(bootstrap: str, settings: Connection | Settings) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, client_id="causalmem-admin", **security_kwargs(settings.security)
    )


async def create_topics(
    bootstrap: str, settings: Connection | Settings, specs: list[TopicSpec] | None = None, attempts: int = 3
) -> dict[str, str]:
    """Create the product's topics (idempotent). Returns ``{name: "created"|"exists"|"repaired"|error}``.

    Topics must exist before any client asks for metadata: the embedded broker would
    auto-create them with 4 partitions, breaking co-partitioning. An *empty* topic with
    the wrong partition count (auto-created after an embedded broker restart) is deleted
    and created again; a non-empty one is reported, never touched. A client asking for
    the topic between the deletion and the creation auto-creates it again: the repair is
    then tried again (``attempts`` in all) while the topic is still empty.
    """
    specs = specs if specs is not None else _topics(settings).all()
    for _ in range(attempts - 1):
        result = await _create_topics(bootstrap, settings, specs)
        if not any(v.startswith("wrong partition count") for v in result.values()):
            return result
    return await _create_topics(bootstrap, settings, specs)


async def _create_topics(bootstrap: str, settings: Connection | Settings, specs: list[TopicSpec]) -> dict[str, str]:
    client = admin(bootstrap, settings)
    await client.start()
    result: dict[str, str] = {}
    try:
        existing = set(await client.list_topics())
        if existing:
            described = await client.describe_topics([s.name for s in specs if s.name in existing])
            counts = {d["topic"]: len(d["partitions"]) for d in described}
            wrong = [s for s in specs if counts.get(s.name, s.partitions) != s.partitions]
            repairable = [s for s in wrong if await _is_empty(bootstrap, settings, s.name, counts[s.name])]
            if repairable:
                await client.delete_topics([s.name for s in repairable])
                existing -= {s.name for s in repairable}
                await asyncio.sleep(0.5)
            for s in repairable:
                result[s.name] = "repaired"
        todo = [s for s in specs if s.name not in existing]
        for s in specs:
            if s.name in existing:
                result[s.name] = "exists"
        if todo:
            try:
                resp = await client.create_topics(
                    [NewTopic(s.name, s.partitions, s.replication, topic_configs=s.configs) for s in todo]
                )
                errors = {t[0]: t[1] for t in getattr(resp, "topic_errors", [])}
            except TopicAlreadyExistsError:
                errors = {}
            for s in todo:
                code = errors.get(s.name, 0)
                ok = code in (0, 36)
                result[s.name] = result.get(s.name, "created") if ok else f"error {code}"
        described = await client.describe_topics([s.name for s in specs])
        counts = {d["topic"]: len(d["partitions"]) for d in described}
        for s in specs:
            if counts.get(s.name) not in (None, s.partitions):
                result[s.name] = f"wrong partition count {counts[s.name]} (want {s.partitions})"
    finally:
        await client.close()
    epoch = _topics(settings).epoch
    if any(s.name == epoch.name for s in specs) and result.get(epoch.name) in ("created", "exists", "repaired"):
        await _mark_epoch(bootstrap, settings, epoch.name)
    return result


async def _is_empty(bootstrap: str, settings: Connection | Settings, topic: str, partitions: int) -> bool:
    """True only when every partition answered a fetch with high watermark 0 (a topic that
    does not answer, e.g. a leaderless partition, is not known to be empty)."""
    for p in range(partitions):
        if await answered_high_watermark(bootstrap, settings, topic, p) != 0:
            return False
    return True


async def _mark_epoch(bootstrap: str, settings: Connection | Settings, topic: str) -> None:
    if await high_watermark(bootstrap, settings, topic) > 0:
        return
    import time

    import orjson

    p = await start_producer(bootstrap, settings)
    try:
        value = orjson.dumps({"schema": "epoch/v1", "created_ts": time.time()})
        await (await p.send(topic, value, key=b"epoch", partition=0))
    finally:
        await p.stop()


async def wait_for_broker(bootstrap: str, settings: Connection | Settings, timeout: float = 30.0) -> None:
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


async def high_watermark(bootstrap: str, settings: Connection | Settings, topic: str, partition: int = 0) -> int:
    """The log-end offset of a partition, from a fetch response (not ``end_offsets``: wrong on
    the embedded broker); 0 when no fetch answered within 5 s."""
    hw = await answered_high_watermark(bootstrap, settings, topic, partition)
    return 0 if hw is None else hw


async def answered_high_watermark(
    bootstrap: str, settings: Connection | Settings, topic: str, partition: int = 0, wait_s: float = 5.0
) -> int | None:
    """The log-end offset of a partition from a fetch response, or None when none answered
    within ``wait_s`` (no leader, broker unreachable): silence is not an empty partition."""
    c = consumer(bootstrap, settings, group_id=None)
    try:
        await c.start()
        return await _fetched_high_watermark(c, topic, partition, wait_s)
    finally:
        await c.stop()


async def _fetched_high_watermark(c: AIOKafkaConsumer, topic: str, partition: int, wait_s: float) -> int | None:
    tp = TopicPartition(topic, partition)
    c.assign([tp])
    await c.seek_to_beginning(tp)
    for _ in range(max(1, int(wait_s / 0.25))):
        await c.getmany(tp, timeout_ms=250, max_records=1)
        hw = c.highwater(tp)
        if hw is not None:
            return int(hw)
    return None


async def epoch_marker_state(bootstrap: str, settings: Connection | Settings, topic: str) -> str:
    """What the broker *answers* about the epoch marker topic: ``"held"`` (it holds the marker),
    ``"missing"`` (a metadata response lists the cluster's topics without it), ``"empty"`` (a
    fetch answered with high watermark 0), or ``"unknown"`` (no answer: unreachable, no leader,
    a timeout). Only ``missing`` and ``empty`` say the cluster lost its data.
    """
    c = consumer(bootstrap, settings, group_id=None)
    try:
        await c.start()
        if topic not in await c.topics():  # a metadata response; KafkaError when none answers
            return "missing"
        hw = await _fetched_high_watermark(c, topic, 0, 5.0)
    except (TimeoutError, KafkaError, OSError):
        return "unknown"
    finally:
        await c.stop()
    if hw is None:
        return "unknown"
    return "held" if hw > 0 else "empty"


async def read_all(
    bootstrap: str,
    settings: Connection | Settings,
    topic: str,
    partitions: list[int] | None = None,
    start: dict[int, int] | None = None,
    idle_s: float = 1.0,
) -> list[Any]:
    """Read a topic from the beginning (or ``start``) to its current high watermark.

    Uses fetch high watermarks (``end_offsets`` is wrong on the embedded broker).
    Returns the records in offset order per partition.
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


class ClusterWatch(Service):
    """Notices a Kafka cluster that lost the product's topics (docs/operations.md).

    An embedded broker keeps everything in memory: after a restart every topic, group and
    offset is gone, and clients reconnect without an error while keeping positions that no
    longer exist, so they may silently skip new messages. The watch lists the topics every
    ``interval`` seconds; once they had all existed, any of them missing means the cluster
    was reset, and ``on_reset(missing)`` is called (once per reset).

    Only a broker's answer counts as a loss: the epoch topic absent from a metadata
    response, or its partition fetched empty after it held the marker. Silence (a timeout,
    an unreachable broker, a partition without a leader while a replicated cluster elects
    one) is not a loss: restarting every process would not help, so the watch looks again.
    """

    def __init__(
        self,
        bootstrap: str,
        settings: Connection | Settings,
        topics: list[str],
        on_reset: Any,
        metrics: Any = None,
        interval: float = 3.0,
        marker_seen: bool = False,
    ) -> None:
        super().__init__()
        self.bootstrap = bootstrap
        self.settings = settings
        self.topics = topics
        self.on_reset = on_reset
        self.metrics = metrics
        self.interval = interval
        self.resets = 0
        # True when the caller has just made sure the topics (and the marker) exist.
        self._seen_all = marker_seen

        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def _start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="cluster-watch")

    async def _stop(self) -> None:
        if self._task is not None:
            # The flag too: on Python 3.11, wait_for may swallow a cancellation that comes
            # as its inner call finishes, and the loop would then go on forever.
            self._stopping = True
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def check(self) -> list[str] | None:
        """One look: the lost topics if the cluster was reset, else None.

        Topics cannot be trusted to vanish: the embedded broker re-creates any topic a
        client asks about. The epoch topic's marker message can: an epoch topic that the
        broker says is empty or absent, after it held the marker, means the cluster lost
        everything. No answer means nothing.
        """
        epoch = _topics(self.settings).epoch.name
        try:
            state = await asyncio.wait_for(epoch_marker_state(self.bootstrap, self.settings, epoch), timeout=15)
        except (TimeoutError, KafkaError, OSError):
            state = "unknown"
        log.debug("cluster watch: %s is %s", epoch, state)
        if state == "held":
            self._seen_all = True
            return None
        if state == "unknown":
            return None  # no answer (unreachable, restarting, leaderless): look again later
        if self._seen_all:
            self._seen_all = False
            return list(self.topics)
        return None

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval)
            try:
                missing = await self.check()
            except Exception as exc:  # the watch must outlive any broker weirdness
                log.debug("cluster watch: check failed: %r", exc)
                continue

            if missing is None or self._stopping:
                continue
            self.resets += 1
            if self.metrics is not None:
                self.metrics.cluster_resets.inc()
            log.error(
                "Kafka cluster reset detected: topics %s are gone (an embedded broker restart loses "
                "every topic, group and offset)",
                ", ".join(sorted(missing)[:5]),
            )
            result = self.on_reset(missing)
            if asyncio.iscoroutine(result):
                await result
