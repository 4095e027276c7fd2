"""The worker's state: RocksDB tables by default, kept across restarts, bounded in bytes."""

from __future__ import annotations

import asyncio
import uuid
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from causalmem_lab.procs import Child
from faust.stores.base import SerializedStore
from faust.stores.rocksdb import Store as RocksDBStore
from faust.streams import _current_event

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from pipeline.metrics import Metrics
from pipeline.promtext import metric
from pipeline.worker.app import Worker
from pipeline.worker.records import PendingSamples, QueryUtility, StoredSamples, encoded_size
from pipeline.worker.store import WorkerStore
from pipeline.worker.tables import STORE_URLS, Tables, claim_slot, match_epoch
from pipeline.worker.upkeep import Upkeep, table_entries
from tests.conftest import settings_env
from tests.helpers import feedback, retrieval_event, until

T0 = 1_767_225_600.0  # 2026-01-01: the join dead-letters event times too far ahead of the wall clock


class FakeTable(dict[bytes, Any]):
    """A table on the memory store, as far as the prune looks: items, deletion, a non-serialized store."""

    data: Any = None


class FakeRawStore(SerializedStore):
    """The prune's view of the RocksDB store: raw (key, value) bytes."""

    def __init__(self, items: dict[bytes, bytes]) -> None:  # no faust app needed
        self.items_ = items

    def _iteritems(self) -> Any:
        return iter(list(self.items_.items()))


FakeRawStore.__abstractmethods__ = frozenset()  # only _iteritems is used


class RawTable(dict[bytes, Any]):
    def __init__(self, records: dict[bytes, faust.Record]) -> None:
        super().__init__(records)
        self.data = FakeRawStore({k: v.dumps(serializer="json") for k, v in records.items()})

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        del self.data.items_[key]


def _upkeep(tables: dict[str, Any], **caps: Any) -> Upkeep:
    s = Settings(partitions=2, embedding_dim=8, slots=32).replace(**caps)
    names = ("query_util", "verdicts", "ratings", "al_pending", "al_sent", "al_samples", "labels_seen")
    t = Tables(**{n: tables.get(n, FakeTable()) for n in names}, drift_pairs={}, drift_state={}, drift_status={})
    join = SimpleNamespace(event_clock=lambda: T0 + 1000.0)  # the slowest partition's event time
    return Upkeep(s.worker(), t, join, Metrics(), app=None, stage_topics=frozenset())  # type: ignore[arg-type]


def _sample(i: int, size: int) -> PendingSamples:
    return PendingSamples(samples={"0": '{"event_id": "e' + str(i) + '", "x": "' + "a" * size + '"}'}, ts=T0 + i)


@pytest.mark.parametrize("raw", [False, True], ids=["memory", "rocksdb"])
def test_prune_keeps_each_group_under_its_byte_cap_oldest_first(raw: bool) -> None:
    """Byte caps hold whatever the entry counts: the samples group and the query-state group."""
    pending = {f"q{i}".encode(): _sample(i, 1000) for i in range(50)}
    stored = {f"q{i}".encode(): StoredSamples(samples=_sample(i, 1000).samples, ts=T0 + i + 0.5) for i in range(50)}
    utils = {f"q{i}".encode(): QueryUtility(sum=0.5, n=1, steps=[0], ts=T0 + i) for i in range(400)}

    def make(records: dict[bytes, Any]) -> Any:
        return RawTable(records) if raw else FakeTable(records)

    tables = {"al_pending": make(pending), "al_samples": make(stored), "query_util": make(utils)}
    biggest = max(len(k) + encoded_size(v) for k, v in pending.items())
    upkeep = _upkeep(tables, al_pending_max_bytes=20_000, query_state_max_bytes=10_000)
    asyncio.run(upkeep.prune())

    left = {name: table_entries(t) for name, t in tables.items()}
    sample_bytes = sum(size for name in ("al_pending", "al_samples") for _, size, _ in left[name])
    assert 20_000 - 2 * biggest < sample_bytes <= 20_000
    assert sum(size for _, size, _ in left["query_util"]) <= 10_000
    # The newest survive: what is left is a suffix in event time.
    kept = sorted(int(k[1:]) for _, _, k in left["al_pending"])
    assert kept and kept == list(range(kept[0], 50))
    kept_u = sorted(int(k[1:]) for _, _, k in left["query_util"])
    assert kept_u == list(range(kept_u[0], 400)) and len(kept_u) < 400


