"""The login throttle, address first (issue: trust boundaries), on an injected clock.

Before: a name's bucket was shared by every address, so five guesses from anywhere held the
real labeler a minute at a time for as long as they went on, and one client's requests,
each claiming another address, never ran out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import Settings, UiConfig
from pipeline.ui.throttle import LoginThrottle, Rate


def clocked(**kw: object) -> tuple[LoginThrottle, list[float]]:
    now = [0.0]
    return LoginThrottle(clock=lambda: now[0], **kw), now  # type: ignore[arg-type]


def test_guesses_from_other_addresses_do_not_lock_a_labeler_out() -> None:
    t, _ = clocked()
    assert all(t.acquire("ann", f"10.0.0.{i}").allowed for i in range(5))
    assert t.acquire("ann", "192.168.1.20").allowed  # ann, from her own address


def test_a_name_sprayed_from_many_addresses_is_slowed_for_seconds_not_minutes() -> None:
    name_all = Rate(UiConfig.login_name_all_burst, UiConfig.login_name_all_refill_s)
    t, now = clocked()
    allowed = [t.acquire("ann", f"10.0.{i // 250}.{i % 250}").allowed for i in range(100)]
    assert allowed == [True] * name_all.burst + [False] * (100 - name_all.burst)  # the name is held …
    held = t.acquire("ann", "192.168.1.20")
    assert not held.allowed and held.retry_after_s <= name_all.refill_s and held.limit == "name_all"  # … briefly
    now[0] += name_all.refill_s
    assert t.acquire("ann", "192.168.1.20").allowed
    assert not t.acquire("ann", "10.9.9.9").allowed  # one every refill_s, whoever asks
    assert name_all.refill_s <= 10 < 60 == UiConfig.login_name_refill_s


def test_an_address_a_labeler_logged_in_from_is_not_held_by_a_spray_of_her_name() -> None:
    t, now = clocked()
    assert t.acquire("ann", "192.168.1.20").allowed
    t.give_back("ann", "192.168.1.20")  # she logged in
    for i in range(200):
        t.acquire("ann", f"10.0.{i // 250}.{i % 250}")
    assert not t.acquire("ann", "172.16.0.1").allowed
    assert all(t.acquire("Ann", "192.168.1.20").allowed for _ in range(5))  # her own failures only
    assert not t.acquire("ann", "192.168.1.20").allowed
    now[0] += LoginThrottle.KNOWN_S + UiConfig.login_name_refill_s * 5
    for i in range(200):
        t.acquire("ann", f"10.1.{i // 250}.{i % 250}")
    assert not t.acquire("ann", "192.168.1.20").allowed  # remembered for KNOWN_S, not for ever


def test_an_address_is_held_first_and_a_refused_attempt_takes_nothing() -> None:
    """One client spraying 43 names twice: 20 tries, the rest refused, and none of the names paid for them."""
    t, _ = clocked()
    verdicts = [t.acquire(f"name{i % 43}", "203.0.113.5") for i in range(86)]
    assert [v.allowed for v in verdicts] == [True] * 20 + [False] * 66
    assert {v.limit for v in verdicts[20:]} == {"address"} and t.refused == 66
    assert verdicts[20].retry_after_s == UiConfig.login_address_refill_s
    # names 20..42 were only ever refused: their buckets are full, from one address as from many
    assert all(t.acquire("name30", "198.51.100.7").allowed for _ in range(5))


def test_one_name_from_one_address_gets_its_burst_then_one_a_minute() -> None:
    t, now = clocked()
    assert [t.acquire("ann", "10.0.0.1").allowed for _ in range(6)] == [True] * 5 + [False]
    held = t.acquire(" ANN", "10.0.0.1")  # the same name, spelled otherwise
    assert not held.allowed and held.limit == "name" and held.retry_after == "60"
    assert t.acquire("bob", "10.0.0.1").allowed  # another name from that address
    now[0] += 60.0
    assert t.acquire("ann", "10.0.0.1").allowed


def test_the_addresses_of_one_ipv6_host_share_an_allowance() -> None:
    from pipeline.ui.throttle import address_key

    t, _ = clocked()
    allowed = [t.acquire(f"user{i}", f"2001:db8:1:2::{i:x}").allowed for i in range(25)]
    assert allowed == [True] * 20 + [False] * 5
    assert t.acquire("user0", "2001:db8:1:3::1").allowed  # another /64
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2::ffff") == "2001:db8:1:2::/64"
    assert address_key("::ffff:10.0.0.1") == "10.0.0.1" and address_key("10.0.0.1") == "10.0.0.1"
    assert address_key("testclient") == "testclient"


def test_the_limits_are_the_uis_options(tmp_path: Path) -> None:
    config = Settings(state_dir=str(tmp_path)).ui(login_name_all_burst=7, login_name_all_refill_s=2.5)
    assert LoginThrottle.of(config).per_name_all == Rate(7, 2.5)
    assert LoginThrottle.of(Settings(state_dir=str(tmp_path)).ui()).per_name_all == Rate(30, 5.0)
    with pytest.raises(ValueError, match="bursts"):
        Settings(state_dir=str(tmp_path)).ui(login_name_all_burst=0)
