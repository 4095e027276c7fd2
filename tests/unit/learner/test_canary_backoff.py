"""The canary back-off (pipeline/learner/canary.py): a learner whose clients serve no canary
stops starting canaries after a few, says so once, probes now and then, and resumes when a
probe sees canary decisions."""

from __future__ import annotations

import logging

import pytest

from models.policy.network import init_policy
from models.serving.params import ServingParams
from pipeline.config import GateConfig
from pipeline.learner.canary import IDLE_CANARIES, PROBE_AFTER_S, canary_plan
from pipeline.learner.promotion_gate import PromotionGate
from pipeline.metrics import Metrics
from tests.integration.test_gate import D, H, S, log_of
from tests.unit.learner.test_canary_gate import Publisher, manifest, served
from topics.internal import Experience


def test_canaries_run_until_the_streak_of_idle_ones_then_only_a_probe_after_the_back_off() -> None:
    assert IDLE_CANARIES >= 2 and PROBE_AFTER_S > 0
    for streak in range(IDLE_CANARIES):
        plan = canary_plan(streak, 50.0, 51.0)
        assert plan.start and not plan.paused and plan.reason == ""
    paused = canary_plan(IDLE_CANARIES, 50.0, 51.0)
    assert not paused.start and paused.paused
    assert f"the last {IDLE_CANARIES} canaries saw no canary decision" in paused.reason
    assert not canary_plan(IDLE_CANARIES + 5, 50.0, 50.0 + PROBE_AFTER_S - 1).start
    probe = canary_plan(IDLE_CANARIES + 5, 50.0, 50.0 + PROBE_AFTER_S)
    assert probe.start and probe.paused  # a probe: still paused until it sees canary decisions
    assert canary_plan(IDLE_CANARIES, None, 0.0).start  # no end known: probe at once
    assert not canary_plan(1, 0.0, 1.0, idle_canaries=1, probe_after_s=10.0).start


async def test_a_learner_whose_clients_serve_no_canary_stops_making_canaries_and_resumes_on_canary_traffic(
    caplog: pytest.LogCaptureFixture,
) -> None:
    net = init_policy(D, S, H, seed=1)
    base = log_of(net, 120, seed=2)
    window: list[Experience] = served(base, 1, 0.0)
    pub = Publisher()
    gate = PromotionGate(
        GateConfig(window=500, min_ess=1e9, canary_max=10),  # off-policy: never decided
        pub,  # type: ignore[arg-type]
        Metrics(),
        lambda: window,
        serving=ServingParams(canary_rate=0.2),
    )
    gate.set_serving(manifest(1), net.tensors())
    caplog.set_level(logging.INFO, logger="pipeline.learner.canary")
    version = 2
    await gate.consider(manifest(version), net.tensors())
    assert pub.canaries == [None, 2]
    # Clients serve no canary: each canary retires on serving decisions alone (80 at 20%, max 10).
    for _ in range(IDLE_CANARIES):
        window += served(base[:90], 1, 0.0, t0=1000.0 * version)
        version += 1
        await gate.consider(manifest(version), net.tensors())
    retired = [d.reason for d in gate.decisions if d.reason.startswith("retired: canary")]
    assert len(retired) == IDLE_CANARIES and all("0 canary /" in r for r in retired)
    assert gate.canary is None and gate.backoff.paused
    assert pub.canaries[-1] is None and pub.canaries.count(None) == IDLE_CANARIES + 1  # no canary after the last
    # More candidates, still no canary; the pause is logged once.
    for _ in range(3):
        window += served(base[:90], 1, 0.0, t0=1000.0 * version)
        version += 1
        await gate.consider(manifest(version), net.tensors())
    assert gate.canary is None and len(pub.canaries) == 2 * IDLE_CANARIES + 1
    paused_lines = [r.getMessage() for r in caplog.records if "canaries paused" in r.getMessage()]
    assert len(paused_lines) == 1 and "no canary decision" in paused_lines[0]
    # After the back-off, one probe canary; this time a client serves it.
    assert gate.backoff.last_end is not None
    gate.backoff.last_end -= PROBE_AFTER_S
    version += 1
    await gate.consider(manifest(version), net.tensors())
    assert gate.canary is not None and pub.canaries[-1] == version
    probe = version
    window += served(base[:90], 1, 0.0, t0=1000.0 * version) + served(base[:5], probe, 0.0, True, 1000.0 * version)
    version += 1
    await gate.consider(manifest(version), net.tensors())
    assert any(d.reason.startswith(f"retired: canary v{probe}: 5 canary /") for d in gate.decisions)
    assert not gate.backoff.paused and gate.backoff.idle_streak == 0
    assert gate.canary is not None and pub.canaries[-1] == version  # canaries resumed at once
    assert any("canaries resume" in r.getMessage() for r in caplog.records)


def test_the_limits_are_the_gate_settings() -> None:
    config = GateConfig(canary_idle=1, canary_probe_s=5.0)
    gate = PromotionGate(config, Publisher(), Metrics(), list, serving=ServingParams())  # type: ignore[arg-type]
    assert (gate.backoff.idle_canaries, gate.backoff.probe_after_s) == (1, 5.0)
    assert (GateConfig().canary_idle, GateConfig().canary_probe_s) == (IDLE_CANARIES, PROBE_AFTER_S)
    gate.backoff.idle_streak, gate.backoff.last_end = 1, 100.0
    assert not gate.backoff.plan(104.0).start and gate.backoff.plan(105.0).start
