"""``causalmem bench guardrail`` on a slice of the real-data world, with a fake LM and embedder:
a version an operator serves that reads what the learner learnt to avoid is rolled back by the
guardrail, and the decisions it served until then are counted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from causalmem_lab.bench import guardrail, promise

from tests.bench.test_fanout_world import use_a_slice


def args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    base = {
        "data": "fanout-lookalike",
        "candidates": None,
        "cache_dir": None,
        "clients": "t1",
        "severities": "1",
        "seeds": "0",
        "at": 900,
        "watch": 1500,
        "epsilon": 0.02,
        "restart_at": None,
        "out": str(tmp_path / "guardrail.json"),
    }
    return argparse.Namespace(**{**base, **kw})


def test_a_served_version_worse_than_similarity_is_rolled_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_a_slice(monkeypatch, tmp_path, promise, "fanout-lookalike")
    assert guardrail.main(args(tmp_path)) == 0
    report = json.loads((tmp_path / "guardrail.json").read_text())
    (run,) = report["runs"]
    assert run["served_at"] >= 900 and run["version"] > 1
    assert run["worse"] and run["vs_similarity"] < -0.02  # the mirror reads what the learner avoids
    assert run["decisions_to_rollback"] is not None and 0 < run["decisions_to_rollback"] <= run["watched"]
    row = report["rows"]["t1"]
    assert row["harmful"] == row["rolled_back"] == row["ended"] == 1
    assert row["median_decisions"] == run["decisions_to_rollback"]
    with pytest.raises(ValueError, match="unknown"):
        guardrail.run(args(tmp_path, clients="other"))


def test_a_mirror_at_one_half_serves_similaritys_ranking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_a_slice(monkeypatch, tmp_path, promise, "fanout-lookalike")
    report = guardrail.run(args(tmp_path, severities="0.5", watch=900))  # every mask 1
    (run,) = report["runs"]
    assert run["vs_similarity_unexplored"] == pytest.approx(0.0, abs=0.02)  # its greedy share is plain top-k
    assert run["vs_similarity"] <= run["vs_similarity_unexplored"]  # its exploration share costs what it costs
    if run["decisions_to_rollback"] is not None:
        assert run["worse"]  # the guardrail rolls back only what is served below similarity-only


def test_the_learner_may_restart_before_the_operators_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_a_slice(monkeypatch, tmp_path, promise, "fanout-lookalike")
    report = guardrail.run(args(tmp_path, restart_at=600))
    (run,) = report["runs"]
    assert report["restart_at"] == 600 and 600 <= run["restarted"] < run["served_at"]
    with pytest.raises(ValueError, match="before --at"):
        guardrail.run(args(tmp_path, restart_at=900))
