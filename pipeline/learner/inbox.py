"""The learner's inbox: experiences read but not yet applied, and where to resume.

Pure bookkeeping, no Kafka: the loop hands it each message of the one-partition
``experiences`` topic (decoded, or ``None`` when it needs no update) and takes micro-batches
out of it. It knows

* the *pending* queue, in offset order: skipped messages stay in line as placeholders so
  that the resume offset never jumps over an experience that is not applied yet;
* in reorder mode (``reorder_s > 0``) the *held* experiences: a heap by (event time, id)
  that releases an experience once the event-time watermark has passed it by
  ``reorder_s``, so experiences are applied in that canonical order whatever order (and
  how often) they were delivered in;
* the *positions* read on the experiences and control topics, and from them the input
  offsets a checkpoint records (docs/architecture.md: a restored learner resumes there);
* the ids seen (experiences and control commands), to apply each at most once. They are
  remembered for ``dedupe_horizon_s`` of event time after the watermark at which they were
  first seen (the join window plus the worker's re-read after a takeover), whatever the
  rate; a restarted learner rebuilds them by re-reading that span (``restore.read_history``);
* the wall-clock bound (``max_future_s`` and the caller's ``now``): in reorder mode an
  experience whose ``ts`` is further ahead is refused (``"ts_in_future"``, the loop
  dead-letters it), so one bad timestamp can neither move the watermark (dropping
  everything after it as late) nor be recorded in a checkpoint; in arrival order it is
  applied, and only the dedupe clock is held at the bound (it cannot evict the memory).

>>> from topics.internal import Experience
>>> inbox = Inbox("experiences", "control", batch_size=2)
>>> [inbox.accept(o, None) for o in (0, 1)]  # undecodable messages: placeholders
[None, None]
>>> list(inbox.batches(force=True)), inbox.input_offsets()
([], {'experiences:0': 2, 'control:0': 0})
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterator

from topics.internal import Experience

DEDUPE_HORIZON_S = 2 * 600.0 + 300.0  # event time an id is remembered (LearnerConfig.dedupe_horizon_s)
DEDUPE_IDS = 4_000_000  # a memory guard only: 1,200 pairs/s over the default horizon is ~1.8 M ids

Key = tuple[float, str]  # (event time, experience id): the canonical order in reorder mode


class Inbox:
    """Pending and held experiences, read positions, resume offsets and seen ids."""

    def __init__(
        self,
        experiences_topic: str,
        control_topic: str,
        batch_size: int,
        reorder_s: float = 0.0,
        policy: str | None = None,
        dedupe_ids: int = DEDUPE_IDS,
        dedupe_horizon_s: float = DEDUPE_HORIZON_S,
        max_future_s: float | None = None,
    ) -> None:
        self.experiences_topic = experiences_topic
        self.control_topic = control_topic
        self.batch_size = max(1, batch_size)
        self.reorder_s = reorder_s
        self.policy = policy  # experiences of another policy are skipped (None: keep all)
        self.dedupe_ids = dedupe_ids
        self.dedupe_horizon_s = dedupe_horizon_s
        self.max_future_s = max_future_s
        self.pending: deque[tuple[int, Experience | None]] = deque()
        self.pending_n = 0  # experiences (not placeholders) in pending
        self.held: list[tuple[float, str, int, Experience]] = []
        self.watermark = 0.0  # reorder mode: the largest event time held
        self.seen_clock = 0.0  # the largest event time accepted (the dedupe memory's clock)
        self.released_key: Key | None = None  # newer keys only may still come in
        self.applied_key: Key | None = None  # the last key applied (recorded in checkpoints)
        self.position = 0  # next offset to read on the experiences topic, as far as it counts
        self.control_position = 0  # next offset to read on the control topic
        self.seen: OrderedDict[str, float] = OrderedDict()  # id -> the clock when first seen

    @property
    def reorder(self) -> bool:
        return self.reorder_s > 0

    # ------------------------------------------------------------------ ids
    def mark_seen(self, ident: str, ts: float | None = None) -> None:
        """Remember ``ident``; ``ts`` (its event time) moves the dedupe clock forward.

        Ids first seen more than ``dedupe_horizon_s`` of event time before the clock are
        forgotten: by then the worker cannot re-emit them.

        >>> inbox = Inbox("e", "c", 1, dedupe_horizon_s=100.0)
        >>> inbox.mark_seen("a", 1000.0); inbox.mark_seen("b", 1050.0); inbox.mark_seen("c", 1101.0)
        >>> [i for i in "abc" if inbox.seen_before(i)]
        ['b', 'c']
        """
        if ts is not None and ts > self.seen_clock:
            self.seen_clock = ts
        self.seen[ident] = self.seen_clock
        self.seen.move_to_end(ident)
        horizon = self.seen_clock - self.dedupe_horizon_s
        while self.seen and (next(iter(self.seen.values())) < horizon or len(self.seen) > self.dedupe_ids):
            self.seen.popitem(last=False)

    def seen_before(self, ident: str) -> bool:
        return ident in self.seen

    # ------------------------------------------------------------------ input
    def accept(self, offset: int, exp: Experience | None, now: float | None = None) -> str | None:
        """Queue the message at ``offset``; returns why it is skipped, if it is.

        ``exp`` is ``None`` for a message that needs no update (it was dead-lettered).
        The reasons are ``"other_policy"``, ``"duplicate"`` and, in reorder mode,
        ``"ts_in_future"`` (beyond ``now`` + ``max_future_s``: the caller dead-letters it)
        and ``"late"`` (it arrived after the reorder window that it belongs to had closed).
        """
        reason: str | None = None
        limit = None if now is None or self.max_future_s is None else now + self.max_future_s
        if self.reorder and exp is not None and limit is not None and exp.event.ts > limit:
            reason, exp = "ts_in_future", None
        if exp is not None and self.policy is not None and exp.event.policy != self.policy:
            reason, exp = "other_policy", None
        elif exp is not None and exp.id in self.seen:
            reason, exp = "duplicate", None
        if self.reorder:
            late = self._hold(offset, exp)
            return reason or late
        if exp is not None:
            # Applied in arrival order, a far-future ts harms nothing but the dedupe clock: bound it.
            self.mark_seen(exp.id, exp.event.ts if limit is None else min(exp.event.ts, limit))
            self.pending_n += 1
        self.pending.append((offset, exp))
        return reason

    def _hold(self, offset: int, exp: Experience | None) -> str | None:
        # Positions follow reads in reorder mode; the held heap keeps the resume point.
        self.position = offset + 1
        if exp is None:
            return None
        key = (exp.event.ts, exp.id)
        if self.applied_key is not None and key <= self.applied_key:
            return None  # applied before a restart (re-read from the resume offset)
        if self.released_key is not None and key <= self.released_key:
            # Applying it now would break the canonical order.
            return "late"
        self.mark_seen(exp.id, exp.event.ts)
        self.watermark = max(self.watermark, exp.event.ts)
        heapq.heappush(self.held, (key[0], key[1], offset, exp))
        return None

    def release(self, force: bool = False) -> None:
        """Reorder mode: move what the watermark has passed (everything when ``force``) to pending."""
        horizon = self.watermark - self.reorder_s
        while self.held and (force or self.held[0][0] <= horizon):
            ts, ident, offset, exp = heapq.heappop(self.held)
            self.released_key = (ts, ident)
            self.pending.append((offset, exp))
            self.pending_n += 1

    def batches(self, force: bool = False) -> Iterator[list[Experience]]:
        """Full micro-batches in order (and, when ``force``, the rest).

        The positions move once the caller comes back for the next batch, that is after
        it applied this one: a batch that fails to apply is not counted as applied.
        """
        b = self.batch_size
        while self.pending_n >= b or (force and self.pending):
            chunk: list[Experience] = []
            last = -1
            while self.pending and len(chunk) < b:
                last, exp = self.pending.popleft()
                if exp is not None:
                    chunk.append(exp)
                    self.pending_n -= 1
            while self.pending and self.pending[0][1] is None:
                last = self.pending.popleft()[0]
            if chunk:
                yield chunk
                if self.reorder:
                    self.applied_key = (chunk[-1].event.ts, chunk[-1].id)
                    continue  # positions follow reads, not batches, in reorder mode
            self.position = last + 1

    # ------------------------------------------------------------------ positions
    def rewind(self, position: int, control_position: int) -> None:
        """Start reading again at these offsets (after a restore): nothing is pending."""
        self.position = position
        self.control_position = control_position
        self.pending.clear()
        self.pending_n = 0
        self.held.clear()

    def resume_after(self, applied_through: Key | None) -> None:
        """Reorder mode: what a checkpoint applied (up to this key) is not applied again."""
        self.applied_key = self.released_key = applied_through

    def input_offsets(self) -> dict[str, int]:
        """Where a learner restored from a checkpoint taken now resumes its inputs.

        Anything read but not yet applied comes again after a restore.
        """
        exp_key = f"{self.experiences_topic}:0"
        out = {exp_key: self.position, f"{self.control_topic}:0": self.control_position}
        if self.reorder:
            unapplied = [o for o, e in self.pending if e is not None] + [h[2] for h in self.held]
            if unapplied:
                out[exp_key] = min(unapplied)
        elif self.pending:
            out[exp_key] = self.pending[0][0]
        return out
