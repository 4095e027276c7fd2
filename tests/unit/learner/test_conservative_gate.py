"""The gate's hook for conservative steps (pipeline/learner/conservative.py) without a broker:
a candidate that would wait is replaced by a certified step, published and promoted."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from models.policy.network import init_policy
from models.serving.params import ServingParams
from pipeline.config import GateConfig
from pipeline.learner import conservative
from pipeline.learner.conservative import StepDecision
from pipeline.learner.promotion_gate import PromotionGate
from pipeline.metrics import Metrics
from tests.integration.test_gate import D, H, S, log_of
from tests.unit.learner.test_canary_gate import manifest
from topics.manifest import Manifest


class Publisher:
    def __init__(self) -> None:
        self.published: list[tuple[Manifest, dict[str, Any]]] = []
        self.promoted: list[int] = []

    async def publish(self, blob: bytes, **kw: Any) -> Manifest:
        m = dataclasses.replace(manifest(10 + len(self.published)), metrics=kw["metrics"], reason=kw["reason"])
        self.published.append((m, kw))
        return m

    async def promote(self, m: Manifest) -> None:
        self.promoted.append(m.version)

    async def set_canary(self, m: Manifest | None) -> None:
        pass


def gate_with(pub: Publisher, on: bool) -> tuple[PromotionGate, Any]:
    serving_net, candidate_net = init_policy(D, S, H, seed=1), init_policy(D, S, H, seed=2)
    window = log_of(serving_net, 200, seed=3)
    gate = PromotionGate(
        GateConfig(window=500, min_ess=1e9, conservative=on),  # the whole candidate always waits
        pub,  # type: ignore[arg-type]
        Metrics(),
        lambda: window,
        serving=ServingParams(canary_rate=0.0),
    )
    gate.set_serving(manifest(1), serving_net.tensors())
    return gate, candidate_net


@pytest.fixture
def certified(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """conservative_step replaced by one that certifies α = 1/4 and records the halves' sizes."""
    calls: list[tuple[int, int]] = []

    def fake(first: Any, second: Any, candidate: Any, serving: Any, judge: Any, **kw: Any) -> StepDecision:
        calls.append((len(first), len(second)))
        net = conservative.interpolate(serving, candidate, 0.25)
        return StepDecision("promoted", "step α=0.25 certified", 0.25, net, {}, (), len(first), len(second))

    monkeypatch.setattr(conservative, "conservative_step", fake)
    return calls


async def test_a_waiting_candidate_is_replaced_by_its_certified_step(certified: list[tuple[int, int]]) -> None:
    pub = Publisher()
    gate, candidate = gate_with(pub, on=True)
    d = await gate.consider(manifest(2), candidate.tensors())
    assert d.decision == "promoted" and d.candidate_version == 10 and "step α=0.25" in d.reason
    ((m, kw),) = pub.published
    assert kw["candidate"] is True and kw["delta"] is None and kw["reason"] == "periodic"
    assert m.metrics["conservative_step"] == {"alpha": 0.25, "toward_version": 2}
    assert pub.promoted == [10] and gate.pending is None
    # The serving policy is now the step, not the candidate, and the halves were disjoint.
    assert gate.serving_net is not None and gate.serving_manifest is not None and gate.serving_manifest.version == 10
    expected = conservative.interpolate(gate_with(Publisher(), True)[0].serving_net, candidate, 0.25)  # type: ignore[arg-type]
    got = gate.serving_net.tensors()
    assert all(np.array_equal(t.numpy(), got[k].numpy()) for k, t in expected.tensors().items())
    ((a, b),) = certified
    assert a + b == 200 and a > 0 and b > 0


async def test_off_by_setting_and_for_label_candidates(certified: list[tuple[int, int]]) -> None:
    pub = Publisher()
    gate, candidate = gate_with(pub, on=False)
    d = await gate.consider(manifest(2), candidate.tensors())
    assert d.decision == "insufficient" and certified == [] and pub.published == []
    gate, candidate = gate_with(pub, on=True)
    label = dataclasses.replace(manifest(3), reason="label")
    d = await gate.consider(label, candidate.tensors())
    assert d.decision == "insufficient" and certified == [] and pub.published == []


def test_after_a_step_serves_the_next_checkpoint_is_a_full_snapshot() -> None:
    # A delta applies onto the serving link; a step's weights are not the trainer's, so the
    # rows the trainer changed since its last checkpoint would not rebuild its state there.
    from models.policy.network import Arch
    from pipeline.learner.deltas import DeltaPlanner
    from pipeline.modeltopic import CheckpointPublisher

    pub = CheckpointPublisher(None, "t", "p")
    planner = DeltaPlanner(pub, Arch(4, 1000, 8), full_every=50, max_share=1.0)
    rows = np.array([1, 2])
    pub.head = (1, "a")
    planner.record(1, False, rows)  # the trainer's full v1 serves
    assert planner.plan("periodic", rows) is not None  # its next checkpoint: a delta on v1
    planner.record(2, True, rows)
    pub.head = (3, "step")  # the gate published and promoted a step, v3
    assert planner.plan("periodic", rows) is None
