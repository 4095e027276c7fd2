"""The worker's RocksDB table store: faust's, with two shortcuts for per-query tables.

faust's RocksDB store (``rocksdb://``, the ``rocksdict`` binding) keeps one database per
table partition. Two costs of it dominate the outcomes stage, which reads and writes a
few per-query entries for every joined step:

- **a miss probes every partition's database.** A key not in faust's key → partition
  index is looked up in all of them (bloom filters, then reads); every new query is such
  a miss. The per-query tables are co-partitioned with their input topics (same key, same
  murmur2 partitioner, same partition count: the worker refuses to start otherwise), so
  while a stage processes an event, a key of that event lives in the event's partition or
  nowhere: one probe;
- **every read decodes JSON into a record.** Recently used values are kept decoded
  (write-through, :data:`CACHE_ENTRIES` per table), so a query's second step reads its
  U_query from memory (the sample tables keep few: their values are kilobytes). The
  cache is dropped whenever faust writes the databases behind
  its back (changelog recovery, standby updates) and on every rebalance.

Reads outside an event (the upkeep's prune iterates raw items) take faust's path.

A database is trusted at start only if the last run stopped cleanly with every changelog
write acknowledged (its ``<table>.clean`` marker); after a crash it is rebuilt from the
changelog (:func:`pipeline.worker.tables.drop_unclean`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import rocksdict
from faust.stores.rocksdb import Store as RocksDBStore
from faust.streams import current_event

CACHE_ENTRIES = 10_000  # decoded values kept per table by default (~5 MB of small records)
CACHE_OPTION = "decoded_cache_entries"  # a table's own size, in its store options
SCHEME = "causalmem-rocksdb"  # registered with faust's store registry by pipeline.worker.tables
CLEAN_SUFFIX = ".clean"  # <table>.clean next to its databases: written by a clean stop
STOP_SETTLE_S = 10.0  # how long a stopping store waits for its changelog writes' acknowledgements

log = logging.getLogger(__name__)


class WorkerStore(RocksDBStore):
    """faust's RocksDB store with event-partition lookups and a decoded-value cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = kwargs.get("options")
        self._cache_entries = int(options.pop(CACHE_OPTION, CACHE_ENTRIES)) if options else CACHE_ENTRIES
        super().__init__(*args, **kwargs)
        self._decoded: OrderedDict[bytes, Any] = OrderedDict()

    # -- reads and writes through the mapping interface (faust's Table uses these)
    def __getitem__(self, key: Any) -> Any:
        raw = self._encode_key(key)
        cache = self._decoded
        if raw in cache:
            cache.move_to_end(raw)
            return cache[raw]
        value = self._get(raw)
        if value is None:
            raise KeyError(key)
        decoded = self._decode_value(value)
        self._remember(raw, decoded)
        return decoded

    def __contains__(self, key: object) -> bool:
        # faust's Table asks this before every read (then reads): one lookup serves both.
        try:
            self[key]
        except KeyError:
            return False
        return True

    def __setitem__(self, key: Any, value: Any) -> None:
        raw = self._encode_key(key)
        self._set(raw, self._encode_value(value))
        self._remember(raw, value)

    def __delitem__(self, key: Any) -> None:
        raw = self._encode_key(key)
        self._decoded.pop(raw, None)
        self._del(raw)

    def _remember(self, raw: bytes, value: Any) -> None:
        cache = self._decoded
        cache[raw] = value
        cache.move_to_end(raw)
        if len(cache) > self._cache_entries:
            cache.popitem(last=False)

    # -- the miss: one probe in the current event's partition
    def _get_bucket_for_key(self, key: bytes) -> Any:
        if self.table.use_partitioner:
            event = current_event()
            if event is not None:
                partition = event.message.partition
                db = self._dbs.get(partition)
                if db is not None and partition == self._key_index.get(key, partition):
                    value = db.get(key)
                    if value is None:
                        return None
                    self._key_index[key] = partition
                    return db, value
        return super()._get_bucket_for_key(key)

    # -- no write-ahead log: the changelog topic is the log. A crash loses unflushed
    # writes, but a flushed database can also hold writes whose changelog send was never
    # acknowledged: it is ahead of its changelog, and a stage re-reading the input would
    # take the update as already applied. So only a clean stop vouches for a database
    # (its marker, CLEAN_SUFFIX); after any other, the worker drops it and rebuilds it
    # from the changelog (tables.drop_unclean).
    def _open_for_partition(self, partition: int) -> Any:
        db = super()._open_for_partition(partition)
        options = rocksdict.WriteOptions()
        options.disable_wal = True  # type: ignore[method-assign,assignment]  # a property (the stub says method)
        db.set_write_options(options)
        return db

    async def stop(self) -> None:
        for db in self._dbs.values():
            db.flush()
        # Written also when no database was opened: the files are then as the start found them.
        if await self._changelog_acknowledged():
            self.clean_marker().touch()
        await super().stop()

    def clean_marker(self) -> Path:
        """The file saying that this table's databases hold nothing their changelog lacks."""
        return self.path / f"{self.basename}{CLEAN_SUFFIX}"

    async def _changelog_acknowledged(self) -> bool:
        unacked = getattr(self.app.producer, "unacked", None)  # delivery.AckedProducer's
        if unacked is None:
            return False
        if await unacked.settle(timeout=STOP_SETTLE_S):
            return True
        log.warning("table %s: changelog writes unacknowledged at stop; rebuilt at the next start", self.basename)
        return False

    # -- writes faust makes without the mapping interface: forget what was decoded
    def apply_changelog_batch(self, batch: Any, to_key: Any, to_value: Any) -> None:
        self._decoded.clear()
        super().apply_changelog_batch(batch, to_key, to_value)

    async def on_rebalance(self, assigned: Any, revoked: Any, newly_assigned: Any, generation_id: int = 0) -> None:
        self._decoded.clear()
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)

    def reset_state(self) -> None:
        self._decoded.clear()
        super().reset_state()
