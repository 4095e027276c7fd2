"""The worker's faust tables and the topics its stages write, declared on one app.

Per-query tables are keyed by the raw query id and use Kafka's default (murmur2)
partitioner over the co-partitioned topics' partition count, so each query's state lives
on the partition its events, labels and outcomes arrive on. The drift tables have one
partition (one owner); ``drift-status`` is global, so every worker reports it.
Values are the typed records of :mod:`pipeline.worker.records`.

The tables whose value changed shape when they became records carry a ``-v2`` suffix:
a worker upgraded on a live cluster starts them empty instead of failing to read the old
changelog (the others read their old values as records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faust

from pipeline.worker.records import (
    DriftPair,
    DriftStatus,
    PendingSamples,
    QueryUtility,
    Rating,
    SeenLabels,
    SentSteps,
    StoredSamples,
    TriggerState,
    Verdict,
)
from topics.names import Topics


@dataclass(frozen=True)
class Tables:
    """faust tables (``Any``: faust's table types are not generic over their values)."""

    query_util: Any  # QueryUtility
    verdicts: Any  # Verdict
    ratings: Any  # Rating
    al_pending: Any  # PendingSamples
    al_sent: Any  # SentSteps
    al_samples: Any  # StoredSamples
    labels_seen: Any  # SeenLabels
    drift_pairs: Any  # DriftPair, keyed by pair id
    drift_state: Any  # TriggerState, key b"trigger"
    drift_status: Any  # DriftStatus, key b"status" (global)

    @classmethod
    def declare(cls, app: faust.App, partitions: int) -> Tables:
        def per_query(name: str, value_type: type[faust.Record]) -> Any:
            return app.Table(
                name,
                default=None,
                key_type=bytes,
                value_type=value_type,
                use_partitioner=True,
                partitions=partitions,
            )

        return cls(
            query_util=per_query("query-utility", QueryUtility),
            verdicts=per_query("verdicts", Verdict),
            ratings=per_query("ratings", Rating),
            al_pending=per_query("al-pending-v2", PendingSamples),
            al_sent=per_query("al-sent-v2", SentSteps),
            al_samples=per_query("al-samples-v2", StoredSamples),
            labels_seen=per_query("labels-seen-v2", SeenLabels),
            drift_pairs=app.Table("drift-pairs-v2", default=None, key_type=bytes, value_type=DriftPair, partitions=1),
            drift_state=app.Table("drift-state", default=None, key_type=bytes, value_type=TriggerState, partitions=1),
            drift_status=app.GlobalTable(
                "drift-status", default=None, key_type=bytes, value_type=DriftStatus, partitions=1
            ),
        )


@dataclass(frozen=True)
class Outputs:
    """The faust topics the stages write (raw bytes: every value is encoded by the codec)."""

    active_learning: Any
    experiences: Any
    dead_letter: Any
    rating_pairs: Any
    control: Any

    @classmethod
    def declare(cls, app: faust.App, topics: Topics) -> Outputs:
        return cls(
            active_learning=raw_topic(app, topics.active_learning.name, topics.active_learning.partitions),
            experiences=raw_topic(app, topics.experiences.name, 1),
            dead_letter=raw_topic(app, topics.dead_letter.name, 1),
            rating_pairs=raw_topic(app, topics.rating_pairs.name, 1),
            control=raw_topic(app, topics.control.name, 1),
        )


def raw_topic(app: faust.App, name: str, partitions: int) -> Any:
    """A faust topic of raw key and value bytes."""
    return app.topic(
        name, partitions=partitions, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw"
    )
