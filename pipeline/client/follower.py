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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from aiokafka import TopicPartition

from pipeline import kafka
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
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()

    async def _start(self) -> None:
        self._consumer = kafka.consumer(self.bootstrap, self.conn, group_id=None)
        await self._consumer.start()
        self._consumer.assign([self.tp])
        await self._consumer.seek_to_beginning(self.tp)
        self._task = asyncio.create_task(self._run(), name="memory-follower")

    async def _stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._consumer:
            await self._consumer.stop()
            self._consumer = None

    async def _run(self) -> None:
        while True:
            try:
                batch = await self._consumer.getmany(timeout_ms=500)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("memory follower: fetch failed: %r", exc)
                await asyncio.sleep(1.0)
                continue
            for msgs in batch.values():
                for msg in msgs:
                    self.handle(msg.offset, msg.key, msg.value)
            async with self._changed:
                self._changed.notify_all()

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
        """Wait until everything on the topic when called is applied; returns the position."""
        target = await self._end_offset()

        async def caught_up() -> int:
            async with self._changed:
                await self._changed.wait_for(lambda: self.position >= target)
                return self.position

        return await asyncio.wait_for(caught_up(), timeout)

    async def wait_for(self, memory_id: str, present: bool = True, timeout: float = 30.0) -> None:
        """Wait until ``memory_id`` is (``present``) or is no longer in the retriever's index."""
        memories = self.retriever.memories
        assert memories is not None

        async def ready() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: (memory_id in memories) == present)

        await asyncio.wait_for(ready(), timeout)

    async def _end_offset(self) -> int:
        # A fetch's high watermark: end_offsets is wrong on the embedded broker (docs/contract.md §7).
        for _ in range(100):
            hw = self._consumer.highwater(self.tp)
            if hw is not None:
                return int(hw)
            await asyncio.sleep(0.05)
        return self.position
