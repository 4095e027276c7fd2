"""The promotion decision (pipeline/learner/promotion_decision.py): each rule changes the decision,
and the learner's gate carries out what it decides."""

from __future__ import annotations

from typing import Any

import pytest

from models.offpolicy.estimators import Estimate
from models.policy.network import init_policy
from models.serving.params import ServingParams
from pipeline.config import GateConfig
from pipeline.learner import promotion_gate as gate_module
from pipeline.learner.promotion_decision import (
    CanaryDecision,
    Candidate,
    Decision,
    Verdict,
    canary_decision,
    decide,
    is_candidate,
)
from pipeline.learner.promotion_gate import PromotionGate
from pipeline.metrics import Metrics
from tests.integration.test_gate import D, H, S, log_of
from tests.unit.learner.test_canary_gate import Publisher, manifest, served
from topics.delta import DeltaManifest

GAIN = Estimate(0.01, -0.05, 0.07, 80.0, 300, "dr", 0.0)


class Judge:
    """The gate's rule as a stub: a fixed verdict, and whether it was asked."""

    def __init__(self, decision: str) -> None:
        self.verdict = Verdict(decision, f"rule says {decision}", {"gain": GAIN})
        self.calls = 0

    def __call__(self) -> Verdict:
        self.calls += 1
        return self.verdict


def run(candidate: Candidate, serving: int | None, decision: str, **kw: Any) -> tuple[Decision, Judge]:
    judge = Judge(decision)
    args: dict[str, Any] = {"canary_running": False, "canary_rate": 0.2, **kw}
    return decide(candidate, serving, judge, **args), judge


def test_the_rules_verdict_decides_a_periodic_candidate() -> None:
    d, judge = run(Candidate(5), 4, "promoted")
    assert (d.decision, d.action, d.end_canary, judge.calls) == ("promoted", "promote", True, 1)
    assert d.estimates["gain"] is GAIN and d.reason == "rule says promoted"
    d, _ = run(Candidate(5), 4, "refused")
    assert (d.decision, d.action, d.start_canary) == ("refused", "refuse", False)
    d, _ = run(Candidate(5), 4, "insufficient")
    assert (d.decision, d.action, d.start_canary, d.end_canary) == ("insufficient", "hold", True, False)


def test_a_superseded_candidate_is_refused_without_a_judgement() -> None:
    for version in (3, 4):  # older than, or the same as, what serves (a canary promoted meanwhile)
        d, judge = run(Candidate(version), 4, "promoted")
        assert (d.decision, d.action, judge.calls) == ("refused", "refuse", 0)
        assert d.reason == "superseded by the serving v4"
    d, judge = run(Candidate(5), 4, "promoted")  # newer: judged, and the same verdict promotes
    assert (d.action, judge.calls) == ("promote", 1)


def test_without_a_serving_policy_the_candidate_serves_unjudged() -> None:
    d, judge = run(Candidate(2), None, "refused")
    assert (d.decision, d.action, d.end_canary, judge.calls) == ("promoted", "promote", True, 0)
    assert d.reason == "no serving policy yet"


def test_the_label_rule_serves_an_undecided_label_fine_tune_and_never_a_refused_one() -> None:
    periodic, _ = run(Candidate(5, "periodic"), 4, "insufficient")
    label, _ = run(Candidate(5, "label"), 4, "insufficient")
    assert periodic.action == "hold" and periodic.start_canary
    # The recorded verdict stays the rule's; the label rule serves it, with no canary of it and
    # without ending a running one (that one is retired at its next judgement).
    assert (label.decision, label.action, label.by_label_rule) == ("insufficient", "promote", True)
    assert not label.start_canary and not label.end_canary
    refused, _ = run(Candidate(5, "label"), 4, "refused")
    assert (refused.action, refused.by_label_rule) == ("refuse", False)
    superseded, judge = run(Candidate(4, "label"), 4, "insufficient")
    assert superseded.action == "refuse" and judge.calls == 0


def test_a_delta_never_becomes_the_canary() -> None:
    full, _ = run(Candidate(5, delta=False), 4, "insufficient")
    delta, _ = run(Candidate(5, delta=True), 4, "insufficient")
    assert full.start_canary and not delta.start_canary
    assert delta.action == "hold"  # still held, judged again as data arrives
    promoted, _ = run(Candidate(5, delta=True), 4, "promoted")
    assert promoted.action == "promote"  # a delta is promoted like a full checkpoint


def test_a_canary_starts_only_when_clients_serve_one_and_none_runs() -> None:
    assert not run(Candidate(5), 4, "insufficient", canary_running=True)[0].start_canary
    assert not run(Candidate(5), 4, "insufficient", canary_rate=0.0)[0].start_canary


def test_checkpoints_served_at_once_skip_the_gate() -> None:
    for reason in ("init", "rollback", "reset", "cutover", "suppress"):
        assert not is_candidate(reason, True)
    for reason in ("periodic", "label", "shutdown"):
        assert is_candidate(reason, True) and not is_candidate(reason, False)


def test_a_canary_ends_on_its_verdict_or_when_the_serving_policy_changed_under_it() -> None:
    asked: list[int] = []

    def judge(verdict: str | None) -> Any:
        def run() -> tuple[str | None, Estimate | None]:
            asked.append(1)
            return verdict, GAIN

        return run

    stale = canary_decision(4, 6, judge("promoted"))
    assert stale == CanaryDecision("retired") and not asked  # not judged: the arms compare the wrong policy
    assert stale.decision == "insufficient" and not stale.serve
    assert canary_decision(4, 4, judge(None)) is None
    promoted = canary_decision(4, 4, judge("promoted"))
    assert promoted is not None and promoted.serve and promoted.gain is GAIN and promoted.decision == "promoted"
    refused = canary_decision(4, 4, judge("refused"))
    assert refused is not None and not refused.serve and refused.decision == "refused"
    with pytest.raises(ValueError, match="unknown canary verdict"):
        canary_decision(4, 4, judge("maybe"))


async def test_the_gate_carries_out_the_decision_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner's gate decides nothing itself: it asks :func:`decide` (with the candidate's
    version, reason and whether it is a delta) and carries out what it says, here a promotion
    of an undecided candidate."""
    net = init_policy(D, S, H, seed=1)
    window = served(log_of(net, 60, seed=5), 1, 0.0)
    seen: list[Candidate] = []

    def promote_all(candidate: Candidate, serving: int | None, judge: Any, **kw: Any) -> Decision:
        seen.append(candidate)
        return Decision("insufficient", "told to", "promote")

    monkeypatch.setattr(gate_module, "decide", promote_all)
    pub = Publisher()
    gate = PromotionGate(GateConfig(min_ess=1e9), pub, Metrics(), lambda: window, serving=ServingParams())  # type: ignore[arg-type]
    gate.set_serving(manifest(1), net.tensors())
    delta = DeltaManifest(**{**manifest(2).__dict__, "base_version": 1, "state_sha256": "0" * 64})
    result = await gate.consider(delta, net.tensors())
    assert seen == [Candidate(2, "periodic", delta=True)]
    assert result.decision == "insufficient" and pub.promoted == [2] and gate.pending is None
    assert gate.serving_manifest is delta
