"""The worker's typed table values: faust records, one per table.

Table values are faust :class:`~faust.Record` subclasses: faust keeps them as objects in
memory and writes them as JSON to the tables' changelog topics (internal; the format
may change between versions, the changelogs are rebuilt from scratch on a new cluster).
Every per-query record carries ``ts``, the latest event time it saw, which is what the
upkeep prunes by.

The values on the worker's internal topics (``outcomes``, ``rating-pairs``) are wire
values, in :mod:`topics.internal`. An error or uncertain candidate reaches the outcomes
stage as its ActiveLearningSample, encoded once by the join, and is kept here as that
text (:class:`PendingSamples`, :class:`StoredSamples`) until a labeler's answer needs
its fields.
"""

from __future__ import annotations

import faust

from models.drift import DriftTrigger

MAX_STEPS_PER_QUERY = 256  # steps remembered per query (U_query dedupe, samples sent)


# --------------------------------------------------------------------------- table records
# Keyed by the raw query id (bytes) unless said otherwise.


class QueryUtility(faust.Record, serializer="json"):
    """``query-utility``: the running sum behind U_query and the steps already counted."""

    sum: float
    n: int
    steps: list[int]
    ts: float

    @property
    def u_query(self) -> float:
        return self.sum / self.n if self.n else 0.0


class Verdict(faust.Record, serializer="json"):
    """``verdicts``: the query's answer was judged correct or not."""

    correct: bool
    ts: float


class Rating(faust.Record, serializer="json"):
    """``ratings``: the query's latest rating; ``paired`` once its (U_query, rating) pair went out."""

    rating: int
    ts: float
    paired: bool = False


class PendingSamples(faust.Record, serializer="json"):
    """``al-pending``: error samples (encoded) by step, waiting for the query's verdict."""

    samples: dict[str, str]  # str(step) -> encoded ActiveLearningSample
    ts: float


class SentSteps(faust.Record, serializer="json"):
    """``al-sent``: the steps whose sample went out (once per (query_id, step))."""

    steps: list[int]
    ts: float


class StoredSamples(faust.Record, serializer="json"):
    """``al-samples``: the samples sent, by sample id, kept until answered or pruned."""

    samples: dict[str, str]  # sample_id -> encoded ActiveLearningSample
    ts: float


class SeenLabels(faust.Record, serializer="json"):
    """``labels-seen``: the label event ids applied (each label counts once)."""

    ids: list[str]
    ts: float


class DriftPair(faust.Record, serializer="json"):
    """``drift-pairs`` (keyed by pair id): one (event time, U_query, rating) pair in the window."""

    t: float
    u: float
    r: float


class TriggerState(faust.Record, serializer="json"):
    """``drift-state`` (key ``trigger``): the reset trigger's state across restarts."""

    reference: float | None = None
    last_reset_t: float | None = None
    resets: int = 0
    since_reset: int = 0
    peak: float | None = None
    peak_t: float | None = None

    @classmethod
    def of(cls, trigger: DriftTrigger) -> TriggerState:
        return cls(
            reference=trigger.reference,
            last_reset_t=trigger.last_reset_t,
            resets=trigger.resets,
            since_reset=trigger.since_reset,
            peak=trigger.peak,
            peak_t=trigger.peak_t,
        )

    def state(self) -> dict[str, float | int | None]:
        return {
            "reference": self.reference,
            "last_reset_t": self.last_reset_t,
            "resets": self.resets,
            "since_reset": self.since_reset,
            "peak": self.peak,
            "peak_t": self.peak_t,
        }


class DriftStatus(faust.Record, serializer="json"):
    """``drift-status`` (global, key ``status``): what every worker reports about drift."""

    correlation: float
    pairs: int
    reference: float | None
    t: float
    resets: int
    last_fired_by: str | None = None
