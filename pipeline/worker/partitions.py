"""The join's state per input partition: pending halves, dedupe sets, positions, event time.

Each input partition number (shared by the co-partitioned ``retrieval-events`` and
``llm-feedback``) has its own event-time watermark, the largest ``ts`` accepted on it.
Join expiry on a partition follows that partition's watermark only, so a partition whose
producer runs ahead (or one bad timestamp, bounded by ``max_future_skew_s``) cannot expire
the pending halves of another (docs/architecture.md, "Event time").

What a partition holds is bounded three ways: by event time (``join_window_s``), by count
(:data:`MAX_PENDING_PER_PARTITION`, :data:`MAX_IDS_PER_PARTITION`) and by bytes (the
worker's ``join_state_max_bytes`` over the partitions): each entry is counted for the bytes
it costs, and past the cap the oldest entries of the partition go first, whichever buffer
they are in (:meth:`PartitionState.shed`). A client sending large events, or many distinct
ids, fills its own partitions' share and no more.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
from aiokafka.partitioner import murmur2

# Bounds on join state per partition, whatever the event times say.
MAX_PENDING_PER_PARTITION = 500_000
MAX_IDS_PER_PARTITION = 1_000_000
# What an entry is counted for: an estimate of the heap it holds, at least what tracemalloc
# measures (CPython 3.11; tests/unit/worker/test_join_state_bytes.py). A pending half is
# counted for its decoded value (heap_bytes: every string, number and array in it, so
# neither a text made of wide characters nor a long list of small numbers costs more than
# it is counted for) plus PENDING_OVERHEAD (the Pending record, its key tuple, the ordered
# dict's node); a remembered id for its string plus ID_OVERHEAD (its time, the node; a
# joined step's key tuple); a joined step also for its record and the two ids it names
# (counted again: the remembered ids may be shed before it).
PENDING_OVERHEAD = 256
ID_OVERHEAD = 160

# The buffers of a partition, in the order a tie on event time sheds them.
BUFFERS = ("seen_retrieval", "seen_feedback", "joined", "feedback", "retrieval")

K = TypeVar("K")
V = TypeVar("V")


def key_partition(key: str, partitions: int) -> int:
    """The partition Kafka's default (murmur2) partitioner gives a string key."""
    return (int(murmur2(key.encode("utf-8"))) & 0x7FFFFFFF) % partitions


_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})
# Per dataclass type: a getter of all its fields at once, and whether its instances have a __dict__.
_FIELDS: dict[type, tuple[Callable[[Any], tuple[Any, ...]], bool]] = {}
_sizeof = sys.getsizeof


def heap_bytes(obj: Any, depth: int = 4) -> int:
    """The bytes a decoded value holds on the heap: its objects' own sizes, through containers,
    dataclasses and arrays (``depth`` levels; what lies deeper counts as its container's size).

    >>> heap_bytes("a" * 100) < heap_bytes(chr(0x1F600) + "a" * 99)  # one wide character: 4 bytes each
    True
    >>> heap_bytes(np.zeros(1000, dtype=np.float32)) >= 4000, heap_bytes([1000, 2000]) > heap_bytes([])
    (True, True)
    """
    t = type(obj)
    if t is np.ndarray:  # its data, its header, and what it is a view of (a view's getsizeof leaves that out)
        base = obj.base
        return int(obj.nbytes) + 112 + (0 if base is None else _sizeof(base))
    size = _sizeof(obj)
    if t in _SCALARS:
        return size
    if depth <= 0:
        return size
    depth -= 1
    if t is list or t is tuple:
        values: Any = obj
    elif t is dict:
        values = [*obj.keys(), *obj.values()]
    else:
        shape = _FIELDS.get(t)
        if shape is None:
            if not dataclasses.is_dataclass(obj) or not dataclasses.fields(obj):
                return size
            getter = operator.attrgetter(*(f.name for f in dataclasses.fields(obj)))
            one = len(dataclasses.fields(obj)) == 1
            shape = _FIELDS[t] = ((lambda o: (getter(o),)) if one else getter, bool(t.__dictoffset__))
        get_all, has_dict = shape
        if has_dict:  # a dataclass without slots: its attributes' dict
            size += _sizeof(obj.__dict__)
        values = get_all(obj)
    if _SCALARS.issuperset(map(type, values)):  # a list of numbers or ids: summed without a Python loop
        return size + sum(map(_sizeof, values))
    for v in values:
        size += _sizeof(v) if type(v) in _SCALARS else heap_bytes(v, depth)
    return size


