"""Principals in ``causalmem status`` (contract 1.15; docs/learning.md, "Influence per principal").

From the policy's newest manifest (the learner writes ``principals`` and ``quarantined`` into
every checkpoint's metrics, pipeline/learner/principals.py): each shown principal's share of the
learner's recent window, the weight its experiences get, its residual against the other
principals and whether that flags it, and the quarantined ones.

>>> view = principals_view_of({"quarantined": ["bot-9"], "principals": {"bot-9": {"share": 0.0, "weight": 0.0,
...     "n": 80, "residual": -0.9, "low": -1.1, "high": -0.7, "flagged": True, "quarantined": True},
...     "svc-a": {"share": 0.7, "weight": 1.0, "n": 900, "residual": 0.01, "low": -0.02, "high": 0.04,
...     "flagged": False, "quarantined": False}}})
>>> [p["name"] for p in view["principals"]], view["flagged"], view["quarantined"]
(['bot-9', 'svc-a'], ['bot-9'], ['bot-9'])
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.modeltopic import ModelTopicIndex
from topics.principal import valid_principal


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def principals_view_of(metrics: dict[str, Any]) -> dict[str, Any]:
    """The view from one manifest's ``metrics`` (what does not parse is left out)."""
    shown = metrics.get("principals")
    rows = []
    for name, p in shown.items() if isinstance(shown, dict) else ():
        if not valid_principal(name) or not isinstance(p, dict):
            continue
        rows.append(
            {
                "name": name,
                "share": _num(p.get("share")) or 0.0,
                "weight": _num(p.get("weight")),
                "n": int(p["n"]) if isinstance(p.get("n"), int) else 0,
                "residual": _num(p.get("residual")),
                "low": _num(p.get("low")),
                "high": _num(p.get("high")),
                "flagged": p.get("flagged") is True,
                "quarantined": p.get("quarantined") is True,
            }
        )
    quarantined = [q for q in metrics.get("quarantined") or [] if valid_principal(q)]
    return {
        "principals": rows,
        "flagged": [r["name"] for r in rows if r["flagged"]],
        "quarantined": quarantined,
    }


def principals_view(index: ModelTopicIndex, policy: str) -> dict[str, Any]:
    """The view from the policy's newest manifest (empty before the first)."""
    newest = index.newest(policy)
    return principals_view_of(newest.metrics if newest is not None else {})
