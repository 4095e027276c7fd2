"""The promotion rule's evidence (pipeline/learner/evidence.py): set probabilities as served, and
doubly robust gain terms whose direct model is a table of what each query read."""

from __future__ import annotations

import dataclasses

import numpy as np

from models.policy.network import PolicyNetwork, init_policy
from models.serving.params import ServingParams
from pipeline.learner import evidence
from pipeline.learner.promotion import SIMILARITY
from tests.integration.test_gate import GOOD, D, H, S, log_of, tilted
from topics.internal import Experience


def recurring(net: PolicyNetwork, n: int, seed: int) -> list[Experience]:
    """Decisions logged by ``net`` (T = 0.5) over a few recurring questions, the utility a
    function of the question and the set read, as an LM's is."""
    return log_of(net, n, seed, questions=5, noise=0.0)


def test_the_bounds_hold_the_gain_and_the_clip_only_widens_them() -> None:
    serving = init_policy(D, S, H, seed=1)
    params = ServingParams(explore_rate=0.0, temperature=0.5, drop="dynamic")  # as log_of draws
    versions = {1: (serving, params), 2: (tilted(serving, GOOD), params)}
    train, held = log_of(serving, 600, seed=1), log_of(serving, 800, seed=2)
    plain = evidence.build(evidence.usable(held), versions, params)
    table = evidence.RewardTable()
    table.add(train)
    ipw = plain.gains(2, 1)[0]
    assert ipw.mean() > 0  # the tilted policy reads the good slots
    se = 3 * ipw.std() / np.sqrt(len(ipw))
    widths = []
    for clip in (evidence.CLIP, 2.0):
        ev = evidence.build(evidence.usable(held), versions, params, table, clip=clip)
        low, high = ev.gains(2, 1)
        assert (low <= high + 1e-12).all() and low.mean() - se < ipw.mean() < high.mean() + se
        widths.append(float((high - low).mean()))
        # The serving version drew these decisions: its weights are 1, nothing is left to the extremes.
        v_low, v_high = ev.bounds(1)
        assert np.allclose(v_low, v_high)
    assert widths[0] < widths[1]  # clipping harder leaves more of the version's reads to the extremes
    assert set(ev.probs) == {1, 2, SIMILARITY} and (ev.logging > 0).all()


def test_on_recurring_questions_the_table_narrows_the_terms() -> None:
    serving = init_policy(D, S, H, seed=1)
    params = ServingParams(explore_rate=0.0, temperature=0.5, drop="dynamic")  # as log_of draws
    versions = {1: (serving, params), 2: (tilted(serving, GOOD, amount=1.0), params)}
    table = evidence.RewardTable()
    table.add(recurring(serving, 600, seed=1))
    held = evidence.usable(recurring(serving, 600, seed=2))
    plain = evidence.build(held, versions, params, evidence.RewardTable())  # a table that knows nothing
    bounded = evidence.build(held, versions, params, table)
    blind, low = plain.gains(2, 1)[0], bounded.gains(2, 1)[0]
    assert low.std() < 0.5 * blind.std()  # most of each utility is known
    assert bounded.fitted is not None and np.isclose(bounded.fitted, bounded.utility).mean() > 0.9


def test_unusable_events_are_left_out() -> None:
    exps = log_of(init_policy(D, S, H, seed=1), 4, seed=3)
    no_probs = dataclasses.replace(exps[0], event=dataclasses.replace(exps[0].event, candidate_probs=None))
    fallback = dataclasses.replace(exps[1], event=dataclasses.replace(exps[1].event, fallback=True))
    coupled = dataclasses.replace(exps[2], event=dataclasses.replace(exps[2].event, canary_arm="canary"))
    label = Experience("l", "label", exps[3].event, 0.0, correct_memories=[1])
    infinite = dataclasses.replace(exps[3], utility=float("inf"))  # the trainer skips it; so does the rule
    assert evidence.usable([no_probs, fallback, coupled, label, infinite, exps[3]]) == [exps[3]]


def test_what_the_log_cannot_show_is_valued_pessimistically_for_each_bound() -> None:
    serving = init_policy(D, S, H, seed=1)
    params = ServingParams(explore_rate=0.0, temperature=0.5, drop="dynamic")  # as log_of draws
    # A version whose hard drop keeps fewer candidates than a decision reads: it reads smaller sets.
    narrow = tilted(serving, {next(iter(GOOD))}, amount=12.0)
    versions = {1: (serving, params), 2: (narrow, params)}
    table = evidence.RewardTable()
    train = recurring(serving, 600, seed=1)
    table.add(train)
    ev = evidence.build(evidence.usable(recurring(serving, 300, seed=2)), versions, params, table)
    low, high = ev.gains(2, 1)
    fewer = ev.probs[2] == 0.0
    assert fewer.mean() > 0.2
    assert (high[fewer] - low[fewer] >= ev_range(table, train) - 1e-9).all()
    assert np.allclose(*ev.bounds(1))  # the serving version's own reads: nothing unknown