@dataclass(slots=True)
class Pending:
    """One half waiting for the other: the decoded value, its input offset, event time and counted bytes."""

    value: Any
    offset: int
    ts: float
    size: int = PENDING_OVERHEAD  # heap_bytes(value) + PENDING_OVERHEAD (the join sets it)


@dataclass(slots=True)
class JoinedStep:
    """A joined ``(query_id, step)``: when (the later half's ``ts``) and the two ids that hold it.

    A message of either topic for the step is a retransmission when it carries its side's id,
    and reuses the step otherwise (docs/contract.md §2), even once the remembered ids are gone.
    """

    ts: float
    retrieval_id: str
    feedback_id: str

    def holder(self, kind: str) -> str:
        """The id that holds this step on ``kind``'s topic (``retrieval`` or ``feedback``)."""
        return self.retrieval_id if kind == "retrieval" else self.feedback_id


_STEP_RECORD = sys.getsizeof(JoinedStep(0.0, "", ""))


def hold(value: Any, offset: int) -> Pending:
    """A decoded event or feedback waiting for its other half, counted for the heap it holds."""
    return Pending(value, offset, value.ts, heap_bytes(value) + PENDING_OVERHEAD)


class Held(Generic[K, V]):
    """One buffer of a partition in arrival order, and the bytes its entries are counted for.

    >>> h: Held[str, float] = Held(size_of=lambda k, v: len(k), ts_of=float)
    >>> h.put("ab", 2.0); h.put("cde", 1.0); h.put("ab", 3.0)  # "ab" keeps its place
    >>> len(h), h.bytes, list(h), h.front_ts()
    (2, 5, ['ab', 'cde'], 3.0)
    >>> h.pop("ab"), h.pop("zz"), h.bytes
    (3.0, None, 3)
    """

    __slots__ = ("_entries", "_size_of", "_ts_of", "bytes")

    def __init__(self, size_of: Callable[[K, V], int], ts_of: Callable[[V], float]) -> None:
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._size_of = size_of
        self._ts_of = ts_of
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def values(self) -> Iterator[V]:
        return iter(self._entries.values())

    def put(self, key: K, value: V) -> None:
        """Add ``key`` (or replace its value; it keeps its place in the arrival order)."""
        if key in self._entries:
            self.bytes -= self._size_of(key, self._entries[key])
        self._entries[key] = value
        self.bytes += self._size_of(key, value)

    def get(self, key: K) -> V | None:
        """The value of ``key`` (None when absent)."""
        return self._entries.get(key)

    def pop(self, key: K) -> V | None:
        """Remove ``key`` and return its value (None when absent)."""
        if key not in self._entries:
            return None
        value = self._entries.pop(key)
        self.bytes -= self._size_of(key, value)
        return value

    def front_ts(self) -> float | None:
        """The event time of the entry that arrived first (None when empty)."""
        if not self._entries:
            return None
        return self._ts_of(next(iter(self._entries.values())))

    def drop_front(self) -> None:
        """Remove the entry that arrived first."""
        key, value = self._entries.popitem(last=False)
        self.bytes -= self._size_of(key, value)

    def prune(self, horizon: float, cap: int) -> tuple[int, int]:
        """Drop entries older than ``horizon`` from the front, then the oldest beyond ``cap``:
        (aged, over the count cap).

        Entries are in arrival order, close to event-time order: one that arrived out of
        order leaves when it reaches the front.

        >>> h: Held[str, float] = Held(size_of=lambda k, v: 1, ts_of=float)
        >>> for k, t in [("a", 1.0), ("b", 5.0), ("c", 2.0), ("d", 6.0)]: h.put(k, t)
        >>> h.prune(horizon=3.0, cap=2), list(h)
        ((1, 1), ['c', 'd'])
        """
        aged = over = 0
        while self._entries and self.front_ts() < horizon:  # type: ignore[operator]  # not None: non-empty
            self.drop_front()
            aged += 1
        while len(self._entries) > cap:
            self.drop_front()
            over += 1
        return aged, over


