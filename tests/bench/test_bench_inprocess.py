"""``causalmem bench learning --in-process`` (lab/causalmem_lab/bench/inprocess.py): its rows, its
configuration of the trainer, its measures and its table, on a tiny scenario and a tiny LM world."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from causalmem_lab.bench import inprocess

from models.policy.trainer import PolicyTrainer
from pipeline.config import Settings
from tests.bench.test_lab_offline import TINY
from tests.bench.test_lm_bench import small


def test_rows_set_the_trainers_imputation() -> None:
    plain = inprocess._Config(hidden=16, credit_impute=False).make_trainer(TINY)
    assert isinstance(plain, inprocess.StepRewardBetween)
    imputing = inprocess._Config(hidden=16).make_trainer(TINY)
    assert type(imputing) is PolicyTrainer
    for t in (plain, imputing):  # once credit has arrived, only the learner's own trainer imputes
        t.baseline.slots.update(3, -1.0)
    assert imputing.imputes() and not plain.imputes()
    assert not inprocess.ROWS["credit25_plain"].credit_impute and inprocess.ROWS["credit25"].credit_impute
    with pytest.raises(ValueError, match="unknown in-process rows"):
        inprocess.run(argparse.Namespace(seeds="0", seed=0, rows="nope", lr=None, quick=True))


def test_measures_as_served_and_for_a_drift() -> None:
    scenario = dataclasses.replace(TINY, attribution_rate=0.25)
    cfg = inprocess._Config(
        hidden=16, refresh_every=40, drift_min_pairs=20, page_hinkley=False, batch_size=16, gate=False
    )
    res = inprocess.run_offline(scenario, cfg)
    drift = inprocess.measure(res, scenario)
    assert set(drift) == {"before", "last_day", "ratio", "resets"} and 0.0 <= drift["last_day"] <= 1.0  # type: ignore[operator]
    flat = dataclasses.replace(scenario, drift_day=None, days=1.0)
    m = inprocess.measure(inprocess.run_offline(flat, cfg), flat)
    assert 0.0 <= m["leak"] <= 1.0 and 0.0 <= m["recall"] <= 1.0  # type: ignore[operator]
    assert m["steps_to_90pct_recall"] is None or m["steps_to_90pct_recall"] >= 300


def test_table_lists_seeds_then_the_mean() -> None:
    sim = {"leak": 0.0, "recall": 0.9, "utility": 0.8, "steps_to_90pct_recall": 1200.0}
    report = {
        "rows": {
            "credit25": {"name": "x", "per_seed": [sim, {**sim, "leak": 0.02}], "mean": {**sim, "leak": 0.01}},
            "reset": {
                "name": "y",
                "per_seed": [{"before": 1.0, "last_day": 0.9, "ratio": 0.9}],
                "mean": {"before": 1.0, "last_day": 0.9, "ratio": 0.9},
            },
        }
    }
    text = inprocess.table(report)
    assert "| x | 0.0% / 2.0% → **1.0%** | 90.0% / 90.0% → **90.0%** | +0.800 / +0.800 → **+0.800** |" in text
    assert "| y | 100.0% → **100.0%** | 90.0% → **90.0%** | 90.0% → **90.0%** |" in text


def test_the_flag_selects_the_in_process_bench() -> None:
    import pipeline.cli as cli

    argv = ["bench", "learning", "--in-process", "--seeds", "0,1", "--rows", "credit25", "--lr", "3e-4"]
    a = cli.build_parser(argv).parse_args(argv)
    assert (a.which, a.in_process, a.seeds, a.rows, a.lr) == ("learning", True, "0,1", "credit25", 3e-4)


def test_steps_to_the_step_rewards_level_use_its_final_recall_on_the_same_seed() -> None:
    # The step reward ends at 0.5 (level 0.45), the credit row at 1.0: on the common level the
    # credit row is counted where it passes 0.45, not where it passes 90% of its own 1.0.
    curves = {
        "dynamic": {0: np.array([0.1, 0.3, 0.45, 0.5])},
        "credit25": {0: np.array([0.2, 0.5, 0.8, 0.95])},
        "reset": {0: np.array([0.0])},
    }
    sim = {"seed": 0, "leak": 0.0, "recall": 0.5, "utility": 0.5}
    report: dict[str, Any] = {
        "rows": {
            "dynamic": {"per_seed": [{**sim, "final_recall_all": 0.5, "steps_to_90pct_recall": 302.0}]},
            "credit25": {"per_seed": [{**sim, "final_recall_all": 1.0, "steps_to_90pct_recall": 303.0}]},
            "reset": {"per_seed": [{"seed": 0, "before": 1.0}], "mean": {"before": 1.0}},
        }
    }
    inprocess.at_step_reward_level(report, curves)
    rows = report["rows"]
    assert rows["dynamic"]["per_seed"][0]["steps_to_90pct_step_reward_final"] == 302.0
    assert rows["credit25"]["per_seed"][0]["steps_to_90pct_step_reward_final"] == 301.0
    assert rows["credit25"]["mean"]["steps_to_90pct_step_reward_final"] == 301.0
    assert "steps_to_90pct_step_reward_final" not in rows["reset"]["per_seed"][0]
    text = inprocess.table({"rows": {k: {"name": k, **rows[k]} for k in ("dynamic", "credit25")}})
    assert "step reward's final recall |" in text and "| 301 → **301** |" in text


def test_an_lm_row_runs_the_lm_world_and_measures_the_served_policy(tmp_path: Path) -> None:
    data, u, _ = small(tmp_path)
    runner = inprocess.LMRunner(data, u, events=150)
    assert runner.oracle >= runner.similarity
    cfg = inprocess._Config(hidden=16, refresh_every=50, batch_size=16, gate=False)  # as the row's run() sets it
    m = runner.run(inprocess.ROWS["lm_credit25"], cfg)
    promotions = {"promoted", "canary_share", "canary_utility", "all_utility", "served_version"}
    promotions |= {"refused"}
    assert set(m) == {"value", "gold", "leak", "gap_closed"} | promotions and 0.0 <= m["gold"] <= 1.0
    assert m["refused"] == 0.0  # ungated: nothing judged
    assert m["canary_share"] == 0.0 and m["canary_utility"] is None  # ungated: no canary
    assert m["gap_closed"] == pytest.approx((m["value"] - runner.similarity) / (runner.oracle - runner.similarity))
    lm_rows = {k for k, r in inprocess.ROWS.items() if r.lm}
    assert lm_rows == {
        "lm_step",
        "lm_credit25",
        "lm_credit25_plain",
        "lm_credit",
        "lm_credit25_gated",
        "lm_credit25_gated_t1",
        "lm_credit25_gated_nocanary",
        "lm_credit25_gated_canary10",
        "lm_credit25_gated_canary20",
    }
    assert inprocess.ROWS["lm_credit25_gated"].canary()["canary_rate"] == Settings().serve_canary_rate
    assert inprocess.ROWS["lm_credit25"].canary() == {"canary_rate": 0.0}


def test_a_freshness_row_records_each_version_its_learnt_steps_and_true_value() -> None:
    from causalmem_lab.bench.staleness import freshness_steps, staleness, true_value
    from causalmem_lab.offline import run_offline

    scenario = dataclasses.replace(TINY, drift_day=None, days=2.0)
    cfg = inprocess._Config(hidden=16, refresh_every=40, batch_size=16, gate=True)
    value = true_value(scenario, queries=60)
    res = run_offline(scenario, cfg, value=value)
    versions = np.asarray(res.tally.version)
    assert set(res.created) == set(res.values) and set(versions) <= set(res.created)
    assert res.created[1] == 0 and all(c % 16 == 0 for c in res.created.values())  # whole micro-batches only
    probes = {v for v, p in res.served_versions.items() if p.manifest.reason == "probe"}  # contract 1.19
    assert [v for _, v, _ in res.refreshes] == sorted(set(res.created) - probes)[1:]
    assert value(res.served.net) == pytest.approx(res.values[int(versions[-1])])  # type: ignore[union-attr]
    fresh = freshness_steps(versions, res.created)
    served_from = np.array([res.created[int(v)] for v in versions])
    for i in range(0, len(versions), 37):  # a served policy has learnt from step i exactly at i + fresh[i]
        j = i + fresh[i]
        if np.isfinite(j):
            assert served_from[int(j)] > i and (int(j) == i or served_from[int(j) - 1] <= i)
    s = staleness(res, warmup=0, tail=0.5, end=80)
    assert s["never_tail"] is not None and 0.0 <= s["never_tail"] <= 1.0
    assert s["served_fall"] is not None and s["served_fall"] >= 0.0
    assert s["served_value_final"] == pytest.approx(res.values[int(versions[-1])])
    row = inprocess.ROWS["fresh_step_gated_lr3e4_eps05"]
    assert (row.freshness, row.gate, row.lr, row.gate_epsilon, row.refresh_every) == (True, True, 3e-4, 0.05, 200)


def test_the_freshness_table_says_never_and_every_candidate() -> None:
    f: dict[str, Any] = {"median_steps": float("inf"), "never": 0.6, "never_tail": 1.0, "candidate_gain_tail": -0.04}
    f |= {"served_value_final": 0.7, "served_fall": 0.02, "promoted": 3.0, "canary_promoted": 1.0}
    sim: dict[str, Any] = {"leak": 0.0, "recall": 0.9, "utility": 0.8, "steps_to_90pct_recall": 1200.0}
    rows: dict[str, Any] = {"fresh_step_gated": {"name": "g", "per_seed": [{**sim, **f}], "mean": {**sim, **f}}}
    rows["fresh_step"] = {"name": "u", "per_seed": [{**sim, **f, "median_steps": 150.0}], "mean": {**sim, **f}}
    text = inprocess.table({"rows": rows})
    assert "| g | never → **never** | 60.0% → **60.0%** | 100.0% → **100.0%** | -0.040 → **-0.040** |" in text
    assert "+0.700 (0.020) → **+0.700 (0.020)** | 4 → **4** |" in text
    assert "| u | 150 → **never** |" in text and "| every candidate |" in text
