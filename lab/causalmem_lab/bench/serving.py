"""``causalmem bench serving``: the latency a user's request pays for the product on the serving path.

Measured side by side in one run, the product's own components, each against what the
request would cost without it (interleaved call by call, the order alternating, so load on a
shared machine hits both alike):

1. **retriever**: ``CausalRetriever.retrieve`` with a policy loaded (a real ``PolicyNetwork``
   from ``init_policy``, as the :class:`~pipeline.client.subscriber.LoadedPolicy` a
   subscriber gives) against the same retriever's faiss search alone (``retriever.search``),
   at each ``--memories`` size (random unit vectors of D = 384). ``--index auto`` searches an
   exact ``IndexFlatIP`` (the retriever's default) below 10^5 memories and an ``IndexIVFFlat``
   from there up (what docs/byo-retriever.md advises for a large bank: exact search takes
   ~100 ms a query at 10^6);
2. **adapter**: the LangChain ``CausalMemoryRetriever.invoke`` (the policy loaded, nothing
   published) around a store of ``--docs`` documents against that store's own retriever's
   ``invoke`` (k = 3), same queries: langchain-core's ``InMemoryVectorStore``, and
   :class:`ArrayStore`, a store searching a numpy matrix, fast enough for the broker phases'
   rate. The embedding is a table lookup, so embedding costs nothing here; the adapter embeds
   each query once for the policy and searches ``InMemoryVectorStore`` by that embedding, while
   ``ArrayStore`` (no search by vector) embeds it again (counted per call in the report: with a
   real embedding model that second embedding adds its own time);
3. **broker away**: the adapter with a ``SyncEventPublisher`` on an embedded broker, paced
   at ``--rate`` requests/s for ``--seconds`` per phase: the broker *up*; *stopped* (its
   process frozen with SIGSTOP: connections hang, as on a partitioned network; for
   ``--stopped-seconds`` when given, e.g. 300 for the 5-minute outage); *flapping*
   (SIGSTOP/SIGCONT every ``--flap`` s); *back* (up again); and *refused* (a second
   publisher on a port where nothing listens). Per phase: invoke latency p50/p99/max next
   to the store alone, calls that raised, calls over ``--block-ms`` (*blocked*; those during
   which the interpreter ran a full garbage collection are counted apart, with each phase's
   longest collection), and the publisher's sent/dropped counters. After the stopped phase
   the broker is resumed and the seconds until ``sent`` grows again are timed. At the end
   every event is accounted for: the events published equal sent + dropped + in doubt + refused, and
   the records on the topic (its high watermarks) equal those published less those
   dropped, i.e. drops are counted exactly (an event the broker was handed but never
   acknowledged, then given up, is counted in doubt: it may be on the topic).

Targets: added p99 ≤ 1 ms at 10^3 memories with the policy loaded (retriever and adapter);
with the broker away (stopped, flapping, refused) added p99 ≤ 2 ms, no call raises or
blocks, drops counted exactly, publishing resumes once the broker is back.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SIZES = (1_000, 1_000_000)
IVF_FROM = 100_000  # --index auto: an IVF index from this many memories up
TARGET_ADDED_P99_MS = 1.0  # at 10^3 memories, the policy loaded
TARGET_AWAY_ADDED_P99_MS = 2.0  # broker stopped, flapping or refusing
AWAY = ("stopped", "flapping", "refused")
K = 3


def unit_vectors(n: int, dim: int, seed: int, chunk: int = 100_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty((n, dim), np.float32)
    for i in range(0, n, chunk):
        x = rng.standard_normal((min(chunk, n - i), dim), dtype=np.float32)
        out[i : i + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def loaded_policy(dim: int, slots: int, hidden: int, seed: int = 0) -> Any:
    """A real policy network as the subscriber hands it over (a manifest without ``serving``: the defaults)."""
    from models.policy.network import init_policy
    from pipeline.client.subscriber import LoadedPolicy
    from topics.manifest import Manifest

    manifest = Manifest("bench", 1, 0.0, "init", {}, 0.5, 0.0, "0" * 64, 1, 1)
    return LoadedPolicy(manifest=manifest, net=init_policy(dim, slots, hidden, seed=seed).eval())


def stats(ms: Sequence[float]) -> dict[str, float]:
    """p50, p99, mean and max of latencies in ms (NaN when there are none)."""
    if not len(ms):
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan"), "max": float("nan"), "n": 0}
    a = np.asarray(ms, dtype=np.float64)
    return {
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
        "max": float(a.max()),
        "n": len(a),
    }


def added(with_: dict[str, float], without: dict[str, float]) -> dict[str, float]:
    """What the product adds to the request's latency distribution: the difference of the quantiles."""
    return {q: with_[q] - without[q] for q in ("p50", "p99", "mean")}


