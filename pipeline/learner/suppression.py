"""Operators' "do not use": whether a ``suppress`` / ``unsuppress`` command is carried out (pure).

A suppression bypasses the promotion gate and forces a checkpoint outside the cadence, so it
is an operator's decision (``causalmem suppress`` / ``unsuppress``, writing ``control``,
which only operators may write: docs/operations.md, "Security"). Even so, one command may
name at most ``suppress_max_slots`` memories, and at most ``suppress_checkpoints_per_hour``
such checkpoints go out in any hour; a command over either is refused (dead-lettered with
its reason, logged): nothing is applied, and the operator sends it again, smaller or later.
A command that changes nothing (every slot already suppressed, or none of them suppressed)
is carried out without a checkpoint and costs nothing.

Every command carried out leaves an entry in the audit trail (who, when, which slots, why),
which the checkpoints carry in their metrics (``suppression_audit``, the newest
:data:`AUDIT_KEEP` entries) and ``causalmem status`` shows; the rate limit counts the
entries of the last hour, so it holds across a learner restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from topics.internal import SUPPRESS_COMMAND, UNSUPPRESS_COMMAND

AUDIT_KEEP = 64  # audit entries a checkpoint carries (the newest); the rate limit needs the last hour's
RATE_WINDOW_S = 3600.0


@dataclass(frozen=True)
class SuppressDecision:
    """What to do with one command: ``verdict`` ``apply`` (with a checkpoint), ``unchanged`` (the
    set already is what it asks: nothing to publish) or ``refused`` (``reason`` says why)."""

    verdict: str
    reason: str
    suppressed: tuple[int, ...]  # the suppressed set once the command is applied
    changed: tuple[int, ...]  # the slots whose state the command changes


def decide(
    command: str,
    slots: Sequence[int],
    suppressed: Sequence[int],
    audit: Sequence[dict[str, Any]],
    now: float,
    *,
    max_slots: int,
    per_hour: int,
) -> SuppressDecision:
    """Whether ``command`` (``suppress`` or ``unsuppress`` of ``slots``) is carried out now.

    ``audit``: the trail so far (entries with ``ts``, the learner's clock when applied);
    ``now``: the learner's clock.

    >>> decide("suppress", [3, 4], [], [], 100.0, max_slots=8, per_hour=4)
    SuppressDecision(verdict='apply', reason='', suppressed=(3, 4), changed=(3, 4))
    >>> decide("suppress", range(32), [], [], 100.0, max_slots=8, per_hour=4).reason
    'too_many_slots: 32 slots, at most 8 per command'
    >>> busy = [{"ts": 100.0 - 60 * i} for i in range(4)]
    >>> decide("suppress", [5], [], busy, 100.0, max_slots=8, per_hour=4).verdict
    'refused'
    >>> decide("suppress", [5], [], busy, 100.0 + 3600, max_slots=8, per_hour=4).verdict  # an hour later
    'apply'
    >>> decide("unsuppress", [4], [3, 4], [], 100.0, max_slots=8, per_hour=4).suppressed
    (3,)
    >>> decide("suppress", [3], [3, 4], busy, 100.0, max_slots=8, per_hour=4).verdict  # changes nothing
    'unchanged'
    """
    wanted = sorted({int(s) for s in slots})
    current = {int(s) for s in suppressed}
    if len(wanted) > max_slots:
        return SuppressDecision(
            "refused",
            f"too_many_slots: {len(wanted)} slots, at most {max_slots} per command",
            tuple(sorted(current)),
            (),
        )
    if command == SUPPRESS_COMMAND:
        changed = [s for s in wanted if s not in current]
        after = current | set(wanted)
    elif command == UNSUPPRESS_COMMAND:
        changed = [s for s in wanted if s in current]
        after = current - set(wanted)
    else:
        raise ValueError(f"not a suppression command: {command!r}")
    if not changed:
        return SuppressDecision("unchanged", "", tuple(sorted(current)), ())
    recent = sum(1 for e in audit if isinstance(e.get("ts"), int | float) and now - RATE_WINDOW_S < e["ts"] <= now)
    if recent >= per_hour:
        return SuppressDecision(
            "refused",
            f"rate_limited: {recent} suppression checkpoints in the last hour, at most {per_hour}",
            tuple(sorted(current)),
            (),
        )
    return SuppressDecision("apply", "", tuple(sorted(after)), tuple(changed))


def audit_entry(
    command: str, changed: Sequence[int], by: str, reason: str, command_id: str, now: float
) -> dict[str, Any]:
    """One line of the audit trail: who, when, which slots, why (and the command's id).

    >>> audit_entry("suppress", [4], "ops-ann", "leaks a password", "c1", 5.0)["by"]
    'ops-ann'
    """
    return {"command": command, "slots": list(changed), "by": by, "ts": now, "reason": reason, "id": command_id}


def read_audit(value: Any) -> list[dict[str, Any]]:
    """The audit trail from a checkpoint's metrics: well-formed entries only (a restore never fails on it).

    >>> read_audit([{"command": "suppress", "slots": [1], "by": "a", "ts": 1.0}, "junk", {"ts": "x"}])
    [{'command': 'suppress', 'slots': [1], 'by': 'a', 'ts': 1.0, 'reason': '', 'id': ''}]
    >>> read_audit(None)
    []
    """
    out: list[dict[str, Any]] = []
    for e in value if isinstance(value, list) else []:
        if not isinstance(e, dict) or not isinstance(e.get("ts"), int | float) or isinstance(e.get("ts"), bool):
            continue
        slots = e.get("slots")
        if e.get("command") not in (SUPPRESS_COMMAND, UNSUPPRESS_COMMAND) or not isinstance(slots, list):
            continue
        out.append(
            audit_entry(
                str(e["command"]),
                [int(s) for s in slots if isinstance(s, int) and not isinstance(s, bool)],
                str(e.get("by") or ""),
                str(e.get("reason") or ""),
                str(e.get("id") or ""),
                float(e["ts"]),
            )
        )
    return out[-AUDIT_KEEP:]
