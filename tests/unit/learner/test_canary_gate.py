"""The gate's canary (pipeline/learner/canary.py, gate.py) without a broker: when it starts
one, how it reads the arms, and how a canary ends."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from models.policy.network import init_policy
from models.serving.params import ServingParams
from pipeline.config import GateConfig
from pipeline.learner import promotion_gate as gate_module
from pipeline.learner.canary import CanaryRun
from pipeline.learner.promotion_gate import PromotionGate
from pipeline.metrics import Metrics
from tests.integration.test_gate import D, H, S, log_of
from topics.internal import Experience
from topics.manifest import Manifest


class Publisher:
    def __init__(self) -> None:
        self.promoted: list[int] = []
        self.canaries: list[int | None] = []

    async def promote(self, manifest: Manifest) -> None:
        self.promoted.append(manifest.version)

    async def set_canary(self, manifest: Manifest | None) -> None:
        self.canaries.append(manifest.version if manifest is not None else None)


def manifest(version: int) -> Manifest:
    return Manifest("default", version, 0.0, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1)


def served(exps: list[Experience], version: int, utility: float, canary: bool = False, t0: float = 0.0) -> list[Any]:
    out = []
    for i, e in enumerate(exps):
        ev = dataclasses.replace(
            e.event,
            event_id=f"{e.event.event_id}-v{version}-{canary}-{t0}",
            policy_version=version,
            canary=True if canary else None,
            ts=e.event.ts + t0 + i,
        )
        out.append(Experience(ev.event_id, "feedback", ev, utility + 0.1 * (i % 3)))
    return out


async def test_an_undecided_candidate_becomes_the_canary_and_its_arms_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    net = init_policy(D, S, H, seed=1)
    base = log_of(net, 120, seed=2)
    window: list[Experience] = served(base, 1, 0.0)
    judged: list[list[Experience]] = []
    real = gate_module.judge_window

    def spy(exps: Any, *args: Any, **kwargs: Any) -> Any:
        judged.append(list(exps))
        return real(exps, *args, **kwargs)

    monkeypatch.setattr(gate_module, "judge_window", spy)
    pub = Publisher()
    gate = PromotionGate(
        GateConfig(window=500, min_ess=1e9, canary_max=10),
        pub,  # type: ignore[arg-type]
        Metrics(),
        lambda: window,
        serving=ServingParams(canary_rate=0.2),
    )
    gate.set_serving(manifest(1), net.tensors())
    d = await gate.consider(manifest(2), net.tensors())
    assert d.decision == "insufficient"
    assert pub.canaries == [None, 2] and gate.canary is not None  # a stale canary ended first, then v2
    # The canary's requests do well, the serving policy's as before.
    window += served(base[:60], 1, 0.0, t0=1000.0) + served(base[:30], 2, 1.0, canary=True, t0=1000.0)
    await gate.consider(manifest(3), net.tensors())
    assert pub.promoted == [2] and gate.serving_manifest is not None and gate.serving_manifest.version == 2
    first = next(x for x in gate.decisions if "canary v2" in x.reason)
    assert first.decision == "promoted" and first.reason.startswith("promoted: canary v2")
    assert first.gain is not None and first.gain.low > -0.02
    assert pub.canaries[-2:] == [None, 3]  # v2 ended, then v3 (undecided off-policy) is the canary
    assert all(not e.event.canary for w in judged for e in w), "canary events stay out of the off-policy window"
    # Nobody serves v3 (e.g. clients that do not know canaries): it gives way after the
    # serving decisions that 10 canary decisions come with at 20%, twice over (80).
    window += served(base[:90], 2, 0.0, t0=5000.0)
    await gate.consider(manifest(4), net.tensors())
    retired = next(x for x in gate.decisions if "canary v3" in x.reason)
    assert retired.decision == "insufficient" and retired.reason.startswith("retired: canary v3")
    assert pub.canaries[-2:] == [None, 4]


async def test_a_checkpoint_served_at_once_ends_the_canary_and_no_rate_starts_none() -> None:
    net = init_policy(D, S, H, seed=1)
    window = served(log_of(net, 80, seed=3), 1, 0.0)
    pub = Publisher()
    gate = PromotionGate(
        GateConfig(min_ess=1e9), pub, Metrics(), lambda: window, serving=ServingParams(canary_rate=0.1)
    )  # type: ignore[arg-type]
    gate.set_serving(manifest(1), net.tensors())
    await gate.consider(manifest(2), net.tensors())
    assert gate.canary is not None
    await gate.serve_at_once(manifest(3), net.tensors())  # e.g. a drift reset
    assert gate.canary is None and pub.canaries[-1] is None and gate.serving_manifest.version == 3  # type: ignore[union-attr]
    no_rate = ServingParams(canary_rate=0.0)
    quiet = PromotionGate(GateConfig(min_ess=1e9), Publisher(), Metrics(), lambda: window, serving=no_rate)  # type: ignore[arg-type]
    quiet.set_serving(manifest(1), net.tensors())
    await quiet.consider(manifest(2), net.tensors())
    assert quiet.canary is None


def test_the_canary_reads_only_what_is_new_in_the_replay_and_counts_each_event_once() -> None:
    net = init_policy(D, S, H, seed=1)
    base = log_of(net, 60, seed=4)
    before = served(base, 1, 0.0)
    later = served(base[:40], 1, 0.0, t0=1000.0) + served(base[:20], 2, 1.0, canary=True, t0=1000.0)
    whole = CanaryRun(manifest(2), net, 1, before, 0.2, 100)
    whole.observe(before + later)
    parts = CanaryRun(manifest(2), net, 1, before, 0.2, 100)
    replay = list(before)
    for chunk in (later[:15], later[15:31], later[31:]):
        replay += chunk
        parts.observe(list(replay))
        parts.observe(list(replay))  # again: nothing new
    assert (len(parts.arms.canary), len(parts.arms.serving)) == (20, 40)
    assert parts.arms.canary == whole.arms.canary and parts.arms.serving == whole.arms.serving
    assert np.allclose(parts.arms.canary_x + parts.arms.serving_x, whole.arms.canary_x + whole.arms.serving_x)
    parts.observe(later[10:] + served(base[:5], 2, 1.0, canary=True, t0=3000.0))  # trimmed past the last one seen
    assert (len(parts.arms.canary), len(parts.arms.serving)) == (25, 40)


async def test_a_label_candidate_the_gate_cannot_judge_is_served_with_the_network_it_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    net = init_policy(D, S, H, seed=1)
    window = served(log_of(net, 80, seed=5), 1, 0.0)
    built: list[Any] = []
    real = gate_module.network

    def spy(tensors: Any) -> Any:
        built.append(real(tensors))
        return built[-1]

    monkeypatch.setattr(gate_module, "network", spy)
    pub = Publisher()
    gate = PromotionGate(
        GateConfig(min_ess=1e9),
        pub,  # type: ignore[arg-type]
        Metrics(),
        lambda: window,
        serving=ServingParams(canary_rate=0.2),
    )
    gate.set_serving(manifest(1), net.tensors())
    label = dataclasses.replace(manifest(2), reason="label")
    decision = await gate.consider(label, net.tensors())
    # The gate's verdict is recorded; the label rule serves the candidate all the same, with the
    # network built to judge it (not built twice: 2 GB at S = 10^6), and makes it no canary.
    assert decision.decision == "insufficient" and gate.decisions[-1] is decision
    assert pub.promoted == [2] and len(built) == 2 and gate.serving_net is built[1] and gate.pending is None
    assert gate.serving_manifest is not None and gate.serving_manifest.version == 2
    assert gate.canary is None and pub.canaries == [None]
