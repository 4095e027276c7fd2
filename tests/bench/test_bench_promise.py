"""``causalmem bench promise`` on a slice of the real-data world, with a fake LM and embedder:
every version served is measured, and a run is unsafe when one was below similarity-only by ε."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from causalmem_lab.bench import promise
from causalmem_lab.offline import PRODUCT

from tests.bench.test_fanout_world import use_a_slice


def test_wilson_interval() -> None:
    lo, hi = promise.wilson(1, 20)
    assert 0.0 < lo < 0.05 < hi < 0.3
    assert promise.wilson(0, 0) == (0.0, 1.0)


def test_versions_are_measured_with_the_exploration_share_their_manifest_serves() -> None:
    # The exploration share is served, so the promise counts it (the first policy's included);
    # t1 explores otherwise than any manifest of the product asks, so it is measured as they ask.
    assert promise.as_asked(promise.CLIENTS["manifest"]) is True
    assert promise.as_asked(promise.CLIENTS["retriever"]) is True
    assert promise.as_asked(promise.CLIENTS["t1"]) == (PRODUCT.serve_explore_rate, PRODUCT.serve_explore_temperature)


def test_the_bench_measures_every_version_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_a_slice(monkeypatch, tmp_path, promise, "fanout")
    args = argparse.Namespace(
        data="fanout",
        candidates=None,
        cache_dir=None,
        clients="t1",
        rules="gate,none",
        seeds="0",
        events=1200,
        epsilon=0.02,
        drop="none",
        restart_at=600,  # a learner restart half-way (gated: the rule's state rebuilt from the serving manifest)
        out=str(tmp_path / "promise.json"),
    )
    assert promise.main(args) == 0
    report = promise.run(args)
    rows = report["rows"]
    assert set(rows) == {"t1/gate", "t1/none"}
    ungated = rows["t1/none"]["runs"][0]
    assert ungated["versions_served"] > 1  # every checkpoint served
    for row in rows.values():
        run = row["runs"][0]
        assert run["unsafe"] == (run["worst_vs_similarity"] < -0.02)
        assert run["versions_served"] >= 1 and "final_gap_closed_unexplored" in run  # the first policy too
        lo, hi = row["unsafe_interval"]
        assert 0.0 <= lo <= hi <= 1.0
    assert "trial" in rows["t1/gate"]["runs"][0]["actions"]
    assert rows["t1/gate"]["runs"][0]["restarted"] == 600 and ungated["restarted"] is None
    assert report["drop"] == "none" and report["restart_at"] == 600
    with pytest.raises(ValueError, match="unknown"):
        promise.run(argparse.Namespace(**{**vars(args), "rules": "other"}))
