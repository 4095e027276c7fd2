"""``causalmem bench gate`` on a tiny configuration: the report's shape and its true values."""

from __future__ import annotations

import argparse

import numpy as np

from pipeline.lab.bench import gate as bench


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
    for log in bench.LOGS:
        for method in bench.METHODS:
            s = report["summary"][log][method]
            assert s["judgements"] == 3
            assert 0.0 <= s["gain_coverage"] <= 1.0 and 0.0 <= s["undecided"] <= 1.0
            decisions = {r["decision"] for r in report["results"][log][method]}
            assert decisions <= {"promoted", "refused", "insufficient"}
    # the exploratory log's ESS is far above the near-greedy one's (what exploration buys)
    ess = {log: np.median([r["ess"] for r in report["results"][log]["pi"]]) for log in bench.LOGS}
    assert ess["exploratory"] > 3 * ess["near-greedy"]
    assert "| exploratory | dr-pi |" in bench.table(report)
