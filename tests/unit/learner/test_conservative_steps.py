"""Conservative steps: where the gate cannot decide the learner's candidate, the largest step
toward it within the trust region, chosen from the logged contexts and judged on the whole window."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest
import torch

from models.offpolicy.estimators import DEFAULT_LEVEL, Estimate
from models.offpolicy.logged import LoggedDecisions, Served
from models.offpolicy.trust_region import STEP_GRID, interpolate, served_tv
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from models.serving.rule import (
    adjusted_logits,
    first_draw_probs,
    keep_dynamic,
    plackett_luce_logprob,
    sample_plackett_luce,
)
from pipeline.learner.conservative import STEP_LEVEL, STEP_TRIES, trust_region_step
from pipeline.learner.promotion_gate import judge

D, S, K = 4, 12, 2
# A: the memories the serving policy reads; B: a little better, a little less similar, rarely
# read by a near-greedy serving; C: worse than either, as similar as A.
A, B, C = range(0, 4), range(4, 8), range(8, 12)
VALUE = {**{s: 1.0 for s in A}, **{s: 1.3 for s in B}, **{s: -1.0 for s in C}}
PARAMS = ServingParams()  # T 0.05, 10% at T 0.25: how clients serve, and how the log was drawn
GATE = partial(judge, epsilon=0.02, min_ess=50.0, method="auto", n_boot=200, params=PARAMS)


def net_with(a: float, b: float, c: float) -> PolicyNetwork:
    """A policy whose mask is softplus(the bias of the memory's group), whatever the query."""
    net = PolicyNetwork(D, S, hidden=4, alpha=1.0)
    with torch.no_grad():
        net.out.weight.zero_()
        net.out.bias.copy_(torch.tensor([a] * 4 + [b] * 4 + [c] * 4))
    return net.eval()


def served_log(net: PolicyNetwork, n: int, seed: int, noise: float = 1.0) -> LoggedDecisions:
    """Decisions drawn as clients serve ``net`` (the mixture of PARAMS), logged with their
    mixture logprob and candidate_probs; utility = mean value of the two memories read + noise."""
    rng = np.random.default_rng(seed)
    cands, scores, sel, lps, probs, utils = [], [], [], [], [], []
    alpha = float(net.alpha.detach()[0])
    for _ in range(n):
        c = np.concatenate([rng.choice(list(g), 2, replace=False) for g in (A, B, C)])
        sc = np.where(np.isin(c, list(B)), rng.uniform(0.45, 0.55, 6), rng.uniform(0.5, 0.6, 6))
        with torch.no_grad():
            m = net.candidate_masks(torch.zeros(1, 4), torch.from_numpy(c[None]))[0].double().numpy()
        keep = keep_dynamic(m)
        zs = [(w, adjusted_logits(sc[keep], m[keep], alpha, t)) for w, t in PARAMS.components()]
        drawn = zs[0][1] if rng.random() < zs[0][0] else zs[-1][1]
        pos = sample_plackett_luce(drawn, K, rng)
        chosen = [int(c[keep][p]) for p in pos]
        cands.append(c[keep].tolist())
        scores.append(sc[keep])
        sel.append(chosen)
        lps.append(float(np.log(sum(w * np.exp(plackett_luce_logprob(z, pos)) for w, z in zs))))
        probs.append(sum(w * first_draw_probs(z) for w, z in zs))
        utils.append(float(np.mean([VALUE[s] for s in chosen]) + noise * rng.normal()))
    return LoggedDecisions.from_lists(
        cands, scores, sel, [PARAMS.temperature] * n, lps, utils, embedding=np.zeros((n, D)), first_probs=probs
    )


def true_value(net: PolicyNetwork, n: int = 4000) -> float:
    return float(served_log(net, n, seed=99, noise=0.0).utility.mean())


SERVING = net_with(2.0, 1.0, -1.0)  # converged on A; B is better but rarely read


@pytest.fixture(scope="module")
def window() -> LoggedDecisions:
    return served_log(SERVING, 2000, seed=1)


RADIUS = 0.05  # the product's gate_trust_region


def step(log: LoggedDecisions, net: PolicyNetwork, judge=GATE, **kw):  # type: ignore[no-untyped-def]
    return trust_region_step(log, net, SERVING, judge, params=PARAMS, radius=kw.pop("radius", RADIUS), **kw)


def test_a_small_step_the_log_can_judge_gets_through_where_the_whole_step_waits(window) -> None:
    candidate = net_with(2.0, 4.0, -1.0)  # truly better, but it serves B, which the log rarely shows
    decision, reason, _ = GATE(window, candidate, SERVING)
    assert decision == "insufficient" and reason.startswith("ESS"), reason  # the plain gate: serving freezes
    # This log's utilities are noisier (σ = 1 a decision) than the product's: the step at the
    # default radius straddles −ε here, a step within TV 0.02 is decided.
    s = step(window, candidate, radius=0.02)
    assert s.decision == "promoted", s.reason
    assert s.alpha is not None and s.alpha < 1.0 and s.net is not None
    assert s.tv is not None and s.tv <= 0.02
    assert s.estimates["gain"].low > -0.02
    # The step served is truly better than serving, and is the interpolation it says it is.
    assert true_value(s.net) > true_value(SERVING)
    expected = interpolate(SERVING, candidate, s.alpha).tensors()
    assert all(torch.equal(t, expected[name]) for name, t in s.net.tensors().items())
    assert f"TV {s.tv:.3f} ≤ 0.02) on 2000 decisions" in s.reason


@pytest.mark.parametrize("worse", [(2.0, -8.0, 3.0), (2.0, 1.0, 8.0), (-2.0, -1.0, 3.5)])
def test_a_step_toward_a_truly_worse_policy_keeps_the_promise(window, worse: tuple[float, float, float]) -> None:
    # Whole steps toward these are far worse than serving. A step within the trust region is
    # promoted only when the log bounds its loss above −ε, and then truly within ε of serving.
    net = net_with(*worse)
    assert true_value(net) < true_value(SERVING) - 1.0
    assert GATE(window, net, SERVING)[0] != "promoted"
    s = step(window, net)
    if s.decision == "promoted":
        assert s.net is not None and s.tv is not None and s.tv <= RADIUS
        assert true_value(s.net) > true_value(SERVING) - 0.02


def test_alpha_is_chosen_from_the_contexts_alone_and_judged_on_every_decision(window) -> None:
    seen: list[tuple[int, float]] = []  # (decisions judged, α) of each judgement

    def recording(log: LoggedDecisions, net: PolicyNetwork, serving: PolicyNetwork, *, level: float):  # type: ignore[no-untyped-def]
        assert level == STEP_LEVEL
        seen.append((len(log), round(float((net.out.bias[4] - serving.out.bias[4]).detach()) / 3.0, 6)))
        return "insufficient", "test", {}

    candidate = net_with(2.0, 4.0, -1.0)  # B's bias moves by 3α
    first = step(window, candidate, recording)
    # The same contexts with other utilities: the same step is chosen (no utility is read).
    shuffled = dataclasses.replace(window, utility=np.random.default_rng(5).permutation(window.utility) * 10)
    second = step(shuffled, candidate, recording)
    assert first.alpha == second.alpha and first.tv == second.tv
    assert seen == [(2000, first.alpha), (2000, first.alpha)]  # one judgement each, on the whole log
    assert first.decision == "insufficient" and first.net is None and first.alpha is not None
    # It is the largest step within the region: the next larger one is outside.
    larger = interpolate(SERVING, candidate, min(1.0, 2 * first.alpha))
    assert served_tv(window, Served(larger, PARAMS), Served(SERVING, PARAMS)).mean() > RADIUS


def test_no_step_is_judged_on_an_empty_window(window) -> None:
    s = step(window.subset(np.zeros(len(window), bool)), net_with(2.0, 4.0, -1.0))
    assert s.decision == "insufficient" and s.alpha is None and s.reason == "no logged decisions to judge a step on"


def test_no_step_when_even_the_smallest_leaves_the_region(window) -> None:
    s = step(window, net_with(2.0, 4.0, -1.0), radius=1e-9)
    assert s.decision == "insufficient" and s.net is None and s.alpha is None
    assert "no step of α ≥ 0.03125 serves within TV 1e-09" in s.reason


@pytest.mark.slow
@pytest.mark.parametrize("radius", [RADIUS, 0.02])
def test_rates_over_windows_keep_the_promise(radius: float) -> None:
    """The figures in docs/learning.md ("Conservative steps"): twelve fresh windows per candidate.

    Run with ``pytest -m slow -s tests/unit/learner/test_conservative_steps.py -k rates``.
    """
    base = true_value(SERVING, 8000)
    candidates = {"better": (2.0, 4.0, -1.0), "worse": (2.0, -8.0, 3.0), "worse2": (2.0, 1.0, 8.0)}
    candidates["worse3"] = (-2.0, -1.0, 3.5)
    promoted: dict[str, list[float]] = {}
    for name, biases in candidates.items():
        net, gains = net_with(*biases), []
        for seed in range(10, 22):
            log = served_log(SERVING, 2000, seed=seed)
            assert GATE(log, net, SERVING)[0] != "promoted"  # the plain gate decides none of them
            s = step(log, net, radius=radius)
            if s.net is not None:
                gains.append(true_value(s.net, 8000) - base)
        promoted[name] = gains
        where = f"TV ≤ {radius:g}, {name} {biases}"
        print(f"{where}: steps promoted in {len(gains)} of 12 windows, true gains {np.round(gains, 4)}")
    if radius <= 0.02:  # at this log's noise (σ = 1 a decision) the default radius is too coarse
        assert promoted["better"] and all(g > 0 for g in promoted["better"])
    assert all(g > -0.02 for gains in promoted.values() for g in gains)  # never worse than serving by ε


def _judging(verdicts: dict[float, tuple[str, float]], seen: list[tuple[float, float]]):  # type: ignore[no-untyped-def]
    """A judgement that answers by the step's α (B's bias moves by 3α): (decision, gain estimate)."""

    def judge(log: LoggedDecisions, net: PolicyNetwork, serving: PolicyNetwork, *, level: float):  # type: ignore[no-untyped-def]
        alpha = round(float((net.out.bias[4] - serving.out.bias[4]).detach()) / 3.0, 6)
        seen.append((alpha, level))
        decision, value = verdicts.get(alpha, ("insufficient", 0.0))
        return (
            decision,
            decision,
            {"gain": Estimate(value, value - 0.05, value + 0.05, 500.0, len(log), "dr-gain", 0.0)},
        )

    return judge


def test_where_the_largest_step_is_undecided_the_smallest_is_judged_too(window) -> None:
    seen: list[tuple[float, float]] = []
    s = step(window, net_with(2.0, 4.0, -1.0), _judging({STEP_GRID[-1]: ("promoted", 0.001)}, seen))
    assert s.decision == "promoted" and s.alpha == STEP_GRID[-1] and s.net is not None
    first = seen[0][0]
    assert first > STEP_GRID[-1] and seen == [(first, STEP_LEVEL), (STEP_GRID[-1], STEP_LEVEL)]
    assert f"step α={first:g}" in s.reason and f"step α={STEP_GRID[-1]:g}" in s.reason
    # Both at half the gate's error rate: together no more than one judgement at the gate's level.
    assert pytest.approx(1.0 - DEFAULT_LEVEL) == STEP_TRIES * (1.0 - STEP_LEVEL)


@pytest.mark.parametrize("first", [("insufficient", -0.004), ("refused", 0.0)])
def test_no_second_step_toward_a_candidate_the_log_shows_worse(window, first: tuple[str, float]) -> None:
    seen: list[tuple[float, float]] = []
    candidate = net_with(2.0, 4.0, -1.0)
    probe: list[tuple[float, float]] = []
    step(window, candidate, _judging({}, probe))
    alpha = probe[0][0]  # the largest step within the region
    s = step(window, candidate, _judging({alpha: first, STEP_GRID[-1]: ("promoted", 0.001)}, seen))
    assert s.decision == "insufficient" and s.net is None and len(seen) == 1
