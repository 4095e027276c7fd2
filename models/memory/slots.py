"""Memory id → slot allocation: the learner's side of the memory lifecycle (docs/contract.md §9.1).

The policy scores *slots* (rows of its output layer); a memory store names memories by id.
:class:`SlotAllocator` gives each added id a slot, tombstones the slot of a removed id and
reuses a tombstoned slot only once ``grace_s`` of event time has passed since the removal
(events still in flight for the removed memory are then long joined or expired, so none
of its feedback reaches the row's next owner). The clock is the largest ``ts`` of the
changes made (a rejected or repeated record moves nothing), never the wall clock; each
change carries the clock as its ``ts``, so the newest change of each slot (the published
map) gives the clock back after a restart: the same records in the same order give the same
slots, which is what makes a replay after a restart assign what the first run assigned.

Order of choice: never-used slots first, lowest first; then the tombstone removed longest
ago whose grace has passed (ties: the lower slot).

>>> a = SlotAllocator(slots=2, grace_s=10.0)
>>> a.add("doc-a", ts=0.0).slot, a.add("doc-b", ts=1.0).slot
(0, 1)
>>> a.add("doc-a", ts=2.0) is None  # already live: an update, the slot stays
True
>>> a.remove("doc-a", ts=3.0).slot
0
>>> try:
...     a.add("doc-c", ts=5.0)  # slot 0 is still in its grace period
... except SlotsFull as e:
...     print(e)
no free slot for 'doc-c': 2 slots, 1 live, 1 in their grace period (the next frees at ts 13.0)
>>> a.add("doc-c", ts=13.0)
SlotChange(memory_id='doc-c', slot=0, live=True, ts=13.0, reused=True)
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass


class SlotsFull(RuntimeError):
    """No slot is free: every slot is live or still in its grace period."""


class UnknownMemory(KeyError):
    """A remove or update names an id that is not live."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown memory"


@dataclass(frozen=True)
class SlotChange:
    """One change of the map: ``memory_id`` now holds ``slot`` (``live``) or left it (a tombstone).

    ``reused``: the slot had an earlier owner, whose row must be re-initialised.
    """

    memory_id: str
    slot: int
    live: bool
    ts: float  # the allocator's clock at the change: max(previous clock, the record's ts)
    reused: bool = False


class SlotAllocator:
    """Id → slot, with tombstones and a grace period; deterministic for a record order.

    Parameters
    ----------
    slots
        S, the policy's number of slots.
    grace_s
        Event time a removed memory's slot stays tombstoned before it may be reused.
    """

    def __init__(self, slots: int, grace_s: float = 3600.0) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self.slots = slots
        self.grace_s = grace_s
        self.live: dict[str, int] = {}  # memory id -> slot
        self.owner: dict[int, str] = {}  # slot -> live memory id
        self.tombstones: dict[int, tuple[str, float]] = {}  # slot -> (removed id, removal ts)
        self._fresh = 0  # slots >= this were never used
        self._reusable: list[tuple[float, int]] = []  # heap of (removal ts, slot)
        self.clock = float("-inf")  # the largest ts applied

    def slot_of(self, memory_id: str) -> int | None:
        """The live slot of ``memory_id``; None when it is not live."""
        return self.live.get(memory_id)

    def add(self, memory_id: str, ts: float) -> SlotChange | None:
        """Give ``memory_id`` a slot; None when it already has one (an update or a repeat).

        Raises :class:`SlotsFull` when every slot is live or in its grace period.
        """
        if memory_id in self.live:
            return None
        now = max(self.clock, float(ts))
        slot, reused = self._take(memory_id, now)
        self.clock = now
        self.live[memory_id] = slot
        self.owner[slot] = memory_id
        return SlotChange(memory_id, slot, True, now, reused)

    def remove(self, memory_id: str, ts: float) -> SlotChange:
        """Tombstone ``memory_id``'s slot; raises :class:`UnknownMemory` when it is not live."""
        slot = self.live.pop(memory_id, None)
        if slot is None:
            raise UnknownMemory(f"{memory_id!r} is not a live memory")
        self.clock = max(self.clock, float(ts))
        del self.owner[slot]
        self._tombstone(slot, memory_id, self.clock)
        return SlotChange(memory_id, slot, False, self.clock)

    def check_live(self, memory_id: str) -> int:
        """The slot of a live ``memory_id`` (an update's target); raises :class:`UnknownMemory`."""
        slot = self.live.get(memory_id)
        if slot is None:
            raise UnknownMemory(f"{memory_id!r} is not a live memory")
        return slot

    def restore(self, changes: Iterable[SlotChange]) -> None:
        """Rebuild the state from the newest change of each slot (the published map).

        Every slot below the highest one named counts as used: fresh slots are taken in
        order, so a slot without a record below it was tombstoned and its record replaced.
        """
        for c in sorted(changes, key=lambda c: c.slot):
            if not 0 <= c.slot < self.slots:
                raise ValueError(f"slot {c.slot} outside 0..{self.slots - 1}")
            self._fresh = max(self._fresh, c.slot + 1)
            self.clock = max(self.clock, c.ts)
            if c.live:
                self.live[c.memory_id] = c.slot
                self.owner[c.slot] = c.memory_id
            else:
                self._tombstone(c.slot, c.memory_id, c.ts)

    def _tombstone(self, slot: int, memory_id: str, ts: float) -> None:
        self.tombstones[slot] = (memory_id, ts)
        heapq.heappush(self._reusable, (ts, slot))

    def _take(self, memory_id: str, now: float) -> tuple[int, bool]:
        if self._fresh < self.slots:
            self._fresh += 1
            return self._fresh - 1, False
        while self._reusable:
            removed_ts, slot = self._reusable[0]
            if self.tombstones.get(slot, (None, None))[1] != removed_ts:
                heapq.heappop(self._reusable)  # a stale entry: the slot was restored or reused since
                continue
            if removed_ts + self.grace_s > now:
                break
            heapq.heappop(self._reusable)
            del self.tombstones[slot]
            return slot, True
        waiting = f" (the next frees at ts {self._reusable[0][0] + self.grace_s})" if self._reusable else ""
        raise SlotsFull(
            f"no free slot for {memory_id!r}: {self.slots} slots, {len(self.live)} live, "
            f"{len(self.tombstones)} in their grace period{waiting}"
        )
