"""CausalRetriever computing the policy's query features during the search serves exactly what it serves without."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from models.policy.network import init_policy
from pipeline.client.overlap import OVERLAP_MIN_SEARCH_S, FeatureOverlap
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import LoadedPolicy
from topics.fields import encode
from topics.manifest import Manifest
from topics.slotmap import SlotRecord, SlotTable

D, S, H = 16, 200, 32


def loaded(table: SlotTable | None = None) -> LoadedPolicy:
    net = init_policy(D, S, H, seed=3).eval()
    with torch.no_grad():  # learnt-looking rows: masks far from the neutral 1, some dropped
        net.out.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
        net.out.bias.uniform_(-6.0, 3.0, generator=torch.Generator().manual_seed(2))
    manifest = Manifest("p", 3, 0.0, "periodic", net.arch.to_dict(), 0.5, 0.0, "0" * 64, 1, 1)
    return LoadedPolicy(manifest, net, slots=table)


def events(r: CausalRetriever, queries: np.ndarray) -> list[bytes]:
    """Each request's event as published (its random id aside)."""
    out = []
    for i, q in enumerate(queries):
        ev = r.retrieve(q, f"q{i}", last_step_loss=0.1 * i, last_step_entropy=0.5, ts=1.0).event
        out.append(encode(replace(ev, event_id="e").to_dict()))
    return out


def workers() -> int:
    return sum(t.name.startswith("causalmem-features") for t in threading.enumerate())


@pytest.mark.parametrize("by_id", [False, True])
def test_overlapped_features_serve_the_same_events(by_id: bool) -> None:
    rng = np.random.default_rng(0)
    mem = rng.normal(size=(S, D)).astype(np.float32)
    mem /= np.linalg.norm(mem, axis=1, keepdims=True)
    queries = rng.normal(size=(40, D)).astype(np.float32)
    table = SlotTable()
    ids = [f"m{i}" for i in range(S)]
    if by_id:
        for i, m in enumerate(ids[: S - 20]):  # the last 20 have no row in this version: neutral masks
            table.apply(SlotRecord("p", i, m, True, version=3, since=3, ts=1.0))
    runs = []
    for overlap in (False, True):
        kw = {"memory_ids": ids} if by_id else {}
        r = CausalRetriever(
            mem, texts=[f"t{i}" for i in range(S)], seed=7, explore_rate=0.3, overlap_features=overlap, **kw
        )
        r.set_policy(loaded(table if by_id else None))
        runs.append(events(r, queries))
        r.close()
    assert runs[0] == runs[1]
    assert any(b'"dropped":[' in e and b'"dropped":[]' not in e for e in runs[0])  # masks mattered: some were dropped


def test_the_default_overlaps_only_slow_searches_and_close_ends_the_worker() -> None:
    o = FeatureOverlap()
    for _ in range(50):
        o.observe(0.5 * OVERLAP_MIN_SEARCH_S)
    assert not o.overlapping()
    for _ in range(50):
        o.observe(2 * OVERLAP_MIN_SEARCH_S)
    assert o.overlapping()
    r = CausalRetriever(np.eye(D, dtype=np.float32), texts=[str(i) for i in range(D)])
    r.set_policy(loaded())
    for i in range(20):  # an exact index of 16 vectors: microseconds a search, never overlapped
        r.retrieve(np.eye(D, dtype=np.float32)[i % D], f"q{i}")
    assert not r.features.overlapping() and r.features._pool is None
    r = CausalRetriever(np.eye(D, dtype=np.float32), texts=[str(i) for i in range(D)], overlap_features=True)
    r.set_policy(loaded())
    before = workers()
    r.retrieve(np.eye(D, dtype=np.float32)[0], "q")
    assert workers() == before + 1
    r.close()
    assert workers() == before
    assert r.retrieve(np.eye(D, dtype=np.float32)[1], "q2").event.policy_version == 3  # usable after close
    r.close()


def test_without_a_policy_nothing_is_started() -> None:
    o = FeatureOverlap(overlap=True)
    assert o.start(None, np.zeros(D, np.float32), 0.0, 0.0)() is None
    assert o._pool is None


def test_a_request_finding_the_worker_busy_or_closed_computes_its_own_features() -> None:
    policy = loaded()
    q = np.ones(D, np.float32)
    o = FeatureOverlap(overlap=True)
    gate = threading.Event()
    o.start(policy, q, 0.0, 0.0)()  # starts the worker
    deadline = time.monotonic() + 10
    while o._busy and time.monotonic() < deadline:  # its done-callback may run just after the result
        time.sleep(0.001)
    o._pool.submit(gate.wait)  # type: ignore[union-attr]  # the worker busy with something else
    o._busy = True
    inline = o.start(policy, q, 0.0, 0.0)
    assert np.array_equal(inline(), o.start(policy, q, 0.0, 0.0)())  # computed on the caller's thread, same values
    gate.set()
    o._pool.shutdown(wait=True)  # type: ignore[union-attr]  # shut down under the retriever's feet
    o._busy = False
    assert o.start(policy, q, 0.0, 0.0)() is not None  # no "cannot schedule new futures after shutdown"
    o.close()


def test_many_threads_share_one_retriever() -> None:
    rng = np.random.default_rng(1)
    mem = rng.normal(size=(S, D)).astype(np.float32)
    queries = rng.normal(size=(64, D)).astype(np.float32)
    policy = loaded()
    serial = CausalRetriever(mem, texts=[str(i) for i in range(S)], seed=0, overlap_features=False, drop="none")
    serial.set_policy(policy)
    want = {i: serial.retrieve(q, f"q{i}").event.candidate_masks for i, q in enumerate(queries)}
    shared = CausalRetriever(mem, texts=[str(i) for i in range(S)], seed=0, overlap_features=True, drop="none")
    shared.set_policy(policy)
    got: dict[int, object] = {}

    def run(part: range) -> None:
        for i in part:
            got[i] = shared.retrieve(queries[i], f"q{i}").event.candidate_masks

    threads = [threading.Thread(target=run, args=(range(j, 64, 4),)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared.close()
    assert all(np.array_equal(got[i], want[i]) for i in want)  # type: ignore[arg-type]
