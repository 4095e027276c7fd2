"""The gain over similarity-only bounded through a witness (pipeline/learner/similarity_witness.py),
and the learner resuming from serving when a canary's own requests show it worse.

The failure it answers (docs/benchmarks.md, "Freshness"): once the policy had learnt, every step
was judged fine against serving but undecided against similarity-only (+0.44 in [−0.95, +1.31]),
and nothing was served for the rest of the run.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from models.offpolicy.estimators import Estimate
from models.serving.params import ServingParams
from pipeline.learner import promotion_gate
from pipeline.learner.promotion_gate import judge, rule
from pipeline.learner.similarity_witness import CHAINED, Witness, next_witness, through
from tests.unit.learner.test_canary_gate import manifest
from tests.unit.learner.test_conservative_gate import Publisher, gate_with
from tests.unit.models.offpolicy.test_gate_served import net_with, served_log

EPS = 0.02


def est(value: float, low: float, high: float, method: str = "dr-gain") -> Estimate:
    return Estimate(value, low, high, 500.0, 2000, method, 0.0)


FINE = est(0.004, -0.008, 0.015)  # over serving: within ε
CANDIDATE = est(0.8, 0.7, 0.9, "dr")


def test_a_step_undecided_over_similarity_only_is_promoted_through_the_witness() -> None:
    wide = est(0.44, -0.95, 1.31)  # what the window says directly about the gain over top-k
    assert rule(FINE, wide, CANDIDATE, EPS, 50.0, 2000)[0] == "insufficient"
    decision, reason = rule(FINE, wide, CANDIDATE, EPS, 50.0, 2000, est(0.30, 0.28, 0.32, "dr-gain through v9"))
    assert decision == "promoted" and "through v9" in reason


@pytest.mark.parametrize(
    ("gs", "chained", "expected"),
    [
        (est(-0.30, -0.50, -0.10), est(0.30, 0.28, 0.32), "refused"),  # a direct refusal stands
        (est(0.44, -0.95, 1.31), est(-0.10, -0.15, -0.05), "insufficient"),  # the chain never refuses
        (est(0.44, -0.95, 1.31), est(0.00, -0.03, 0.03), "insufficient"),  # nor certifies below −ε
        (est(0.30, 0.10, 0.50), est(-0.10, -0.15, -0.05), "promoted"),  # nor spoils a direct bound
    ],
)
def test_the_chained_bound_only_certifies(gs: Estimate, chained: Estimate, expected: str) -> None:
    assert rule(FINE, gs, CANDIDATE, EPS, 50.0, 2000, chained)[0] == expected


def test_a_worse_candidate_over_serving_is_not_rescued_by_the_witness() -> None:
    worse = est(-0.06, -0.09, -0.03)
    assert rule(worse, est(0.44, -0.95, 1.31), CANDIDATE, EPS, 50.0, 2000, est(0.3, 0.28, 0.32))[0] == "refused"


def test_the_chained_bound_is_the_gain_over_the_witness_on_the_window_plus_its_margin() -> None:
    serving = net_with(2.0, -2.0, 0.0)
    log = served_log(serving, 1000, 0.05, seed=1)
    params = ServingParams()
    # A candidate judged against itself as the witness: the paired gain is 0 on every resample.
    _, _, e = judge(
        log, serving, serving, EPS, 50.0, params=params, n_boot=50, witness=Witness(3, serving, params, 0.25)
    )
    chained = e[CHAINED]
    assert chained.low == pytest.approx(0.25) and chained.high == pytest.approx(0.25)
    assert "through v3 (margin +0.2500)" in chained.method
    # Against another witness the bound moves with the gain over it, and the direct bound is unchanged.
    other = net_with(1.0, -1.0, 0.0)
    _, _, e2 = judge(
        log, serving, serving, EPS, 50.0, params=params, n_boot=50, witness=Witness(4, other, params, 0.25)
    )
    assert e2[CHAINED].value != pytest.approx(0.25)
    assert e2["gain_similarity"] == e["gain_similarity"]
    _, _, alone = judge(log, serving, serving, EPS, 50.0, params=params, n_boot=50)
    assert CHAINED not in alone and alone["gain_similarity"] == e["gain_similarity"]


def test_the_witness_moves_only_to_a_version_bounded_directly_and_more_tightly() -> None:
    net = net_with(2.0, -2.0, 0.0)
    p = ServingParams()
    w = next_witness(None, 3, net, p, {"gain_similarity": est(0.4, 0.3, 0.5)}, EPS)
    assert w is not None and (w.version, w.margin) == (3, 0.3)
    # Promoted through the witness (its direct bound undecided): no chain of chains.
    assert next_witness(w, 4, net, p, {"gain_similarity": est(0.4, -0.9, 1.3), CHAINED: est(0.3, 0.28, 0.32)}, EPS) is w
    # Bounded directly, but less tightly than through the witness: the witness stays.
    assert next_witness(w, 5, net, p, {"gain_similarity": est(0.1, 0.0, 0.2), CHAINED: est(0.3, 0.28, 0.32)}, EPS) is w
    # Bounded directly and more tightly: it becomes the witness.
    moved = next_witness(w, 6, net, p, {"gain_similarity": est(0.5, 0.45, 0.55), CHAINED: est(0.3, 0.28, 0.32)}, EPS)
    assert moved is not None and (moved.version, moved.margin) == (6, 0.45)
    # A promotion without a direct bound (a canary's, a label fine-tune's) leaves it.
    assert next_witness(w, 7, net, p, {}, EPS) is w


def _judged(gs: Estimate, over_witness: Estimate | None = None) -> Any:
    """The gate's judgement with these gains over similarity-only and over the witness it is given."""

    def judgement(*_: Any, **kw: Any) -> tuple[str, str, dict[str, Estimate]]:
        out = {"gain": FINE, "gain_similarity": gs, "candidate": CANDIDATE}
        if kw.get("witness") is not None and over_witness is not None:
            out[CHAINED] = through(over_witness, kw["witness"])
        decision, reason = rule(FINE, gs, CANDIDATE, EPS, 50.0, 2000, out.get(CHAINED))
        return decision, reason, out

    return judgement


