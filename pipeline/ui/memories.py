"""The memories pages: each memory's reads, hard drops and measured effect, from the topics.

The view is built from two topics, read from the beginning and then followed
(:mod:`pipeline.ui.feeds`), and bounded in memory:

- ``retrieval-events``: a memory is *read* when its slot is among ``selected`` and
  *dropped* when the hard drop removed it (``dropped``); its text and the recent queries
  that read or dropped it (``recent_per_memory`` of them) come from here;
- ``experiences`` (kind ``feedback``): the measured effect. Per-memory credit
  (``slot_effects``, contract 1.1: the answer's NLL without the memory minus with it, so
  positive helps) where the feedback carried it, else the step's utility, shared by every
  memory the step read.

Per memory: the mean effect with a 95% interval (normal approximation), the probability
that the memory is harmful (mean effect below 0), δ (the reward-prediction error: an
exponentially weighted mean of ``effect − mean before it``; negative when a memory does
worse than it used to) and a sparkline of its recent effects.

The bound is in bytes (``max_bytes``): each memory is charged an estimate of what it keeps
(its text, its recent queries with their texts, a fixed overhead), and past the budget the
least recently seen memories are forgotten first (``evicted`` counts them; one seen again
starts over). Slot numbers are the deployment's (the feeds decode with its slot count), so
the effect statistics, one row per slot, are bounded by the configuration too.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from models.memory.stats import Z95, MemoryStats
from topics.events import RetrievalEvent
from topics.internal import Experience

DELTA_ALPHA = 0.1  # weight of the newest reward-prediction error in δ
SPARK_POINTS = 40  # recent effects a sparkline shows
# Estimated bytes beyond the texts: a Memory with its deques and sparkline, and one Recent.
MEMORY_OVERHEAD = 1024
RECENT_OVERHEAD = 200


@dataclass(frozen=True)
class Effect:
    """A memory's measured effect: ``n`` observations, their mean and 95% interval."""

    n: int
    mean: float
    low: float
    high: float

    @property
    def p_harmful(self) -> float:
        """P(true mean < 0) under the normal approximation (0.5 with fewer than two observations)."""
        if self.n < 2 or self.high == self.low:
            return 0.5 if self.n < 2 else float(self.mean < 0)
        se = (self.high - self.low) / (2 * Z95)
        return 0.5 * math.erfc(self.mean / (se * math.sqrt(2)))


class MemoryEffects:
    """Per-memory effect statistics, ``update(slot, value)`` and ``get(slot)``: the learner's own
    :class:`models.memory.stats.MemoryStats` (Welford, 95% normal interval), so the UI and the
    learner's metrics agree."""

    def __init__(self, slots: int) -> None:
        self._stats = MemoryStats(slots)

    def update(self, slot: int, value: float) -> None:
        self._stats.update((), {slot: value})

    def get(self, slot: int) -> Effect | None:
        if not 0 <= slot < self._stats.slots or self._stats.n[slot] == 0:
            return None
        st = self._stats.get(slot)
        low, high = (st.low, st.high) if st.effects >= 2 else (-math.inf, math.inf)
        return Effect(st.effects, st.mean, low, high)


@dataclass
class Recent:
    """A retrieval step that read or dropped a memory."""

    query_id: str
    step: int
    ts: float
    how: str  # "read" | "dropped"
    query_text: str | None


@dataclass
class Memory:
    slot: int
    reads: int = 0
    drops: int = 0
    text: str | None = None
    delta: float = 0.0
    spark: deque[float] = field(default_factory=lambda: deque(maxlen=SPARK_POINTS))
    recent: deque[Recent] = field(default_factory=deque)
    size: int = MEMORY_OVERHEAD  # estimated bytes kept for this memory (charged to the view's budget)


def recent_size(r: Recent) -> int:
    """Bytes charged for one recent query (its text counted whole, though events' texts are shared)."""
    return RECENT_OVERHEAD + len(r.query_id) + len(r.query_text or "")


