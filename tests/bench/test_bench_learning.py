"""`causalmem bench learning --quick`: the causal policy beats similarity-only on harmful leak."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from causalmem_lab.bench import learning


@pytest.mark.broker
@pytest.mark.slow
def test_quick_learning_benchmark_causal_beats_similarity(broker, tmp_path: Path) -> None:
    out = tmp_path / "learning.json"
    args = argparse.Namespace(
        bootstrap=broker.bootstrap, quick=True, text=False, seed=0, rows=None, scenario=None, out=str(out)
    )
    assert learning.main(args) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert set(rows) == {"similarity", "dynamic"}
    sim, causal = rows["similarity"], rows["dynamic"]
    assert sim["steps"] == causal["steps"] > 1000  # the same event stream for both
    assert causal["leak"] < sim["leak"] - 0.1, (causal, sim)
    assert causal["utility"] > sim["utility"]
    assert (tmp_path / "learning-curves.png").stat().st_size > 10_000


def test_claims_are_reported_side_by_side() -> None:
    report = {
        "rows": {
            "dynamic": {"leak": 0.01, "empty": 0.0, "events_to_90pct_recall": 1000},
            "soft": {"leak": 0.2, "empty": 0.0, "events_to_90pct_recall": 1000},
            "fixed": {"leak": 0.05, "empty": 0.1, "events_to_90pct_recall": 1000},
            "nobaseline": {"leak": 0.1, "empty": 0.0, "events_to_90pct_recall": 2500},
        },
        "drift": {"reset": {"drop": 0.05}, "noreset": {"drop": 0.3}},
    }
    got = {c["claim"]: c["met"] for c in learning.claims(report)}
    assert got == {
        learning.SEED_CLAIMS["hard_leak"]: True,
        learning.SEED_CLAIMS["dynamic_empty"]: True,
        learning.SEED_CLAIMS["baseline_speed"]: False,  # 2.5× < 3×
        learning.SEED_CLAIMS["drift_drop"]: False,  # 5% > 2.3%
    }


def test_drift_rows_alone_plot_the_drift_only(tmp_path: Path) -> None:
    """`--rows reset,...` has no curves: no empty curves plot, the drift plot is drawn."""
    series = {"corr": [[86400.0, 0.5, 10], [2 * 86400.0, 0.6, 20]], "ts": [86400.0, 2 * 86400.0], "leak": [0.5, 0.1]}
    report = {
        "rows": {},
        "curves": {},
        "drift": {"reset": {"name": "drift, with reset"}},
        "drift_series": {"reset": {**series, "resets": [{"ts": 1.5 * 86400.0}]}},
        "drift_scenario": {"start_ts": 0.0, "drift_day": 1.2},
    }
    paths = learning.plot(report, str(tmp_path / "drift3"))
    assert paths == [str(tmp_path / "drift3-drift.png")]
    assert (tmp_path / "drift3-drift.png").stat().st_size > 10_000
    assert not (tmp_path / "drift3-curves.png").exists()
