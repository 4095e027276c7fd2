"""The in-process learning loop (lab/causalmem_lab/offline.py) on a tiny scenario: it refreshes,
resets and gates with the learner's own rules."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from causalmem_lab import offline
from causalmem_lab.offline import OfflineConfig, run_offline
from causalmem_lab.simulator import Scenario

from models.offpolicy.estimators import Estimate
from models.offpolicy.trust_region import interpolate
from pipeline.config import Settings
from pipeline.learner import conservative, promotion_decision, promotion_gate

TINY = Scenario(
    embedding_dim=8, slots=64, intents=3, background=20, days=2, queries_per_day=120, drift_day=1.0, n_candidates=8
)


def test_refreshes_and_resets_each_serve_a_new_version() -> None:
    cfg = OfflineConfig(
        hidden=16, refresh_every=40, drift_min_pairs=20, drift_cooldown_s=86400.0, page_hinkley=False, gate=False
    )
    result = run_offline(TINY, cfg)
    assert len(result.tally.version) > 400
    assert result.resets, "the drift on day 1 fires a reset"
    assert result.alpha and not result.gate
    # Ungated: every refresh and every reset is served, in order.
    assert max(result.tally.version) == 1 + len(result.alpha) + len(result.resets)
    assert result.tally.version == sorted(result.tally.version)


def test_a_gate_without_enough_data_keeps_the_first_policy() -> None:
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, gate_min_ess=1e9, canary_rate=0.0)
    result = run_offline(TINY, cfg)
    assert result.gate and set(result.gate) == {"insufficient"}
    assert set(result.tally.version) == {1}
    # Served as the learner serves a fresh first policy under the gate: the similarity
    # ranking (T = 0.001), not drawn at the serving temperature, until a promotion.
    assert result.served is not None and result.served.serving is not None
    assert result.served.serving.temperature == 0.001
    ungated = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=False)
    assert run_offline(TINY, ungated).served.serving is None  # type: ignore[union-attr]


def test_keeps_what_the_learner_keeps_and_defaults_to_the_products_settings() -> None:
    product = Settings()
    cfg = OfflineConfig()
    assert cfg.replay_window_s == product.learner().replay_window_s
    assert OfflineConfig(gate=False).gate_config() is None
    assert cfg.gate_config() == product.learner().gate  # gated with the learner's rule, as the product is
    sized = product.replace(embedding_dim=TINY.embedding_dim, slots=TINY.slots, device="cpu")
    assert cfg.trainer(TINY) == sized.trainer()
    assert OfflineConfig(lr=0.5).trainer(TINY) == sized.replace(lr=0.5).trainer()
    assert (cfg.batch_size, cfg.warmup_epochs, cfg.warmup_half_life_s) == (
        product.batch_size,
        product.warmup_epochs,
        product.warmup_half_life_s,
    )
    assert (cfg.canary_rate, cfg.canary_coupled, cfg.drop, cfg.reset) == (
        product.serve_canary_rate,
        product.serve_canary_coupled,
        product.serve_drop,
        product.drift_reset,
    )


def test_a_canary_serves_the_pending_candidate_on_its_share_and_is_judged_on_it() -> None:
    cfg = OfflineConfig(
        hidden=16, refresh_every=40, reset=False, gate=True, gate_min_ess=1e9, canary_rate=0.3, canary_max=15
    )
    result = run_offline(TINY, cfg)
    assert set(result.gate) == {"insufficient"}  # the off-policy gate never decides here
    # Undecided canaries give way to newer candidates after 15 canary decisions or are judged.
    assert result.canary and all(v.split()[0] in ("promoted", "refused", "retired") for v in result.canary)
    n = len(result.tally.utility)
    assert 0.15 * n < len(result.canary_utility) < 0.35 * n
    # Canary requests are measured apart from the policy as served, like exploration.
    assert sum(result.tally.explore) >= len(result.canary_utility)
    promoted = [v for v in result.canary if v.startswith("promoted")]
    assert (max(result.tally.version) > 1) == bool(promoted)


def test_without_a_canary_share_nothing_is_canaried() -> None:
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, gate_min_ess=1e9, canary_rate=0.0)
    result = run_offline(TINY, cfg)
    assert not result.canary and not result.canary_utility
    assert set(result.tally.version) == {1}


def test_the_loop_takes_the_learners_promotion_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    # One function decides for both: the learner's gate and this loop import the same objects.
    for name in ("decide", "canary_decision", "is_candidate"):
        assert getattr(offline, name) is getattr(promotion_decision, name)
    assert promotion_gate.decide is promotion_decision.decide
    assert promotion_gate.canary_decision is promotion_decision.canary_decision
    # The loop holds no rule of its own: it defines no function but its snapshot and itself.
    own = {n for n, v in vars(offline).items() if callable(v) and getattr(v, "__module__", "") == offline.__name__}
    # SequenceGate only carries out pipeline.learner.promotion.decide's actions (tested below).
    assert own == {"OfflineConfig", "OfflineResult", "SequenceGate", "_snapshot", "run_offline"}
    calls: list[tuple[promotion_decision.Candidate, int | None, str]] = []
    ended: list[str] = []

    def decide(candidate: Any, serving: Any, judge: Any, **kw: Any) -> Any:
        d = promotion_decision.decide(candidate, serving, judge, **kw)
        calls.append((candidate, serving, d.decision))
        return d

    def canary_decision(*args: Any) -> Any:
        d = promotion_decision.canary_decision(*args)
        if d is not None:
            ended.append(d.verdict)
        return d

    monkeypatch.setattr(offline, "decide", decide)
    monkeypatch.setattr(offline, "canary_decision", canary_decision)
    cfg = OfflineConfig(
        hidden=16, refresh_every=40, gate_min_ess=1e9, canary_rate=0.3, canary_max=15, drift_min_pairs=20
    )
    result = run_offline(TINY, cfg)
    # Every refresh is a candidate the product's decision judged (a drift reset is served at
    # once: no decision), and the loop records exactly what it decided.
    assert [c.version for c, _, _ in calls] == [v for _, v, _ in result.refreshes]
    assert all(c.reason == "periodic" and not c.delta for c, _, _ in calls)
    assert [d for _, _, d in calls] == result.gate
    assert [s for _, s, _ in calls] == [s for _, _, s in result.refreshes]
    assert ended == [v.split()[0] for v in result.canary] and ended


def test_where_a_candidate_would_wait_the_loop_serves_the_gates_promoted_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # The product's own step (pipeline/learner/conservative.py), promoting α = 1/4 here; the
    # whole candidate never has the data (ESS 1e9), so every promotion is a step.
    assert offline.step_on_window is conservative.step_on_window
    seen: list[tuple[Any, Any, Any]] = []

    def certify(decisions: Any, candidate: Any, serving: Any, judge: Any, **kw: Any) -> Any:
        assert kw["radius"] == OfflineConfig.gate_trust_region
        net = interpolate(serving, candidate, 0.25, kw.get("fresh", ()))
        seen.append((candidate, serving, net))
        return conservative.StepDecision("promoted", "promoted", 0.25, net, {}, 0.01)

    monkeypatch.setattr(conservative, "trust_region_step", certify)
    resumed: list[dict[str, Any]] = []
    real = offline.PolicyTrainer.resume_from

    def spy(self: Any, tensors: Any, keep_rows: Any = ()) -> None:
        resumed.append(tensors)
        real(self, tensors, keep_rows)

    monkeypatch.setattr(offline.PolicyTrainer, "resume_from", spy)
    cfg = OfflineConfig(
        hidden=16, refresh_every=40, reset=False, gate=True, gate_min_ess=1e9, canary_rate=0.0, gate_conservative=True
    )
    result = run_offline(TINY, cfg)
    assert result.steps_taken and len(result.steps_taken) == len(seen)
    # As the learner (gate_reanchor): the trainer goes on from each step served, not from beyond it.
    for _, _, net in seen:
        step = net.tensors()
        assert any(all(torch.equal(t, step[k]) for k, t in r.items()) for r in resumed)
    versions = [v for _, _, v, _, _, _ in result.steps_taken]
    assert set(versions) <= set(result.tally.version)  # each step was served
    assert all(toward == v - 1 and before < toward for _, _, v, toward, before, _ in result.steps_taken)
    assert result.served is not None and result.served.version == versions[-1]
    assert result.served.net is seen[-1][2]
    cfg = OfflineConfig(
        hidden=16, refresh_every=40, reset=False, gate=True, gate_min_ess=1e9, canary_rate=0.0, gate_conservative=False
    )
    off = run_offline(TINY, cfg)
    assert not off.steps_taken and set(off.tally.version) == {1}  # without steps nothing new is served


def test_where_the_gate_finds_a_candidate_worse_the_loop_resumes_from_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the learner (ControlHandler.resume_from_serving): every candidate judged worse than
    # serving (gain upper bound < 0) sends the trainer back to the serving weights.
    worse = {"gain": Estimate(-0.05, -0.09, -0.01, 90.0, 200, "dr-gain", 0.0)}
    monkeypatch.setattr(offline, "judge_window", lambda *a, **k: ("insufficient", "worse", worse))
    resumed: list[int] = []
    real = offline.PolicyTrainer.resume_from

    def spy(self: Any, tensors: Any, keep_rows: Any = ()) -> None:
        resumed.append(1)
        real(self, tensors, keep_rows)

    monkeypatch.setattr(offline.PolicyTrainer, "resume_from", spy)
    base = {"hidden": 16, "refresh_every": 40, "reset": False, "gate": True, "canary_rate": 0.0}
    result = run_offline(TINY, OfflineConfig(**base, gate_conservative=False))
    judged = [r for r in result.refreshes if r[2] > 0]
    assert result.reanchors and len(result.reanchors) == len(resumed) == len(judged)
    assert all(serving == 1 for _, _, serving in result.reanchors)  # nothing was promoted: v1 serves
    off = run_offline(TINY, OfflineConfig(**base, gate_conservative=False, gate_reanchor=False))
    assert not off.reanchors and len(resumed) == len(judged)


def test_where_candidates_wait_in_a_row_the_loop_resumes_from_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    # As the learner's gate (conservative.Stall): every STALL_WAITS-th undecided candidate in a
    # row sends the trainer back to the serving weights; none is shown worse.
    undecided = {"gain": Estimate(0.01, -0.09, 0.11, 90.0, 200, "dr-gain", 0.0)}
    monkeypatch.setattr(offline, "judge_window", lambda *a, **k: ("insufficient", "straddles", undecided))
    step = conservative.StepDecision("insufficient", "step α=0.5: straddles", 0.5, None, {}, 0.01)
    monkeypatch.setattr(conservative, "trust_region_step", lambda *a, **k: step)
    assert offline.Lineage is conservative.Lineage
    base = {"hidden": 16, "refresh_every": 40, "reset": False, "gate": True, "canary_rate": 0.0}
    result = run_offline(TINY, OfflineConfig(**base))
    judged = [r for r in result.refreshes if r[2] > 0]
    assert not result.reanchors and len(judged) >= 2 * conservative.STALL_WAITS
    # Every STALL_WAITS-th candidate whose step was judged (the first has no window to step on yet).
    stalled = [v for _, v, _ in result.stalls]
    assert len(stalled) >= 2 and all(b - a == conservative.STALL_WAITS for a, b in itertools.pairwise(stalled))
    assert set(stalled) <= {v for _, v, _ in judged}
    off = run_offline(TINY, OfflineConfig(**base, gate_reanchor=False))
    assert not off.stalls
    nosteps = run_offline(TINY, OfflineConfig(**base, gate_conservative=False))  # only a whole candidate can go
    assert not nosteps.stalls


def test_the_sequence_rule_decides_from_held_out_decisions_only() -> None:
    """gate_rule "sequences": the loop carries out pipeline.learner.promotion.decide; the trainer
    learns from the queries outside the hold-out alone, and every promotion names its path."""
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, gate_rule="sequences", canary_rate=0.0)
    result = run_offline(TINY, cfg)
    kinds = {k for _, k, _, _ in result.actions}
    assert "trial" in kinds
    assert all(p in ("improved", "within-epsilon") for _, k, _, p in result.actions if k == "promote")
    served = set(result.tally.version)
    promoted = {v for _, k, v, _ in result.actions if k == "promote"}
    assert served - {1} <= promoted  # nothing but the first policy is served without the rule
    with pytest.raises(ValueError, match="gate_rule"):
        run_offline(TINY, OfflineConfig(hidden=16, refresh_every=40, gate=True, gate_rule="other"))
