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
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import rocksdict
from faust.stores.rocksdb import Store as RocksDBStore
from faust.streams import current_event

CACHE_ENTRIES = 10_000  # decoded values kept per table by default (~5 MB of small records)
CACHE_OPTION = "decoded_cache_entries"  # a table's own size, in its store options
SCHEME = "causalmem-rocksdb"  # registered with faust's store registry by pipeline.worker.tables


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

    # -- no write-ahead log: the changelog topic is the log. A crash loses at most the
    # unflushed writes, and the database's persisted offset is in the same flushed
    # prefix, so recovery replays the changelog from there. A clean stop flushes.
    def _open_for_partition(self, partition: int) -> Any:
        db = super()._open_for_partition(partition)
        options = rocksdict.WriteOptions()
        options.disable_wal = True  # type: ignore[method-assign,assignment]  # a property (the stub says method)
        db.set_write_options(options)
        return db

    async def stop(self) -> None:
        for db in self._dbs.values():
            db.flush()
        await super().stop()

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
