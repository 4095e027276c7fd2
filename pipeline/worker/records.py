"""The worker's typed values: the ``outcomes`` message and the faust tables' records.

Table values are faust :class:`~faust.Record` subclasses: faust keeps them as objects in
memory and writes them as JSON to the tables' changelog topics (internal; the format
may change between versions, the changelogs are rebuilt from scratch on a new cluster).
Every per-query record carries ``ts``, the latest event time it saw, which is what the
upkeep prunes by.

An error or uncertain candidate travels as its ActiveLearningSample, encoded once by the
join (``sample``: the exact bytes the ``active-learning`` topic gets, as text) and never
decoded until a labeler's answer needs its fields.

>>> o = Outcome("q1", 3, 10.0, -0.5, False, "default", al="error", sample='{"x":1}')
>>> Outcome.from_obj(o.to_dict()) == o
True
>>> decode_outcomes(encode_outcomes([o])) == [o]
True
>>> Outcome.from_obj({**o.to_dict(), "sample": None}).al is None
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faust
import orjson

from models.drift import DriftTrigger
from topics.fields import SCHEMA_OUTCOMES, SCHEMA_RATING_PAIR, Limits, encode, loads_object

MAX_STEPS_PER_QUERY = 256  # steps remembered per query (U_query dedupe, samples sent)


# --------------------------------------------------------------------------- outcomes/v1


@dataclass(frozen=True, slots=True)
class Outcome:
    """One joined step, as the join tells the outcomes stage about it."""

    query_id: str
    step: int
    ts: float  # event time of the join: max(event ts, feedback ts)
    utility: float
    fallback: bool
    policy: str
    al: str | None = None  # "error" or "uncertain": a candidate for active learning
    sample: str | None = None  # its ActiveLearningSample, encoded (with ``al``)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "query_id": self.query_id,
            "step": self.step,
            "ts": self.ts,
            "utility": self.utility,
            "fallback": self.fallback,
            "policy": self.policy,
        }
        if self.al is not None:
            out["al"] = self.al
            out["sample"] = self.sample
        return out

    @classmethod
    def from_obj(cls, obj: Any) -> Outcome:
        """Raises ``KeyError``/``TypeError``/``ValueError`` on a malformed record."""
        if not isinstance(obj, dict):
            raise TypeError("an outcome record must be an object")
        al, sample = obj.get("al"), obj.get("sample")
        if al is not None and al not in ("error", "uncertain"):
            raise ValueError(f"unknown candidate reason {al!r}")
        if not isinstance(sample, str):  # an older join sent the event, not the sample: count the utility only
            al = None
        return cls(
            query_id=str(obj["query_id"]),
            step=int(obj["step"]),
            ts=float(obj["ts"]),
            utility=float(obj["utility"]),
            fallback=bool(obj["fallback"]),
            policy=str(obj.get("policy", "default")),
            al=al,
            sample=sample if al is not None else None,
        )


def encode_outcomes(records: list[Outcome]) -> bytes:
    """One ``outcomes`` message: a join batch's records of one partition."""
    return encode({"schema": SCHEMA_OUTCOMES, "records": [r.to_dict() for r in records]})


def decode_outcomes(raw: bytes) -> list[Outcome]:
    """Raises ``ValueError`` (or ``KeyError``/``TypeError``) on a malformed message."""
    body = orjson.loads(raw)
    if not isinstance(body, dict) or body.get("schema") != SCHEMA_OUTCOMES:
        raise ValueError("not an outcomes/v1 message")
    records = body["records"]
    if not isinstance(records, list):
        raise TypeError("records must be a list")
    return [Outcome.from_obj(r) for r in records]


# --------------------------------------------------------------------------- rating_pair/v1


@dataclass(frozen=True, slots=True)
class RatingPair:
    """A query's (U_query, rating) pair at event time ``t``, for the drift stage (``id``: the query id).

    >>> RatingPair.decode(RatingPair("q1", 5.0, 0.25, 4).encode(), Limits())
    RatingPair(id='q1', t=5.0, u_query=0.25, rating=4.0)
    """

    id: str
    t: float
    u_query: float
    rating: float

    def encode(self) -> bytes:
        return encode(
            {"schema": SCHEMA_RATING_PAIR, "id": self.id, "t": self.t, "u_query": self.u_query, "rating": self.rating}
        )

    @classmethod
    def decode(cls, raw: bytes, limits: Limits) -> RatingPair:
        """Raises :class:`~topics.fields.Rejected`, ``KeyError``, ``TypeError`` or ``ValueError`` when malformed."""
        obj = loads_object(raw, limits)
        return cls(str(obj["id"]), float(obj["t"]), float(obj["u_query"]), float(obj["rating"]))


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
