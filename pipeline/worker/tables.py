"""The worker's faust tables and the topics its stages write, declared on one app.

Per-query tables are keyed by the raw query id and use Kafka's default (murmur2)
partitioner over the co-partitioned topics' partition count, so each query's state lives
on the partition its events, labels and outcomes arrive on. The drift tables have one
partition (one owner); ``drift-status`` is global, so every worker reports it.
Values are the typed records of :mod:`pipeline.worker.records`.

Where they live (``store``, docs/operations.md "Worker state"): by default in RocksDB
(faust's RocksDB store through the ``rocksdict`` binding, with the shortcuts of
:mod:`pipeline.worker.store`), one database per table partition in
``<state_dir>/tables/<app_id>/slot-<n>``. A restarted worker reads only the
changelog written since its last run. Several workers on one machine each lock their own
slot. A slot filled against another Kafka cluster (a new epoch marker, see
docs/operations.md) is emptied first. With ``memory`` they live in dicts and every start
replays the whole changelogs.

The tables whose value changed shape when they became records carry a ``-v2`` suffix:
a worker upgraded on a live cluster starts them empty instead of failing to read the old
changelog (the others read their old values as records).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import faust
import faust.stores

from pipeline.worker import store
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

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# RocksDB options per table partition (faust opens one database per table partition:
# 7 per-query tables × the partition count, plus the drift tables). faust's defaults
# (64 MiB write buffers ×3, a 2 GiB block cache, each per database) are sized for one
# table, not for ~60: these keep the worst case near 60 × (2 × 4 + 8) MiB.
ROCKSDB_OPTIONS: dict[str, int] = {
    "write_buffer_size": 4 * MIB,
    "max_write_buffer_number": 2,
    "target_file_size_base": 16 * MIB,
    "block_cache_size": 8 * MIB,
}
SAMPLE_CACHE_ENTRIES = 256  # decoded samples kept per sample table (each is kilobytes)
STORE_URLS = {"rocksdb": f"{store.SCHEME}://", "memory": "memory://"}
# faust finds a store class by the URL's scheme in this registry.
faust.stores.STORES.aliases.setdefault(store.SCHEME, "pipeline.worker.store:WorkerStore")
MAX_SLOTS = 64  # workers of one app on one machine
EPOCH_FILE = "epoch"


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
        rocksdb = str(app.conf.store).startswith(f"{store.SCHEME}:")

        def options(cache: int = store.CACHE_ENTRIES) -> dict[str, int] | None:
            # A fresh dict per table: faust's RocksDB store pops keys from the one it gets.
            return {**ROCKSDB_OPTIONS, store.CACHE_OPTION: cache} if rocksdb else None

        def per_query(name: str, value_type: type[faust.Record], cache: int = store.CACHE_ENTRIES) -> Any:
            return app.Table(
                name,
                default=None,
                key_type=bytes,
                value_type=value_type,
                use_partitioner=True,
                partitions=partitions,
                options=options(cache),
            )

        def single(name: str, value_type: type[faust.Record]) -> Any:
            return app.Table(name, default=None, key_type=bytes, value_type=value_type, partitions=1, options=options())

        return cls(
            query_util=per_query("query-utility", QueryUtility),
            verdicts=per_query("verdicts", Verdict),
            ratings=per_query("ratings", Rating),
            al_pending=per_query("al-pending-v2", PendingSamples, SAMPLE_CACHE_ENTRIES),
            al_sent=per_query("al-sent-v2", SentSteps),
            al_samples=per_query("al-samples-v2", StoredSamples, SAMPLE_CACHE_ENTRIES),
            labels_seen=per_query("labels-seen-v2", SeenLabels),
            drift_pairs=single("drift-pairs-v2", DriftPair),
            drift_state=single("drift-state", TriggerState),
            drift_status=app.GlobalTable(
                "drift-status", default=None, key_type=bytes, value_type=DriftStatus, partitions=1, options=options()
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


# --------------------------------------------------------------------------- table directory


def claim_slot(root: Path) -> tuple[Path, IO[str]]:
    """The first ``<root>/slot-<n>`` no other live process holds, and its lock (keep it open).

    RocksDB allows one process per database: two workers of one app on one machine (tests,
    a scale-out on one host) each take their own slot, and a restarted worker takes back
    the lowest free one, with its data. The lock is an ``flock``: the kernel releases it
    when the process exits, is killed, or ``exec``s itself (the file is close-on-exec).

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> (a, lock_a), (b, lock_b) = claim_slot(root), claim_slot(root)
    >>> a.name, b.name
    ('slot-0', 'slot-1')
    >>> lock_a.close(); claim_slot(root)[0].name
    'slot-0'
    """
    for n in range(MAX_SLOTS):
        slot = root / f"slot-{n}"
        slot.mkdir(parents=True, exist_ok=True)
        lock = open(slot / "lock", "a")  # noqa: SIM115 (held for the process's lifetime)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        return slot, lock
    raise RuntimeError(f"{MAX_SLOTS} workers of this app already hold table directories under {root}")


def match_epoch(slot: Path, marker: bytes | None) -> bool:
    """Empty ``slot`` if its tables were filled against another cluster; True if emptied.

    ``marker`` is the value of the cluster's epoch marker (written once when the topics are
    created; a reset cluster, or another one, has another). Without it (unreadable), the
    slot is kept as it is.

    >>> import tempfile
    >>> slot = Path(tempfile.mkdtemp())
    >>> match_epoch(slot, b"one"), (slot / "t-0.db").mkdir(), match_epoch(slot, b"one")
    (False, None, False)
    >>> match_epoch(slot, b"two"), (slot / "t-0.db").exists()
    (True, False)
    """
    if marker is None:
        return False
    stamp = hashlib.sha256(marker).hexdigest()
    path = slot / EPOCH_FILE
    old = path.read_text().strip() if path.exists() else None
    emptied = False
    if old is not None and old != stamp:
        for child in slot.iterdir():
            if child.name not in ("lock", EPOCH_FILE):
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        emptied = True
        log.warning("worker tables in %s were built against another Kafka cluster: emptied", slot)
    if old != stamp:
        path.write_text(stamp + "\n")
    return emptied


def drop_unclean(slot: Path) -> list[str]:
    """Delete the databases of every table in ``slot`` whose last run did not stop cleanly.

    Returns the tables dropped (faust then rebuilds them from their changelogs). Every
    marker is removed: from here on, only this run's clean stop vouches for the tables.
    A database written without a write-ahead log may, after a crash, hold an update whose
    changelog write was never acknowledged; kept, it would stay ahead of its changelog and
    hide that update from the stage re-reading its input (docs/architecture.md, "Nothing
    lost on a crash").

    >>> import tempfile
    >>> slot = Path(tempfile.mkdtemp())
    >>> for name in ("a-0.db", "a-1.db", "b-0.db"): (slot / name).mkdir()
    >>> _ = (slot / ("a" + store.CLEAN_SUFFIX)).touch()
    >>> drop_unclean(slot), sorted(p.name for p in slot.iterdir())
    (['b'], ['a-0.db', 'a-1.db'])
    >>> drop_unclean(slot), sorted(p.name for p in slot.iterdir())
    (['a'], [])
    """
    clean = {p.name[: -len(store.CLEAN_SUFFIX)] for p in slot.glob(f"*{store.CLEAN_SUFFIX}")}
    dropped: set[str] = set()
    for db in slot.glob("*.db"):
        table = db.stem.rsplit("-", 1)[0]  # <table>-<partition>.db
        if table not in clean:
            shutil.rmtree(db) if db.is_dir() else db.unlink()
            dropped.add(table)
    for table in clean:
        (slot / f"{table}{store.CLEAN_SUFFIX}").unlink()
    if dropped:
        log.warning("worker tables %s in %s: no clean stop, rebuilt from their changelogs", sorted(dropped), slot)
    return sorted(dropped)
