"""``causalmem bench gate`` on a slice of the real-data world, with a fake LM and embedder: every
trial's intervals are judged against the true values of the versions they name."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from causalmem_lab.bench import gate_calibration as bench
from causalmem_lab.bench import promise

from tests.bench.test_fanout_world import use_a_slice


def test_the_bench_judges_every_trial_against_the_truth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_a_slice(monkeypatch, tmp_path, promise, "fanout-lookalike")
    p = argparse.ArgumentParser()
    bench.add_options(p)
    args = p.parse_args(["--clients", "t1", "--seeds", "0", "--events", "3000", "--drop", "none"])
    args.out = str(tmp_path / "gate.json")
    assert bench.main(args) == 0
    report = bench.run(args)
    run = report["runs"][0]
    assert run["trials"] >= 1 and run["looks"] >= run["trials"]  # some trial saw a bound
    assert 0 <= run["covered"] <= run["trials"] and 0 <= run["looks_covered"] <= run["looks"]
    assert set(run["gains"]) == set(run["last"])
    lo, hi = report["coverage_interval"]
    assert 0.0 <= lo <= report["coverage"] <= hi <= 1.0
    assert report["meets_target"] == (report["coverage"] >= bench.TARGET)
    assert "coverage over" in bench.table(report)
    with pytest.raises(ValueError, match="unknown"):
        bench.run(argparse.Namespace(**{**vars(args), "clients": "other"}))