class MemoryView:
    """What the memory pages show, built incrementally from decoded events and experiences (bounded)."""

    def __init__(
        self,
        max_events: int = 200_000,
        recent_per_memory: int = 20,
        slots: int = 1024,
        max_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.max_events = max_events
        self.recent_per_memory = recent_per_memory
        self.max_bytes = max_bytes
        self.memories: OrderedDict[int, Memory] = OrderedDict()  # least recently seen first
        self.bytes = 0  # estimated bytes the memories keep (Memory.size summed)
        self.evicted = 0  # memories forgotten to stay within max_bytes
        self.effects = MemoryEffects(slots)
        self.utilities: OrderedDict[tuple[str, int], float] = OrderedDict()  # (query_id, step) → utility
        self.events = 0
        self.experiences = 0
        self.per_memory_credit = 0  # experiences whose feedback carried per-memory effects
        # Contract 1.3: an event with candidate_ids numbers its memories with labels of its own,
        # not slots; counting them by number would mix memories (and "do not use" would
        # suppress another memory), so these pages leave such events out and say how many.
        self.by_id = 0

    def _memory(self, slot: int) -> Memory:
        m = self.memories.get(slot)
        if m is None:
            m = self.memories[slot] = Memory(slot, recent=deque())
            self.bytes += m.size
        else:
            self.memories.move_to_end(slot)
        return m

    def _charge(self, m: Memory, delta: int) -> None:
        m.size += delta
        self.bytes += delta

    def _set_text(self, m: Memory, text: str) -> None:
        self._charge(m, len(text) - len(m.text or ""))
        m.text = text

    def _add_recent(self, m: Memory, r: Recent) -> None:
        m.recent.appendleft(r)
        self._charge(m, recent_size(r))
        while len(m.recent) > self.recent_per_memory:
            self._charge(m, -recent_size(m.recent.pop()))

    def _shrink(self) -> None:
        """Forget the least recently seen memories until the view is within ``max_bytes``."""
        while self.bytes > self.max_bytes and self.memories:
            _, m = self.memories.popitem(last=False)
            self.bytes -= m.size
            self.evicted += 1

    def observe_event(self, ev: RetrievalEvent) -> None:
        if ev.candidate_ids is not None:
            self.by_id += 1
            return
        self.events += 1
        texts = ev.memory_texts or {}
        for how, slots in (("read", ev.selected), ("dropped", ev.dropped or [])):
            for slot in slots:
                m = self._memory(slot)
                if how == "read":
                    m.reads += 1
                else:
                    m.drops += 1
                if texts.get(slot):
                    self._set_text(m, texts[slot])
                self._add_recent(m, Recent(ev.query_id, ev.step, ev.ts, how, ev.query_text))
        self._shrink()

    def observe_experience(self, exp: Experience) -> None:
        if exp.kind != "feedback" or exp.event.candidate_ids is not None:
            return
        self.experiences += 1
        ev = exp.event
        self.utilities[(ev.query_id, ev.step)] = exp.utility
        while len(self.utilities) > self.max_events:
            self.utilities.popitem(last=False)
        if exp.slot_effects:
            self.per_memory_credit += 1
            credit = dict(exp.slot_effects)
        else:
            credit = {s: exp.utility for s in ev.selected}
        for slot, value in credit.items():
            m = self._memory(slot)
            before = self.effects.get(slot)
            if before is not None:
                m.delta = (1 - DELTA_ALPHA) * m.delta + DELTA_ALPHA * (value - before.mean)
            self.effects.update(slot, value)
            m.spark.append(value)
        self._shrink()

    def row(self, m: Memory) -> dict[str, Any]:
        e = self.effects.get(m.slot)
        return {
            "slot": m.slot,
            "text": m.text or "",
            "reads": m.reads,
            "drops": m.drops,
            "n": e.n if e else 0,
            "mean": e.mean if e else None,
            "low": e.low if e and e.n >= 2 else None,
            "high": e.high if e and e.n >= 2 else None,
            "p_harmful": e.p_harmful if e else None,
            "delta": m.delta,
            "spark": sparkline(list(m.spark)),
        }

    SORTS = ("harmful", "reads", "drops", "effect", "slot")

    def rows(self, search: str = "", sort: str = "harmful", limit: int = 500) -> list[dict[str, Any]]:
        """The table: memories whose text or slot matches ``search``, sorted (``harmful``: most probably first)."""
        needle = search.strip().lower()
        found = [
            m for m in self.memories.values() if not needle or needle in (m.text or "").lower() or needle == str(m.slot)
        ]
        rows = [self.row(m) for m in found]
        keys: dict[str, Any] = {
            "harmful": lambda r: (-(r["p_harmful"] if r["p_harmful"] is not None else -1), r["slot"]),
            "reads": lambda r: (-r["reads"], r["slot"]),
            "drops": lambda r: (-r["drops"], r["slot"]),
            "effect": lambda r: (r["mean"] if r["mean"] is not None else math.inf, r["slot"]),
            "slot": lambda r: r["slot"],
        }
        return sorted(rows, key=keys.get(sort, keys["harmful"]))[:limit]

    def detail(self, slot: int) -> dict[str, Any] | None:
        """A memory's page: its row and the recent queries that read or dropped it, each with its utility."""
        m = self.memories.get(slot)
        if m is None:
            return None
        recent = [{**vars(r), "utility": self.utilities.get((r.query_id, r.step))} for r in m.recent]
        return {**self.row(m), "recent": recent}

    def last_step(self, slot: int) -> Recent | None:
        m = self.memories.get(slot)
        return m.recent[0] if m is not None and m.recent else None


def sparkline(values: list[float], width: int = 120, height: int = 24) -> str:
    """An inline SVG polyline of ``values`` with the zero line (empty string for fewer than two).

    >>> sparkline([1.0])
    ''
    >>> 'polyline' in sparkline([0.0, 1.0, -1.0])
    True
    """
    if len(values) < 2:
        return ""
    lo, hi = min(*values, 0.0), max(*values, 0.0)
    span = (hi - lo) or 1.0

    def y(v: float) -> float:
        return round(height - 2 - (v - lo) / span * (height - 4), 1)

    step = width / (len(values) - 1)
    points = " ".join(f"{round(i * step, 1)},{y(v)}" for i, v in enumerate(values))
    color = "#b3261e" if sum(values[-5:]) < 0 else "#1b6e3a"
    return (
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="recent effects"><line x1="0" x2="{width}" y1="{y(0.0)}" y2="{y(0.0)}" class="zero"/>'
        f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/></svg>'
    )
