""" "Do not use" in ``causalmem status``: the memories operators suppressed, the audit trail, and
labelers' proposals (docs/operations.md, "Security").

- **suppressed** and **audit** come from the policy's newest manifest (``suppressed``,
  ``suppression_audit``: the learner writes them, pipeline/learner/suppression.py);
- **proposals** are the labelers' "do not use" marks (``memory_choice`` labels with sample id
  ``do-not-use:<slot>``), read from ``human-labels`` (incrementally across ``--watch``
  refreshes) and tallied per memory: how many marks, by how many labelers, the newest time.
  A proposal changes nothing until an operator runs ``causalmem suppress``. A label that does
  not decode is skipped here (the worker dead-letters it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline import kafka
from pipeline.config import Connection
from pipeline.learner.suppression import read_audit
from pipeline.modeltopic import ModelTopicIndex
from topics.fields import Limits
from topics.labels import DO_NOT_USE_PREFIX, decode_human_label

SHOWN_AUDIT = 5  # the newest audit entries status shows
SHOWN_PROPOSALS = 10  # the most-proposed memories status lists
READ_IDLE_S = 5.0


def suppression_view(index: ModelTopicIndex, policy: str) -> dict[str, Any]:
    """The suppressed set and the newest audit entries, from the policy's newest manifest."""
    newest = index.newest(policy)
    metrics = newest.metrics if newest is not None else {}
    audit = read_audit(metrics.get("suppression_audit"))
    return {
        "suppressed": [int(s) for s in metrics.get("suppressed") or [] if isinstance(s, int)],
        "audit": audit[-SHOWN_AUDIT:][::-1],
    }


@dataclass
class ProposalTally:
    """Labelers' "do not use" marks per memory, read incrementally from ``human-labels``."""

    limits: Limits = field(default_factory=Limits)
    next_offsets: dict[int, int] = field(default_factory=dict)
    marks: dict[int, int] = field(default_factory=dict)
    labelers: dict[int, set[str]] = field(default_factory=dict)
    last_ts: dict[int, float] = field(default_factory=dict)

    def observe(self, value: bytes | None, key: bytes | None) -> None:
        """Count one ``human-labels`` record if it is a "do not use" mark."""
        if value is None or DO_NOT_USE_PREFIX.encode() not in value:  # most labels: no decode
            return
        try:
            label = decode_human_label(value, self.limits, key)
        except Exception:  # whatever the parse raised: status only reads, and skips what it cannot
            return
        if not (label.sample_id or "").startswith(DO_NOT_USE_PREFIX):
            return
        for slot in label.harmful_memories or []:
            self.marks[slot] = self.marks.get(slot, 0) + 1
            self.labelers.setdefault(slot, set()).add(label.labeler)
            self.last_ts[slot] = max(self.last_ts.get(slot, 0.0), label.ts)

    def view(self, suppressed: list[int]) -> dict[str, Any]:
        """The open proposals (memories not suppressed), most-marked first.

        >>> t = ProposalTally()
        >>> t.marks, t.labelers, t.last_ts = {4: 3, 7: 1}, {4: {"ann", "bob"}, 7: {"ann"}}, {4: 2.0, 7: 1.0}
        >>> t.view(suppressed=[7])
        {'open': 1, 'memories': [{'slot': 4, 'marks': 3, 'labelers': 2, 'last_ts': 2.0}]}
        """
        open_ = sorted((s for s in self.marks if s not in set(suppressed)), key=lambda s: (-self.marks[s], s))
        return {
            "open": len(open_),
            "memories": [
                {"slot": s, "marks": self.marks[s], "labelers": len(self.labelers[s]), "last_ts": self.last_ts[s]}
                for s in open_[:SHOWN_PROPOSALS]
            ],
        }

    async def update(self, bootstrap: str, conn: Connection, topic: str, suppressed: list[int]) -> dict[str, Any]:
        self.limits = conn.limits
        start = dict(self.next_offsets) or None
        for msg in await kafka.read_all(bootstrap, conn, topic, start=start, idle_s=READ_IDLE_S):
            if msg.offset < self.next_offsets.get(msg.partition, 0):
                continue
            self.next_offsets[msg.partition] = msg.offset + 1
            self.observe(msg.value, msg.key)
        return self.view(suppressed)
