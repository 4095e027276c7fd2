"""Which input offsets a faust stage commits: never one past an input it did not process.

faust (at least once) commits, per input partition, the end of the first run of
consecutive offsets its streams acknowledged. Two things in it lost inputs of the
outcomes stage when a worker restarted after a SIGKILL (docs/architecture.md, "Nothing
lost on a crash"):

- **fetched, then dropped.** When table recovery ends, faust resumes the stream
  partitions, seeks them "to the committed offset" and then resumes its flow control,
  which empties the streams' queues. The fetcher already runs (recovery used it), so
  records fetched in between are in those queues and are dropped: faust counts on the
  seek to read them again. aiokafka seeks only partitions with a committed offset above
  0; a partition with none (the stage had not committed yet when the worker was
  killed) stays where the fetcher left it, past the dropped records;
- **a commit over the hole.** faust then committed past the missing offset anyway: it
  treats the first acknowledged offset as following the committed one when it is one
  above it (``min(acked) - committed > 1``), and does no check at all while a
  partition has no committed offset.

:class:`StageConsumer` closes both. Every stream partition gets a known base at each
seek (its committed offset, or its first offset when it has none, and the fetcher is
rewound there). An offset is committed only when every input from the base to it was
acknowledged: a missing one (a record dropped anywhere between fetcher and stream)
holds the partition's commits back and rewinds the partition to it, so it is read
again (the stages are idempotent per query and step, so the inputs read twice change
nothing). faust's guessed "gaps" (offsets it assumes do not exist because the fetch
skipped them) are ignored: the stage topics are neither compacted nor transactional,
so every offset from the log start on holds a record; only offsets below the log start
(removed by retention) are skipped, after asking the broker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from faust.types import TP

from pipeline.worker.recovery import WatermarkConsumer

log = logging.getLogger(__name__)

REWIND_RETRY_S = 30.0  # a hole still there this long after its rewind is rewound again


def _tp(tp: Any) -> TP:
    return TP(tp.topic, tp.partition)


class StageConsumer(WatermarkConsumer):
    """The worker's faust consumer: commits never pass an input the stage did not process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bases: dict[TP, int] = {}  # per stream partition: the offset the last seek started from
        self._rewinds: dict[TP, tuple[int, float]] = {}  # the last rewind: (offset, monotonic time)
        self._rewind_tasks: set[asyncio.Task[None]] = set()

    def _is_stream(self, tp: Any) -> bool:
        return bool(self.app.topics.acks_enabled_for(tp.topic))

    # -- every stream partition starts from a known offset
    async def seek_to_committed(self) -> Mapping[TP, int]:
        committed = dict(await super().seek_to_committed())
        stream = [tp for tp in committed if self._is_stream(tp)]
        if not stream:
            return committed
        starts = await self.earliest_offsets(*stream)
        rewind: dict[TP, int] = {}
        for tp in stream:
            offset = committed[tp]
            base = max(offset or 0, int(starts.get(tp) or 0))
            if not offset:  # aiokafka seeks only offsets above 0: the fetcher may be past the start
                rewind[tp] = base
            committed[tp] = base
            self._bases[_tp(tp)] = base
        if rewind:
            await self.seek_wait(rewind)
        return committed

    async def perform_seek(self) -> None:
        self._bases = {}
        await super().perform_seek()
        # faust keeps "no committed offset" for 0 (and for a partition never committed):
        # here every stream partition has its base, so its first offset is checked too.
        self._committed_offset.update(self._bases)

    # -- commits only over inputs acknowledged from the base on
    def _new_offset(self, tp: TP) -> int | None:
        base = self._committed_offset[tp]
        acked = self._acked[tp]
        if acked and self._is_stream(tp):
            if base is None:
                # Before the seek that ends table recovery the fetcher already feeds the
                # streams, from an offset nobody checked: wait for the seek's base.
                return None
            if min(acked) > base:
                # Offset ``base`` never reached the stream (a stage acknowledges its inputs
                # in order, so later ones being acknowledged means it was dropped, not slow).
                self._on_hole(tp, base, min(acked))
                return None
        offset: int | None = super()._new_offset(tp)
        return offset

    async def _add_gap(self, tp: TP, offset_from: int, offset_to: int) -> None:
        # faust guesses that offsets the fetch did not return do not exist; here every
        # offset holds a record (see the module), and a guess would let a commit pass
        # inputs dropped after a seek. Offsets below the log start: see _rewind.
        return None

    def _on_hole(self, tp: TP, base: int, first_acked: int) -> None:
        last = self._rewinds.get(tp)
        now = time.monotonic()
        if last is not None and last[0] == base and now - last[1] < REWIND_RETRY_S:
            return  # rewound already: the record is on its way again
        self._rewinds[tp] = (base, now)
        log.warning(
            "%s: input %d was not processed but %d was: commits held, rewinding to %d", tp, base, first_acked, base
        )
        task = asyncio.ensure_future(self._rewind(tp, base))
        self._rewind_tasks.add(task)
        task.add_done_callback(self._rewound)

    async def _rewind(self, tp: TP, base: int) -> None:
        if tp not in self.assignment():
            return  # revoked meanwhile: its next owner reads it from the committed offset
        start = int((await self.earliest_offsets(tp)).get(tp) or 0)
        if start > base:  # removed by retention: nothing to read there
            self._committed_offset[tp] = start
            return
        await self.seek_wait({tp: base})

    def _rewound(self, task: asyncio.Task[None]) -> None:
        self._rewind_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("rewind failed (%r): commits stay held until the next rebalance", task.exception())
