"""Where faust's table recovery stops: the changelog's end from a fetch, not from ``end_offsets``.

faust rebuilds a table partition by reading its changelog up to the "highwater" it asks
the broker for with ``end_offsets`` (ListOffsets, latest). The embedded broker answers
that with the *first* offset of the partition's last record batch + 1, not the log end.
A changelog's last batch usually holds many table writes (the producer batches them), so
recovery stopped after the first of them and the table silently lacked the rest: after a
crash or a takeover, a stage then built on a table without those updates (a query's
U_query restarted from its later steps only; verdicts were missing, so error samples
waited for a verdict that had already come). Apache Kafka answers the log end; there
this costs one small fetch per changelog partition at each recovery.

:class:`WatermarkConsumer` is faust's aiokafka consumer whose ``highwaters`` are the
larger of ``end_offsets`` and the high watermark of a fetch response (the log end on
both brokers), read by :func:`fetched_highwaters` with a short-lived client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiokafka import TopicPartition
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.types import TP

from pipeline import kafka
from pipeline.config import Connection

log = logging.getLogger(__name__)

FETCH_WAIT_S = 10.0  # how long a recovery waits for fetch answers before trusting end_offsets

HighwaterFetch = Callable[[Sequence[TP], Mapping[TP, int]], Awaitable[dict[TP, int]]]


async def fetched_highwaters(
    bootstrap: str, conn: Connection, tps: Sequence[TP], near: Mapping[TP, int], wait_s: float = FETCH_WAIT_S
) -> dict[TP, int]:
    """The high watermark of each partition's fetch response (those that answered within ``wait_s``).

    Each partition is fetched from just before ``near`` (its ``end_offsets`` answer), so a
    long changelog is not read: one small fetch per partition.
    """
    c = kafka.consumer(bootstrap, conn, group_id=None)
    await c.start()
    try:
        wanted = {TopicPartition(tp.topic, tp.partition): tp for tp in tps}
        c.assign(list(wanted))
        for atp, tp in wanted.items():
            c.seek(atp, max(0, int(near.get(tp) or 0) - 1))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        out: dict[TP, int] = {}
        while len(out) < len(wanted) and loop.time() < deadline:
            await c.getmany(*[a for a, tp in wanted.items() if tp not in out], timeout_ms=250, max_records=1)
            for atp, tp in wanted.items():
                hw = c.highwater(atp)
                if hw is not None:
                    out[tp] = int(hw)
        return out
    finally:
        await c.stop()


def corrected(ends: Mapping[TP, int | None], fetched: Mapping[TP, int]) -> dict[TP, int | None]:
    """``end_offsets`` answers raised to the fetched high watermarks.

    >>> a, b = TP("t", 0), TP("t", 1)
    >>> corrected({a: 3, b: 7}, {a: 9})
    {TP(topic='t', partition=0): 9, TP(topic='t', partition=1): 7}
    """
    out: dict[TP, int | None] = {}
    for tp, end in ends.items():
        hw = fetched.get(tp)
        out[tp] = end if hw is None else max(hw, end or 0)
    return out


class _Thread(AIOKafkaConsumerThread):
    async def _highwaters(self, partitions: list[TP]) -> Mapping[TP, int]:
        ends = await super()._highwaters(partitions)
        fetch: HighwaterFetch | None = getattr(self.app, "fetch_highwaters", None)
        if fetch is None or self.consumer.in_transaction or not partitions:
            return ends
        try:
            fetched = await fetch(partitions, ends)
        except Exception as exc:  # recovery then stops where end_offsets says, as faust would
            log.warning("changelog high watermarks unreadable (%r): using end_offsets", exc)
            return ends
        missing = [tp for tp in partitions if tp not in fetched]
        if missing:
            log.warning("no fetch answer for %d changelog partitions: using end_offsets for them", len(missing))
        return corrected(ends, fetched)  # type: ignore[return-value]  # faust's None means unknown


class WatermarkConsumer(AIOKafkaConsumer):
    """faust's aiokafka consumer whose recovery reads each changelog to its real end."""

    def _new_consumer_thread(self) -> Any:
        return _Thread(self, loop=self.loop, beacon=self.beacon)
