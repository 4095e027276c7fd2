"""The join's state per input partition: pending halves, dedupe sets, positions, event time.

Each input partition number (shared by the co-partitioned ``retrieval-events`` and
``llm-feedback``) has its own event-time watermark, the largest ``ts`` accepted on it.
Join expiry on a partition follows that partition's watermark only, so a partition whose
producer runs ahead (or one bad timestamp, bounded by ``max_future_skew_s``) cannot expire
the pending halves of another (docs/architecture.md, "Event time").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.partitioner import murmur2

# Bounds on join state per partition, whatever the event times say.
MAX_PENDING_PER_PARTITION = 500_000
MAX_IDS_PER_PARTITION = 1_000_000


def key_partition(key: str, partitions: int) -> int:
    """The partition Kafka's default (murmur2) partitioner gives a string key."""
    return (int(murmur2(key.encode("utf-8"))) & 0x7FFFFFFF) % partitions


@dataclass
class Pending:
    """One half waiting for the other: the decoded value, its input offset and event time."""

    value: Any
    offset: int
    ts: float


@dataclass
class PartitionState:
    """Join state of one input partition number (shared by both co-partitioned topics).

    >>> st = PartitionState()
    >>> st.advance(5.0); st.advance(3.0); st.watermark
    5.0
    >>> st.position["retrieval"] = 9; st.retrieval[("q", 0)] = Pending(None, 4, 5.0)
    >>> st.commit_offset("retrieval"), st.commit_offset("feedback")
    (4, None)
    """

    retrieval: OrderedDict[tuple[str, int], Pending] = field(default_factory=OrderedDict)
    feedback: OrderedDict[tuple[str, int], Pending] = field(default_factory=OrderedDict)
    # One dedupe set per topic: a feedback may legitimately reuse its event's event_id.
    seen_retrieval: OrderedDict[str, float] = field(default_factory=OrderedDict)
    seen_feedback: OrderedDict[str, float] = field(default_factory=OrderedDict)
    joined: OrderedDict[tuple[str, int], float] = field(default_factory=OrderedDict)
    position: dict[str, int] = field(default_factory=dict)  # topic -> next offset to read
    watermark: float | None = None  # the largest accepted ts on this partition; None before the first

    def pending(self) -> int:
        return len(self.retrieval) + len(self.feedback)

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

    def evict(self, window_s: float) -> tuple[int, int]:
        """Drop what this partition's own event time has left behind; (retrieval, feedback) halves expired.

        Queues are in arrival order, which is close to event-time order: they are pruned
        from the front, and an event that arrived out of order leaves when it reaches it.
        Before the first accepted event only the count caps apply.
        """
        horizon = float("-inf") if self.watermark is None else self.watermark - window_s
        expired = (
            prune_front(self.retrieval, horizon, MAX_PENDING_PER_PARTITION, ts_of=_pending_ts),
            prune_front(self.feedback, horizon, MAX_PENDING_PER_PARTITION, ts_of=_pending_ts),
        )
        prune_front(self.seen_retrieval, horizon, MAX_IDS_PER_PARTITION)
        prune_front(self.seen_feedback, horizon, MAX_IDS_PER_PARTITION)
        prune_front(self.joined, horizon, MAX_IDS_PER_PARTITION)
        return expired


def _pending_ts(p: Pending) -> float:
    return p.ts


def prune_front(d: OrderedDict[Any, Any], horizon: float, cap: int, ts_of: Callable[[Any], float] | None = None) -> int:
    """Drop entries older than ``horizon`` from the front, and any beyond ``cap``.

    >>> d = OrderedDict([("a", 1.0), ("b", 5.0), ("c", 2.0)])
    >>> prune_front(d, horizon=3.0, cap=10), list(d)
    (1, ['b', 'c'])
    """
    removed = 0
    while d:
        k, v = next(iter(d.items()))
        ts = ts_of(v) if ts_of else v
        if ts >= horizon and len(d) <= cap:
            break
        del d[k]
        removed += 1
    return removed


def event_clock(states: dict[int, PartitionState]) -> float | None:
    """The slowest partition's watermark: a clock one partition running ahead cannot move.

    >>> a, b = PartitionState(), PartitionState()
    >>> a.advance(100.0); b.advance(7.0)
    >>> event_clock({0: a, 1: b, 2: PartitionState()}), event_clock({})
    (7.0, None)
    """
    marks = [st.watermark for st in states.values() if st.watermark is not None]
    return min(marks) if marks else None
