"""The login throttle's decisions and the server-side session record, without an app."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline.cli as cli
from pipeline.config import Settings
from pipeline.ui.auth import Sessions
from pipeline.ui.throttle import PER_ADDRESS, PER_NAME, LoginThrottle, Rate


def test_a_name_gets_its_burst_then_one_guess_per_refill_and_a_success_costs_nothing() -> None:
    now = [0.0]
    t = LoginThrottle(per_name=Rate(3, 60.0), per_address=Rate(100, 1.0), clock=lambda: now[0])
    assert [t.acquire("ann", "a").allowed for _ in range(4)] == [True, True, True, False]
    refused = t.acquire("ANN ", "a")  # the same name, spelled otherwise (from elsewhere: test_ui_login_throttle.py)
    assert not refused.allowed and refused.retry_after_s == 60.0 and refused.retry_after == "60"
    assert t.refused == 2
    now[0] = 30.0
    assert t.acquire("ann", "a").retry_after == "30"
    now[0] = 60.0
    assert t.acquire("ann", "a").allowed  # one back after a minute
    assert not t.acquire("ann", "a").allowed
    now[0] = 120.0
    assert t.acquire("ann", "a").allowed
    t.give_back("ann", "a")  # that one logged in: the guess it took is returned
    assert t.acquire("ann", "a").allowed


def test_an_address_is_held_across_names_and_a_refused_attempt_takes_nothing() -> None:
    t = LoginThrottle(per_name=Rate(5, 60.0), per_address=Rate(3, 10.0), per_name_all=Rate(5, 60.0), clock=lambda: 0.0)
    assert [t.acquire(f"u{i}", "10.0.0.1").allowed for i in range(4)] == [True, True, True, False]
    assert t.acquire("u9", "10.0.0.2").allowed
    for _ in range(3):
        assert not t.acquire("u9", "10.0.0.1").allowed  # refused by the address: u9's bucket keeps its tokens
    assert [t.acquire("u9", f"10.0.1.{i}").allowed for i in range(5)] == [True, True, True, True, False]


def test_the_throttle_keeps_a_bounded_number_of_buckets() -> None:
    t = LoginThrottle(max_keys=50, clock=lambda: 0.0)
    for i in range(1000):
        t.acquire(f"name{i}", f"addr{i}")
    assert len(t._buckets) == 50


def test_sessions_end_at_logout_expire_and_are_capped_per_labeler() -> None:
    now = [0.0]
    s = Sessions(max_age_s=100.0, per_labeler=2, clock=lambda: now[0])
    a, b = s.start("ann"), s.start("ann")
    assert s.valid(a, "ann") and not s.valid(a, "bob") and not s.valid(None, "ann")
    c = s.start("ann")  # a third: the oldest ends
    assert not s.valid(a, "ann") and s.valid(b, "ann") and s.valid(c, "ann")
    s.end(b)
    assert not s.valid(b, "ann")
    now[0] = 101.0
    assert not s.valid(c, "ann")


def test_the_limits_are_causalmem_uis_options(tmp_path: Path) -> None:
    from pipeline.ui.app import create_app

    defaults = Settings(state_dir=str(tmp_path)).ui()
    assert (LoginThrottle.of(defaults).per_name, LoginThrottle.of(defaults).per_address) == (PER_NAME, PER_ADDRESS)
    assert (Rate(5, 60.0), Rate(20, 15.0)) == (PER_NAME, PER_ADDRESS)  # docs/ui.md, Safety
    labelers = tmp_path / "labelers.toml"
    labelers.write_text('[labelers.ann]\ntoken = "a-long-enough-token"\n')
    config = Settings(state_dir=str(tmp_path)).ui(
        labelers_file=labelers, login_name_burst=2, login_name_refill_s=7.0, login_address_burst=9
    )
    app = create_app(config, "127.0.0.1:1")  # nothing connects before the app starts
    throttle = app.state.ui.throttle
    assert (throttle.per_name, throttle.per_address) == (Rate(2, 7.0), Rate(9, 15.0))
    argv = ["ui", "--login-name-burst", "3", "--login-address-refill", "4.5"]
    a = cli.build_parser(argv).parse_args(argv)
    assert (a.login_name_burst, a.login_name_refill_s, a.login_address_burst, a.login_address_refill_s) == (
        3,
        60.0,
        20,
        4.5,
    )
    with pytest.raises(ValueError, match="bursts"):
        Settings(state_dir=str(tmp_path)).ui(login_name_burst=0)
