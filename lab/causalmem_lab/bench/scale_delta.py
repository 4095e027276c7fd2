"""Delta checkpoints at scale: bytes per delta against a full snapshot, and the client's apply latency.

:func:`measure_deltas` builds a policy of S slots, then publishes ``checkpoints`` deltas of
``changed_rows`` random output rows each (plus the backbone) with the learner's publisher
(``CheckpointPublisher``, to an in-memory log), and feeds each delta's messages to a real
``PolicySubscriber`` (``handle``: assemble the chunks, check size, sha256 and base, decode,
check every tensor, apply; below ``STATE_CHECK_BYTES`` also re-hash the state). The
latency is the wall time of the manifest's ``handle`` call, and next to it the process's
CPU time over the same call (on a shared machine the wall time also counts waiting for a
core). The subscriber hashes a delta's chunks as they arrive, before the manifest: that
CPU time is reported apart (``chunks_cpu_ms_p50``).

The rows changed per checkpoint under a traffic (:func:`expected_changed_rows`): events
of ``candidates`` distinct slots drawn uniformly (as ``causalmem bench throughput``'s
events) at ``rate`` events/s for ``cadence_s`` seconds touch S·(1 − (1 − c/S)^n) rows.

    python -m causalmem_lab.bench.scale_delta --slots 1024 100000 1000000 --rate 2850

Figures and the commands that produced them: docs/benchmarks.md, "Delta checkpoints".
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import time
from typing import Any

import numpy as np
import torch

from models.policy.delta import encode_delta, state_sha256
from models.policy.network import TENSOR_NAMES, Arch, PolicyNetwork
from models.policy.weights import to_safetensors
from pipeline.client.subscriber import STATE_CHECK_BYTES, LoadedPolicy, PolicySubscriber
from pipeline.config import Connection
from pipeline.modeltopic.publisher import CheckpointPublisher
from topics.delta import DeltaManifest
from topics.manifest import Manifest, sha256_hex, split_chunks

THROUGHPUT_RATE = 2850.0  # experiences/s: `causalmem bench throughput`, pipeline end to end (docs/benchmarks.md)
TARGET_SHARE = 0.05  # a delta at most 5% of a full snapshot
TARGET_APPLY_P99_MS = 50.0


def expected_changed_rows(slots: int, rate: float, cadence_s: float, candidates: int = 20) -> int:
    """Rows touched in ``cadence_s`` by ``rate`` events/s of ``candidates`` distinct uniform slots.

    >>> expected_changed_rows(1024, 2850, 10), expected_changed_rows(1_000_000, 2850, 10)
    (1024, 434478)
    >>> expected_changed_rows(1_000_000, 100, 10)
    19802
    """
    n = rate * cadence_s
    c = min(candidates, slots)
    return round(slots * (1.0 - math.pow(1.0 - c / slots, n)))


class _Log:
    """A producer that keeps what it is sent (the subscriber reads it back)."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes | None]] = []

    async def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int = 0) -> Any:
        self.messages.append((key or b"", value))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def _random_state(arch: Arch, gen: torch.Generator) -> dict[str, torch.Tensor]:
    shapes = arch.shapes()
    return {n: torch.randn(shapes[n], generator=gen) * 0.05 for n in TENSOR_NAMES}


