"""Conservative steps: where the gate cannot decide the learner's candidate, a smaller step
toward it, selected on one half of the window and certified on the other."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from models.offpolicy.estimators import Estimate
from models.offpolicy.logged import LoggedDecisions
from models.offpolicy.trust_region import interpolate
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from models.serving.rule import (
    adjusted_logits,
    first_draw_probs,
    keep_dynamic,
    plackett_luce_logprob,
    sample_plackett_luce,
)
from pipeline.learner.conservative import conservative_step, split_by_id, split_random
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


def halves(log: LoggedDecisions, seed: int = 0) -> tuple[LoggedDecisions, LoggedDecisions]:
    pick = split_random(len(log), seed)
    return log.subset(pick), log.subset(~pick)


def test_a_small_step_the_log_can_certify_gets_through_where_the_whole_step_waits(window) -> None:
    candidate = net_with(2.0, 4.0, -1.0)  # truly better, but it serves B, which the log rarely shows
    decision, reason, _ = GATE(window, candidate, SERVING)
    assert decision == "insufficient" and reason.startswith("ESS"), reason  # the plain gate: serving freezes
    step = conservative_step(*halves(window), candidate, SERVING, GATE, params=PARAMS)
    assert step.decision == "promoted", step.reason
    assert step.alpha is not None and step.alpha < 1.0 and step.net is not None
    assert step.estimates["gain"].low > -0.02 and step.estimates["gain"].value > 0
    # The step served is truly better than serving, and is the interpolation it says it is.
    assert true_value(step.net) > true_value(SERVING)
    expected = interpolate(SERVING, candidate, step.alpha).tensors()
    assert all(torch.equal(t, expected[name]) for name, t in step.net.tensors().items())
    assert "certified on 1000 decisions the selection never saw" in step.reason


def test_an_unproven_large_step_that_is_truly_worse_is_promoted_at_no_step_size(window) -> None:
    worse = net_with(2.0, -8.0, 3.0)  # drops B, the best memories, and reads C, the worst, more
    assert true_value(worse) < true_value(SERVING) - 1.0
    decision, _, _ = GATE(window, worse, SERVING)
    assert decision != "promoted"
    grid = (0.5, 0.25, 0.125, 1 / 16, 1 / 32)
    step = conservative_step(*halves(window), worse, SERVING, GATE, params=PARAMS, grid=grid)
    assert step.decision == "insufficient" and step.net is None
    assert [s.alpha for s in step.steps] == list(grid)  # every step size was looked at
    assert not any(s.decision == "promoted" and s.gain is not None and s.gain.value > 0 for s in step.steps)


@pytest.mark.parametrize("worse", [(2.0, 1.0, 8.0), (-2.0, -1.0, 3.5)])
def test_a_step_toward_a_worse_policy_that_the_log_cannot_tell_from_serving_keeps_the_promise(
    window, worse: tuple[float, float, float]
) -> None:
    # Far steps toward these are much worse than serving; steps of 1/8 or less are within
    # noise of it. Whatever is promoted is never worse than serving by more than ε.
    net = net_with(*worse)
    assert true_value(net) < true_value(SERVING) - 1.0
    step = conservative_step(*halves(window), net, SERVING, GATE, params=PARAMS)
    if step.decision == "promoted":
        assert step.net is not None and step.alpha is not None and step.alpha <= 0.125
        assert true_value(step.net) > true_value(SERVING) - 0.02


def _estimate(value: float, half: float) -> Estimate:
    return Estimate(value, value - half, value + half, 500.0, 1000, "dr-gain", 0.0)


def test_alpha_is_selected_on_one_half_and_certified_on_the_other(window) -> None:
    first, second = halves(window)
    seen: list[tuple[str, float]] = []  # (which half, α) of each judgement

    def recording(log: LoggedDecisions, net: PolicyNetwork, serving: PolicyNetwork):  # type: ignore[no-untyped-def]
        step = float((net.out.bias[4] - serving.out.bias[4]).detach()) / 3.0  # B's bias moves by 3α
        seen.append(("first" if log is first else "second", round(step, 6)))
        # The selection half shows a gain at every α; the other half shows a loss.
        g = _estimate(0.01, 0.005) if log is first else _estimate(-0.01, 0.005)
        return ("promoted" if g.value > 0 else "insufficient"), "test", {"gain": g}

    candidate = net_with(2.0, 4.0, -1.0)
    step = conservative_step(first, second, candidate, SERVING, recording, params=PARAMS, max_tv=1.0)
    # Selection stopped at the largest α the first half favours; the certificate judged that
    # one α, on the second half only, and its verdict decides.
    assert seen == [("first", 0.5), ("second", 0.5)]
    assert step.decision == "insufficient" and step.net is None and step.alpha == 0.5
    assert "not certified on the other half" in step.reason
    assert step.selected_on == len(first) and step.certified_on == len(second)


def test_the_halves_are_disjoint_and_stable_across_sliding_windows() -> None:
    ids = [f"event-{i}" for i in range(1000)]
    pick = split_by_id(ids)
    assert 400 < pick.sum() < 600
    # A window that slid by 100 events keeps every shared event on the same side.
    assert (split_by_id(ids[100:]) == pick[100:]).all()
    r = split_random(11, seed=3)
    assert r.sum() == 5 and (~r).sum() == 6


@pytest.mark.slow
def test_rates_over_windows_keep_the_promise() -> None:
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
            step = conservative_step(*halves(log, seed), net, SERVING, GATE, params=PARAMS)
            if step.net is not None:
                gains.append(true_value(step.net, 8000) - base)
        promoted[name] = gains
        print(f"{name} {biases}: steps promoted in {len(gains)} of 12 windows, true gains {np.round(gains, 4)}")
    assert promoted["better"] and all(g > 0 for g in promoted["better"])
    assert all(g > -0.02 for gains in promoted.values() for g in gains)  # never worse than serving by ε