def _pending_size(key: Any, p: Pending) -> int:
    return p.size


def _pending_ts(p: Pending) -> float:
    return p.ts


def _id_size(event_id: str, ts: float) -> int:
    return sys.getsizeof(event_id) + ID_OVERHEAD


def _step_size(key: tuple[str, int], step: JoinedStep) -> int:
    getsize = sys.getsizeof
    return getsize(key[0]) + ID_OVERHEAD + _STEP_RECORD + getsize(step.retrieval_id) + getsize(step.feedback_id)


def _ts(ts: float) -> float:
    return ts


def _step_ts(step: JoinedStep) -> float:
    return step.ts


def _pending() -> Held[tuple[str, int], Pending]:
    return Held(_pending_size, _pending_ts)


def _ids() -> Held[str, float]:
    return Held(_id_size, _ts)


def _steps() -> Held[tuple[str, int], JoinedStep]:
    return Held(_step_size, _step_ts)


@dataclass
class Dropped:
    """What a prune of one partition dropped: pending halves past the window, by side, and
    entries shed for a cap, by (buffer, reason) with reason ``max_count`` or ``max_bytes``."""

    expired: Counter[str] = field(default_factory=Counter)
    shed: Counter[tuple[str, str]] = field(default_factory=Counter)


@dataclass
class PartitionState:
    """Join state of one input partition number (shared by both co-partitioned topics).

    >>> st = PartitionState()
    >>> st.advance(5.0); st.advance(3.0); st.watermark
    5.0
    >>> st.position["retrieval"] = 9; st.retrieval.put(("q", 0), Pending(None, 4, 5.0))
    >>> st.commit_offset("retrieval"), st.commit_offset("feedback")
    (4, None)
    """

    retrieval: Held[tuple[str, int], Pending] = field(default_factory=_pending)
    feedback: Held[tuple[str, int], Pending] = field(default_factory=_pending)
    # One dedupe set per topic: a feedback may legitimately reuse its event's event_id.
    seen_retrieval: Held[str, float] = field(default_factory=_ids)
    seen_feedback: Held[str, float] = field(default_factory=_ids)
    joined: Held[tuple[str, int], JoinedStep] = field(default_factory=_steps)
    position: dict[str, int] = field(default_factory=dict)  # topic -> next offset to read
    watermark: float | None = None  # the largest accepted ts on this partition; None before the first

    def pending(self) -> int:
        return len(self.retrieval) + len(self.feedback)

    def held_bytes(self) -> int:
        """The bytes this partition's entries are counted for (pending halves and remembered ids)."""
        return (
            self.retrieval.bytes
            + self.feedback.bytes
            + self.seen_retrieval.bytes
            + self.seen_feedback.bytes
            + self.joined.bytes
        )

    def holder(self, kind: str, key: tuple[str, int]) -> tuple[str, str] | None:
        """The event that holds ``key`` on ``kind``'s topic, and how: ``(event_id, "joined" | "waiting")``.

        None when the step is neither joined nor waiting on that side (as far as this
        partition remembers: ``join_window_s`` of its event time, within its caps).

        >>> st = PartitionState()
        >>> st.joined.put(("q", 0), JoinedStep(5.0, "ev-1", "fb-1"))
        >>> st.holder("retrieval", ("q", 0)), st.holder("feedback", ("q", 0)), st.holder("feedback", ("q", 1))
        (('ev-1', 'joined'), ('fb-1', 'joined'), None)
        """
        step = self.joined.get(key)
        if step is not None:
            return step.holder(kind), "joined"
        waiting = (self.retrieval if kind == "retrieval" else self.feedback).get(key)
        if waiting is None:
            return None
        return waiting.value.event_id, "waiting"

    def advance(self, ts: float) -> None:
        """Move this partition's event-time clock to ``ts`` if it is later."""
        if self.watermark is None or ts > self.watermark:
            self.watermark = ts

    def commit_offset(self, topic_kind: str) -> int | None:
        """The offset to commit for one of the two topics: its oldest pending half, else its position."""
        side = self.retrieval if topic_kind == "retrieval" else self.feedback
        pos = self.position.get(topic_kind)
        if side:
            oldest = min(p.offset for p in side.values())
            return oldest if pos is None else min(oldest, pos)
        return pos

    def _buffers(self) -> tuple[tuple[str, Held[Any, Any]], ...]:
        return tuple((name, getattr(self, name)) for name in BUFFERS)

    def shed(self, max_bytes: int) -> Counter[str]:
        """Drop the oldest entries, whichever buffer holds them, until at most ``max_bytes`` are held;
        the entries shed per buffer.

        The oldest is the earliest event time among the buffers' first arrivals. A pending
        half shed here is never joined (its other half, if it comes, waits and expires), a
        remembered id shed here no longer stops a duplicate: what the count caps did, by bytes.

        >>> st = PartitionState()
        >>> for i in range(4): st.retrieval.put((f"q{i}", 0), Pending(None, i, float(i), size=1000))
        >>> st.seen_feedback.put("late-id", 2.5)
        >>> shed = st.shed(2600); sorted(shed.items()), len(st.retrieval), len(st.seen_feedback)
        ([('retrieval', 2)], 2, 1)
        >>> st.held_bytes() <= 2600
        True
        """
        shed: Counter[str] = Counter()
        if self.held_bytes() <= max_bytes:
            return shed
        buffers = self._buffers()
        while self.held_bytes() > max_bytes:
            oldest: tuple[float, str, Held[Any, Any]] | None = None
            for name, held in buffers:
                ts = held.front_ts()
                if ts is not None and (oldest is None or ts < oldest[0]):
                    oldest = (ts, name, held)
            if oldest is None:
                break
            oldest[2].drop_front()
            shed[oldest[1]] += 1
        return shed

    def evict(self, window_s: float, max_bytes: int | None = None) -> Dropped:
        """Drop what this partition's own event time has left behind, then what is over the caps.

        Before the first accepted event only the caps apply.
        """
        horizon = float("-inf") if self.watermark is None else self.watermark - window_s
        out = Dropped()
        for name, held in self._buffers():
            cap = MAX_PENDING_PER_PARTITION if name in ("retrieval", "feedback") else MAX_IDS_PER_PARTITION
            aged, over = held.prune(horizon, cap)
            if aged and name in ("retrieval", "feedback"):
                out.expired[name] += aged
            if over:
                out.shed[(name, "max_count")] += over
        if max_bytes is not None:
            for name, n in self.shed(max_bytes).items():
                out.shed[(name, "max_bytes")] += n
        return out


def event_clock(states: dict[int, PartitionState]) -> float | None:
    """The slowest partition's watermark: a clock one partition running ahead cannot move.

    >>> a, b = PartitionState(), PartitionState()
    >>> a.advance(100.0); b.advance(7.0)
    >>> event_clock({0: a, 1: b, 2: PartitionState()}), event_clock({})
    (7.0, None)
    """
    marks = [st.watermark for st in states.values() if st.watermark is not None]
    return min(marks) if marks else None