async def test_the_gate_keeps_a_witness_and_drops_it_when_a_checkpoint_is_served_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pub = Publisher()
    gate, candidate = gate_with(pub, on=False)
    gate.config = dataclasses.replace(gate.config, min_ess=50.0)
    monkeypatch.setattr(promotion_gate, "judge_window", _judged(est(0.4, 0.3, 0.5)))
    assert (await gate.consider(manifest(2), candidate.tensors())).decision == "promoted"
    assert gate.witness is not None and (gate.witness.version, gate.witness.margin) == (2, 0.3)
    # Later the window cannot bound the gain over similarity-only: the witness does.
    monkeypatch.setattr(promotion_gate, "judge_window", _judged(est(0.4, -0.9, 1.3), est(0.01, -0.01, 0.03)))
    d = await gate.consider(manifest(3), candidate.tensors())
    assert d.decision == "promoted" and "+0.2900 (dr-gain through v2 (margin +0.3000))" in d.reason
    assert gate.witness.version == 2  # promoted through it: no chain of chains
    # A checkpoint served without the gate (a reset, a rollback): nothing vouches any more.
    gate.set_serving(manifest(4), candidate.tensors())
    assert gate.witness is None
    d = await gate.consider(manifest(5), candidate.tensors())
    assert d.decision == "insufficient" and "over similarity-only" in d.reason


class _Run(SimpleNamespace):
    def judge(self, *_: Any) -> tuple[str, Estimate]:
        return self.verdict, self.gain

    def describe(self, gain: Estimate | None) -> str:
        return f"canary v{self.version}"


@pytest.mark.parametrize(
    ("verdict", "high", "resumed"), [("retired", -0.004, True), ("refused", -0.02, True), ("retired", 0.03, False)]
)
async def test_a_canary_shown_worse_sends_the_learner_back(verdict: str, high: float, resumed: bool) -> None:
    gate, _ = gate_with(Publisher(), on=False)
    back: list[int] = []
    gate.on_resume = lambda version, net: back.append(version)
    gain = Estimate(-0.06, -0.11, high, 130.0, 130, "canary", 0.0)
    arms = SimpleNamespace(canary=[1] * 130, serving=[1] * 700)
    gate.canary = _Run(verdict=verdict, gain=gain, version=7, serving_version=1, arms=arms, coupled=[])  # type: ignore[assignment]
    await gate._judge_canary()
    assert gate.canary is None and back == ([1] if resumed else [])
    assert gate.metrics.registry.get_sample_value("causalmem_gate_reanchors_total") == (1.0 if resumed else 0.0)
