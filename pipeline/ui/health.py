"""The health page: the memory health score, its band and what the band asks, trends, gate and checkpoints.

- **Score and band** — the workers' own health score (``causalmem_memory_health_score``,
  :mod:`models.memory.health`), the worst among the ``--worker`` endpoints, as ``causalmem
  status`` shows it. Without an endpoint the page computes the score from the topics it
  reads (no correlation known: that term counts 0.5) and says so.
- **Trends** — per time bucket of event time: U_system (mean utility of the joined steps,
  from ``experiences``), the intervention rate (share of candidates the hard drop removed)
  and the fallback rate (from ``retrieval-events``).
- **Gate decisions** — the candidate checkpoints on the model topic and whether each was
  then served; the gate's estimates from the learner's metrics when ``--learner`` is given.
- **Checkpoints** — the serving and candidate versions (``causalmem status``'s collector), and
  while candidates newer than the serving version wait, ``causalmem status``'s line on why
  serving has not moved (:mod:`pipeline.status.freeze`), marked as a freeze after 30 minutes.

The page refreshes itself by polling ``/health/data`` (JSON).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from models.memory.health import band as health_band
from models.memory.health import health_score
from pipeline.promtext import labelled
from topics.events import RetrievalEvent
from topics.internal import Experience

# Seed 000's bands, and what each asks of the operator.
BANDS: tuple[tuple[str, float, str], ...] = (
    ("efficient", 90.0, "Nothing to do: memories help and the policy agrees with people."),
    ("healthy", 70.0, "Watch the trends; review the memories sorted by “probably harmful” weekly."),
    (
        "warning",
        50.0,
        "Look now: check the memories marked probably harmful (propose “do not use”), label the queue, "
        "and check the gate's recent refusals.",
    ),
    (
        "critical",
        -math.inf,
        "Act: the policy or the memory bank is failing. Check the fallback rate and the learner (causalmem status), "
        "consider a rollback (causalmem rollback) and clear the labeling queue.",
    ),
)


def band_advice(score: float | None) -> dict[str, Any] | None:
    """The band of a score and its advice.

    >>> band_advice(72.0)["band"], band_advice(49.9)["band"], band_advice(None)
    ('healthy', 'critical', None)
    """
    if score is None:
        return None
    name = health_band(score)
    advice = next(text for b, _, text in BANDS if b == name)
    return {"score": score, "band": name, "advice": advice}


@dataclass
class Bucket:
    utility_sum: float = 0.0
    steps: int = 0
    nonnegative: int = 0
    events: int = 0
    fallbacks: int = 0
    kept: int = 0
    dropped: int = 0


class Trends:
    """Per-bucket sums over event time (``bucket_s`` wide, the newest ``buckets`` kept)."""

    def __init__(self, bucket_s: float = 3600.0, buckets: int = 48) -> None:
        self.bucket_s = bucket_s
        self.max_buckets = buckets
        self.buckets: OrderedDict[int, Bucket] = OrderedDict()

    def _bucket(self, ts: float) -> Bucket | None:
        key = int(ts // self.bucket_s)
        b = self.buckets.get(key)
        if b is None:
            if self.buckets and len(self.buckets) >= self.max_buckets and key < next(iter(self.buckets)):
                return None  # older than everything kept
            b = self.buckets[key] = Bucket()
            self.buckets = OrderedDict(sorted(self.buckets.items()))
            while len(self.buckets) > self.max_buckets:
                self.buckets.popitem(last=False)
            b = self.buckets.get(key)
        return b

    def observe_event(self, ev: RetrievalEvent) -> None:
        b = self._bucket(ev.ts)
        if b is not None:
            b.events += 1
            b.fallbacks += bool(ev.fallback)
            b.kept += len(ev.candidates)
            b.dropped += len(ev.dropped or [])

    def observe_experience(self, exp: Experience) -> None:
        if exp.kind != "feedback":
            return
        b = self._bucket(exp.event.ts)
        if b is not None:
            b.steps += 1
            b.utility_sum += exp.utility
            b.nonnegative += exp.utility >= 0

    def series(self) -> list[dict[str, Any]]:
        """One point per bucket: start time, U_system, intervention and fallback rates (None when unknown)."""
        out = []
        for key, b in self.buckets.items():
            seen = b.kept + b.dropped
            out.append(
                {
                    "ts": key * self.bucket_s,
                    "u_system": b.utility_sum / b.steps if b.steps else None,
                    "intervention_rate": b.dropped / seen if seen else None,
                    "fallback_rate": b.fallbacks / b.events if b.events else None,
                    "steps": b.steps,
                    "events": b.events,
                }
            )
        return out

    def local_score(self, recent: int = 6) -> float | None:
        """The health score from the newest ``recent`` buckets, without the correlation (counted 0.5)."""
        window = list(self.buckets.values())[-recent:]
        steps = sum(b.steps for b in window)
        seen = sum(b.kept + b.dropped for b in window)
        events = sum(b.events for b in window)
        if not steps or not events:
            return None
        score, _ = health_score(
            correlation=0.0,
            pairs=0,
            min_pairs=1,
            nonnegative_share=sum(b.nonnegative for b in window) / steps,
            intervention_rate=sum(b.dropped for b in window) / seen if seen else 0.0,
            fallback_rate=sum(b.fallbacks for b in window) / events,
        )
        return score


def gate_history(manifests: list[dict[str, Any]], serving_version: int | None) -> list[dict[str, Any]]:
    """The candidates on the model topic, newest first, each with whether it was served.

    ``manifests``: ``{"version", "reason", "created_ts", "candidate", "served"}`` per version.

    >>> gate_history([{"version": 2, "reason": "update", "created_ts": 1.0, "candidate": True, "served": False},
    ...               {"version": 3, "reason": "update", "created_ts": 2.0, "candidate": True, "served": True}], 3)
    [{'version': 3, 'reason': 'update', 'created_ts': 2.0, 'outcome': 'promoted (serving)'}, \
{'version': 2, 'reason': 'update', 'created_ts': 1.0, 'outcome': 'not promoted'}]
    """
    out = []
    for m in sorted(manifests, key=lambda m: -m["version"]):
        if not m["candidate"]:
            continue
        if m["served"]:
            outcome = "promoted (serving)" if m["version"] == serving_version else "promoted"
        elif serving_version is not None and m["version"] > serving_version:
            outcome = "waiting"
        else:
            outcome = "not promoted"
        out.append({"version": m["version"], "reason": m["reason"], "created_ts": m["created_ts"], "outcome": outcome})
    return out


def principals_of(values: dict[str, float]) -> list[dict[str, Any]]:
    """The principals a learner's metrics label (contract 1.15, :func:`pipeline.promtext.parse`'d):
    each one's share of the recent window, the weight of its experiences and whether it is
    flagged as disagreeing with the others; the flagged first, then by share.

    >>> rows = principals_of({
    ...     "causalmem_principal_share{principal=a}": 0.7, "causalmem_principal_weight{principal=a}": 0.3,
    ...     "causalmem_principal_share{principal=b}": 0.1, "causalmem_principal_flagged{principal=b}": 1.0,
    ... })
    >>> [(r["principal"], r["flagged"]) for r in rows]
    [('b', True), ('a', False)]
    """
    share = labelled(values, "causalmem_principal_share", "principal")
    weight = labelled(values, "causalmem_principal_weight", "principal")
    flagged = labelled(values, "causalmem_principal_flagged", "principal")
    rows = [
        {"principal": p, "share": share.get(p), "weight": weight.get(p), "flagged": flagged.get(p, 0.0) >= 1.0}
        for p in sorted(set(share) | set(weight) | set(flagged))
    ]
    return sorted(rows, key=lambda r: (not r["flagged"], -(r["share"] or 0.0)))


def health_page(snapshot: dict[str, Any] | None, trends: Trends, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything the health page shows (also its JSON, ``/health/data``)."""
    snapshot = snapshot or {}
    live = snapshot.get("health")
    score = live["score"] if live else trends.local_score()
    ckpt = snapshot.get("checkpoints") or {}
    serving = (ckpt.get("serving") or {}).get("version")
    learners = snapshot.get("learners") or []
    return {
        "health": band_advice(score),
        "score_source": "workers" if live else ("topics (no correlation known)" if score is not None else None),
        "trends": trends.series(),
        "checkpoints": {
            "serving": ckpt.get("serving"),
            "candidate": ckpt.get("candidate"),
            "learners": [x.get("checkpoint_version") for x in learners if x.get("up")],
        },
        "gate": gate_history(manifests, serving),
        "serving_freeze": ckpt.get("freeze"),  # why serving has not moved while candidates wait
        "gate_estimates": snapshot.get("gate_estimates"),
        "shadow": snapshot.get("shadow"),
        "queue_depth": (snapshot.get("active_learning") or {}).get("depth"),
        "dead_letters": (snapshot.get("dead_letter") or {}).get("total"),
        "errors": snapshot.get("errors") or [],
        "ts": snapshot.get("ts"),
    }
