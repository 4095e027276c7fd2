"""``causalmem bench scale`` (lab/causalmem_lab/bench/scale.py): its measurements at tiny S, in
process, the table (with the delta checkpoints' extra columns) and the verdict."""

from __future__ import annotations

import os
from typing import Any

import pytest
from causalmem_lab.bench import scale

import pipeline.cli as cli

OPTS: dict[str, Any] = dict(
    dim=16, hidden=16, batch=8, candidates=6, steps=4, threads=1, queries=20, nlist=4, nprobe=2, rounds=2
)


def test_the_learner_bench_runs_the_real_update_and_reports_rss() -> None:
    b = scale.LearnerBench(300, OPTS)
    b.burst(3)
    r = b.report()
    assert r["slots"] == 300 and r["timed_steps"] == 3 and r["steps_per_s"] > 0
    assert r["step_cpu_ms_p50"] > 0 and r["steps_per_cpu_s"] == pytest.approx(1e3 / r["step_cpu_ms_p50"])
    assert r["minor_faults_per_step"] >= 0
    assert 0 < r["changed_rows"] <= 3 * 8 * 6  # the rows the timed steps wrote, not every row
    assert r["learner_rss_gb"] > 0.05 and r["learner_peak_rss_gb"] >= r["learner_rss_gb"]
    assert r["optimizer_state_gb"] > 0


def test_the_client_bench_times_plain_faiss_and_the_retriever_on_one_index() -> None:
    b = scale.ClientBench(500, OPTS)
    b.burst(10)
    r = b.report()
    assert r["queries"] == 10 and r["index"] == "IVFFlat nlist=4 nprobe=2"
    assert 0 < r["faiss_p50_ms"] <= r["faiss_p99_ms"] and r["policy_p50_ms"] > 0 and r["masks_p50_ms"] > 0
    assert b.retriever.policy is not None and b.retriever.index is b.index


def _report() -> dict[str, Any]:
    rows = [
        {
            "slots": s,
            "steps_per_s": rate,
            "learner_rss_gb": rss,
            "learner_peak_rss_gb": rss + 0.5,
            "faiss_p50_ms": 1.0,
            "faiss_p99_ms": 2.0,
            "policy_p50_ms": lat,
            "policy_p99_ms": 3.0,
            "ratio_p50": lat / 1.0,
            "masks_p50_ms": 0.1,
            "client_rss_gb": 1.0,
            "steps_per_cpu_s": cpu_rate,
            "step_cpu_ms_p50": 1e3 / cpu_rate,
        }
        for s, rate, cpu_rate, rss, lat in ((1024, 100.0, 125.0, 0.4, 1.2), (1_000_000, 70.0, 100.0, 6.5, 1.8))
    ]
    return {
        "rows": rows,
        "step_rate_ratio": 0.7,
        "cpu_step_rate_ratio": 0.8,
        "latency_ratio": 1.8,
        "learner_rss_gb": 6.5,
        "seconds": 9.0,
    }


def test_table_and_verdict() -> None:
    report = _report()
    text = scale.table(report, extra={1024: {"delta B / full B": "1.2%"}, 1_000_000: {"delta B / full B": "0.01%"}})
    lines = text.splitlines()
    assert lines[0].endswith("| delta B / full B |") and lines[1].count("|---") == 12
    assert "| 1,000,000 | 70.0 | 70% | 6.50 (7.00) |" in lines[3] and lines[3].endswith("| 10.0 (80%) | 0.01% |")
    v = scale.verdict(report)
    assert "70% of the smallest's (target ≥ 80%: MISSED; in CPU time 80%)" in v
    assert "1.80× plain faiss (target ≤ 1.5×: MISSED)" in v and "6.50 GB (target ≤ 8 GB: met)" in v


def test_cli_flags() -> None:
    argv = ["bench", "scale", "--sizes", "1024,4096", "--steps", "10", "--nprobe", "8", "--out", "s.json"]
    a = cli.build_parser(argv).parse_args(argv)
    assert (a.which, a.sizes, a.steps, a.nprobe, a.out, a.rounds) == ("scale", "1024,4096", 10, 8, "s.json", 10)


def test_delta_columns_measure_the_rows_the_learner_wrote() -> None:
    report = {"rows": [{"slots": 256, "changed_rows": 16}, {"slots": 4096, "changed_rows": 16}]}
    extra = scale.delta_columns(report, {"hidden": 16, "dim": 8}, checkpoints=3)
    assert set(extra) == {256, 4096}
    small, large = report["deltas"]
    assert small["client_equals_learner"] and large["client_equals_learner"]
    # the same 16 changed rows are a smaller share of the bigger policy's full snapshot
    assert large["share"] < small["share"] < 1.0
    assert extra[4096]["delta / full"] == f"{large['share']:.1%}"


def test_each_measuring_process_runs_with_malloc_pinned() -> None:
    """The thresholds reach the spawned process (glibc reads them as it starts) and only it."""
    (r,) = scale.measure("learner", [300], OPTS, total=2, rounds=1)
    assert r["malloc_pinned"] and r["timed_steps"] == 2 and r["minor_faults_per_step"] >= 0
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ
