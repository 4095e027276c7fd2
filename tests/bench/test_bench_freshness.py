"""``causalmem bench freshness`` (lab/causalmem_lab/bench/freshness.py): the measure, the summary and the flags.

The bench itself runs a worker, a learner and a client on a broker for minutes: it is run by
hand (docs/benchmarks.md, "Freshness"), not here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from causalmem_lab.bench import freshness

import pipeline.cli as cli
from pipeline.config import Settings


def test_a_pair_is_fresh_at_the_first_load_after_it_that_covers_its_offset() -> None:
    published = [(0.0, 4), (1.0, 5), (1.5, 5), (2.0, 9)]
    loads = [(0.2, 3), (0.9, 5), (1.2, 6), (3.0, 6), (4.5, 10)]
    # (0.0, 4): covered at 0.9 (offsets below 5); (1.0, 5): at 1.2; (1.5, 5): at 3.0; (2.0, 9): at 4.5
    out = freshness.freshness(published, loads)
    assert [round(v, 3) for v in out] == [0.9, 0.2, 1.5, 2.5]
    assert freshness.freshness([(5.0, 1)], [(1.0, 100)]) == [math.inf]  # a load before it does not count


def test_summary_counts_never_fresh_pairs_in_the_quantiles() -> None:
    run = freshness.Run("default", True, 2.0, 50, pairs=5, traffic_s=2.5)
    run.freshness_s = [1.0, 2.0, 3.0, math.inf, math.inf]
    run.all_freshness_s = [1.0, 2.0, 0.5, 0.5, math.inf]
    s = run.summary()
    assert s["never_fresh_share"] == 0.4 and s["median_s"] == 3.0 and s["p90_s"] is None  # None: never fresh
    assert s["median_s_with_warmup"] == 1.0 and s["pairs_per_s"] == 2.0
    assert s["median_s_covered"] == 2.0 and s["p90_s_covered"] == 3.0  # among the pairs a checkpoint served
    assert s["freshness_s"][-1] is None and s["warmup_pairs"] == 0
    assert "never" in freshness.table([run])


def test_summary_gives_the_gates_promotions_per_minute_and_certified_gain() -> None:
    run = freshness.Run("default", True, 2.0, 50, traffic_s=30.0, gate_decisions={"promoted": 6.0})
    run.gain_sum, run.gain_count, run.refused = 0.03, 6.0, 2.0
    s = run.summary()
    assert s["promotions_per_min"] == 12.0 and abs(s["certified_gain_per_promotion"] - 0.005) < 1e-12
    text = freshness.table([run])
    assert "12.0 promotions/min, certified gain per promotion +0.0050" in text
    assert "2 refused (shown worse)" in text
    assert freshness.Run("default", True, 2.0, 50).summary()["certified_gain_per_promotion"] is None


def test_cli_flags() -> None:
    argv = ["bench", "freshness", "--seconds", "30", "--ungated", "--also-interval", "1", "--out", "f.json"]
    a = cli.build_parser(argv).parse_args(argv)
    assert (a.which, a.seconds, a.ungated, a.also_interval, a.rate) == ("freshness", 30.0, True, [1.0], 100.0)
    assert not a.minimal_client and not a.skip_previous and a.attribution_rate == 0.0
    argv = ["bench", "freshness", "--minimal-client", "--skip-previous", "--attribution-rate", "0.25"]
    a = cli.build_parser(argv).parse_args(argv)
    assert a.minimal_client and a.skip_previous and a.attribution_rate == 0.25


def test_logs_go_under_the_expanded_state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "~/.causalmem" used to become a directory named "~" in the working directory.
    monkeypatch.setenv("HOME", str(tmp_path))
    d = freshness.log_dir(Settings(state_dir="~/.causalmem"))
    assert d.parent == tmp_path / ".causalmem" / "bench-freshness"