def _timed(call: Callable[[], Any]) -> float:
    t = time.perf_counter()
    call()
    return (time.perf_counter() - t) * 1e3


class Timings:
    """Wall and CPU time (every thread of the process: the retriever's overlapped features too) per call, in ms.

    CPU time leaves out the waits for a core, which on a shared machine decide the wall p99.
    """

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def time(self, call: Callable[[], Any], keep: bool = True) -> None:
        c, t = time.process_time(), time.perf_counter()
        call()
        wall, cpu = (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3
        if keep:
            self.wall.append(wall)
            self.cpu.append(cpu)


def compare(ours: Timings, own: Timings) -> dict[str, Any]:
    """Both sides' wall and CPU quantiles, and what ours adds to each."""
    a, b, ac, bc = stats(ours.wall), stats(own.wall), stats(ours.cpu), stats(own.cpu)
    return {
        "ours_ms": a,
        "own_ms": b,
        "added_ms": added(a, b),
        "added_cpu_ms": added(ac, bc),
        "ratio_p50": a["p50"] / b["p50"],
    }


def _empty(query_text: str | None, query_embedding: np.ndarray, k: int) -> list[int]:
    return []


# --------------------------------------------------------------------------- 1. CausalRetriever


def retriever_latency(n: int, opts: dict[str, Any]) -> dict[str, Any]:
    """``CausalRetriever.retrieve`` (policy loaded) against ``retriever.search`` at ``n`` memories."""
    import faiss

    from pipeline.client.retriever import CausalRetriever

    dim = opts["dim"]
    t0 = time.perf_counter()
    vectors = unit_vectors(n, dim, seed=1)
    index, description = None, "FlatIP (exact)"
    if opts["index"] == "ivf" or (opts["index"] == "auto" and n >= IVF_FROM):
        nlist = max(1, min(opts["nlist"], n // 39))  # faiss wants ≥ 39 training points per list
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.niter = 10
        index.train(vectors[np.random.default_rng(3).choice(n, size=min(n, 64 * nlist), replace=False)])
        index.nprobe = min(opts["nprobe"], nlist)
        description = f"IVFFlat nlist={nlist} nprobe={index.nprobe}"
    retriever = CausalRetriever(
        vectors, k=K, n_candidates=opts["candidates"], fallback=_empty, faiss_index=index, seed=0
    )
    del vectors  # the retriever keeps its own reference
    retriever.set_policy(loaded_policy(dim, max(n, 1024), opts["hidden"]))
    build_s = time.perf_counter() - t0
    queries = unit_vectors(opts["queries"], dim, seed=2)
    plain, policy = Timings(), Timings()
    try:
        for i in range(-opts["warmup"], len(queries)):
            q = queries[i % len(queries)]

            def search(q: np.ndarray = q) -> Any:
                return retriever.search(q, retriever.n_candidates)

            def retrieve(q: np.ndarray = q, i: int = i) -> Any:
                return retriever.retrieve(q, f"q{i}", with_texts=False)

            pair = ((plain, search), (policy, retrieve))
            for timings, call in pair if i % 2 == 0 else pair[::-1]:
                timings.time(call, keep=i >= 0)
        overlapped = retriever.features.overlapping()
    finally:
        retriever.close()
    c = compare(policy, plain)
    return {
        "memories": n,
        "index": description,
        "build_s": round(build_s, 1),
        "search_ms": c["own_ms"],
        "retrieve_ms": c["ours_ms"],
        "added_ms": c["added_ms"],
        "added_cpu_ms": c["added_cpu_ms"],
        "ratio_p50": c["ratio_p50"],
        "features_overlapped": overlapped,
    }


# --------------------------------------------------------------------------- 2. the LangChain adapter


def _stores() -> tuple[Any, Any]:
    """The lookup embedding and the numpy store (defined on first use: langchain-core is an extra)."""
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import VectorStore

    class TableEmbeddings(Embeddings):
        """``"memory i"`` → row i of the memories, ``"query j"`` → row j of the queries; counts queries embedded."""

        def __init__(self, memories: np.ndarray, queries: np.ndarray) -> None:
            self.memories, self.queries, self.calls = memories, queries, 0

        def _row(self, text: str) -> list[float]:
            kind, i = text.split()
            out: list[float] = (self.memories if kind == "memory" else self.queries)[int(i)].tolist()
            return out

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return [self._row(t) for t in texts]

        def embed_query(self, text: str) -> list[float]:
            self.calls += 1
            return self._row(text)

    class ArrayStore(VectorStore):
        """Documents and their unit vectors in a numpy matrix; inner-product search (a fast user store)."""

        def __init__(self, embedding: Embeddings, docs: list[Document], vectors: np.ndarray) -> None:
            self.embedding, self.docs, self.vectors = embedding, docs, np.ascontiguousarray(vectors, np.float32)

        @property
        def embeddings(self) -> Embeddings:
            return self.embedding

        @classmethod
        def from_texts(
            cls, texts: list[str], embedding: Embeddings, metadatas: list[dict[Any, Any]] | None = None, **kwargs: Any
        ) -> ArrayStore:
            docs = [Document(id=f"doc-{i}", page_content=t) for i, t in enumerate(texts)]
            return cls(embedding, docs, np.asarray(embedding.embed_documents(list(texts)), np.float32))

        def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[Document, float]]:
            q = np.asarray(self.embedding.embed_query(query), np.float32)
            scores = self.vectors @ q
            k = min(k, len(scores))
            top = np.argpartition(-scores, k - 1)[:k]
            top = top[np.argsort(-scores[top])]
            return [(self.docs[i], float(scores[i])) for i in top]

        def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
            return [d for d, _ in self.similarity_search_with_score(query, k)]

    return TableEmbeddings, ArrayStore


def make_store(kind: str, docs: int, dim: int, queries: int) -> tuple[Any, Any]:
    """A store of ``docs`` documents (``"memory i"``) and its lookup embedding (``"query j"`` for queries)."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    table_embeddings, array_store = _stores()
    emb = table_embeddings(unit_vectors(docs, dim, seed=5), unit_vectors(queries, dim, seed=6))
    texts = [f"memory {i}" for i in range(docs)]
    if kind == "InMemoryVectorStore":
        store: Any = InMemoryVectorStore(emb)
        store.add_documents([Document(id=f"doc-{i}", page_content=t) for i, t in enumerate(texts)])
    else:
        store = array_store.from_texts(texts, emb)
    return store, emb


def make_adapter(store: Any, dim: int, slots: int, hidden: int, publisher: Any = None, settings: Any = None) -> Any:
    from pipeline.client.langchain import CausalMemoryRetriever
    from pipeline.config import AdapterConfig, Settings

    conn = settings if settings is not None else Settings(embedding_dim=dim, slots=slots)
    adapter = CausalMemoryRetriever(store, conn=conn, config=AdapterConfig(k=K, seed=0), publisher=publisher)
    adapter.set_policy(loaded_policy(dim, slots, hidden))
    return adapter


def adapter_latency(kind: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The adapter's ``invoke`` (policy loaded, no publisher) against the store's own retriever's ``invoke``."""
    dim, docs, n = opts["dim"], opts["docs"], opts["adapter_queries"]
    store, emb = make_store(kind, docs, dim, n)
    adapter = make_adapter(store, dim, max(docs, 1024), opts["hidden"])
    plain = store.as_retriever(search_kwargs={"k": K})
    timings = {"store": Timings(), "adapter": Timings()}
    embeds = {"store": 0, "adapter": 0}
    for i in range(-opts["warmup"], n):
        text = f"query {i % n}"

        def own(text: str = text) -> Any:
            return plain.invoke(text)

        def ours(text: str = text, i: int = i) -> Any:
            return adapter.invoke(text, query_id=f"a{i}")

        pair = (("store", own), ("adapter", ours))
        for name, call in pair if i % 2 == 0 else pair[::-1]:
            before = emb.calls
            timings[name].time(call, keep=i >= 0)
            if i >= 0:
                embeds[name] += emb.calls - before
    c = compare(timings["adapter"], timings["store"])
    return {
        "store": kind,
        "docs": docs,
        "store_ms": c["own_ms"],
        "adapter_ms": c["ours_ms"],
        "added_ms": c["added_ms"],
        "added_cpu_ms": c["added_cpu_ms"],
        "ratio_p50": c["ratio_p50"],
        "embeds_per_call": {k: v / n for k, v in embeds.items()},
    }


# --------------------------------------------------------------------------- 3. the broker away


def paced(rate: float, seconds: float, tick: Callable[[int], None]) -> tuple[int, float]:
    """Call ``tick(i)`` at ``rate`` per second for ``seconds`` (catching up back to back when late)."""
    period, start, i = 1.0 / rate, time.perf_counter(), 0
    while i * period < seconds:
        wait = start + i * period - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        tick(i)
        i += 1
    return i, time.perf_counter() - start


class Flapper:
    """Stops and continues a process every ``every`` seconds on a thread of its own; continued at :meth:`stop`."""

    def __init__(self, pid: int, every: float) -> None:
        self.pid, self.every, self.toggles = pid, every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-flapper", daemon=True)

    def _run(self) -> None:
        stopped = False
        while not self._done.wait(self.every):
            stopped = not stopped
            os.kill(self.pid, signal.SIGSTOP if stopped else signal.SIGCONT)
            self.toggles += 1
        os.kill(self.pid, signal.SIGCONT)

    def start(self) -> Flapper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class GcWatch:
    """The interpreter's full (generation 2) collections while installed, on any thread: when each ran."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.spans.append((self._t, time.perf_counter()))

    @property
    def pauses_ms(self) -> list[float]:
        return [(end - start) * 1e3 for start, end in self.spans]

    def during(self, start: float, end: float) -> bool:
        """Whether a full collection ran during ``start``..``end``."""
        return any(s < end and e > start for s, e in self.spans)

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


class Phase:
    """One phase's request loop: the adapter (with its publisher) on every request, and the store
    alone next to it on every ``baseline_every``-th (the order alternating).

    A call longer than ``block_ms`` counts as *blocked*, unless a full garbage collection of
    the interpreter ran during it (*gc_paused*: a pause every Python thread of the process
    takes, whatever the broker does).
    """

    def __init__(self, name: str, adapter: Any, plain: Any, publisher: Any, opts: dict[str, Any]) -> None:
        self.name, self.adapter, self.plain, self.publisher = name, adapter, plain, publisher
        self.queries, self.block_ms, self.every = opts["adapter_queries"], opts["block_ms"], opts["baseline_every"]
        self.adapter_ms: list[float] = []
        self.store_ms: list[float] = []
        self.raised = 0
        self.calls = 0
        self.slow: list[tuple[float, float, float]] = []  # calls over block_ms: start, end, the thread's CPU ms
        self.gc = GcWatch()

    def _ours(self, i: int) -> None:
        c, t = time.thread_time(), time.perf_counter()
        try:
            self.adapter.invoke(f"query {i % self.queries}", query_id=f"{self.name}-{i}")
        except Exception:
            self.raised += 1
        end = time.perf_counter()
        self.adapter_ms.append((end - t) * 1e3)
        self.calls += 1
        if (end - t) * 1e3 > self.block_ms:
            self.slow.append((t, end, (time.thread_time() - c) * 1e3))

    def _own(self, i: int) -> None:
        self.store_ms.append(_timed(lambda: self.plain.invoke(f"query {i % self.queries}")))

    def tick(self, i: int) -> None:
        if i % self.every:
            self._ours(i)
        elif (i // self.every) % 2 == 0:
            self._ours(i)
            self._own(i)
        else:
            self._own(i)
            self._ours(i)

    def run(self, rate: float, seconds: float) -> dict[str, Any]:
        pub = self.publisher
        sent, dropped, failures = pub.sent, pub.dropped, self.adapter.serving.publish_failures
        with self.gc:
            calls, elapsed = paced(rate, seconds, self.tick)
        a, b = stats(self.adapter_ms), stats(self.store_ms)
        slow = [
            {"ms": (end - start) * 1e3, "thread_cpu_ms": cpu, "full_gc": self.gc.during(start, end)}
            for start, end, cpu in self.slow
        ]
        paused = sum(c["full_gc"] for c in slow)
        return {
            "phase": self.name,
            "calls": calls,
            "rate_per_s": calls / elapsed,
            "invoke_ms": a,
            "store_ms": b,
            "added_ms": added(a, b),
            "raised": self.raised,
            "blocked": len(self.slow) - paused,
            "gc_paused": paused,
            "full_gcs": len(self.gc.pauses_ms),
            "full_gc_max_ms": max(self.gc.pauses_ms, default=0.0),
            "slow_calls": slow,  # wall and the request thread's own CPU: little CPU means it waited (a core, the GIL)
            "publish_failures": self.adapter.serving.publish_failures - failures,
            "sent": pub.sent - sent,
            "dropped": pub.dropped - dropped,
            "buffered_after": pub.sender.buffered,
            "health_after": pub.health(),
        }


def wait_for(check: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``check()`` holds (polled every 10 ms), None when it did not within ``timeout``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if check():
            return time.perf_counter() - t0
        time.sleep(0.01)
    return None


def records_on_topic(bootstrap: str, settings: Any, topic: str, partitions: int) -> int:
    from pipeline import kafka

    async def count() -> int:
        return sum([await kafka.high_watermark(bootstrap, settings, topic, p) for p in range(partitions)])

    return asyncio.run(count())


def stopped_seconds(opts: dict[str, Any]) -> float:
    """How long the broker stays stopped: ``--stopped-seconds``, else ``--seconds`` like every phase.

    >>> stopped_seconds({"seconds": 10.0, "stopped_seconds": None})
    10.0
    >>> stopped_seconds({"seconds": 10.0, "stopped_seconds": 300.0})
    300.0
    """
    given = opts.get("stopped_seconds")
    return float(opts["seconds"] if given is None else given)


def broker_phases(opts: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    """The adapter with a ``SyncEventPublisher`` on an embedded broker: up, stopped, flapping, back; refused."""
    from pipeline import kafka
    from pipeline.broker import HOST, EmbeddedBroker, free_port
    from pipeline.client.publisher import SyncEventPublisher
    from pipeline.config import Settings
    from topics.fields import encode

    dim, docs = opts["dim"], opts["docs"]
    slots = max(docs, 1024)
    logdir = Path(tempfile.mkdtemp(prefix="causalmem-bench-serving-"))
    broker = EmbeddedBroker(port=free_port(), log_path=logdir / "broker.log")
    broker.start()
    pid = broker.pid
    assert pid is not None
    settings = Settings(
        bootstrap=broker.bootstrap,
        topic_prefix=f"bench-serving-{uuid.uuid4().hex[:6]}.",
        embedding_dim=dim,
        slots=slots,
        state_dir=str(logdir / "state"),
    )
    pubs: list[Any] = []
    try:
        asyncio.run(kafka.create_topics(broker.bootstrap, settings))
        store, _ = make_store(opts["store"], docs, dim, opts["adapter_queries"])
        plain = store.as_retriever(search_kwargs={"k": K})
        pub = SyncEventPublisher(broker.bootstrap, settings, max_events=opts["max_events"])
        pubs.append(pub)
        adapter = make_adapter(store, dim, slots, opts["hidden"], publisher=pub, settings=settings)
        total = 0  # adapter calls through ``pub``

        def phase(
            name: str, adapter: Any = adapter, publisher: Any = pub, seconds: float = opts["seconds"]
        ) -> dict[str, Any]:
            r = Phase(name, adapter, plain, publisher, opts).run(opts["rate"], seconds)
            log(
                f"  {name}: {r['calls']:,} calls at {r['rate_per_s']:,.0f}/s, "
                f"invoke p99 {r['invoke_ms']['p99']:.3f} ms (max {r['invoke_ms']['max']:.1f}), "
                f"added p99 {r['added_ms']['p99']:.3f} ms, raised {r['raised']}, "
                f"sent {r['sent']:,}, dropped {r['dropped']:,}, buffered {r['buffered_after']:,}"
            )
            return r

        # Refused, later: a second publisher on a port where nothing listens (connections fail at once).
        dead = SyncEventPublisher(f"{HOST}:{free_port()}", settings, max_events=opts["max_events"])
        pubs.append(dead)
        refused_adapter = make_adapter(store, dim, slots, opts["hidden"], publisher=dead, settings=settings)
        warm = Phase("warmup", adapter, plain, pub, opts)
        warm_refused = Phase("warmup-refused", refused_adapter, plain, dead, opts)
        for i in range(opts["warmup"]):
            warm.tick(i)
            warm_refused.tick(i)
        total += warm.calls
        if not pub.flush(timeout=60):
            raise RuntimeError(f"the publisher did not reach the broker within 60 s ({pub.health()})")
        event_bytes = len(encode(adapter.last.event.to_dict()))
        if opts["gc_freeze"]:
            gc.freeze()  # what a service may do once started: full collections then skip the objects of start-up
        rows = [phase("up")]
        os.kill(pid, signal.SIGSTOP)
        try:
            rows.append(phase("stopped", seconds=stopped_seconds(opts)))
        finally:
            os.kill(pid, signal.SIGCONT)
        sent_at_return = pub.sent
        resumed_s = wait_for(lambda: pub.sent > sent_at_return, 60.0)
        drained_s = wait_for(lambda: pub.sender.buffered == 0, 60.0)
        log(f"  broker back: sent grew after {resumed_s} s, the buffer drained after {drained_s} s")
        flapper = Flapper(pid, opts["flap"]).start()
        try:
            rows.append(phase("flapping"))
        finally:
            flapper.stop()
        rows.append(phase("back"))
        total += sum(r["calls"] for r in rows)
        flushed = pub.flush(timeout=60)
        pub.close(timeout=10)
        failures = adapter.serving.publish_failures
        published = total - failures
        topic = settings.topics().retrieval_events.name
        on_topic = records_on_topic(broker.bootstrap, settings, topic, settings.partitions)
        accounting = {
            "published": published,
            "sent": pub.sent,
            "dropped": pub.dropped,
            "in_doubt": pub.in_doubt,
            "refused": pub.sender.refused,
            "records_on_topic": on_topic,
            "flushed": flushed,
            "balanced": published == pub.sent + pub.dropped + pub.in_doubt + pub.sender.refused,
            # Every event counted dropped or refused is missing from the topic, and every missing
            # one is counted: dropped, refused, or in doubt (handed to the broker, never acknowledged).
            "drops_exact": pub.dropped + pub.sender.refused
            <= published - on_topic
            <= pub.dropped + pub.sender.refused + pub.in_doubt,
        }
        rows.append(phase("refused", refused_adapter, dead))
        dead_calls = rows[-1]["calls"] + warm_refused.calls
        dead.close(timeout=1)
        accounting["refused_phase"] = {
            "published": dead_calls - refused_adapter.serving.publish_failures,
            "sent": dead.sent,
            "dropped": dead.dropped,
            "balanced": dead_calls - refused_adapter.serving.publish_failures == dead.sent + dead.dropped,
        }
        result = {
            "store": opts["store"],
            "rate": opts["rate"],
            "seconds": opts["seconds"],
            "stopped_seconds": stopped_seconds(opts),
            "max_events": opts["max_events"],
            "event_bytes": event_bytes,
            "gc_freeze": opts["gc_freeze"],
            "block_ms": opts["block_ms"],
            "flap_s": opts["flap"],
            "flap_toggles": flapper.toggles,
            "phases": rows,
            "resumed_s": resumed_s,
            "drained_s": drained_s,
            "accounting": accounting,
        }
    finally:
        gc.unfreeze()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        for p in pubs:
            p.close(timeout=1)
        broker.stop()
    # The run's logs, its broker's and its state go once it succeeded; a failure keeps them.
    shutil.rmtree(logdir, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- run, tables, verdict


def run(opts: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    import faiss
    import torch

    threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(opts["threads"])
    faiss.omp_set_num_threads(opts["threads"])
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "options": opts,
        "cpus": os.cpu_count(),
        "load_average_before": os.getloadavg(),
        "retriever": [],
        "adapter": [],
    }
    try:
        for n in opts["memories"]:
            r = retriever_latency(n, opts)
            report["retriever"].append(r)
            log(
                f"retriever, {n:,} memories ({r['index']}, built in {r['build_s']} s): search p50 "
                f"{r['search_ms']['p50']:.3f} ms, retrieve p50 {r['retrieve_ms']['p50']:.3f} ms"
            )
        for kind in opts["stores"]:
            r = adapter_latency(kind, opts)
            report["adapter"].append(r)
            log(f"adapter around {kind}: store p50 {r['store_ms']['p50']:.3f} ms, adapter {r['adapter_ms']['p50']:.3f}")
        if opts["rate"] > 0 and opts["seconds"] > 0:
            log(
                f"broker phases: {opts['rate']:g} requests/s, {opts['seconds']:g} s each "
                f"(stopped: {stopped_seconds(opts):g} s), store {opts['store']}"
            )
            report["broker"] = broker_phases(opts, log)
    finally:
        torch.set_num_threads(threads[0])
        faiss.omp_set_num_threads(threads[1])
    report["load_average_after"] = os.getloadavg()
    report["seconds"] = time.perf_counter() - t0
    return report


P = ("p50", "p99")


def _q(s: dict[str, float], keys: Iterable[str] = ("p50", "p99", "mean")) -> str:
    return " / ".join(f"{s[k]:.3f}" for k in keys)


def tables(report: dict[str, Any]) -> str:
    lines = [
        "| memories | index | search alone p50 / p99 / mean ms | retrieve, policy loaded p50 / p99 / mean ms "
        "| added p50 / p99 / mean ms | added CPU p50 / p99 ms | ratio p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["retriever"]:
        lines.append(
            f"| {r['memories']:,} | {r['index']} | {_q(r['search_ms'])} | {_q(r['retrieve_ms'])} "
            f"| {_q(r['added_ms'])} | {_q(r['added_cpu_ms'], P)} | {r['ratio_p50']:.2f}× |"
        )
    if report["adapter"]:
        lines += [
            "",
            "| store (docs) | store's retriever p50 / p99 / mean ms | adapter, policy loaded p50 / p99 / mean ms "
            "| added p50 / p99 / mean ms | added CPU p50 / p99 ms | ratio p50 "
            "| query embeddings per call (store / adapter) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in report["adapter"]:
            e = r["embeds_per_call"]
            lines.append(
                f"| {r['store']} ({r['docs']:,}) | {_q(r['store_ms'])} | {_q(r['adapter_ms'])} | {_q(r['added_ms'])} "
                f"| {_q(r['added_cpu_ms'], P)} | {r['ratio_p50']:.2f}× | {e['store']:g} / {e['adapter']:g} |"
            )
    b = report.get("broker")
    if b:
        from pipeline.client.sender import MAX_BYTES

        lines += [
            "",
            "| broker | calls (rate/s) | invoke p50 / p99 / max ms | store alone p50 / p99 ms | added p50 / p99 ms "
            "| raised | blocked (GC-paused) | full GCs, longest ms | sent | dropped | buffered after |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in b["phases"]:
            lines.append(
                f"| {r['phase']} | {r['calls']:,} ({r['rate_per_s']:,.0f}) "
                f"| {_q(r['invoke_ms'], ('p50', 'p99', 'max'))} | {_q(r['store_ms'], P)} "
                f"| {_q(r['added_ms'], P)} | {r['raised']} "
                f"| {r['blocked']} ({r['gc_paused']}) | {r['full_gcs']}, {r['full_gc_max_ms']:.0f} | {r['sent']:,} "
                f"| {r['dropped']:,} | {r['buffered_after']:,} |"
            )
        a = b["accounting"]
        lines += [
            "",
            f"Events through the broker's publisher: {a['published']:,} published = {a['sent']:,} sent + "
            f"{a['dropped']:,} dropped + {a.get('in_doubt', 0):,} in doubt + {a['refused']:,} refused "
            f"({'balanced' if a['balanced'] else 'NOT balanced'}); "
            f"{a['records_on_topic']:,} records on the topic "
            f"({'drops exact' if a['drops_exact'] else 'drops NOT exact'}). "
            f"Broker back: sent grew after {_s(b['resumed_s'])}, the buffer drained after {_s(b['drained_s'])}. "
            f"An event: {b['event_bytes']:,} B encoded, so the buffer ({b['max_events']:,} events, 32 MiB) holds "
            f"{min(b['max_events'], MAX_BYTES // b['event_bytes']):,}"
            + ("; gc.freeze() after start-up." if b["gc_freeze"] else "."),
        ]
    return "\n".join(lines)


def _s(seconds: float | None) -> str:
    return "never (60 s)" if seconds is None else f"{seconds:.2f} s"


def verdict(report: dict[str, Any]) -> str:
    def ok(flag: bool) -> str:
        return "met" if flag else "MISSED"

    parts = []
    small = [r for r in report["retriever"] if r["memories"] <= 1_000]
    for r in small:
        parts.append(
            f"retriever at {r['memories']:,}: added p99 {r['added_ms']['p99']:.3f} ms "
            f"(≤ {TARGET_ADDED_P99_MS:g} ms: {ok(r['added_ms']['p99'] <= TARGET_ADDED_P99_MS)})"
        )
    for r in report["adapter"]:
        if r["docs"] <= 1_000:
            parts.append(
                f"adapter around {r['store']}: added p99 {r['added_ms']['p99']:.3f} ms "
                f"(≤ {TARGET_ADDED_P99_MS:g} ms: {ok(r['added_ms']['p99'] <= TARGET_ADDED_P99_MS)})"
            )
    b = report.get("broker")
    if b:
        away = [r for r in b["phases"] if r["phase"] in AWAY]
        worst = max(r["added_ms"]["p99"] for r in away)
        raised = sum(r["raised"] for r in b["phases"])
        blocked = sum(r["blocked"] for r in b["phases"])
        paused = sum(r["gc_paused"] for r in b["phases"])
        a = b["accounting"]
        exact = a["balanced"] and a["drops_exact"] and a["refused_phase"]["balanced"]
        parts.append(
            f"broker away: worst added p99 {worst:.3f} ms (≤ {TARGET_AWAY_ADDED_P99_MS:g} ms: "
            f"{ok(worst <= TARGET_AWAY_ADDED_P99_MS)}); {raised} raised, {blocked} blocked "
            f"({ok(raised == 0 == blocked)}; "
            f"{paused} more over {b['block_ms']:g} ms in a full garbage collection); "
            f"drops counted exactly: {ok(exact)}; publishing resumed: {ok(b['resumed_s'] is not None)}"
        )
    parts.append(f"{report['seconds']:.0f} s")
    return "; ".join(parts)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memories",
        default=",".join(str(s) for s in SIZES),
        help="memory counts for the retriever, comma-separated (10^6 holds ~5 GB: the vectors, the index, the policy)",
    )
    p.add_argument("--index", choices=("auto", "flat", "ivf"), default="auto", help=f"auto: IVF from {IVF_FROM:,} up")
    p.add_argument("--queries", type=int, default=2000, help="timed retrievals per memory count")
    p.add_argument("--docs", type=int, default=1000, help="documents in the adapter's store")
    p.add_argument("--adapter-queries", type=int, default=1000, help="timed adapter calls per store")
    p.add_argument(
        "--stores",
        default="InMemoryVectorStore,ArrayStore",
        help="stores the adapter wraps, comma-separated (InMemoryVectorStore, ArrayStore)",
    )
    p.add_argument("--store", default="ArrayStore", help="the store of the broker phases (1,000/s needs a fast one)")
    p.add_argument("--rate", type=float, default=1000.0, help="requests/s in the broker phases (0: skip them)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds per broker phase (0: skip them)")
    p.add_argument(
        "--stopped-seconds",
        type=float,
        default=None,
        help="seconds the broker stays stopped (default: --seconds; the outage target: 300)",
    )
    p.add_argument("--flap", type=float, default=2.0, help="seconds between SIGSTOP and SIGCONT while flapping")
    p.add_argument("--max-events", type=int, default=10_000, help="the publisher's buffer (its default: 10,000)")
    p.add_argument("--block-ms", type=float, default=100.0, help="a call longer than this counts as blocked")
    p.add_argument("--baseline-every", type=int, default=4, help="broker phases: time the store alone every n requests")
    p.add_argument(
        "--gc-freeze", action="store_true", help="broker phases: gc.freeze() after start-up, as a service may"
    )
    p.add_argument("--dim", type=int, default=384, help="D, the embedding dimension")
    p.add_argument("--hidden", type=int, default=512, help="H, the policy's hidden width")
    p.add_argument("--candidates", type=int, default=20, help="the retriever's candidates (n_candidates)")
    p.add_argument("--nlist", type=int, default=1024, help="IVF lists")
    p.add_argument("--nprobe", type=int, default=16, help="IVF lists probed")
    p.add_argument("--threads", type=int, default=1, help="torch and faiss threads")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls first")
    p.add_argument("--out", help="write the report as JSON here")


def options(args: argparse.Namespace) -> dict[str, Any]:
    opts = {
        k: getattr(args, k)
        for k in (
            "index",
            "queries",
            "docs",
            "adapter_queries",
            "store",
            "rate",
            "seconds",
            "stopped_seconds",
            "flap",
            "max_events",
            "block_ms",
            "baseline_every",
            "gc_freeze",
            "dim",
            "hidden",
            "candidates",
            "nlist",
            "nprobe",
            "threads",
            "warmup",
        )
    }
    opts["memories"] = [int(s) for s in str(args.memories).split(",") if s.strip()]
    opts["stores"] = [s.strip() for s in str(args.stores).split(",") if s.strip()]
    for s in [*opts["stores"], opts["store"]]:
        if s not in ("InMemoryVectorStore", "ArrayStore"):
            raise SystemExit(f"unknown store {s!r}: InMemoryVectorStore or ArrayStore")
    return opts


def main(args: argparse.Namespace) -> int:
    report = run(options(args))
    print()
    print(tables(report))
    print(verdict(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
