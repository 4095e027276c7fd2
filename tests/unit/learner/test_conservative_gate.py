"""The gate's hooks without a broker (pipeline/learner/conservative.py): a candidate that would
wait is replaced by a promoted step, published and served; a candidate judged worse than
serving sends the learner back to the serving weights."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from models.offpolicy.estimators import Estimate
from models.offpolicy.trust_region import interpolate
from models.policy.network import init_policy
from models.serving.params import ServingParams
from pipeline.config import GateConfig
from pipeline.learner import conservative, promotion_gate
from pipeline.learner.conservative import StepDecision
from pipeline.learner.promotion_gate import PromotionGate
from pipeline.learner.publishing import Publishing
from pipeline.learner.store import LocalStore
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
        if kw.get("prepare") is not None:
            kw["prepare"](m)  # as CheckpointPublisher: before anything is sent
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
def certified(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """trust_region_step replaced by one that promotes α = 1/4; records the decisions and radius it got."""
    calls: list[tuple[int, float]] = []

    def fake(decisions: Any, candidate: Any, serving: Any, judge: Any, **kw: Any) -> StepDecision:
        calls.append((len(decisions), kw["radius"]))
        net = interpolate(serving, candidate, 0.25, kw.get("fresh", ()))
        return StepDecision("promoted", "step α=0.25 promoted", 0.25, net, {}, 0.01)

    monkeypatch.setattr(conservative, "trust_region_step", fake)
    return calls


async def test_a_waiting_candidate_is_replaced_by_its_promoted_step(certified: list[tuple[int, float]]) -> None:
    pub = Publisher()
    gate, candidate = gate_with(pub, on=True)
    d = await gate.consider(manifest(2), candidate.tensors())
    assert d.decision == "promoted" and d.candidate_version == 10 and "step α=0.25" in d.reason
    ((m, kw),) = pub.published
    assert kw["candidate"] is True and kw["delta"] is None and kw["reason"] == "periodic"
    assert m.metrics["conservative_step"] == {"alpha": 0.25, "toward_version": 2}
    assert pub.promoted == [10] and gate.pending is None
    assert gate.metrics.registry.get_sample_value("causalmem_gate_conservative_steps_total", {"alpha": "0.25"}) == 1
    # The serving policy is now the step, not the candidate; the step was judged on the whole window.
    assert gate.serving_net is not None and gate.serving_manifest is not None and gate.serving_manifest.version == 10
    expected = interpolate(gate_with(Publisher(), True)[0].serving_net, candidate, 0.25)  # type: ignore[arg-type]
    got = gate.serving_net.tensors()
    assert all(np.array_equal(t.numpy(), got[k].numpy()) for k, t in expected.tensors().items())
    assert certified == [(200, GateConfig().trust_region)]


@pytest.mark.parametrize("reanchor", [True, False])
async def test_the_learner_goes_on_from_a_promoted_step(certified: list[tuple[int, float]], reanchor: bool) -> None:
    # Its own weights are beyond what the log vouches for: its next candidates start from the step served.
    gate, candidate = gate_with(Publisher(), on=True)
    gate.config = dataclasses.replace(gate.config, reanchor=reanchor)
    resumed: list[tuple[int, Any]] = []
    gate.on_resume = lambda version, net: resumed.append((version, net))
    await gate.consider(manifest(2), candidate.tensors())
    assert resumed == ([(10, gate.serving_net)] if reanchor else [])
    assert gate.metrics.registry.get_sample_value("causalmem_gate_reanchors_total") == 0  # not a regression


async def test_a_published_step_is_kept_locally_before_it_is_sent(
    certified: list[tuple[int, float]], tmp_path: Path
) -> None:
    # A rollback to a step must not need the model topic to still hold it: the learner saves its
    # local copy (Publishing.keep_step) as it does for every version it publishes.
    pub = Publisher()
    gate, candidate = gate_with(pub, on=True)
    store = LocalStore(tmp_path)
    store.save(dataclasses.replace(manifest(2)), candidate.tensors(), {}, {"kind": "moving", "value": 0.3, "n": 9})
    gate.keep_step = partial(Publishing.keep_step, SimpleNamespace(store=store))  # type: ignore[arg-type]
    d = await gate.consider(manifest(2), candidate.tensors())
    assert d.decision == "promoted" and d.candidate_version == 10
    meta = store.manifest_of(10)
    assert meta is not None and meta["manifest"]["metrics"]["conservative_step"]["toward_version"] == 2
    assert meta["baseline"] == {"kind": "moving", "value": 0.3, "n": 9}  # the candidate's
    kept = store.load_version(10, candidate.arch)
    assert kept is not None and gate.serving_net is not None
    served = gate.serving_net.tensors()
    assert all(np.array_equal(t.numpy(), served[k].numpy()) for k, t in kept.items())
    assert store.optimizer_of(10, meta["manifest"]["sha256"]) == {}  # a restore starts a fresh optimizer


async def test_a_step_takes_the_candidates_rows_where_a_slot_changed_owner(certified: list[tuple[int, float]]) -> None:
    pub = Publisher()
    gate, candidate = gate_with(pub, on=True)
    asked: list[tuple[int, int]] = []
    gate.slots_given = lambda after, upto: asked.append((after, upto)) or [3]
    serving = gate.serving_net
    assert serving is not None
    d = await gate.consider(manifest(2), candidate.tensors())
    assert d.decision == "promoted" and asked == [(1, 2)]
    step = gate.serving_net
    assert step is not None
    assert torch.equal(step.out.weight[3], candidate.out.weight[3])  # the new owner's row, not a blend
    assert torch.equal(step.out.bias[3], candidate.out.bias[3])
    blend = torch.lerp(serving.out.weight[4], candidate.out.weight[4], 0.25)
    assert torch.allclose(step.out.weight[4], blend)  # every other row is the step


async def test_off_by_setting_and_for_label_candidates(certified: list[tuple[int, float]]) -> None:
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


def _worse(*_: Any, **__: Any) -> tuple[str, str, dict[str, Estimate]]:
    """A judgement that finds the candidate worse than serving: undecided, gain upper bound < 0."""
    return "insufficient", "gain below serving", {"gain": Estimate(-0.05, -0.09, -0.01, 90.0, 200, "dr-gain", 0.0)}


async def test_a_candidate_worse_than_serving_sends_the_learner_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(promotion_gate, "judge_window", _worse)
    gate, candidate = gate_with(Publisher(), on=False)
    back: list[tuple[int, Any]] = []
    gate.on_resume = lambda version, net: back.append((version, net))
    d = await gate.consider(manifest(2), candidate.tensors())
    assert d.decision == "insufficient" and gate.pending is not None
    assert back == [(1, gate.serving_net)]  # the serving version and its network
    assert gate.metrics.registry.get_sample_value("causalmem_gate_reanchors_total") == 1
    await gate.reconsider()  # the same held candidate judged again: the learner already went back
    assert len(back) == 1
    await gate.consider(manifest(3), candidate.tensors())  # a new candidate, worse again
    assert len(back) == 2


@pytest.mark.parametrize("case", ["setting off", "label fine-tune"])
async def test_no_return_to_serving_when_off_or_for_expert_answers(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setattr(promotion_gate, "judge_window", _worse)
    gate, candidate = gate_with(Publisher(), on=False)
    if case == "setting off":
        gate.config = dataclasses.replace(gate.config, reanchor=False)
    back: list[int] = []
    gate.on_resume = lambda version, net: back.append(version)
    m = dataclasses.replace(manifest(2), reason="label") if case == "label fine-tune" else manifest(2)
    await gate.consider(m, candidate.tensors())
    assert back == []


@pytest.mark.parametrize("radius", [0.0, -0.1, 1.5])
def test_a_trust_region_outside_0_1_is_refused_at_start(radius: float) -> None:
    with pytest.raises(ValueError, match="gate_trust_region"):
        GateConfig(trust_region=radius)


def _undecided(*_: Any, **__: Any) -> tuple[str, str, dict[str, Estimate]]:
    """A judgement that cannot decide: the gain's interval straddles −ε and 0."""
    return "insufficient", "straddles", {"gain": Estimate(0.01, -0.09, 0.11, 90.0, 200, "dr-gain", 0.0)}