async def _measure(slots: int, hidden: int, embedding_dim: int, changed_rows: int, checkpoints: int) -> dict[str, Any]:
    arch = Arch(embedding_dim=embedding_dim, slots=slots, hidden=hidden)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    state = _random_state(arch, gen)  # the learner's
    full = to_safetensors(state)
    full_size, head_sha = len(full), sha256_hex(full)
    del full
    log = _Log()
    publisher = CheckpointPublisher(log, "policy-checkpoints", "bench", keep_versions=1)
    base = Manifest("bench", 1, time.time(), "init", arch.to_dict(), 0.5, 0.0, head_sha, full_size, 1)
    publisher.last_version, publisher.head = 1, (1, head_sha)
    sub = PolicySubscriber("127.0.0.1:1", policy="bench", conn=Connection.of(None))
    net = PolicyNetwork.from_tensors(state).eval()  # the client's copy of version 1
    sub.current = LoadedPolicy(base, net)
    checked = 4 * slots * (hidden + 1) <= sub.state_check_bytes
    sizes: list[int] = []
    latencies: list[float] = []
    cpu: list[float] = []  # the process's CPU time: what the apply costs without other processes on the cores
    chunk_cpu: list[float] = []  # CPU time taking the chunks (kept, and hashed as they arrive) before the manifest
    offset = 0
    for _ in range(checkpoints):
        rows = np.sort(rng.choice(slots, size=min(changed_rows, slots), replace=False)).astype(np.int64)
        with torch.no_grad():  # what training wrote: those rows and the backbone
            state["out.weight"][torch.from_numpy(rows)] = torch.randn(len(rows), hidden, generator=gen) * 0.05
            state["out.bias"][torch.from_numpy(rows)] += 0.01
            state["hidden.weight"].add_(1e-4)
        assert publisher.head is not None
        delta: dict[str, Any] = {"base_version": publisher.head[0], "base_sha256": publisher.head[1]}
        delta.update(state_sha256=state_sha256(state), rows=len(rows))  # before the blob: less memory at once
        blob = encode_delta(state, rows, publisher.head[1])
        log.messages.clear()
        manifest = await publisher.publish(
            blob, alpha=0.5, reason="periodic", arch=arch.to_dict(), baseline=0.0, delta=delta
        )
        assert isinstance(manifest, DeltaManifest) and manifest.chunks == len(split_chunks(blob))
        sizes.append(len(blob))
        del blob
        *chunks, (key, value) = log.messages
        log.messages.clear()
        c0 = time.process_time()
        for k, v in chunks:
            await sub.handle(offset, k, v)
            offset += 1
        chunk_cpu.append((time.process_time() - c0) * 1000.0)
        del chunks
        t0, c0 = time.perf_counter(), time.process_time()
        await sub.handle(offset, key, value)
        offset += 1
        latencies.append((time.perf_counter() - t0) * 1000.0)
        cpu.append((time.process_time() - c0) * 1000.0)
        if sub.current.version != manifest.version:
            raise RuntimeError(f"the subscriber did not take v{manifest.version}: {sub.rejections[-1:]}")
        gc.collect()
    same = all(torch.equal(sub.current.net.tensors()[n], state[n]) for n in TENSOR_NAMES)
    delta_size = float(np.median(sizes))
    return {
        "slots": slots,
        "hidden": hidden,
        "embedding_dim": embedding_dim,
        "changed_rows": min(changed_rows, slots),
        "checkpoints": checkpoints,
        "full_bytes": full_size,
        "delta_bytes": int(delta_size),
        "share": delta_size / full_size,
        "apply_ms_p50": float(np.percentile(latencies, 50)),
        "apply_ms_p99": float(np.percentile(latencies, 99)),
        "apply_ms_max": float(max(latencies)),
        "apply_cpu_ms_p50": float(np.percentile(cpu, 50)),
        "apply_cpu_ms_p99": float(np.percentile(cpu, 99)),
        "chunks_cpu_ms_p50": float(np.percentile(chunk_cpu, 50)),
        "state_rehashed": checked,  # the client re-hashes states up to STATE_CHECK_BYTES
        "replays": sub.replays,
        "client_equals_learner": same,
    }


def measure_deltas(slots: int, hidden: int, embedding_dim: int, changed_rows: int, checkpoints: int) -> dict[str, Any]:
    """Bytes per delta against a full snapshot, and the client's delta-apply latency (ms, p50/p99).

    ``changed_rows`` random rows change per checkpoint (see :func:`expected_changed_rows`).
    """
    return asyncio.run(_measure(slots, hidden, embedding_dim, changed_rows, checkpoints))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m causalmem_lab.bench.scale_delta", description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[1024, 100_000, 1_000_000])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--embedding-dim", type=int, default=384)
    p.add_argument("--rate", type=float, default=THROUGHPUT_RATE, help="events/s (default: the throughput bench's)")
    p.add_argument("--cadence", type=float, default=10.0, help="seconds between checkpoints (default 10)")
    p.add_argument("--candidates", type=int, default=20)
    p.add_argument("--rows", type=int, help="changed rows per checkpoint (default: from rate, cadence, candidates)")
    p.add_argument("--checkpoints", type=int, default=20, help="deltas per size (fewer above 100,000 slots)")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    print(f"state re-hashed by the client up to {STATE_CHECK_BYTES / 2**20:.0f} MiB; above, the chain's checks only")
    print("slots      rows     share  delta MB   full MB  apply p50 ms  p99 ms  CPU p50 ms  p99 ms  equal")
    for s in args.slots:
        rows = (
            args.rows if args.rows is not None else expected_changed_rows(s, args.rate, args.cadence, args.candidates)
        )
        n = args.checkpoints if s <= 100_000 else max(3, args.checkpoints // 4)
        r = measure_deltas(s, args.hidden, args.embedding_dim, rows, n)
        r.update(rate=args.rate, cadence_s=args.cadence, candidates=args.candidates)
        results.append(r)
        print(
            f"{s:<9,d} {r['changed_rows']:>8,d} {r['share']:>8.3f} {r['delta_bytes'] / 1e6:>9.2f} "
            f"{r['full_bytes'] / 1e6:>9.1f} {r['apply_ms_p50']:>13.1f} {r['apply_ms_p99']:>7.1f} "
            f"{r['apply_cpu_ms_p50']:>11.1f} {r['apply_cpu_ms_p99']:>7.1f}  "
            f"{r['client_equals_learner']}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"targets": {"share": TARGET_SHARE, "apply_p99_ms": TARGET_APPLY_P99_MS}, "runs": results}, fh)


if __name__ == "__main__":
    main()
