"""``causalmem bench serving`` (lab/causalmem_lab/bench/serving.py): each measure at a tiny size, the
tables and verdict, the flags, and the whole bench through the command line on an embedded broker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from causalmem_lab.bench import serving

import pipeline.cli as cli

OPTS: dict[str, Any] = dict(
    index="auto",
    queries=20,
    docs=40,
    adapter_queries=12,
    dim=16,
    hidden=16,
    candidates=6,
    nlist=4,
    nprobe=2,
    warmup=2,
)


def test_the_retriever_is_timed_with_its_policy_against_its_own_search() -> None:
    r = serving.retriever_latency(300, OPTS)
    assert r["memories"] == 300 and r["index"] == "FlatIP (exact)"
    assert r["search_ms"]["n"] == r["retrieve_ms"]["n"] == 20
    assert 0 < r["search_ms"]["p50"] <= r["search_ms"]["p99"] and r["retrieve_ms"]["p50"] > 0
    assert r["added_ms"]["p99"] == pytest.approx(r["retrieve_ms"]["p99"] - r["search_ms"]["p99"])
    ivf = serving.retriever_latency(1000, {**OPTS, "index": "ivf"})
    assert ivf["index"] == "IVFFlat nlist=4 nprobe=2"


@pytest.mark.parametrize("kind", ["InMemoryVectorStore", "ArrayStore"])
def test_the_adapter_is_timed_against_the_stores_own_retriever(kind: str) -> None:
    r = serving.adapter_latency(kind, OPTS)
    assert r["store"] == kind and r["docs"] == 40
    assert r["store_ms"]["n"] == r["adapter_ms"]["n"] == 12 and r["adapter_ms"]["p50"] > 0
    # One embedding a request where the store can be searched by vector (InMemoryVectorStore);
    # a store without similarity_search_with_score_by_vector embeds the query again.
    assert r["embeds_per_call"] == {"store": 1.0, "adapter": 1.0 if kind == "InMemoryVectorStore" else 2.0}


def test_the_array_store_finds_the_nearest_documents_first() -> None:
    store, emb = serving.make_store("ArrayStore", 30, 8, 4)
    found = store.similarity_search_with_score("query 1", k=5)
    scores = emb.memories @ emb.queries[1]
    assert [d.id for d, _ in found] == [f"doc-{i}" for i in scores.argsort()[::-1][:5]]
    assert [s for _, s in found] == sorted((s for _, s in found), reverse=True)


def test_paced_keeps_the_rate() -> None:
    calls: list[int] = []
    n, elapsed = serving.paced(200.0, 0.1, calls.append)
    assert n == 20 and calls == list(range(20)) and elapsed >= 0.095


def _latency(p50: float, p99: float) -> dict[str, float]:
    return {"p50": p50, "p99": p99, "mean": p50, "max": 2 * p99, "n": 10}


def _report(raised: int = 0, exact: bool = True) -> dict[str, Any]:
    phase = {
        "calls": 100,
        "rate_per_s": 99.0,
        "invoke_ms": _latency(0.9, 1.5),
        "store_ms": _latency(0.2, 0.4),
        "added_ms": {"p50": 0.7, "p99": 1.1, "mean": 0.7},
        "raised": 0,
        "blocked": 0,
        "gc_paused": 1,
        "full_gcs": 1,
        "full_gc_max_ms": 120.0,
        "sent": 100,
        "dropped": 0,
        "buffered_after": 0,
    }
    phases = [{**phase, "phase": p} for p in ("up", "stopped", "flapping", "back", "refused")]
    phases[1]["raised"] = raised
    accounting = {
        "published": 400,
        "sent": 380,
        "dropped": 20,
        "refused": 0,
        "records_on_topic": 380 if exact else 390,
        "balanced": True,
        "drops_exact": exact,
        "refused_phase": {"balanced": True},
    }
    return {
        "retriever": [
            {
                "memories": 1000,
                "index": "FlatIP (exact)",
                "search_ms": _latency(0.06, 0.1),
                "retrieve_ms": _latency(0.5, 0.7),
                "added_ms": {"p50": 0.44, "p99": 0.6, "mean": 0.44},
                "added_cpu_ms": {"p50": 0.43, "p99": 0.5, "mean": 0.43},
                "ratio_p50": 8.0,
            }
        ],
        "adapter": [
            {
                "store": "ArrayStore",
                "docs": 1000,
                "store_ms": _latency(0.16, 0.3),
                "adapter_ms": _latency(0.75, 1.5),
                "added_ms": {"p50": 0.59, "p99": 1.2, "mean": 0.6},
                "added_cpu_ms": {"p50": 0.58, "p99": 0.8, "mean": 0.6},
                "ratio_p50": 4.6,
                "embeds_per_call": {"store": 1.0, "adapter": 2.0},
            }
        ],
        "broker": {
            "phases": phases,
            "accounting": accounting,
            "resumed_s": 0.01,
            "drained_s": None,
            "block_ms": 100.0,
            "event_bytes": 6_600,
            "max_events": 10_000,
            "gc_freeze": False,
        },
        "seconds": 30.0,
    }


def test_tables_and_verdict() -> None:
    text = serving.tables(_report())
    assert "| 1,000 | FlatIP (exact) | 0.060 / 0.100 / 0.060 | 0.500 / 0.700 / 0.500 | 0.440 / 0.600 / 0.440 " in text
    assert "| 0.430 / 0.500 | 8.00× |" in text
    assert "| ArrayStore (1,000) |" in text and "| 0.580 / 0.800 | 4.60× | 1 / 2 |" in text
    assert "| stopped | 100 (99) | 0.900 / 1.500 / 3.000 | 0.200 / 0.400 | 0.700 / 1.100 | 0 | 0 (1) | 1, 120 |" in text
    assert "400 published = 380 sent + 20 dropped + 0 in doubt + 0 refused (balanced); 380 records on the topic" in text
    assert "(drops exact)" in text
    assert "drained after never (60 s). An event: 6,600 B encoded, so the buffer (10,000 events, 32 MiB)" in text
    assert "holds 5,084." in text
    v = serving.verdict(_report())
    assert "retriever at 1,000: added p99 0.600 ms (≤ 1 ms: met)" in v
    assert "adapter around ArrayStore: added p99 1.200 ms (≤ 1 ms: MISSED)" in v
    assert "worst added p99 1.100 ms (≤ 2 ms: met); 0 raised, 0 blocked (met; 5 more over 100 ms" in v
    assert "drops counted exactly: met; publishing resumed: met" in v
    v = serving.verdict(_report(raised=1, exact=False))
    assert "1 raised, 0 blocked (MISSED" in v and "drops counted exactly: MISSED" in v


def test_cli_flags() -> None:
    argv = ["bench", "serving", "--memories", "1000", "--rate", "500", "--seconds", "2", "--out", "s.json"]
    a = cli.build_parser(argv).parse_args(argv)
    assert (a.which, a.memories, a.rate, a.seconds, a.out) == ("serving", "1000", 500.0, 2.0, "s.json")
    opts = serving.options(a)
    assert opts["memories"] == [1000] and opts["stores"] == ["InMemoryVectorStore", "ArrayStore"]
    assert (opts["store"], opts["max_events"], opts["index"], opts["flap"]) == ("ArrayStore", 10_000, "auto", 2.0)
    assert (opts["baseline_every"], opts["gc_freeze"]) == (4, False)
    assert opts["stopped_seconds"] is None and serving.stopped_seconds(opts) == 2.0  # as long as every phase
    argv = ["bench", "serving", "--seconds", "10", "--stopped-seconds", "300"]
    opts = serving.options(cli.build_parser(argv).parse_args(argv))
    assert (opts["seconds"], serving.stopped_seconds(opts)) == (10.0, 300.0)
    argv = ["bench", "serving", "--stores", "Chroma"]
    with pytest.raises(SystemExit):
        serving.options(cli.build_parser(argv).parse_args(argv))


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_bench_runs_end_to_end_and_accounts_for_every_event(tmp_path: Path) -> None:
    """Tiny sizes, a buffer of 30 events: the stopped and refused phases drop, and every drop is counted."""
    out = tmp_path / "serving.json"
    argv = (
        "bench serving --memories 300 --queries 20 --docs 40 --adapter-queries 12 --stores ArrayStore "
        f"--rate 100 --seconds 1 --stopped-seconds 2 --flap 0.3 --max-events 30 --dim 16 --hidden 16 --warmup 5 "
        f"--gc-freeze --out {out}"
    ).split()
    assert cli.main(argv) == 0
    r = json.loads(out.read_text())
    phases = {p["phase"]: p for p in r["broker"]["phases"]}
    assert list(phases) == ["up", "stopped", "flapping", "back", "refused"]
    assert all(p["raised"] == 0 and p["publish_failures"] == 0 and p["calls"] >= 90 for p in phases.values())
    # 200 calls (--stopped-seconds 2), 30 buffered at most; what was in flight at SIGSTOP may still be
    # acknowledged during the phase
    assert r["broker"]["stopped_seconds"] == 2.0 and phases["stopped"]["calls"] == 200
    assert phases["stopped"]["sent"] < 10 and phases["stopped"]["dropped"] >= 160
    assert phases["refused"]["sent"] == 0 and phases["refused"]["health_after"].startswith("degraded")
    a = r["broker"]["accounting"]
    assert a["balanced"] and a["drops_exact"] and a["refused_phase"]["balanced"] and a["flushed"]
    assert a["published"] == a["records_on_topic"] + a["dropped"] and a["refused_phase"]["dropped"] >= 90
    assert r["broker"]["resumed_s"] is not None
    assert [x["memories"] for x in r["retriever"]] == [300] and r["adapter"][0]["store"] == "ArrayStore"
