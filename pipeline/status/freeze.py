"""Why the serving version has not moved, read from the model topic (``causalmem status``, the health page).

A learner whose candidates the gate cannot decide trains and publishes as usual; only the
serving version standing still shows it. The view counts the candidates newer than the
serving version on the model topic, and takes from the newest manifest's ``metrics.gate``
(written by the learner, :mod:`pipeline.learner.freeze`) since when that version serves,
and the gate's last decision and reason. Without that record
(a learner from before it, or the gate off) the serving manifest's creation time stands in.
"""

from __future__ import annotations

from typing import Any

from pipeline.modeltopic import ModelTopicIndex
from topics.fields import PROBE

# Serving this long while candidates wait is a freeze (the CausalmemServingFrozen alert's bound).
FROZEN_AFTER_S = 1800.0


def short_age(seconds: float) -> str:
    """An age in its largest unit: ``45s``, ``12m``, ``3h 05m``, ``2d 04h``.

    >>> [short_age(x) for x in (45, 720, 11100, 187200)]
    ['45s', '12m', '3h 05m', '2d 04h']
    """
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m"
    if s < 86400:
        return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d {int(s % 86400 // 3600):02d}h"


def freeze_line(serving_version: int, seconds: float, waiting: int, reason: str | None) -> str:
    """The one line status and the health page show.

    >>> freeze_line(1, 720.0, 20, "v21 waits: ESS 8 < 50 needed")
    'serving v1 for 12m while 20 candidates waited: v21 waits: ESS 8 < 50 needed'
    """
    what = "candidate" if waiting == 1 else "candidates"
    line = f"serving v{serving_version} for {short_age(seconds)} while {waiting} {what} waited"
    return f"{line}: {reason}" if reason else line


def freeze_view(
    index: ModelTopicIndex, policy: str, now: float, frozen_after_s: float = FROZEN_AFTER_S
) -> dict[str, Any]:
    """The serving version's standing: how long, how many candidates newer than it, the gate's last word.

    ``line`` is None while no candidate waits; ``frozen`` once candidates waited for
    ``frozen_after_s``.
    """
    serving = index.serving_head(policy)
    newest = index.newest(policy)
    record = newest.metrics.get("gate") if newest is not None else None
    record = record if isinstance(record, dict) else {}
    out: dict[str, Any] = {
        "serving_version": None,
        "seconds": None,
        "candidates_waiting": 0,
        "decision": None,
        "reason": None,
        "frozen": False,
        "line": None,
    }
    if serving is None:
        return out
    since = record.get("serving_since")
    # Contract 1.19 (1.23): under a probe clients still serve their own ranking (the certified
    # version) but on the exploration share: the clock did not restart.
    probe = serving.reason == PROBE
    if not isinstance(since, int | float) or (record.get("serving_version") != serving.version and not probe):
        since = serving.created_ts  # promoted no earlier than it was created
    waiting = sum(1 for m in index.links(policy) if m.version > serving.version)
    reason = record.get("reason") if isinstance(record.get("reason"), str) else None
    version = record.get("candidate_version")
    if reason and isinstance(version, int) and record.get("decision") == "insufficient":
        reason = f"v{version} waits: {reason}"
    elif reason and isinstance(version, int):
        reason = f"v{version} {record.get('decision')}: {reason}"
    seconds = max(0.0, now - float(since))
    out.update(serving_version=serving.version, seconds=round(seconds, 3), candidates_waiting=waiting)
    out.update(decision=record.get("decision"), reason=reason)
    if waiting:
        out["line"] = freeze_line(serving.version, seconds, waiting, reason)
        out["frozen"] = seconds >= frozen_after_s
    return out