def test_prune_still_applies_counts_and_the_label_window() -> None:
    utils = {f"q{i}".encode(): QueryUtility(sum=0.5, n=1, steps=[0], ts=T0 - 90_000 + i * 1000) for i in range(100)}
    table = FakeTable(utils)
    asyncio.run(_upkeep({"query_util": table}, query_state_max=10).prune())
    # the label window (86,400 s before the event clock) leaves the last ~87; the count cap 10
    assert sorted(table) == sorted(f"q{i}".encode() for i in range(90, 100))


def test_encoded_size_matches_what_rocksdb_holds() -> None:
    recs = [QueryUtility(sum=0.1 * i, n=i, steps=list(range(i)), ts=T0 + i) for i in range(1, 40)]
    recs += [_sample(i, 10 * i) for i in range(40)]
    for r in recs:
        real = len(r.dumps(serializer="json"))
        assert abs(encoded_size(r) - real) <= max(16, 0.02 * real), (r, encoded_size(r), real)


def test_workers_take_separate_table_slots_and_a_new_cluster_empties_one(tmp_path: Path) -> None:
    (a, lock_a), (b, lock_b) = claim_slot(tmp_path), claim_slot(tmp_path)
    assert a != b
    assert not match_epoch(a, b'{"created_ts": 1}')
    (a / "query-utility-0.db").mkdir()
    assert not match_epoch(a, b'{"created_ts": 1}') and (a / "query-utility-0.db").exists()
    assert not match_epoch(a, None) and (a / "query-utility-0.db").exists()  # unknown: kept
    assert match_epoch(a, b'{"created_ts": 2}') and not (a / "query-utility-0.db").exists()
    lock_a.close()
    assert claim_slot(tmp_path)[0] == a  # a restarted worker gets its own data back
    lock_b.close()


def test_worker_tables_are_on_rocksdb_by_default(tmp_path: Path) -> None:
    s = Settings(partitions=2, embedding_dim=8, slots=32, state_dir=str(tmp_path))
    assert s.worker().store == "rocksdb"
    worker = Worker(s.worker(), "127.0.0.1:9", Metrics())
    worker.table_dir(b"marker")
    store = worker.tables.query_util.data
    assert isinstance(store, WorkerStore) and store.use_rocksdict
    assert store.partition_path(1).parent == tmp_path / "faust" / "tables" / "causalmem-worker" / "slot-0"
    # Sized for dozens of databases, not faust's 2 GiB block cache each.
    assert store.rocksdb_options.block_cache_size <= 16 * 1024 * 1024
    memory = Worker(s.replace(worker_store="memory").worker(), "127.0.0.1:9", Metrics())
    assert not isinstance(memory.tables.query_util.data, SerializedStore)
    with pytest.raises(ValueError, match="worker store"):
        s.replace(worker_store="sqlite").worker()


class _Event:
    """What the store reads of faust's current event: its message's partition."""

    def __init__(self, partition: int) -> None:
        self.message = SimpleNamespace(partition=partition)


def _event_in(partition: int) -> _Event:
    event = _Event(partition)
    _current_event.set(weakref.ref(event))
    return event  # keep it alive while it is the current event


def test_worker_store_reads_through_its_cache_and_the_event_partition(tmp_path: Path) -> None:
    app = faust.App("t", store=STORE_URLS["rocksdb"], datadir=str(tmp_path), autodiscover=False)
    table = app.Table("qu", default=None, key_type=bytes, value_type=QueryUtility, use_partitioner=True, partitions=4)
    store = table.data
    assert isinstance(store, WorkerStore)
    for p in range(4):
        store._db_for_partition(p)
    q = QueryUtility(sum=0.5, n=1, steps=[0], ts=T0)
    ev = _event_in(2)
    store[b"a"] = q
    assert store[b"a"] is q  # decoded once, kept
    assert store._dbs[2].get(b"a") is not None  # written through to the event's partition
    store._decoded.clear()
    assert store[b"a"] == q and store[b"a"] is not q  # read back from RocksDB
    with pytest.raises(KeyError):
        store[b"b"]
    assert b"a" in store and b"b" not in store
    ev = _event_in(1)  # another partition's event still finds a key faust indexed
    assert store[b"a"] == q
    store._key_index.clear()
    store._decoded.clear()
    ev = _event_in(2)
    assert store[b"a"] == q  # not indexed: the event's partition holds it
    del store[b"a"]
    with pytest.raises(KeyError):
        store[b"a"]
    store[b"c"] = q
    store.apply_changelog_batch([], lambda k: k, lambda v: v)  # faust wrote behind the cache
    assert not store._decoded
    _current_event.set(None)
    del ev