@pytest.fixture
def undecided_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """trust_region_step replaced by one that judges a step within the trust region and cannot decide it."""

    def fake(*_: Any, **__: Any) -> StepDecision:
        return StepDecision("insufficient", "step α=0.5 (TV 0.010 ≤ 0.05): straddles", 0.5, None, {}, 0.01)

    monkeypatch.setattr(conservative, "trust_region_step", fake)


async def test_candidates_that_wait_in_a_row_send_the_learner_back(
    monkeypatch: pytest.MonkeyPatch, undecided_step: None
) -> None:
    # Measured through the pipeline: a learner whose candidates wait goes on drifting out of what
    # the window can judge. After STALL_WAITS of them in a row (each with its step undecided
    # too) it goes on from the serving weights.
    monkeypatch.setattr(promotion_gate, "judge_window", _undecided)
    gate, candidate = gate_with(Publisher(), on=True)
    back: list[int] = []
    gate.on_resume = lambda version, net: back.append(version)
    stalls = "causalmem_gate_stall_resumes_total"
    for v in range(2, 1 + conservative.STALL_WAITS):
        await gate.consider(manifest(v), candidate.tensors())
        await gate.reconsider()  # the same candidate judged again counts once
    assert back == [] and gate.metrics.registry.get_sample_value(stalls) == 0
    await gate.consider(manifest(1 + conservative.STALL_WAITS), candidate.tensors())
    assert back == [1] and gate.metrics.registry.get_sample_value(stalls) == 1
    assert gate.metrics.registry.get_sample_value("causalmem_gate_reanchors_total") == 0  # not shown worse
    for v in range(2 + conservative.STALL_WAITS, 1 + 2 * conservative.STALL_WAITS):
        await gate.consider(manifest(v), candidate.tensors())
    assert back == [1]  # a new count after the resume
    gate.config = dataclasses.replace(gate.config, reanchor=False)
    for v in range(1 + 2 * conservative.STALL_WAITS, 1 + 4 * conservative.STALL_WAITS):
        await gate.consider(manifest(v), candidate.tensors())
    assert back == [1]  # off with gate_reanchor


