"""A consume → process → publish stage in a consumer group, committed after its outputs.

The evaluator and the write gate share this loop: read up to ``batch_size`` records from one
input topic (waiting ``linger_s`` at most for a partial batch), hand them to the subclass's
:meth:`BatchStage.process`, which publishes and then calls :meth:`BatchStage.commit` once
the broker acknowledged the batch's outputs (at-least-once). A batch that fails is read
again from the committed offsets; a fetch that fails is retried. Consumer lag of the owned
partitions is exported after every batch.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from typing import Any, Protocol

from aiokafka import ConsumerRebalanceListener, TopicPartition
from prometheus_client import Gauge, Histogram

from pipeline import kafka
from pipeline.config import Connection
from pipeline.deadletter import DeadLetterWriter
from pipeline.metrics import Metrics
from pipeline.service import Service

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 1.0  # after a failed batch, before reading it again


class StageConfig(Protocol):
    """What the loop reads of a stage's configuration."""

    @property
    def connection(self) -> Connection: ...
    @property
    def group_id(self) -> str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def linger_s(self) -> float: ...


class BatchStage(Service, abc.ABC):
    """The loop of a batch stage (``start`` / ``run`` / ``stop``, or ``async with``).

    Parameters
    ----------
    config
        The stage's configuration (connection, consumer group, batch size, linger).
    bootstrap
        Kafka bootstrap ``HOST:PORT``.
    metrics
        The process's metrics (dead letters, input counts, lag).
    name
        The stage's name in logs.
    input_topic
        The topic it consumes.
    partitions_owned, batch_seconds
        The stage's own gauge of owned partitions and histogram of batch durations.
    """

    def __init__(
        self,
        config: StageConfig,
        bootstrap: str,
        metrics: Metrics,
        name: str,
        input_topic: str,
        partitions_owned: Gauge,
        batch_seconds: Histogram,
    ) -> None:
        super().__init__()
        self.stage_config = config
        self.bootstrap = bootstrap
        self.metrics = metrics
        self.name = name
        self.input_topic = input_topic
        self.topics = config.connection.topics
        self.limits = config.connection.limits
        self.partitions_owned = partitions_owned
        self._batch_seconds = batch_seconds
        self.positions: dict[TopicPartition, int] = {}  # next offset to read, per owned partition
        self.ready = asyncio.Event()
        self._consumer: Any = None
        self._producer: Any = None
        self._dead: DeadLetterWriter | None = None
        self._stopping = asyncio.Event()

    @abc.abstractmethod
    async def process(self, records: list[Any]) -> Any:
        """Handle one batch: publish its outputs, await their acknowledgement, then :meth:`commit`."""

    # ------------------------------------------------------------------ lifecycle
    async def _start(self) -> None:
        conn, c = self.stage_config.connection, self.stage_config
        self._stopping.clear()
        self._producer = await kafka.start_producer(self.bootstrap, conn)
        self._dead = DeadLetterWriter(self._producer, self.topics.dead_letter.name, self.metrics)
        self._consumer = kafka.consumer(self.bootstrap, conn, group_id=c.group_id, max_poll_records=c.batch_size)
        self._consumer.subscribe([self.input_topic], listener=_Rebalance(self))
        await self._consumer.start()

    async def _stop(self) -> None:
        self._stopping.set()
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def run(self) -> None:
        """Consume, process and publish until :meth:`stop`. Never raises on bad input."""
        while not self._stopping.is_set() and self._consumer is not None:
            try:
                records = await self._gather()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker hiccups: keep going
                log.warning("%s: fetch failed: %r", self.name, exc)
                await asyncio.sleep(0.5)
                continue
            if records:
                t0 = time.perf_counter()
                try:
                    await self.process(records)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # nothing committed past the batch: read it again
                    log.error("%s: batch failed (%r); reading it again from the committed offsets", self.name, exc)
                    await asyncio.sleep(RETRY_PAUSE_S)
                    await self.rewind()
                    continue
                self._batch_seconds.observe(time.perf_counter() - t0)
            self._export_lag()

    async def _gather(self) -> list[Any]:
        """Up to ``batch_size`` records: what is there, plus ``linger_s`` of waiting for more."""
        c, want = self._consumer, self.stage_config.batch_size
        records: list[Any] = []
        deadline: float | None = None
        while len(records) < want and not self._stopping.is_set():
            wait_s = 0.2 if deadline is None else deadline - time.monotonic()
            if wait_s <= 0:
                break
            got = await c.getmany(timeout_ms=int(wait_s * 1000), max_records=want - len(records))
            if c.assignment():
                self.ready.set()
            for messages in got.values():
                records.extend(messages)
            if records and deadline is None:
                deadline = time.monotonic() + self.stage_config.linger_s
            elif not records:
                break  # nothing waiting: let the caller export lag and check for stop
        return records

    # ------------------------------------------------------------------ offsets
    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Record the batch's positions and commit them (call once its outputs are acknowledged)."""
        self.positions.update(offsets)
        owned = self._consumer.assignment() if self._consumer else set()
        offsets = {tp: off for tp, off in offsets.items() if tp in owned}
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except Exception as exc:  # a rebalance in progress: the next owner reads the batch again
            log.info("%s: commit skipped: %r", self.name, exc)

    async def rewind(self) -> None:
        """Read every owned partition again from its committed offset (after a failed batch)."""
        c = self._consumer
        if c is None:
            return
        with contextlib.suppress(Exception):
            assert self._dead is not None
            await self._dead.flush()
        for tp in c.assignment():
            offset = await c.committed(tp)
            if offset is None:
                await c.seek_to_beginning(tp)
            else:
                c.seek(tp, offset)
            self.positions.pop(tp, None)

    def _export_lag(self) -> None:
        c = self._consumer
        if c is None:
            return
        lag = 0
        for tp in c.assignment():
            hw = c.highwater(tp)
            if hw is not None:
                lag += max(0, hw - self.positions.get(tp, hw))
        self.metrics.consumer_lag.labels(topic=self.input_topic).set(lag)

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.partitions_owned.set(len(assigned))
        for tp in set(self.positions) - assigned:
            self.positions.pop(tp, None)
        log.info("%s: assigned partitions %s", self.name, sorted(tp.partition for tp in assigned))


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, stage: BatchStage) -> None:
        self.stage = stage

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Nothing to flush: each batch is committed before the next fetch, where rebalances happen."""

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.stage.on_assigned(set(assigned))
