"""The worker's typed table values: faust records, one per table.

Table values are faust :class:`~faust.Record` subclasses: faust keeps them as objects in
memory and writes them as JSON to the tables' changelog topics (internal; the format
may change between versions, the changelogs are rebuilt from scratch on a new cluster).
Every per-query record carries ``ts``, the latest event time it saw, which is what the
upkeep prunes by; its caps count each entry's encoded size (:func:`raw_ts`,
:func:`encoded_size`).

The values on the worker's internal topics (``outcomes``, ``rating-pairs``) are wire
values, in :mod:`topics.internal`. An error or uncertain candidate reaches the outcomes
stage as its ActiveLearningSample, encoded once by the join, and is kept here as that
text (:class:`PendingSamples`, :class:`StoredSamples`) until a labeler's answer needs
its fields.
"""

from __future__ import annotations

import re
from collections.abc import Callable

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
        record = cls.from_data(trigger.state())  # the trigger's own state fields, nothing more
        assert isinstance(record, cls)
        return record

    def state(self) -> dict[str, float | int | None]:
        """What :meth:`DriftTrigger.load` takes back (the fields above)."""
        return {name: getattr(self, name) for name in DriftTrigger.STATE_FIELDS}


class DriftStatus(faust.Record, serializer="json"):
    """``drift-status`` (global, key ``status``): what every worker reports about drift."""

    correlation: float
    pairs: int
    reference: float | None
    t: float
    resets: int
    last_fired_by: str | None = None


# --------------------------------------------------------------------------- entry sizes
# What the prune counts against the byte caps: an entry's key and value as the RocksDB
# store and the changelog hold them (faust's JSON of the record). docs/operations.md gives
# the measured cost of an entry beyond that, per store.

_TS_FIELD = re.compile(rb'"ts":(-?[0-9.eE+-]+)[,}]')


def raw_ts(value: bytes) -> float:
    """The ``ts`` field of an encoded record, without decoding it (0.0: none).

    The top-level ``ts`` is the last unescaped ``"ts":`` (the samples inside are escaped
    JSON text, in which every quote is ``\\"``).

    >>> raw_ts(Verdict(correct=True, ts=1.5e9).dumps(serializer="json"))
    1500000000.0
    >>> raw_ts(StoredSamples(samples={"s": '{"ts":7}'}, ts=3.25).dumps(serializer="json"))
    3.25
    """
    found = _TS_FIELD.findall(value)
    return float(found[-1]) if found else 0.0


def encoded_size(value: faust.Record | None) -> int:
    """About the bytes of ``value`` as faust encodes it (for the memory store, without encoding it).

    The record's fixed part is measured once per class; its lists and samples are counted.
    Within a few percent of the encoded length for the records the per-query tables hold.

    >>> q = QueryUtility(sum=1.25, n=3, steps=[0, 1, 2], ts=1.8e9)
    >>> abs(encoded_size(q) - len(q.dumps(serializer="json"))) <= 16
    True
    >>> p = PendingSamples(samples={"0": '{"event_id": "e", "ts": 1800000000.5}' * 40}, ts=1.8e9)
    >>> abs(encoded_size(p) - len(p.dumps(serializer="json"))) < 0.02 * encoded_size(p)
    True
    """
    if value is None:
        return 4
    base = _BASE_SIZES.get(type(value))
    if base is None:
        return len(value.dumps(serializer="json"))
    n = base()
    samples = getattr(value, "samples", None)
    if samples:
        # The samples are JSON text inside JSON: every quote gains a backslash.
        n += sum(len(k) + 6 + len(v) + v.count('"') for k, v in samples.items())
    steps = getattr(value, "steps", None)
    if steps:
        n += sum(len(str(i)) + 1 for i in steps)
    ids = getattr(value, "ids", None)
    if ids:
        n += sum(len(i) + 3 for i in ids)
    return n


def _fixed(example: faust.Record) -> Callable[[], int]:
    size: list[int] = []

    def get() -> int:
        if not size:
            size.append(len(example.dumps(serializer="json")))
        return size[0]

    return get


_TS_EXAMPLE = 1_800_000_000.125  # an event time of typical length
_BASE_SIZES: dict[type, Callable[[], int]] = {
    QueryUtility: _fixed(QueryUtility(sum=-12.3456789, n=10, steps=[], ts=_TS_EXAMPLE)),
    Verdict: _fixed(Verdict(correct=False, ts=_TS_EXAMPLE)),
    Rating: _fixed(Rating(rating=1, ts=_TS_EXAMPLE, paired=False)),
    PendingSamples: _fixed(PendingSamples(samples={}, ts=_TS_EXAMPLE)),
    SentSteps: _fixed(SentSteps(steps=[], ts=_TS_EXAMPLE)),
    StoredSamples: _fixed(StoredSamples(samples={}, ts=_TS_EXAMPLE)),
    SeenLabels: _fixed(SeenLabels(ids=[], ts=_TS_EXAMPLE)),
}
