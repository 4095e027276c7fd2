"""The cost of one worker table entry, per store: ``python -m causalmem_lab.bench.statecost``.

For each per-query table's typical value (one joined step per query; a sample of a
D=384, 20-candidate retrieval event), measured on this machine:

- **encoded**: key + value as faust encodes them: what the byte caps
  (``query_state_max_bytes``, ``al_pending_max_bytes``) count;
- **rocksdb disk**: the database directory's growth per entry after a flush, written
  with the worker's RocksDB options (:data:`pipeline.worker.tables.ROCKSDB_OPTIONS`);
- **rocksdb RSS**: the process's resident growth while writing them (bounded by the
  write buffers and block cache, so it does not grow with the entries beyond those);
- **memory**: the Python heap per entry holding the decoded records in a dict (what the
  ``memory://`` store keeps), from ``tracemalloc``.

docs/operations.md ("Worker state") records the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faust
from faust.stores.rocksdb import RocksDBOptions

from causalmem_lab.bench.soak.rig import rss_mb
from causalmem_lab.bench.throughput import make_events
from pipeline.worker.records import (
    PendingSamples,
    QueryUtility,
    Rating,
    SeenLabels,
    SentSteps,
    StoredSamples,
    Verdict,
)
from pipeline.worker.tables import ROCKSDB_OPTIONS
from topics.convert import make_sample, sample_id_for
from topics.fields import encode

T0 = 1_800_000_000.0


def typical(d: int = 384, slots: int = 1024) -> dict[str, Callable[[int], faust.Record]]:
    """A typical value of each per-query table, for query ``i``."""
    event = make_events(1, d, slots)[0].event
    sample = encode(make_sample(event, utility=-0.6, reason="error", ts=event.ts).to_dict()).decode()
    return {
        "query-utility": lambda i: QueryUtility(sum=0.123456 * i, n=1, steps=[0], ts=T0 + i * 0.01),
        "verdicts": lambda i: Verdict(correct=bool(i % 2), ts=T0 + i * 0.01),
        "ratings": lambda i: Rating(rating=i % 6, ts=T0 + i * 0.01, paired=True),
        "al-sent": lambda i: SentSteps(steps=[0], ts=T0 + i * 0.01),
        "labels-seen": lambda i: SeenLabels(ids=[f"label-{i:012d}"], ts=T0 + i * 0.01),
        "al-pending": lambda i: PendingSamples(samples={"0": sample}, ts=T0 + i * 0.01),
        "al-samples": lambda i: StoredSamples(samples={sample_id_for(f"q{i}", 0): sample}, ts=T0 + i * 0.01),
    }


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(name: str, make: Callable[[int], faust.Record], n: int, workdir: Path) -> dict[str, Any]:
    keys = [f"query-{i:08d}".encode() for i in range(n)]
    values = [make(i) for i in range(n)]
    encoded = [v.dumps(serializer="json") for v in values]
    enc = sum(len(k) + len(v) for k, v in zip(keys, encoded, strict=True)) / n

    path = workdir / f"{name}.db"
    rss0 = rss_mb(os.getpid())
    db = RocksDBOptions(**ROCKSDB_OPTIONS, use_rocksdict=True).open(path)
    empty = _dir_bytes(path)
    for k, v in zip(keys, encoded, strict=True):
        db.put(k, v)
    db.flush()
    rss1 = rss_mb(os.getpid())
    disk = (_dir_bytes(path) - empty) / n
    db.close()
    del db
    gc.collect()

    cls = type(values[0])
    del values
    gc.collect()
    tracemalloc.start()  # the dict of decoded records (fresh keys too) a memory store holds
    table = {bytes(bytearray(k)): cls.loads(e, serializer="json") for k, e in zip(keys, encoded, strict=True)}
    heap = tracemalloc.get_traced_memory()[0] / n
    tracemalloc.stop()
    del table
    gc.collect()
    return {
        "table": name,
        "entries": n,
        "encoded_bytes": round(enc),
        "rocksdb_disk_bytes": round(disk),
        "rocksdb_rss_growth_mb": None if rss0 is None or rss1 is None else round(rss1 - rss0, 1),
        "memory_heap_bytes": round(heap),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=20_000, help="entries per small table (samples: a tenth)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="causalmem-statecost-"))
    rows = []
    try:
        for name, make in typical().items():
            n = args.entries // 10 if name.startswith("al-") and name != "al-sent" else args.entries
            rows.append(measure(name, make, n, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("| table | entries | encoded B | RocksDB disk B | memory store heap B | heap / encoded |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['table']}` | {r['entries']:,} | {r['encoded_bytes']:,} | {r['rocksdb_disk_bytes']:,} "
            f"| {r['memory_heap_bytes']:,} | {r['memory_heap_bytes'] / r['encoded_bytes']:.1f} |"
        )
    print(
        "RocksDB RSS growth while writing (MB): "
        + ", ".join(f"{r['table']} {r['rocksdb_rss_growth_mb']}" for r in rows)
    )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
