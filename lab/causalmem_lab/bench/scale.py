"""``causalmem bench scale``: the learner and the client at S = 1,024, 100,000 and 1,000,000 memories.

Measured side by side in one run, each S in its own process (so memory figures do not mix),
all S held at once and timed in interleaved bursts (so load on a shared machine hits every S
alike):

1. **learner**: the step rate of the real ``PolicyTrainer.update`` path (row-sparse lazy Adam,
   docs/learning.md) on synthetic experiences (``--candidates`` candidates drawn uniformly from
   the S slots, 3 selected, random utilities, micro-batches of ``--batch``), and the learner's
   RSS with the main optimizer's moments for every row resident (the steady state once every
   memory has been a candidate; the label optimizer's moments stay lazily allocated: labels
   touch few rows);
2. **client**: retrieval latency per query, p50/p99, of plain faiss search (``IndexIVFFlat``
   over S random unit vectors of D = 384, inner product, ``--nprobe`` lists probed) against
   ``CausalRetriever.retrieve`` on the same index (faiss search + the policy's candidate masks
   + the hard drop + the Plackett–Luce draw + the event), interleaved query by query; and the
   client's RSS holding the index and the policy. Random unit vectors have no cluster
   structure, so IVF recall is lower than on real embeddings; the costs measured are the same.

Every measuring process starts with glibc's malloc thresholds pinned (:data:`PINNED_MALLOC`), so
that no S pays for its allocator giving a step's temporaries back to the kernel; the learner
process's CPU time per step (all its threads: at 10^6 the optimizer's row mover too) is
reported beside the wall time (on a shared machine it leaves out the waits for a core).

Targets: step rate at 10^6 ≥ 80% of the rate at 1,024; policy + faiss ≤ 1.5× plain
faiss at 10^6; learner RSS ≤ 8 GB. The delta-checkpoint figures (bytes per delta against a full
snapshot, client delta-apply p50/p99) come from :func:`causalmem_lab.bench.scale_delta.measure_deltas`,
run after the learner and client measurements with the rows the timed learner steps wrote
(``changed_rows``: at ~20 steps/s, 200 steps are about one 10 s checkpoint interval), and are
added to this table as extra columns (:func:`table`'s ``extra``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.allocator import PINNED_MALLOC

SIZES = (1_024, 100_000, 1_000_000)
TARGET_STEP_RATE = 0.80  # step rate at the largest S / at the smallest
TARGET_LATENCY = 1.5  # policy + faiss / plain faiss, p50, at the largest S
TARGET_LEARNER_RSS_GB = 8.0


def rss_gb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in GB (Linux /proc)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024 / 1e9
    return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))


def experiences(n: int, slots: int, dim: int, candidates: int, seed: int) -> list[Any]:
    """Synthetic joined experiences: ``candidates`` distinct slots of S each, 3 selected."""
    from topics.events import Features, RetrievalEvent
    from topics.internal import Experience

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        cand = [int(c) for c in rng.choice(slots, size=candidates, replace=False)]
        ev = RetrievalEvent(
            event_id=f"s{i}",
            query_id=f"sq{i}",
            step=0,
            ts=1_767_225_600.0 + i,
            features=Features(rng.normal(size=dim).astype(np.float32), float(rng.uniform(0, 3)), 0.5),
            candidates=cand,
            scores=rng.uniform(0.2, 0.9, size=candidates),
            selected=cand[:3],
            temperature=0.05,
            logprob=float(-rng.uniform(0.1, 3.0)),
            fallback=False,
        )
        out.append(Experience(ev.event_id, "feedback", ev, float(rng.normal(0.2, 0.6))))
    return out


class LearnerBench:
    """The learner at one S: ``PolicyTrainer.update`` steps, timed one by one."""

    def __init__(self, slots: int, opts: dict[str, Any]) -> None:
        import torch

        from models.policy.trainer import PolicyTrainer, TrainerConfig

        torch.set_num_threads(opts["threads"])
        self.slots, self.batch = slots, opts["batch"]
        t0 = time.perf_counter()
        self.trainer = PolicyTrainer(TrainerConfig(embedding_dim=opts["dim"], slots=slots, hidden=opts["hidden"]))
        self.build_s = time.perf_counter() - t0
        pool = experiences(self.batch * 64, slots, opts["dim"], opts["candidates"], seed=1)  # 64 batches, cycled
        self.batches = [pool[i : i + self.batch] for i in range(0, len(pool), self.batch)]
        for b in self.batches[:3]:  # first-call allocations
            self.trainer.update(b)
        rows = self.trainer.optimizer.rows
        for moment in (rows.exp_avg, rows.exp_avg_sq, rows.bias_avg, rows.bias_avg_sq):
            moment.add_(0.0)  # commit every page: the steady state, once every memory has been a candidate
        self.trainer.take_changed_rows()  # from here on: the rows the timed steps write
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # the process's CPU time (user + system) per step: the row mover's too
        self.faults = 0  # minor page faults in the timed steps (memory the allocator got back from the kernel)

    def burst(self, n: int) -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            b = self.batches[len(self.times) % len(self.batches)]
            t, c = time.perf_counter(), time.process_time()
            stats = self.trainer.update(b)
            self.cpu_times.append(time.process_time() - c)
            self.times.append(time.perf_counter() - t)
            assert stats.applied == self.batch
        self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def report(self) -> dict[str, Any]:
        changed = len(self.trainer.take_changed_rows())
        t = time.perf_counter()
        state = self.trainer.optimizer_tensors()  # what a checkpoint saves locally
        state_s = time.perf_counter() - t
        rss, peak = rss_gb()
        return {
            "slots": self.slots,
            "build_s": round(self.build_s, 2),
            "steps_per_s": 1.0 / statistics.median(self.times),
            "steps_per_s_mean": len(self.times) / sum(self.times),
            "step_ms_p50": 1e3 * statistics.median(self.times),
            "step_ms_p90": 1e3 * float(np.percentile(self.times, 90)),
            # CPU time: what a step costs without the waits for a core on a shared machine
            "steps_per_cpu_s": 1.0 / statistics.median(self.cpu_times),
            "step_cpu_ms_p50": 1e3 * statistics.median(self.cpu_times),
            "step_cpu_ms_mean": 1e3 * statistics.fmean(self.cpu_times),
            "minor_faults_per_step": self.faults / len(self.times),
            "malloc_pinned": all(os.environ.get(k) == v for k, v in PINNED_MALLOC.items()),
            "timed_steps": len(self.times),
            "changed_rows": changed,  # distinct output rows the timed steps wrote (a delta's rows)
            "optimizer_state_ms": 1e3 * state_s,
            "optimizer_state_gb": sum(v.numel() * v.element_size() for v in state.values()) / 1e9,
            "learner_rss_gb": rss,
            "learner_peak_rss_gb": peak,
        }


def unit_vectors(n: int, dim: int, seed: int, chunk: int = 100_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty((n, dim), np.float32)
    for i in range(0, n, chunk):
        x = rng.standard_normal((min(chunk, n - i), dim), dtype=np.float32)
        out[i : i + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


class ClientBench:
    """The client at one S: an IVF index over S vectors and the policy; plain vs policy retrieval."""

    def __init__(self, slots: int, opts: dict[str, Any]) -> None:
        import faiss
        import torch

        from models.policy.network import init_policy
        from pipeline.client.retriever import CausalRetriever
        from pipeline.client.serving import policy_masks
        from pipeline.client.subscriber import LoadedPolicy
        from topics.manifest import Manifest

        torch.set_num_threads(1)
        faiss.omp_set_num_threads(1)  # one query at a time: threads only add overhead
        dim, n = opts["dim"], slots
        self.slots, self.k = slots, opts["candidates"]
        t0 = time.perf_counter()
        vectors = unit_vectors(n, dim, seed=2)
        nlist = max(1, min(opts["nlist"], n // 39))  # faiss wants ≥ 39 training points per list
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.niter = 10
        index.train(vectors[np.random.default_rng(3).choice(n, size=min(n, 64 * nlist), replace=False)])
        index.add(vectors)
        index.nprobe = min(opts["nprobe"], nlist)
        del vectors
        self.index_s = time.perf_counter() - t0
        self.index = index
        self.description = f"IVFFlat nlist={nlist} nprobe={index.nprobe}"
        policy = LoadedPolicy(
            manifest=Manifest("bench", 1, 0.0, "init", {}, 0.5, 0.0, "0" * 64, 1, 1),
            net=init_policy(dim, slots, opts["hidden"]).eval(),
        )
        self.retriever = CausalRetriever(np.zeros((1, dim), np.float32), k=3, n_candidates=self.k, fallback=_empty)
        self.retriever.index = index  # the same IVF index for both
        self.retriever.set_policy(policy)
        self.policy_masks = policy_masks
        self.queries = unit_vectors(opts["queries"] + 50, dim, seed=4)
        self.plain: list[float] = []
        self.with_policy: list[float] = []
        self.masks: list[float] = []  # the policy's part alone: its masks for the found candidates
        self.cpu: list[tuple[float, float]] = []  # CPU time of (plain search, retrieve)
        self.done = 0
        self.burst(50)  # warm caches up, untimed
        for timings in (self.plain, self.with_policy, self.masks, self.cpu):
            timings.clear()

    def burst(self, n: int) -> None:
        for _ in range(n):
            q = self.queries[self.done % len(self.queries)]
            c, t = time.process_time(), time.perf_counter()
            self.index.search(q[None], self.k)
            a, ca = time.perf_counter() - t, time.process_time() - c
            c, t = time.process_time(), time.perf_counter()  # CPU of every thread: the overlapped features too
            self.retriever.retrieve(q, f"q{self.done}", with_texts=False)
            b, cb = time.perf_counter() - t, time.process_time() - c
            self.cpu.append((ca, cb))
            found = self.retriever.search(q, self.k)[0]
            t = time.perf_counter()
            self.policy_masks(self.retriever.policy, q, 0.0, 0.0, found)
            c = time.perf_counter() - t
            self.plain.append(a)
            self.with_policy.append(b)
            self.masks.append(c)
            self.done += 1

    def report(self) -> dict[str, Any]:
        rss, peak = rss_gb()
        p = np.array(self.plain) * 1e3
        w = np.array(self.with_policy) * 1e3
        return {
            "slots": self.slots,
            "index": self.description,
            "index_build_s": round(self.index_s, 1),
            "queries": len(p),
            "faiss_p50_ms": float(np.percentile(p, 50)),
            "faiss_p99_ms": float(np.percentile(p, 99)),
            "policy_p50_ms": float(np.percentile(w, 50)),
            "policy_p99_ms": float(np.percentile(w, 99)),
            "ratio_p50": float(np.percentile(w, 50) / np.percentile(p, 50)),
            "ratio_p99": float(np.percentile(w, 99) / np.percentile(p, 99)),
            "masks_p50_ms": float(np.percentile(np.array(self.masks) * 1e3, 50)),
            "cpu_faiss_policy_mean_ms": [float(x) for x in np.array(self.cpu).mean(axis=0) * 1e3],
            "features_overlapped": self.retriever.features.overlapping(),  # the retriever's own choice, at the end
            "client_rss_gb": rss,
            "client_peak_rss_gb": peak,
        }


def _empty(query_text: str | None, query_embedding: np.ndarray, k: int) -> list[int]:
    return []


def _serve(conn: Any, kind: str, slots: int, opts: dict[str, Any]) -> None:
    """A measuring process: builds its bench, then runs bursts and reports on request."""
    try:
        bench: LearnerBench | ClientBench = (LearnerBench if kind == "learner" else ClientBench)(slots, opts)
        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "burst":
                bench.burst(arg)
                conn.send(("ok", None))
            elif cmd == "report":
                conn.send(("ok", bench.report()))
            else:
                return
    except Exception as e:  # the parent raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))


class Worker:
    """One S in its own process (memory figures do not mix), held while the others run, so
    that bursts of every S can be interleaved: load on a shared machine then hits them alike."""

    def __init__(self, kind: str, slots: int, opts: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kind, slots, opts), daemon=True)
        self.proc.start()
        self.slots = slots

    def ask(self, cmd: str, arg: Any = None) -> Any:
        if cmd:
            self.conn.send((cmd, arg))
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"S={self.slots}: {value}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(("stop", None))
        except OSError:
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


# glibc's malloc, pinned in every measuring process as the learner pins it (pipeline/allocator.py):
# unpinned, the S = 1,024 learner took ~1,800 minor faults per step (~3 ms of system time), the
# S = 10^6 one ~600 — noise that depends on each process's history.


def measure(kind: str, sizes: list[int], opts: dict[str, Any], total: int, rounds: int) -> list[dict[str, Any]]:
    """``total`` timed steps (or queries) per S, in ``rounds`` interleaved bursts; each S's
    process starts with glibc's malloc pinned (:data:`PINNED_MALLOC`)."""
    saved = dict(os.environ)
    os.environ.update(PINNED_MALLOC)  # read by each process as it starts (spawn)
    try:
        workers = [Worker(kind, s, opts) for s in sizes]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        for w in workers:
            w.ask("")  # wait until built
        for _ in range(rounds):
            for w in workers:
                w.ask("burst", max(1, total // rounds))
        return [w.ask("report") for w in workers]
    finally:
        for w in workers:
            w.close()


def run(sizes: list[int], opts: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    t0 = time.perf_counter()
    learners = measure("learner", sizes, opts, opts["steps"], opts["rounds"])
    for r in learners:
        log(f"S={r['slots']:,}: learner {r['steps_per_s']:.1f} steps/s, RSS {r['learner_rss_gb']:.2f} GB")
    clients = measure("client", sizes, opts, opts["queries"], opts["rounds"])
    for r in clients:
        log(
            f"S={r['slots']:,}: faiss p50 {r['faiss_p50_ms']:.3f} ms, policy+faiss p50 {r['policy_p50_ms']:.3f} ms, "
            f"client RSS {r['client_rss_gb']:.2f} GB (index built in {r['index_build_s']} s)"
        )
    rows = [{**a, **b} for a, b in zip(learners, clients, strict=True)]
    small, large = rows[0], rows[-1]
    return {
        "options": opts,
        "rows": rows,
        "step_rate_ratio": large["steps_per_s"] / small["steps_per_s"],
        "cpu_step_rate_ratio": large["steps_per_cpu_s"] / small["steps_per_cpu_s"],
        "latency_ratio": large["ratio_p50"],
        "learner_rss_gb": large["learner_rss_gb"],
        "seconds": time.perf_counter() - t0,
    }


def table(report: dict[str, Any], extra: Mapping[int, Mapping[str, str]] | None = None) -> str:
    """The side-by-side table; ``extra`` adds columns per S (e.g. the delta checkpoints' bytes
    per delta and apply latency), keyed by S then by column title."""
    titles = list(next(iter(extra.values())).keys()) if extra else []
    head = (
        "| S | learner steps/s | vs first S | learner RSS GB (peak) | faiss p50/p99 ms | policy+faiss p50/p99 ms "
        "| ratio p50 | policy adds p50 ms | policy masks alone p50 ms | client RSS GB "
        "| learner CPU ms/step p50 (rate vs first S) |"
    )
    lines = [head + "".join(f" {t} |" for t in titles), "|---" * (11 + len(titles)) + "|"]
    base = report["rows"][0]["steps_per_s"]
    base_cpu = report["rows"][0].get("steps_per_cpu_s")
    for r in report["rows"]:
        cells = [
            f"{r['slots']:,}",
            f"{r['steps_per_s']:.1f}",
            f"{r['steps_per_s'] / base:.0%}",
            f"{r['learner_rss_gb']:.2f} ({r['learner_peak_rss_gb']:.2f})",
            f"{r['faiss_p50_ms']:.3f} / {r['faiss_p99_ms']:.3f}",
            f"{r['policy_p50_ms']:.3f} / {r['policy_p99_ms']:.3f}",
            f"{r['ratio_p50']:.2f}×",
            f"{r['policy_p50_ms'] - r['faiss_p50_ms']:.3f}",
            f"{r['masks_p50_ms']:.3f}",
            f"{r['client_rss_gb']:.2f}",
            f"{r['step_cpu_ms_p50']:.1f} ({r['steps_per_cpu_s'] / base_cpu:.0%})" if base_cpu else "",
        ] + [str((extra or {}).get(r["slots"], {}).get(t, "")) for t in titles]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(report: dict[str, Any]) -> str:
    def ok(flag: bool) -> str:
        return "met" if flag else "MISSED"

    return (
        f"step rate at the largest S: {report['step_rate_ratio']:.0%} of the smallest's "
        f"(target ≥ {TARGET_STEP_RATE:.0%}: {ok(report['step_rate_ratio'] >= TARGET_STEP_RATE)}"
        + (f"; in CPU time {report['cpu_step_rate_ratio']:.0%}" if "cpu_step_rate_ratio" in report else "")
        + "); "
        f"policy + faiss {report['latency_ratio']:.2f}× plain faiss (target ≤ {TARGET_LATENCY}×: "
        f"{ok(report['latency_ratio'] <= TARGET_LATENCY)}); learner RSS {report['learner_rss_gb']:.2f} GB "
        f"(target ≤ {TARGET_LEARNER_RSS_GB:.0f} GB: {ok(report['learner_rss_gb'] <= TARGET_LEARNER_RSS_GB)}); "
        f"{report['seconds']:.0f} s"
    )


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="S values, comma-separated")
    p.add_argument("--quick", action="store_true", help="a small run (used by the tests): S = 256, 4,096")
    p.add_argument("--dim", type=int, default=384, help="D, the embedding dimension")
    p.add_argument("--hidden", type=int, default=512, help="H, the policy's hidden width")
    p.add_argument("--batch", type=int, default=64, help="experiences per learner step (the learner's default)")
    p.add_argument("--candidates", type=int, default=20)
    p.add_argument("--steps", type=int, default=200, help="timed learner steps per S")
    p.add_argument("--threads", type=int, default=1, help="learner torch threads (the learner's default)")
    p.add_argument("--queries", type=int, default=2000, help="timed retrievals per S")
    p.add_argument("--rounds", type=int, default=10, help="interleaved bursts the steps and queries are split into")
    p.add_argument("--nlist", type=int, default=1024, help="IVF lists (fewer for small S)")
    p.add_argument("--nprobe", type=int, default=16)
    p.add_argument("--delta-checkpoints", type=int, default=5, help="deltas measured per S (0: skip them)")
    p.add_argument("--out", help="write the report as JSON here")


def delta_columns(report: dict[str, Any], opts: dict[str, Any], checkpoints: int) -> dict[int, dict[str, str]]:
    """Each S's delta checkpoint with the rows its timed steps wrote: size against a full snapshot, apply latency."""
    from causalmem_lab.bench.scale_delta import measure_deltas

    extra: dict[int, dict[str, str]] = {}
    report["deltas"] = []
    for r in report["rows"]:
        d = measure_deltas(r["slots"], opts["hidden"], opts["dim"], int(r["changed_rows"]), checkpoints)
        report["deltas"].append(d)
        extra[r["slots"]] = {
            "delta / full": f"{d['share']:.1%}",
            "delta apply p50 / p99 ms (CPU p99)": (
                f"{d['apply_ms_p50']:.1f} / {d['apply_ms_p99']:.1f} ({d['apply_cpu_ms_p99']:.1f})"
            ),
        }
    return extra


def main(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    opts = {k: getattr(args, k) for k in ("dim", "hidden", "batch", "candidates", "steps", "threads", "queries")}
    opts.update(nlist=args.nlist, nprobe=args.nprobe, rounds=args.rounds)
    if args.quick:
        sizes = [256, 4096]
        opts.update(dim=32, hidden=32, batch=16, steps=20, queries=100, nlist=16, rounds=2)
    report = run(sizes, opts)
    extra = delta_columns(report, opts, args.delta_checkpoints) if args.delta_checkpoints > 0 else None
    print(table(report, extra))
    print(verdict(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
