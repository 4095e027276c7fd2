"""The promotion gate judges policies as clients serve them, not at the logged T."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.offpolicy.logged import LoggedDecisions
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from models.serving.rule import (
    adjusted_logits,
    first_draw_probs,
    keep_dynamic,
    plackett_luce_logprob,
    sample_plackett_luce,
)
from pipeline.learner.promotion_gate import judge
from pipeline.learner.publishing import FRESH_TEMPERATURE

D, S, K = 4, 12, 2
HELPFUL, HARMFUL, IRRELEVANT = range(0, 4), range(4, 8), range(8, 12)
VALUE = {**{s: 1.0 for s in HELPFUL}, **{s: -1.0 for s in HARMFUL}, **{s: 0.0 for s in IRRELEVANT}}


def net_with(helpful: float, harmful: float, irrelevant: float) -> PolicyNetwork:
    """A policy whose mask is softplus(bias of the slot's group), whatever the query."""
    net = PolicyNetwork(D, S, hidden=4, alpha=1.0)
    bias = [helpful] * 4 + [harmful] * 4 + [irrelevant] * 4
    with torch.no_grad():
        net.out.weight.zero_()
        net.out.bias.copy_(torch.tensor(bias))
    return net.eval()


def served_log(net: PolicyNetwork, n: int, temperature: float, seed: int = 0) -> LoggedDecisions:
    """Retrievals of 2 out of 6 candidates (2 of each group), logged as CausalRetriever logs them."""
    rng = np.random.default_rng(seed)
    cands, scores, sel, lps, probs, utils = [], [], [], [], [], []
    alpha = float(net.alpha.detach()[0])
    for _ in range(n):
        c = np.concatenate([rng.choice(list(g), 2, replace=False) for g in (HELPFUL, HARMFUL, IRRELEVANT)])
        sc = np.where(np.isin(c, list(HARMFUL)), rng.uniform(0.5, 0.7, 6), rng.uniform(0.4, 0.6, 6))
        with torch.no_grad():
            m = net.candidate_masks(torch.zeros(1, net.arch.hidden), torch.from_numpy(c[None]))[0].double().numpy()
        keep = keep_dynamic(m)
        z = adjusted_logits(sc[keep], m[keep], alpha, temperature)
        pos = sample_plackett_luce(z, K, rng)
        chosen = [int(c[keep][p]) for p in pos]
        cands.append(c[keep].tolist())
        scores.append(sc[keep])
        sel.append(chosen)
        lps.append(plackett_luce_logprob(z, pos))
        probs.append(first_draw_probs(z))
        utils.append(float(np.mean([VALUE[s] for s in chosen]) + 0.1 * rng.normal()))
    return LoggedDecisions.from_lists(
        cands, scores, sel, [temperature] * n, lps, utils, embedding=np.zeros((n, D)), first_probs=probs
    )


SERVING = net_with(helpful=2.0, harmful=1.0, irrelevant=0.0)  # served greedily it reads the helpful pair
# Drops the harmful memories (which helps a client drawing at T = 1) but ranks irrelevant
# look-alikes above the helpful ones, so that served at T = 0.05 it reads nothing useful.
GREEDY_TRAP = net_with(helpful=-1.0, harmful=-8.0, irrelevant=4.0)


@pytest.fixture(scope="module")
def exploratory_log() -> LoggedDecisions:
    return served_log(SERVING, 1500, temperature=1.0)  # the client explored at T = 1.0 and logged it


def test_a_candidate_that_lowers_the_served_value_is_refused_on_an_exploratory_log(exploratory_log) -> None:
    decision, reason, est = judge(exploratory_log, GREEDY_TRAP, SERVING, epsilon=0.02, min_ess=50)
    assert decision == "refused", reason
    # As served (T = 0.05, 10% at 0.25) the trap reads the irrelevant pair; serving reads helpful ones.
    assert est["gain"].high < -0.2
    # Judged at the logged T = 1.0 it would look better than serving: the failure.
    at_logged_t = ServingParams(temperature=1.0, explore_rate=0.0)
    _, _, logged_t = judge(exploratory_log, GREEDY_TRAP, SERVING, epsilon=0.02, min_ess=50, params=at_logged_t)
    assert logged_t["gain"].low > 0


def test_a_clearly_better_candidate_is_promoted_with_enough_data() -> None:
    serving = net_with(helpful=0.0, harmful=2.0, irrelevant=0.0)  # prefers the harmful look-alikes
    better = net_with(helpful=2.0, harmful=-8.0, irrelevant=0.0)
    log = served_log(serving, 1500, temperature=1.0, seed=1)
    decision, reason, est = judge(log, better, serving, epsilon=0.02, min_ess=50)
    assert decision == "promoted", reason
    assert est["gain"].low > 1.0 and est["candidate"].value > est["similarity"].value
    # every estimate stays within what a top-2 can reach: at most +1 here
    assert est["candidate"].high <= 1.0 + 0.5


def test_too_little_data_says_what_is_missing() -> None:
    serving = net_with(helpful=0.0, harmful=2.0, irrelevant=0.0)
    log = served_log(serving, 30, temperature=1.0, seed=2)
    decision, reason, est = judge(log, net_with(2.0, -8.0, 0.0), serving, epsilon=0.02, min_ess=200)
    assert decision == "insufficient"
    assert reason.startswith(f"ESS {est['gain'].ess:.0f} < 200 needed")
    # enough ESS but an interval that straddles −ε: how many times the data it needs
    log = served_log(SERVING, 80, temperature=1.0, seed=3)
    decision, reason, _ = judge(log, net_with(2.0, 1.02, 0.0), SERVING, epsilon=0.02, min_ess=10)
    assert decision == "insufficient" and "straddles −ε" in reason and "the decisions needed" in reason


def test_events_without_candidate_probs_fall_back_to_standard_ips(exploratory_log) -> None:
    bare = LoggedDecisions(**{**exploratory_log.__dict__, "first_probs": None})
    decision, reason, _ = judge(bare, GREEDY_TRAP, SERVING, epsilon=0.02, min_ess=1)
    assert "lack candidate_probs" in reason and decision in ("refused", "insufficient")


def tied_log(net: PolicyNetwork, n: int, temperature: float, seed: int = 0) -> LoggedDecisions:
    """Like :func:`served_log`, with near-tied similarity scores (as real embeddings give): the
    helpful pair is the most similar by a hair, so plain top-k reads it and a draw at T = 0.05
    reads almost anything."""
    rng = np.random.default_rng(seed)
    cands, scores, sel, lps, probs, utils = [], [], [], [], [], []
    alpha = float(net.alpha.detach()[0])
    for _ in range(n):
        c = np.concatenate([rng.choice(list(g), 2, replace=False) for g in (HELPFUL, HARMFUL, IRRELEVANT)])
        sc = np.array([0.53, 0.52, 0.51, 0.505, 0.50, 0.495])
        with torch.no_grad():
            m = net.candidate_masks(torch.zeros(1, net.arch.hidden), torch.from_numpy(c[None]))[0].double().numpy()
        z = adjusted_logits(sc, m, alpha, temperature)
        pos = sample_plackett_luce(z, K, rng)
        chosen = [int(c[p]) for p in pos]
        cands.append(c.tolist())
        scores.append(sc)
        sel.append(chosen)
        lps.append(plackett_luce_logprob(z, pos))
        probs.append(first_draw_probs(z))
        utils.append(float(np.mean([VALUE[s] for s in chosen]) + 0.1 * rng.normal()))
    return LoggedDecisions.from_lists(
        cands, scores, sel, [temperature] * n, lps, utils, embedding=np.zeros((n, D)), first_probs=probs
    )


def test_similarity_only_is_plain_top_k_not_a_draw_at_the_serving_temperature() -> None:
    # The real-LM bench's failure: the gate compared candidates with similarity drawn at
    # T = 0.05, which on near-tied scores is far below plain top-k (what similarity-only
    # serves), and promoted candidates better than that draw but below top-k.
    neutral = net_with(helpful=0.0, harmful=0.0, irrelevant=0.0)  # the same mask everywhere: +0.18 as served
    halfway = net_with(helpful=0.2, harmful=0.0, irrelevant=0.0)  # leans to the helpful pair: +0.50 as served
    log = tied_log(neutral, 2000, temperature=1.0, seed=4)
    decision, reason, est = judge(log, halfway, neutral, epsilon=0.02, min_ess=50)
    assert est["similarity"].low <= 1.0 <= est["similarity"].high  # top-2 reads the helpful pair: +1
    assert est["gain"].low > 0.1  # better than the neutral policy as served ...
    assert est["gain_similarity"].high < -0.1  # ... and worse than similarity-only
    assert decision == "refused", reason


def test_the_serving_policy_is_judged_as_its_own_manifest_serves_it() -> None:
    # A fresh first policy is published to be served as plain top-k (pipeline/learner/publishing.py,
    # first_serving); the gate judges it so, not at the candidates' serving temperature.
    neutral = net_with(helpful=0.0, harmful=0.0, irrelevant=0.0)
    log = tied_log(neutral, 2000, temperature=1.0, seed=5)
    greedy = ServingParams(temperature=FRESH_TEMPERATURE)
    _, _, est = judge(log, neutral, neutral, epsilon=0.02, min_ess=50, serving_params=greedy)
    _, _, at_t = judge(log, neutral, neutral, epsilon=0.02, min_ess=50)
    assert at_t["serving"].high < 0.5 < est["serving"].low  # at T = 0.05 ≈ +0.18; top-k ≈ +0.9
    assert est["gain"].high < -0.2  # the same network drawn at T = 0.05 is worse than it served as top-k
