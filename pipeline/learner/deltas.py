"""Which checkpoints the learner publishes as deltas, and which rows they carry (docs/contract.md §7.1).

A delta's base is always the *serving* link, the one clients hold
(``CheckpointPublisher.head``), so a delta candidate the gate promotes later applies onto
what clients have. Its rows are every output row written since that base: the union of the
trainer's record of written rows (``PolicyTrainer.take_changed_rows()``, passed as
``changed_rows`` with every checkpoint) since the serving version.

A full snapshot is published instead when

- deltas are off (``full_every`` ≤ 1; the default is on: see docs/operations.md);
- there is no serving link yet, or this learner has not published since it took over (it
  does not know what changed since the serving version);
- the reason is ``init``, ``reset`` or ``rollback`` (the whole state may change);
- the serving link is a version this planner did not publish (its weights are not the
  trainer's);
- ``full_every`` − 1 deltas followed the last full snapshot;
- the delta would exceed ``max_share`` of a full snapshot's bytes.
"""

from __future__ import annotations

import numpy as np

from models.policy.delta import delta_bytes, full_bytes
from models.policy.network import Arch
from pipeline.modeltopic.publisher import CheckpointPublisher
from topics.fields import PROBE

FULL_REASONS = ("init", "reset", "rollback", PROBE)  # checkpoints that are always full snapshots
KEEP_LINKS = 3  # versions whose rows are kept apart (older ones are merged: a safe over-approximation)
KEEP_KNOWN = 1024  # versions remembered as this planner's own (an older serving link: a full snapshot)


class DeltaPlanner:
    """Decides, checkpoint by checkpoint, between a full snapshot and a delta (see the module's docstring).

    >>> p = DeltaPlanner(CheckpointPublisher(None, "t", "p"), Arch(4, 6, 8), full_every=1)
    >>> p.plan("periodic", np.array([1, 2])) is None  # deltas off
    True
    """

    def __init__(
        self, publisher: CheckpointPublisher, arch: Arch, full_every: int = 1, max_share: float = 0.25
    ) -> None:
        self.publisher = publisher
        self.arch = arch
        self.full_every = full_every
        self.max_share = min(max_share, 1.0)  # a delta is never larger than a full snapshot (readers bound sizes)
        self.since_full = 0  # deltas published since the last full snapshot
        self.tracked_from: int | None = None  # the first version published since this learner took over
        self.rows: dict[int, np.ndarray] = {}  # version -> rows written up to it since the version before
        self.known: set[int] = set()  # the versions recorded here: the trainer's own states
        self._adoptions = publisher.adoptions

    def plan(self, reason: str, changed_rows: np.ndarray) -> np.ndarray | None:
        """The rows of a delta for this checkpoint, or None for a full snapshot.

        ``changed_rows``: the output rows written since the last published checkpoint.
        """
        if self.publisher.adoptions != self._adoptions:  # a takeover: what changed since the head is unknown
            self._adoptions = self.publisher.adoptions
            self.tracked_from, self.rows = None, {}
        head = self.publisher.head
        if self.full_every <= 1 or reason in FULL_REASONS or head is None:
            return None
        if self.tracked_from is None or head[0] < self.tracked_from or self.since_full + 1 >= self.full_every:
            return None
        if head[0] not in self.known:  # not this planner's: every row may differ from the trainer's
            return None
        parts = [r for v, r in self.rows.items() if v > head[0]] + [np.asarray(changed_rows, dtype=np.int64)]
        rows = np.unique(np.concatenate(parts))
        if not len(rows):  # nothing written since the head (a probe's candidate): a full snapshot, a canary can load it
            return None
        if delta_bytes(len(rows), self.arch) > self.max_share * full_bytes(self.arch):
            return None
        return rows

    def record(self, version: int, delta: bool, changed_rows: np.ndarray) -> None:
        """Note a published checkpoint (``delta``: published as a delta) and the rows written up to it."""
        if self.full_every <= 1:
            return
        if self.tracked_from is None:
            self.tracked_from = version
        self.known.add(version)
        if len(self.known) > KEEP_KNOWN:
            self.known.discard(min(self.known))
        self.since_full = self.since_full + 1 if delta else 0
        head = self.publisher.head[0] if self.publisher.head else 0
        self.rows = {v: r for v, r in self.rows.items() if v > head}
        self.rows[version] = np.asarray(changed_rows, dtype=np.int64)
        if len(self.rows) > KEEP_LINKS:  # merge the oldest under the newest of them
            old = sorted(self.rows)[: -KEEP_LINKS + 1]
            merged = np.unique(np.concatenate([self.rows.pop(v) for v in old]))
            self.rows[old[-1]] = merged