@pytest.mark.parametrize("case", ["steps off", "no step fits"])
async def test_without_a_step_to_judge_the_learner_is_let_go_on(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    # From the first policy (served at T = 0.001) no step fits the trust region, and with steps
    # off there are none: only a whole candidate can be promoted, so the learner must go far
    # enough for one to be decided.
    monkeypatch.setattr(promotion_gate, "judge_window", _undecided)
    gate, candidate = gate_with(Publisher(), on=case == "no step fits")
    if case == "no step fits":
        gate.config = dataclasses.replace(gate.config, trust_region=1e-9)
    back: list[int] = []
    gate.on_resume = lambda version, net: back.append(version)
    for v in range(2, 2 + 2 * conservative.STALL_WAITS):
        d = await gate.consider(manifest(v), candidate.tensors())
    assert d.decision == "insufficient" and ("no step of α" in d.reason) == (case == "no step fits")
    assert back == [] and gate.lineage.stall.waited == 0


async def test_a_promoted_step_starts_the_count_again(
    monkeypatch: pytest.MonkeyPatch, certified: list[tuple[int, float]]
) -> None:
    monkeypatch.setattr(promotion_gate, "judge_window", _undecided)
    gate, candidate = gate_with(Publisher(), on=True)
    back: list[int] = []
    gate.on_resume = lambda version, net: back.append(version)
    gate.lineage.stall.waited = conservative.STALL_WAITS - 1
    d = await gate.consider(manifest(2), candidate.tensors())
    assert d.decision == "promoted" and back == [10]  # it goes on from the step, not from serving
    assert gate.lineage.stall.waited == 0


async def test_a_canary_promoted_after_the_learner_left_its_weights_is_where_it_goes_on() -> None:
    # The canary v7 was published before the learner resumed from serving: its next candidates
    # descend from the serving weights, not from v7, so once v7 serves the learner goes on from it.
    from tests.unit.learner.test_similarity_witness import _Run

    gate, candidate = gate_with(Publisher(), on=False)
    back: list[int] = []
    gate.on_resume = lambda version, net: back.append(version)
    arms = SimpleNamespace(canary=[1] * 130, serving=[1] * 700)
    gain = Estimate(0.12, 0.02, 0.22, 90.0, 90, "canary", 0.0)

    def canary(version: int) -> _Run:
        return _Run(
            verdict="promoted",
            gain=gain,
            version=version,
            serving_version=1,
            arms=arms,
            coupled=[],
            manifest=manifest(version),
            net=candidate,
        )

    gate.lineage.judging(8)
    gate.canary = canary(7)  # type: ignore[assignment]
    await gate._judge_canary()
    assert gate.serving_manifest is not None and gate.serving_manifest.version == 7
    assert back == []  # the learner's weights descend from v7: nothing to do
    gate._resume_learner(7, candidate)  # it resumes (from serving, a step…) while judging v8
    gate.canary = canary(8)  # type: ignore[assignment]
    gate.canary.serving_version = 7
    await gate._judge_canary()
    assert back == [7, 8]
