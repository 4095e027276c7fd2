"""Operators' commands that bypass the promotion gate: whether one is carried out (pure).

**"Do not use"** (``suppress`` / ``unsuppress``). A suppression bypasses the promotion gate and
forces a checkpoint outside the cadence, so it is an operator's decision (``causalmem suppress``
/ ``unsuppress``, writing ``control``, which only operators may write: docs/operations.md,
"Security"). Even so, one command may name at most ``suppress_max_slots`` memories, and at most
``suppress_checkpoints_per_hour`` suppressions go out in any hour; a command over either is
refused (dead-lettered with its reason, logged): nothing is applied, and the operator sends it
again, smaller or later. An ``unsuppress`` is never refused for the rate and does not count
against it: a mistaken suppression must always be undoable, and each undo needs a suppression
before it, which was counted. A command that changes nothing (every slot already suppressed,
or none of them suppressed) is carried out without a checkpoint and costs nothing.

**Rollback, reset and cut-over** (:func:`decide_command`) each force a checkpoint past the gate
too: at most ``control_checkpoints_per_hour`` of them, together, in any hour; one beyond is
refused (dead letter ``rate_limited``) and changes nothing.

Every command carried out leaves an entry in an audit trail (who, when, which slots, why, the
command's id): the suppressions' in the checkpoints' metrics (``suppression_audit``, the newest
:data:`AUDIT_KEEP` entries), which ``causalmem status`` shows; a rollback's, reset's or
cut-over's in the metrics of the checkpoint it forced (``control``). The rate limits count these
entries, so they hold across a learner restart. ``by`` is what the sender *claims*
(``by_verified: false``) unless the learner holds operators' keys and the command's signature
proves it (contract 1.16; docs/operations.md, "Security").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from topics.internal import CUTOVER_COMMAND, SUPPRESS_COMMAND, UNSUPPRESS_COMMAND

AUDIT_KEEP = 64  # audit entries a checkpoint carries (the newest); the rate limit needs the last hour's
RATE_WINDOW_S = 3600.0
# The commands that force a checkpoint past the gate and share control_checkpoints_per_hour.
GATE_BYPASSING = ("rollback", "reset", CUTOVER_COMMAND)


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
    >>> busy = [{"command": "suppress", "ts": 100.0 - 60 * i} for i in range(4)]
    >>> decide("suppress", [5], [], busy, 100.0, max_slots=8, per_hour=4).verdict
    'refused'
    >>> decide("suppress", [5], [], busy, 100.0 + 3600, max_slots=8, per_hour=4).verdict  # an hour later
    'apply'
    >>> decide("unsuppress", [5], [5], busy, 100.0, max_slots=8, per_hour=4).verdict  # an undo: never rate-limited
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
    # An undo is never refused for the rate, nor counted: each one takes back a counted suppression.
    recent = _within_the_hour(audit, now, (SUPPRESS_COMMAND,))
    if command == SUPPRESS_COMMAND and recent >= per_hour:
        return SuppressDecision(
            "refused",
            f"rate_limited: {recent} suppressions in the last hour, at most {per_hour}",
            tuple(sorted(current)),
            (),
        )
    return SuppressDecision("apply", "", tuple(sorted(after)), tuple(changed))


def audit_entry(
    command: str,
    changed: Sequence[int],
    by: str,
    reason: str,
    command_id: str,
    now: float,
    by_verified: bool = False,
) -> dict[str, Any]:
    """One line of the audit trail: who, when, which slots, why (and the command's id). ``by``
    is the sender's claim unless ``by_verified``: its signature verified with that operator's key.

    >>> e = audit_entry("suppress", [4], "ops-ann", "leaks a password", "c1", 5.0)
    >>> e["by"], e["by_verified"]
    ('ops-ann', False)
    """
    return {
        "command": command,
        "slots": list(changed),
        "by": by,
        "by_verified": by_verified,  # contract 1.16: proven by an operator's signature (operator_keys)
        "ts": now,
        "reason": reason,
        "id": command_id,
    }


def read_audit(value: Any) -> list[dict[str, Any]]:
    """The audit trail from a checkpoint's metrics: well-formed entries only (a restore never fails on it).

    >>> read_audit([{"command": "suppress", "slots": [1], "by": "a", "ts": 1.0}, "junk", {"ts": "x"}])
    [{'command': 'suppress', 'slots': [1], 'by': 'a', 'by_verified': False, 'ts': 1.0, 'reason': '', 'id': ''}]
    >>> read_audit(None)
    []
    """
    out: list[dict[str, Any]] = []
    for e in value if isinstance(value, list) else []:
        if not _timed(e):
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


def _timed(e: Any) -> bool:
    """An audit entry with a time (the learner's clock when it was applied)."""
    return isinstance(e, dict) and isinstance(e.get("ts"), int | float) and not isinstance(e.get("ts"), bool)


def _within_the_hour(entries: Iterable[Any], now: float, commands: Sequence[str]) -> int:
    """How many of ``entries`` are of ``commands`` and were applied in the hour up to ``now``."""
    return sum(
        1 for e in entries if _timed(e) and e.get("command") in commands and now - RATE_WINDOW_S < e["ts"] <= now
    )


# --------------------------------------------------------------------------- rollback, reset, cut-over


@dataclass(frozen=True)
class CommandDecision:
    """Whether a rollback, reset or cut-over is carried out: ``apply``, or ``refused`` with the dead
    letter's ``reason`` and a ``detail`` for the operator."""

    verdict: Literal["apply", "refused"]
    reason: str = ""
    detail: str = ""


def decide_command(command: str, recent: Sequence[dict[str, Any]], now: float, *, per_hour: int) -> CommandDecision:
    """Whether ``command`` (one of :data:`GATE_BYPASSING`) may force its checkpoint now.

    ``recent``: the entries of the commands carried out so far (:func:`command_entry`; others are
    not counted); ``now``: the learner's clock.

    >>> done = [command_entry("rollback", "ops", "", f"c{i}", 100.0 + i) for i in range(6)]
    >>> decide_command("reset", done[:5], 110.0, per_hour=6)
    CommandDecision(verdict='apply', reason='', detail='')
    >>> decide_command("reset", done, 110.0, per_hour=6).detail
    'reset refused: 6 rollbacks, resets and cut-overs in the last hour, at most 6 (control_checkpoints_per_hour)'
    >>> decide_command("reset", done, 100.0 + 3600 + 6, per_hour=6).verdict  # an hour later
    'apply'
    """
    if command not in GATE_BYPASSING:
        raise ValueError(f"not a command that bypasses the gate: {command!r}")
    recent_n = _within_the_hour(recent, now, GATE_BYPASSING)
    if recent_n >= per_hour:
        return CommandDecision(
            "refused",
            "rate_limited",
            f"{command} refused: {recent_n} rollbacks, resets and cut-overs in the last hour, "
            f"at most {per_hour} (control_checkpoints_per_hour)",
        )
    return CommandDecision("apply")


def command_entry(
    command: str, by: str, reason: str, command_id: str, now: float, by_verified: bool = False
) -> dict[str, Any]:
    """The audit entry of a rollback, reset or cut-over carried out: a suppression's, without slots.

    >>> command_entry("rollback", "ops-bob", "regression", "rollback-1", 5.0)["by_verified"]
    False
    """
    entry = audit_entry(command, [], by, reason, command_id, now, by_verified)
    del entry["slots"]
    return entry


def read_commands(metrics: Iterable[Any]) -> list[dict[str, Any]]:
    """The entries (``control``) of the rollbacks, resets and cut-overs that checkpoints' metrics carry,
    oldest first: well-formed ones only (a restore never fails on them).

    >>> read_commands([{"control": command_entry("reset", "", "drift", "r1", 7.0)}, {"updates": 3}, "junk",
    ...                {"control": {"command": "suppress", "ts": 1.0}}, {"control": {"command": "reset"}}])
    [{'command': 'reset', 'by': '', 'by_verified': False, 'ts': 7.0, 'reason': 'drift', 'id': 'r1'}]
    """
    out = []
    for m in metrics:
        e = m.get("control") if isinstance(m, dict) else None
        if isinstance(e, dict) and _timed(e) and e.get("command") in GATE_BYPASSING:
            out.append(
                command_entry(
                    str(e["command"]),
                    str(e.get("by") or ""),
                    str(e.get("reason") or ""),
                    str(e.get("id") or ""),
                    float(e["ts"]),
                )
            )
    return sorted(out, key=lambda e: e["ts"])
