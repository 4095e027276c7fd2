"""``causalmem bench soak``: the lag/memory judgement on synthetic samples, the max-rate search
plan, and one short end-to-end run on a real broker with real worker and learner processes."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pytest
from causalmem_lab.bench import soak
from causalmem_lab.bench.soak import judge, summary

import pipeline.cli as cli


def series(
    duration: float = 30.0,
    rate: float = 100.0,
    backlog: object = lambda t: 40.0,
    worker_lag: object = lambda t: 20.0,
    learner_lag: object = lambda t: 10.0,
    rss: object = lambda t: {"broker": 100 + 2.0 * t, "worker": 200.0, "learner": 300.0},
    drain: list[tuple[float, float, float, float]] | None = None,
) -> list[dict]:
    """One sample a second during the load, then ``drain`` as (t after the end, applied share, lags)."""
    out = []
    for i in range(int(duration) + 1):
        t = float(i)
        produced = rate * t
        b = min(backlog(t), produced)  # type: ignore[operator]
        out.append(
            {
                "t": t,
                "produced": produced,
                "joined": produced - b / 2,
                "applied": produced - b,
                "worker_lag": worker_lag(t),  # type: ignore[operator]
                "learner_lag": learner_lag(t),  # type: ignore[operator]
                "rss_mb": rss(t),  # type: ignore[operator]
            }
        )
    total = rate * duration
    for dt, share, wlag, llag in drain if drain is not None else [(1.0, 1.0, 0.0, 0.0)]:
        out.append(
            {
                "t": duration + dt,
                "produced": total,
                "joined": total,
                "applied": share * total,
                "worker_lag": wlag,
                "learner_lag": llag,
                "rss_mb": rss(duration + dt),  # type: ignore[operator]
            }
        )
    return out


def test_steady_lag_is_bounded_and_drains() -> None:
    v = judge.judge_phase(series(), 30.0, 100.0)
    assert v["sustainable"], v["reasons"]
    assert v["lag_bounded"] and v["drained"] and v["rate_ok"]
    assert v["caught_up_s"] == pytest.approx(1.0)
    assert v["achieved_pairs_per_s"] == pytest.approx(100.0)
    assert v["achieved_input_per_s"] == pytest.approx(200.0)
    assert v["lag"]["backlog"]["mean"] == pytest.approx(40.0, rel=0.05)
    assert abs(v["lag"]["backlog"]["slope_per_s"]) < 0.5  # flat (0 only at t=0)


def test_growing_lag_is_not_bounded() -> None:
    # the pipeline keeps up with 80 % of the input: the backlog grows by 20 pairs/s
    v = judge.judge_phase(series(backlog=lambda t: 20.0 * t, worker_lag=lambda t: 40.0 * t), 30.0, 100.0)
    assert not v["lag"]["backlog"]["bounded"]
    assert not v["lag"]["worker_lag"]["bounded"]
    assert v["lag"]["learner_lag"]["bounded"]
    assert not v["sustainable"]
    assert v["lag"]["backlog"]["slope_per_s"] == pytest.approx(20.0, rel=0.01)
    assert any("backlog grew" in r for r in v["reasons"])


def test_small_noisy_lag_stays_within_the_floor() -> None:
    # 0 in the first third, then noise below two seconds of input: still bounded
    v = judge.judge_phase(series(backlog=lambda t: 0.0 if t < 10 else 150.0 * (t % 2)), 30.0, 100.0)
    assert v["lag"]["backlog"]["limit"] == pytest.approx(200.0)
    assert v["lag"]["backlog"]["bounded"]


def test_a_transient_spike_is_bounded_but_a_sustained_rise_is_not() -> None:
    # a checkpoint holds the learner for a few seconds once: a one-sample spike that recovers
    spike = judge.judge_phase(series(backlog=lambda t: 1100.0 if t == 27 else 300.0), 30.0, 100.0)
    b = spike["lag"]["backlog"]
    assert b["max"] == 1100.0 and b["last_third_max"] == 1100.0
    assert b["first_third_mean"] == pytest.approx(240.0)  # the ramp: 0, 100, 200, then 300
    assert b["limit"] == pytest.approx(480.0)
    assert b["bounded"] and spike["sustainable"]
    # the whole last third at 700: the stage fell behind and stayed there
    rise = judge.judge_phase(series(backlog=lambda t: 300.0 if t < 20 else 700.0), 30.0, 100.0)
    assert rise["lag"]["backlog"]["last_third_mean"] == pytest.approx(700.0)
    assert not rise["lag"]["backlog"]["bounded"] and not rise["sustainable"]


def test_drain_too_slow_or_never() -> None:
    slow = series(drain=[(10.0, 0.5, 100.0, 50.0), (40.0, 1.0, 0.0, 0.0)])
    v = judge.judge_phase(slow, 30.0, 100.0, drain_limit_s=30.0)
    assert v["caught_up_s"] == pytest.approx(40.0)
    assert not v["drained"] and not v["sustainable"]
    never = series(drain=[(5.0, 0.9, 100.0, 50.0)])
    v = judge.judge_phase(never, 30.0, 100.0)
    assert v["caught_up_s"] is None and not v["drained"]
    assert v["applied_fraction"] == pytest.approx(0.9)


def test_full_drain_needs_the_lags_at_zero_but_keep_up_does_not() -> None:
    s = series(drain=[(2.0, 1.0, 5.0, 0.0), (4.0, 1.0, 0.0, 0.0)])
    assert judge.judge_phase(s, 30.0, 100.0)["caught_up_s"] == pytest.approx(4.0)
    s = series(drain=[(3.0, 0.995, 50.0, 10.0)])
    v = judge.judge_phase(s, 30.0, 100.0, drain_limit_s=5.0, keep_up=0.99)
    assert v["drained"] and v["caught_up_s"] == pytest.approx(3.0)


def test_rate_not_reached() -> None:
    v = judge.judge_phase(series(rate=80.0), 30.0, 100.0)
    assert not v["rate_ok"] and not v["sustainable"]
    assert v["achieved_pairs_per_s"] == pytest.approx(80.0)
    assert judge.judge_phase(series(rate=96.0), 30.0, 100.0)["rate_ok"]


def test_rss_slopes() -> None:
    def rss(t: float) -> dict[str, float]:
        # broker grows 2 MB/s; worker warms up then flat; learner shrinks 0.5 MB/s
        return {"broker": 100 + 2.0 * t, "worker": 200.0 + min(t, 10.0) * 3, "learner": 300.0 - 0.5 * t}

    v = judge.judge_phase(series(rss=rss), 30.0, 100.0)
    r = v["rss"]
    assert list(r) == ["broker", "worker", "learner"]
    assert r["broker"]["slope_mb_per_min"] == pytest.approx(120.0)
    assert r["broker"]["start_mb"] == 100.0 and r["broker"]["end_mb"] == 160.0
    assert r["broker"]["max_mb"] == pytest.approx(100 + 2.0 * 31)  # the drain sample counts for the max
    assert r["worker"]["slope_mb_per_min"] > 0
    assert r["worker"]["slope_second_half_mb_per_min"] == pytest.approx(0.0, abs=1e-9)
    assert r["learner"]["slope_mb_per_min"] == pytest.approx(-30.0)


def test_rss_is_flat_only_within_ten_percent_after_warm_up() -> None:
    def rss(t: float) -> dict[str, float]:
        # worker: warms up over the first third, then ±5 %; broker: +2 MB/s, i.e. +40 % over the rest
        return {"broker": 100 + 2.0 * t, "worker": 200.0 + min(t, 10.0) * 10 + (15.0 if t % 2 else -15.0)}

    r = judge.judge_phase(series(rss=rss), 30.0, 100.0)["rss"]
    assert r["worker"]["flat"] and r["worker"]["after_warmup_spread"] == pytest.approx(0.05, abs=0.005)
    assert not r["broker"]["flat"] and r["broker"]["after_warmup_spread"] > 0.10


def test_slope_helper() -> None:
    assert judge.slope_per_min([0, 1], [0, 1]) is None
    assert judge.slope_per_min([0, 30, 60], [5, 6, 7]) == pytest.approx(2.0)


def test_search_doubles_then_bisects() -> None:
    h: list[tuple[float, bool]] = []
    assert judge.next_search_rate(h, 300) == 300
    h.append((300, True))
    assert judge.next_search_rate(h, 300) == 600
    h.append((600, True))
    assert judge.next_search_rate(h, 300) == 1200
    h.append((1200, False))
    assert judge.next_search_rate(h, 300) == 900
    h.append((900, True))
    assert judge.next_search_rate(h, 300) == 1050
    h.append((1050, False))
    assert judge.next_search_rate(h, 300) == 975
    h.append((975, True))
    assert judge.next_search_rate(h, 300) is None  # 975..1050 is within 10 %
    assert judge.search_bounds(h) == (975, 1050)


def test_search_halves_when_the_start_fails_and_stops_at_the_cap() -> None:
    h = [(300.0, False)]
    assert judge.next_search_rate(h, 300) == 150
    h.append((150.0, True))
    assert judge.next_search_rate(h, 300) == 225
    assert judge.next_search_rate([(4.0, False)], 4.0) is None
    assert judge.next_search_rate([(800.0, True)], 800.0, max_rate=1000.0) == 1000.0
    assert judge.next_search_rate([(800.0, True), (1000.0, True)], 800.0, max_rate=1000.0) is None


def test_options_fall_back_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = argparse.Namespace(rate=None, duration=None)
    assert soak.options(ns)["find_max"] is True
    assert soak.options(ns)["rate"] == soak.DEFAULT_RATE
    monkeypatch.setenv("CAUSALMEM_SOAK_FIND_MAX", "0")
    monkeypatch.setenv("CAUSALMEM_SOAK_STEP_SECONDS", "7")
    o = soak.options(argparse.Namespace(rate=50.0, duration=None))
    assert (o["find_max"], o["step_seconds"], o["rate"]) == (False, 7.0, 50.0)
    assert soak.options(argparse.Namespace(rate=None, duration=None, find_max=True))["find_max"] is True


def test_report_renders_a_table() -> None:
    v = judge.judge_phase(series(), 30.0, 100.0)
    v.update(label="steady", input_mb_per_min=30.0, join_expired=0.0, samples=series())
    r = {
        "config": {
            "embedding_dim": 8,
            "slots": 32,
            "hidden": 16,
            "partitions": 8,
            "batch_size": 32,
            "gate": True,
            "join_window_s": 60.0,
            "checkpoint_interval_s": 60.0,
            "replay_max": 50000,
            "broker": "embedded (Tansu)",
        },
        "machine": {"cpus": 2, "loadavg_start": [1.0, 1.0, 1.0]},
        "steady": v,
    }
    text = summary.report(r)
    assert "| broker | 100 |" in text
    assert "**sustainable**" in text
    assert "+120.0" in text
    assert "| worker | 200 |" in text and "200, ±0.0 % | yes |" in text  # flat after warm-up
    assert "| NO |" in text  # the broker's +2 MB/s is not


@pytest.mark.slow
@pytest.mark.broker
def test_soak_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"CAUSALMEM_EMBEDDING_DIM": "8", "CAUSALMEM_SLOTS": "32", "CAUSALMEM_HIDDEN": "16"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # logs and state under tmp_path
    out = tmp_path / "soak.json"
    t0 = time.monotonic()
    rc = cli.main(["bench", "soak", "--rate", "50", "--duration", "15", "--no-find-max", "--out", str(out)])
    elapsed = time.monotonic() - t0
    r = json.loads(out.read_text())
    st = r["steady"]
    assert rc == 0, st["reasons"]
    assert {"options", "config", "machine", "steady", "logdir"} <= set(r)
    assert "search" not in r
    assert r["config"]["embedding_dim"] == 8 and r["config"]["slots"] == 32
    for key in ("achieved_pairs_per_s", "achieved_input_per_s", "lag", "rss", "caught_up_s", "samples"):
        assert key in st
    assert st["achieved_pairs_per_s"] == pytest.approx(50.0, rel=0.2)
    assert st["lag_bounded"] and st["drained"] and st["sustainable"]
    assert st["samples"][-1]["applied"] == st["produced_pairs"]
    assert st["join_expired"] == 0
    assert set(st["rss"]) == {"broker", "worker", "learner"}
    for proc in st["rss"].values():
        assert proc["start_mb"] > 0 and proc["slope_mb_per_min"] is not None
    assert out.with_suffix(".png").exists()
    assert elapsed < 90
