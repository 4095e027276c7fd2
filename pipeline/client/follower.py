"""Client side: :class:`MemoryFollower` keeps a retriever's memories as ``memory-lifecycle`` says.

It reads the lifecycle topic (docs/contract.md §9) from the beginning and follows it: an
``add`` or ``update`` puts the memory in the retriever's index (embedding the text with
the client's ``embed`` function when the record carries no embedding), a ``remove`` takes
it out. Memories are searchable as soon as their record is read; their mask comes from
the policy once a loaded checkpoint holds their row (``LoadedPolicy.slot_of``).

    retriever = CausalRetriever.by_id(dim=384, conn=settings)
    async with PolicySubscriber(bootstrap, conn=settings, on_update=retriever.set_policy,
                                on_canary=retriever.set_canary), \\
               MemoryFollower(bootstrap, retriever, conn=settings, embed=embed) as follower:
        await follower.wait_caught_up()
        result = retriever.retrieve(embed(question), query_id="q1", query_text=question)

A record that fails validation, or whose embedding has the wrong size, is skipped and kept
in :attr:`MemoryFollower.rejections` (the learner dead-letters the same record).

The follower reads on a thread of its own (:class:`~pipeline.client.background.Background`;
the retriever's index is safe to change while searched), so a caller whose event loop is
busy still gets new memories, and ``start`` returns at once without a broker: it connects in
the background with backoff (:meth:`MemoryFollower.health`). ``embed`` is called on that thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.client.background import Background, Backoff, keep_trying
from pipeline.client.retriever import CausalRetriever
from pipeline.config import Connection, Settings
from pipeline.service import Service
from topics.fields import Rejected
from topics.lifecycle import MemoryRecord, decode_memory_record

log = logging.getLogger(__name__)

EmbedFn = Callable[[str], np.ndarray]


class MemoryFollower(Service):
    """Applies ``memory-lifecycle`` records to a :class:`CausalRetriever` built with memory ids.

    Parameters
    ----------
    bootstrap
        The Kafka bootstrap address.
    retriever
        The retriever to keep (``CausalRetriever.by_id`` or one given ``memory_ids``).
    conn
        Topic names and limits (a :class:`~pipeline.config.Connection` or ``Settings``).
    embed
        Text → embedding, for records without one; None: such records are skipped.
    """

    def __init__(
        self,
        bootstrap: str,
        retriever: CausalRetriever,
        conn: Connection | Settings | None = None,
        embed: EmbedFn | None = None,
    ) -> None:
        super().__init__()
        if retriever.memories is None:
            raise TypeError("the retriever numbers its memories by slot: build it with CausalRetriever.by_id")
        self.bootstrap = bootstrap
        self.retriever = retriever
        self.conn = Connection.of(conn)
        self.embed = embed
        self.tp = TopicPartition(self.conn.topics.memory_lifecycle.name, 0)
        self.position = 0
        self.applied = 0
        self.rejections: list[tuple[int, str]] = []
        self._consumer: Any = None  # set on the follower's thread once connected
        self.backoff = Backoff()
        self._bg: Background | None = None

    async def _start(self) -> None:
        self._bg = Background("causalmem-memory-follower")
        self._bg.submit(self._follow())

    async def _stop(self) -> None:
        if self._bg is not None:
            await asyncio.to_thread(self._bg.close)
            self._bg = None
            self._consumer = None

    def health(self) -> str:
        """``"ok"``, or ``"degraded: no broker since …"`` while the lifecycle topic cannot be read."""
        return self.backoff.health()

    async def _connect(self) -> Any:
        async def attempt() -> Any:
            consumer = kafka.consumer(self.bootstrap, self.conn, group_id=None)
            try:
                await consumer.start()
                consumer.assign([self.tp])
                await consumer.seek_to_beginning(self.tp)
            except BaseException:
                await consumer.stop()
                raise
            return consumer

        def failed(exc: BaseException, delay: float) -> None:
            log.warning("memory follower: cannot read %s (%r); retrying in %.1f s", self.tp.topic, exc, delay)

        return await keep_trying(attempt, self.backoff, failed)

    async def _follow(self) -> None:
        consumer = await self._connect()
        self._consumer = consumer
        try:
            while True:
                try:
                    batch = await consumer.getmany(timeout_ms=500)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("memory follower: fetch failed: %r", exc)
                    await asyncio.sleep(self.backoff.failed())
                    continue
                self.backoff.succeeded()
                for msgs in batch.values():
                    for msg in msgs:
                        self.handle(msg.offset, msg.key, msg.value)
        finally:
            await consumer.stop()

    def handle(self, offset: int, key: bytes | None, value: bytes | None) -> None:
        """Apply one lifecycle message (public so tests can feed crafted ones)."""
        self.position = offset + 1
        if value is None:
            return
        try:
            record = decode_memory_record(value, self.conn.limits, key=key)
            self.apply(record)
        except (Rejected, ValueError) as exc:
            why = f"{exc.reason}: {exc.detail}" if isinstance(exc, Rejected) else str(exc)
            self.rejections.append((offset, why))
            log.warning("memory follower: skipped the lifecycle record at offset %d (%s)", offset, why)

    def apply(self, record: MemoryRecord) -> None:
        """Add, replace or remove one memory in the retriever; raises ValueError when it cannot be embedded."""
        if record.op == "remove":
            self.retriever.remove_memory(record.memory_id)
        else:
            embedding = record.embedding
            if embedding is None:
                if self.embed is None or record.text is None:
                    raise ValueError(f"{record.memory_id!r} has no embedding and the follower has no embed function")
                embedding = np.asarray(self.embed(record.text), dtype=np.float32)
            self.retriever.add_memory(record.memory_id, embedding, record.text)
        self.applied += 1

    async def wait_caught_up(self, timeout: float = 30.0) -> int:
        """Wait until everything on the topic when called is applied; returns the position
        (``TimeoutError`` after ``timeout`` s, e.g. while the broker is away)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        target: int | None = None
        while True:
            if target is None and self._consumer is not None and self._bg is not None:
                target = await asyncio.wait_for(self._bg.wait(self._end_offset()), max(0.0, deadline - loop.time()))
            if target is not None and self.position >= target:
                return self.position
            if loop.time() >= deadline:
                raise TimeoutError(f"not caught up with {self.tp.topic} after {timeout} s ({self.health()})")
            await asyncio.sleep(0.02)

    async def wait_for(self, memory_id: str, present: bool = True, timeout: float = 30.0) -> None:
        """Wait until ``memory_id`` is (``present``) or is no longer in the retriever's index."""
        memories = self.retriever.memories
        assert memories is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (memory_id in memories) != present:
            if loop.time() >= deadline:
                where = "not yet in" if present else "still in"
                raise TimeoutError(f"{memory_id!r} {where} the index after {timeout} s")
            await asyncio.sleep(0.02)

    async def _end_offset(self) -> int:
        # A fetch's high watermark: end_offsets is wrong on the embedded broker (docs/contract.md §7).
        for _ in range(100):
            hw = self._consumer.highwater(self.tp) if self._consumer is not None else None
            if hw is not None:
                return int(hw)
            await asyncio.sleep(0.05)
        return self.position
