"""``causalmem bench gate`` on a tiny configuration: the report's shape and its true values."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from causalmem_lab.bench import gate_calibration as bench


def test_tiny_gate_bench_reports_every_estimator_and_log() -> None:
    p = argparse.ArgumentParser()
    bench.add_options(p)
    args = p.parse_args(["--window", "150", "--candidates", "3", "--repeats", "1", "--truth-queries", "200"])
    args.min_ess, args.boot, args.dim = 50.0, 30, 16
    report = bench.run(args)
    truth = report["truth"]
    # the true served values are means of per-memory values: within what a top-3 can reach
    assert truth["similarity"] < truth["best_top_k"] and truth["serving"] <= truth["best_top_k"]
    assert len(truth["candidates"]) == 3
    for log in bench.LOG_KINDS:
        for method in bench.METHODS:
            s = report["summary"][log][method]
            assert s["judgements"] == 3
            assert 0.0 <= s["gain_coverage"] <= 1.0 and 0.0 <= s["undecided"] <= 1.0
            decisions = {r["decision"] for r in report["results"][log][method]}
            assert decisions <= {"promoted", "refused", "insufficient"}
    # the exploratory log's ESS is far above the near-greedy one's (what exploration buys)
    ess = {log: np.median([r["ess"] for r in report["results"][log]["pi"]]) for log in bench.LOG_KINDS}
    assert ess["exploratory"] > 3 * ess["near-greedy"]
    assert "| exploratory | dr-pi |" in bench.table(report)


def test_a_subset_of_estimators_and_logs_and_the_serving_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAUSALMEM_SERVE_EXPLORE_TEMPERATURE", "1.0")
    assert bench.served_params().components() == ((0.9, 0.05), (0.1, 1.0))
    p = argparse.ArgumentParser()
    bench.add_options(p)
    args = p.parse_args(["--window", "150", "--candidates", "2", "--repeats", "1", "--truth-queries", "200"])
    args.min_ess, args.boot, args.dim = 50.0, 30, 16
    args.methods, args.logs = "dr,auto", "near-greedy"
    report = bench.run(args)
    assert list(report["summary"]) == ["near-greedy"] and list(report["summary"]["near-greedy"]) == ["dr", "auto"]
    args.methods = "dr,nope"
    with pytest.raises(ValueError, match="nope"):
        bench.run(args)


def test_conservative_steps_are_looked_for_where_a_candidate_is_undecided() -> None:
    p = argparse.ArgumentParser()
    bench.add_options(p)
    args = p.parse_args(["--window", "150", "--candidates", "3", "--repeats", "1", "--truth-queries", "200"])
    args.min_ess, args.boot, args.dim = 50.0, 30, 16
    args.methods, args.logs, args.conservative = "auto", "near-greedy", True
    report = bench.run(args)
    rows = report["results"]["near-greedy"]["auto"]
    undecided = [r for r in rows if r["decision"] == "insufficient"]
    assert undecided  # 150 near-greedy steps decide few candidates
    assert all(("step" in r) == (r["decision"] == "insufficient") for r in rows)
    for r in undecided:
        assert r["step"]["decision"] in ("promoted", "insufficient")
        assert (r["step"]["true_gain"] is not None) == (r["step"]["decision"] == "promoted")
    s = report["summary"]["near-greedy"]["auto"]
    assert s["steps_looked"] == len(undecided) and "conservative steps promoted" in bench.table(report)