@pytest.mark.broker
async def test_worker_state_is_on_disk_and_resumes_from_its_offset(settings: Settings, tmp_path: Path) -> None:
    """After a run the RocksDB tables hold the state and the changelog offset it reached.

    A restarted worker therefore seeks past what it has (faust's persisted offset) instead
    of replaying the whole changelog, and still has every query's U_query.
    """
    import rocksdict

    s = settings.replace(topic_prefix=f"w{uuid.uuid4().hex[:6]}.", join_window_s=86400.0)
    env = settings_env(s)
    await kafka.create_topics(s.bootstrap, s)
    n = 40
    worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker.log")
    try:
        await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 60, "worker")
        async with EventPublisher(s.bootstrap, s) as pub:
            for i in range(n):
                ev = retrieval_event(s, f"q{i}", ts=T0 + i)
                await pub.publish(ev)
                await pub.publish(feedback(ev.query_id, ts=T0 + i + 1, utility=0.25))
        changelog = f"{s.worker().app_id}-query-utility-changelog"
        records: list[Any] = []
        for _ in range(120):
            records = await kafka.read_all(s.bootstrap, s, changelog)
            if len({m.key for m in records}) >= n:
                break
            await asyncio.sleep(0.5)
        assert len({m.key for m in records}) == n
    finally:
        worker.stop()  # SIGTERM
    last = {}  # changelog partition -> last offset
    for m in records:
        last[m.partition] = max(m.offset, last.get(m.partition, -1))

    slot = Path(s.state_dir) / "faust" / "tables" / s.worker().app_id / "slot-0"
    keys: set[bytes] = set()
    persisted = {}
    for partition in last:
        path = slot / f"query-utility-{partition}.db"
        assert path.is_dir(), sorted(p.name for p in slot.iterdir())
        db = rocksdict.Rdict(
            str(path), options=rocksdict.Options(raw_mode=True), access_type=rocksdict.AccessType.read_only()
        )
        try:
            for k, v in db.items():
                if k == RocksDBStore.offset_key:
                    persisted[partition] = int(v)
                else:
                    keys.add(k)
                    assert QueryUtility.loads(v, serializer="json").n == 1
        finally:
            db.close()
    assert keys == {f"q{i}".encode() for i in range(n)}
    # Each database knows how far into the changelog it is: a restart reads from there on.
    assert persisted == last
    # ... and the clean stop vouched for it (a crash would leave no marker: rebuilt instead).
    assert (slot / "query-utility.clean").exists()

    # Restarted (killed this time), the worker takes its slot back and goes on from its state.
    worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker-2.log")
    try:
        await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 60, "worker")
        async with EventPublisher(s.bootstrap, s) as pub:
            for i in range(5):
                ev = retrieval_event(s, f"q{i}", step=1, ts=T0 + 100 + i)
                await pub.publish(ev)
                await pub.publish(feedback(ev.query_id, step=1, ts=T0 + 101 + i, utility=0.75))
        start = {p: o + 1 for p, o in last.items()}
        latest: dict[bytes, QueryUtility] = {}
        for _ in range(120):
            for m in await kafka.read_all(s.bootstrap, s, changelog, start=start):
                latest[m.key] = QueryUtility.loads(m.value, serializer="json")
            if len(latest) >= 5:
                break
            await asyncio.sleep(0.5)
        assert {k: (q.n, q.u_query) for k, q in latest.items()} == {f"q{i}".encode(): (2, 0.5) for i in range(5)}
    finally:
        worker.kill()
    assert not (slot.parent / "slot-1").exists()
