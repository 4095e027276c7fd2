"""The promotion rule's evidence (pipeline/learner/evidence.py): set probabilities as served, and
doubly robust gain terms whose direct model is a table of what each query read."""

from __future__ import annotations

import dataclasses

import numpy as np

from models.policy.network import PolicyNetwork, init_policy
from models.serving.params import ServingParams
from models.serving.rule import adjusted_logits, first_draw_probs, plackett_luce_logprob, sample_plackett_luce
from pipeline.learner import evidence
from pipeline.learner.promotion import SIMILARITY
from tests.integration.test_gate import GOOD, D, H, S, _masks, log_of, tilted
from topics.events import Features, RetrievalEvent
from topics.internal import Experience


def recurring(net: PolicyNetwork, n: int, seed: int, questions: int = 5) -> list[Experience]:
    """Decisions logged by ``net`` (T = 0.5) over a few recurring questions, each with its own
    candidates: the utility is a function of the question and the set read, as an LM's is."""
    fixed = np.random.default_rng(99)
    asked = [
        (fixed.normal(size=D).astype(np.float32), [int(c) for c in fixed.choice(16, size=8, replace=False)])
        for _ in range(questions)
    ]
    scores = fixed.uniform(0.3, 0.9, size=(questions, 8))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        q = i % questions
        emb, cands = asked[q]
        m = _masks(net, emb, cands)
        z = adjusted_logits(scores[q], m, float(net.alpha.detach()[0]), 0.5)
        pos = sample_plackett_luce(z, 2, rng)
        sel = [cands[p] for p in pos]
        u = sum(1.0 if s in GOOD else -1.0 for s in sel) / 2 + 0.3 * q
        ev = RetrievalEvent(
            f"r{seed}-{i}",
            f"rq{seed}-{i}",
            0,
            1_800_000_000.0 + i,
            Features(emb, 0.0, 0.0),
            cands,
            scores[q],
            sel,
            0.5,
            plackett_luce_logprob(z, pos),
            False,
            candidate_probs=first_draw_probs(z),
        )
        out.append(Experience(ev.event_id, "feedback", ev, float(u)))
    return out


def test_the_table_makes_the_gain_terms_tight_and_leaves_their_mean() -> None:
    serving = init_policy(D, S, H, seed=1)
    params = ServingParams(explore_rate=0.0, temperature=0.5)  # as log_of draws
    versions = {1: (serving, params), 2: (tilted(serving, GOOD), params)}
    train, held = log_of(serving, 600, seed=1), log_of(serving, 800, seed=2)
    plain = evidence.build(evidence.usable(held), versions, params)
    table = evidence.RewardTable()
    table.add(train)
    doubly = evidence.build(evidence.usable(held), versions, params, table)
    ipw, dr = plain.gains(2, 1)[0], doubly.gains(2, 1)[0]
    # Both estimate the same gain (these decisions' queries never recur: the table knows only the mean).
    assert abs(ipw.mean() - dr.mean()) < 3 * dr.std() / np.sqrt(len(dr))
    assert dr.mean() > 0  # the tilted policy reads the good slots
    assert set(doubly.probs) == {1, 2, SIMILARITY} and (doubly.logging > 0).all()


def test_on_recurring_questions_the_table_predicts_the_utility() -> None:
    serving = init_policy(D, S, H, seed=1)
    params = ServingParams(explore_rate=0.0, temperature=0.5)
    versions = {1: (serving, params), 2: (tilted(serving, GOOD), params)}
    table = evidence.RewardTable()
    table.add(recurring(serving, 600, seed=1))
    held = evidence.usable(recurring(serving, 600, seed=2))
    plain = evidence.build(held, versions, params)
    doubly = evidence.build(held, versions, params, table)
    ipw, dr = plain.gains(2, 1)[0], doubly.gains(2, 1)[0]
    assert dr.std() < 0.5 * ipw.std()  # most of each utility is predicted
    assert abs(ipw.mean() - dr.mean()) < 3 * ipw.std() / np.sqrt(len(ipw))
    assert doubly.fitted is not None and np.abs(doubly.fitted - doubly.utility).mean() < 0.2


def test_unusable_events_are_left_out() -> None:
    exps = log_of(init_policy(D, S, H, seed=1), 4, seed=3)
    no_probs = dataclasses.replace(exps[0], event=dataclasses.replace(exps[0].event, candidate_probs=None))
    fallback = dataclasses.replace(exps[1], event=dataclasses.replace(exps[1].event, fallback=True))
    coupled = dataclasses.replace(exps[2], event=dataclasses.replace(exps[2].event, canary_arm="canary"))
    label = Experience("l", "label", exps[3].event, 0.0, correct_memories=[1])
    assert evidence.usable([no_probs, fallback, coupled, label, exps[3]]) == [exps[3]]


def test_what_the_log_cannot_show_is_valued_pessimistically_for_each_bound() -> None:
    serving = init_policy(D, S, H, seed=1)
    params = ServingParams(explore_rate=0.0, temperature=0.5)
    # A version whose hard drop keeps fewer candidates than a decision reads: it reads smaller sets.
    narrow = tilted(serving, {next(iter(GOOD))}, amount=12.0)
    versions = {1: (serving, params), 2: (narrow, params)}
    table = evidence.RewardTable()
    train = log_of(serving, 200, seed=1)
    table.add(train)
    ev = evidence.build(evidence.usable(log_of(serving, 300, seed=2)), versions, params, table)
    assert ev.unsupported[2].mean() > 0.2 and not ev.unsupported[1].any()
    low, high = ev.gains(2, 1)
    where = ev.unsupported[2]
    assert (low[where] < high[where]).all() and np.allclose(low[~where], high[~where])
    # The range is what the table saw before this batch (predictable), not the batch's own.
    assert (ev.worst, ev.best) == (min(e.utility for e in train), max(e.utility for e in train))