def ev_range(table: evidence.RewardTable, train: list[Experience]) -> float:
    """best − worst: the range is what the table saw before this batch (predictable), not the batch's own."""
    worst, best = table.range(np.zeros(0))
    assert (worst, best) == (min(e.utility for e in train), max(e.utility for e in train))
    return best - worst


def test_the_logging_probability_is_the_manifests_mixture_where_nothing_is_dropped() -> None:
    serving = init_policy(D, S, H, seed=1)
    held = [  # drawn by version 1 at T = 0.5
        dataclasses.replace(e, event=dataclasses.replace(e.event, policy_version=1))
        for e in evidence.usable(recurring(serving, 50, seed=3))
    ]
    mixture = ServingParams(temperature=0.05, explore_rate=0.1, explore_temperature=0.5, drop="none")
    own = evidence.build(held, {1: (serving, dataclasses.replace(mixture, drop="dynamic"))}, mixture)
    mixed = evidence.build(held, {1: (serving, mixture)}, mixture)
    # At T = 0.05 the draw's own probability of a set is nearly 0 or 1; the mixture keeps a
    # tenth of the explored draw's, so no weight exceeds 1 / 0.1.
    assert (mixed.logging >= 0.1 * own.logging - 1e-12).all()
    assert mixed.weights(1).max() <= 10.0 + 1e-9 and not np.allclose(mixed.logging, own.logging)


def test_a_clients_mix_of_serving_and_canary_is_the_logging_probability() -> None:
    serving = init_policy(D, S, H, seed=1)
    canary = tilted(serving, GOOD, amount=1.0)
    params = ServingParams(explore_rate=0.0, temperature=0.5, drop="none")
    versions = {1: (serving, params), 2: (canary, params)}
    held = [  # serving requests of a client that serves the canary on a fifth (contract 1.9)
        dataclasses.replace(
            e, event=dataclasses.replace(e.event, policy_version=1, canary_rate=0.2, alternative_version=2)
        )
        for e in evidence.usable(recurring(serving, 80, seed=4))
    ]
    ev = evidence.build(held, versions, params)
    assert np.allclose(ev.logging, 0.8 * ev.probs[1] + 0.2 * ev.probs[2])
    assert ev.weights(2).max() <= 1 / 0.2 + 1e-9 and ev.weights(1).max() <= 1 / 0.8 + 1e-9
    # Where the learner does not hold the other version, the draw's own probability.
    alone = evidence.build(held, {1: (serving, params)}, params)
    assert np.allclose(alone.logging, alone.probs[1])


def as_incumbent(e: Experience, version: int, temperature: float) -> Experience:
    """``e`` as a 1.17 client logs a request under an incumbent: its candidates in the index's order
    (by score), the first k read, no draw (logprob 0) at the manifest's temperature."""
    ev = e.event
    order = np.argsort(-np.asarray(ev.scores), kind="stable")
    candidates = [ev.candidates[i] for i in order]
    k = len(ev.selected)
    event = dataclasses.replace(
        ev,
        candidates=candidates,
        scores=np.asarray(ev.scores)[order],
        selected=candidates[:k],
        logprob=0.0,
        temperature=temperature,
        candidate_probs=None,
        candidate_masks=None,
        policy_version=version,
        incumbent=True,
    )
    return dataclasses.replace(e, event=event)


def test_an_incumbents_own_ranking_is_valued_as_its_manifests_mixture() -> None:
    """Contract 1.17: under an incumbent the client serves plain top-k on the share not explored;
    the logging probability of each such set is that share plus the explored draw's, and the
    version as served is that same mixture, so its weights are 1."""
    serving = init_policy(D, S, H, seed=1)
    params = ServingParams(temperature=0.001, explore_rate=0.1, explore_temperature=0.5, drop="none", incumbent=True)
    exps = [as_incumbent(e, 1, params.temperature) for e in recurring(serving, 60, seed=5)]
    assert evidence.usable(exps) == []  # no version to value them as: no draw's own probability either
    held = evidence.usable(exps, {1: (serving, params)})
    assert held == exps
    ev = evidence.build(held, {1: (serving, params)}, params)
    assert (ev.logging >= 0.9 - 1e-9).all() and (ev.logging <= 1.0 + 1e-9).all()
    assert np.allclose(ev.weights(1), 1.0)
    assert np.allclose(ev.probs[SIMILARITY], 1.0)  # the sets read are plain top-k
    # A client before 1.17 drew near-greedily at the manifest's temperature instead: not that
    # mixture (its draw's own probability), and an incumbent request of a version not served as
    # one is no evidence.
    old_client = [dataclasses.replace(e, event=dataclasses.replace(e.event, incumbent=None)) for e in exps]
    assert evidence.drawn_from(old_client, {1: (serving, params)}) == {}
    assert evidence.usable(exps, {1: (serving, dataclasses.replace(params, incumbent=False))}) == []
