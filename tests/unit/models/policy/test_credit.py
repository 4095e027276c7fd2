"""Per-memory credit (docs/learning.md, "Per-memory credit"): the per-position Plackett–Luce
terms, the credit loss, the per-slot baseline and its persistence, and the trainer plumbing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from models.policy.baseline import MAX_SLOTS_PER_QUERY, QueryMeans, SlotBaseline, make_baseline, query_key
from models.policy.batch import make_batch
from models.policy.reinforce import credit_loss, impute_effects, reinforce_loss
from models.policy.trainer import PolicyTrainer
from models.serving.rule import plackett_luce_logprob, plackett_luce_terms_torch
from tests.unit.models.policy.test_trainer import event, fb, params, trainer
from topics.internal import Experience

ALL3 = torch.ones(1, 3, dtype=torch.bool)


class StepRewardBetween(PolicyTrainer):
    """Imputation off (as the lab's ablation rows run it): the step reward where no effect was measured."""

    def imputes(self) -> bool:
        return False


def plain() -> PolicyTrainer:
    return StepRewardBetween(trainer().config)


def _row_loss(
    z: torch.Tensor, order: list[int], effects: list[float], has: list[bool], base: list[float]
) -> torch.Tensor:
    sel = torch.tensor([order])
    terms, dists = plackett_luce_terms_torch(z, ALL3, sel, torch.ones(1, len(order), dtype=torch.bool))
    return credit_loss(
        terms,
        dists,
        sel,
        torch.tensor([0.3], dtype=z.dtype),
        torch.tensor([effects], dtype=z.dtype),
        torch.tensor([has]),
        torch.tensor([base], dtype=z.dtype),
        torch.ones(1, dtype=z.dtype),
    )


def test_terms_sum_to_the_numpy_logprob_and_dists_are_each_draws_softmax() -> None:
    zv = [0.4, -1.2, 2.0, 0.1]
    z = torch.tensor([zv], dtype=torch.float64)
    sel = torch.tensor([[2, 0, 3]])
    terms, dists = plackett_luce_terms_torch(
        z, torch.ones(1, 4, dtype=torch.bool), sel, torch.ones(1, 3, dtype=torch.bool)
    )
    assert float(terms.sum()) == pytest.approx(plackett_luce_logprob(np.array(zv), [2, 0, 3]), rel=1e-12)
    e = np.exp(zv)
    assert dists[0, 0].tolist() == pytest.approx((e / e.sum()).tolist(), rel=1e-12)
    rest = e * np.array([1, 1, 0, 1])
    assert dists[0, 1].tolist() == pytest.approx((rest / rest.sum()).tolist(), rel=1e-12)
    rest = e * np.array([0, 1, 0, 1])
    assert dists[0, 2].tolist() == pytest.approx((rest / rest.sum()).tolist(), rel=1e-12)
    assert float(dists[0, 2, 1] + dists[0, 2, 3]) == pytest.approx(1.0)


def test_without_effects_the_credit_loss_is_the_step_loss() -> None:
    z = torch.tensor([[0.4, -1.2, 2.0]], dtype=torch.float64, requires_grad=True)
    loss = _row_loss(z, [1, 2], [0.0, 0.0], [False, False], [5.0, -5.0, 1.0])
    loss.backward()
    g_credit = z.grad.clone()  # type: ignore[union-attr]
    z.grad = None
    terms, _ = plackett_luce_terms_torch(z, ALL3, torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool))
    ref = reinforce_loss(terms.sum(dim=1), torch.tensor([0.3], dtype=torch.float64), torch.ones(1, dtype=torch.float64))
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    assert g_credit[0].tolist() == pytest.approx(z.grad[0].tolist(), rel=1e-12)  # type: ignore[index]


def _expected_gradient(zv: list[float], effect: list[float], base: list[float]) -> np.ndarray:
    """E over every ordered pair drawn from PL(z) of the estimator's gradient, exactly."""
    total = np.zeros(3)
    for order in itertools.permutations(range(3), 2):
        p = float(np.exp(plackett_luce_logprob(np.array(zv), list(order))))
        z = torch.tensor([zv], dtype=torch.float64, requires_grad=True)
        _row_loss(z, list(order), [effect[i] for i in order], [True, True], base).backward()
        total += p * z.grad[0].numpy()  # type: ignore[index]
    return total


def test_the_per_slot_baseline_and_its_analytic_term_leave_the_expected_gradient_unchanged() -> None:
    """A baseline that depends on the drawn slot is only unbiased with the analytic term:
    exact enumeration over all ordered pairs, any b̂ gives the same expected gradient as b̂ = 0."""
    zv, effect = [0.3, -0.5, 1.1], [0.8, -1.0, 0.2]
    plain = _expected_gradient(zv, effect, [0.0, 0.0, 0.0])
    for base in ([0.7, -0.3, 0.2], [0.8, -1.0, 0.2], [-2.0, 3.0, 1.0]):
        assert _expected_gradient(zv, effect, base) == pytest.approx(plain, abs=1e-12)
    # and the expected step raises the best memory's first-draw logit (gradient descent: −grad)
    assert int(np.argmin(plain)) == 0


def test_single_draw_expected_gradient_is_the_gradient_of_the_expected_effect() -> None:
    zv, effect, base = [0.3, -0.5, 1.1], np.array([0.8, -1.0, 0.2]), [0.5, 0.5, -0.4]
    total = np.zeros(3)
    for i in range(3):
        p = float(np.exp(plackett_luce_logprob(np.array(zv), [i])))
        z = torch.tensor([zv], dtype=torch.float64, requires_grad=True)
        sel = torch.tensor([[i]])
        terms, dists = plackett_luce_terms_torch(z, ALL3, sel, torch.ones(1, 1, dtype=torch.bool))
        credit_loss(
            terms,
            dists,
            sel,
            torch.zeros(1, dtype=torch.float64),
            torch.tensor([[effect[i]]], dtype=torch.float64),
            torch.tensor([[True]]),
            torch.tensor([base], dtype=torch.float64),
            torch.ones(1, dtype=torch.float64),
        ).backward()
        total += p * z.grad[0].numpy()  # type: ignore[index]
    z = torch.tensor(zv, dtype=torch.float64, requires_grad=True)
    (-(torch.softmax(z, 0) * torch.from_numpy(effect)).sum()).backward()
    assert total == pytest.approx(z.grad.numpy(), abs=1e-12)  # type: ignore[union-attr]


def test_make_batch_carries_effects_by_position() -> None:
    e1 = Experience("a", "feedback", event(0, selected=[11, 3]), 0.5, slot_effects={3: -0.4, 11: 0.9, 99: 1.0})
    e2 = fb(1, 0.2)
    e3 = Experience("c", "feedback", event(2, selected=[7]), 0.1, slot_effects={7: float("nan")})
    b = make_batch([e1, e2, e3])
    assert b.has_effect.tolist() == [[True, True], [False, False], [False, False]]
    assert b.effect[0].tolist() == [0.9, -0.4]


def test_credit_moves_each_memory_by_its_own_effect() -> None:
    """One memory helps, the other hurts, and the step's utility is 0: the step reward
    learns nothing about them, per-memory credit separates them."""
    ev = event(0, candidates=[3, 7, 11, 20, 31], selected=[7, 3])
    credited = Experience("e0", "feedback", ev, 0.0, slot_effects={7: 1.0, 3: -1.0})
    t = trainer(baseline="none")
    m0 = t.net.candidate_masks(t.net.features(*_feats(ev)), torch.tensor([ev.candidates])).detach()[0]
    for _ in range(5):
        stats = t.update([credited])
    assert stats.credited == 2
    m1 = t.net.candidate_masks(t.net.features(*_feats(ev)), torch.tensor([ev.candidates])).detach()[0]
    assert float(m1[1] - m0[1]) > 0 > float(m1[0] - m0[0])  # slot 7 up, slot 3 down
    # The step reward: u = 0 with b = 0 is a zero advantage, so nothing moves.
    step = trainer(baseline="none")
    before = params(step)
    step.update([Experience("e0", "feedback", ev, 0.0)])
    assert all(torch.equal(before[k], v) for k, v in params(step).items())


def _feats(ev: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = ev.features  # type: ignore[attr-defined]
    return (
        torch.from_numpy(f.query_embedding[None]),
        torch.tensor([f.last_step_loss]),
        torch.tensor([f.last_step_entropy]),
    )


def test_slot_baselines_update_and_survive_the_baseline_state() -> None:
    t = trainer()
    t.update([Experience("e0", "feedback", event(0, selected=[7, 3]), 0.3, slot_effects={7: 1.0, 3: -0.5})])
    t.update([Experience("e1", "feedback", event(1, selected=[7]), 0.3, slot_effects={7: 0.0})])
    slots = t.baseline.slots
    assert (slots.get(7), slots.n(7), slots.get(3), slots.n(3)) == (0.5, 2, -0.5, 1)
    restored = make_baseline("moving", 0.01, t.baseline.state())
    assert (restored.slots.get(7), restored.slots.n(7), restored.slots.get(3)) == (0.5, 2, -0.5)
    t2 = trainer()
    t2.load(t.tensors(), t.baseline.state())
    assert t2.baseline.slots.get(7) == 0.5
    assert make_baseline("none", 0.01, t.baseline.state()).slots.get(7) == 0.0


def test_a_skipped_batch_leaves_the_slot_baselines_as_they_were() -> None:
    t = trainer()
    t.update([Experience("e0", "feedback", event(0, selected=[7]), 0.3, slot_effects={7: 1.0})])
    bad = Experience("e1", "feedback", event(1, selected=[7]), float("nan"), slot_effects={7: 5.0})
    assert t.update([bad]).skipped_non_finite == 1
    assert (t.baseline.slots.get(7), t.baseline.slots.n(7)) == (1.0, 1)


def test_a_reset_restarts_the_slot_baselines() -> None:
    t = trainer()
    t.update([Experience("e0", "feedback", event(0, selected=[7]), 0.3, slot_effects={7: 1.0})])
    t.reset_last_layer([])
    assert len(t.baseline.slots) == 0 and len(t.query_means) == 0


def test_slot_baseline_state_is_bounded() -> None:
    b = SlotBaseline()
    for s in range(5000):
        b.update(s, 1.0)
    b.update(4999, 1.0)
    st = b.state()
    assert len(st["slot"]) == 2048 and st["slot"][0] == 4999


def test_the_drift_reset_reinitialises_the_whole_network_by_default() -> None:
    t = trainer()
    for i in range(3):
        # varied utilities: with lazy Adam only steps with a gradient move the output rows, and
        # one step each side would move them by exactly ±lr, the same before and after the reset
        t.update([fb(i, 1.0 + i)])
    before = params(t)
    replay = [fb(10 + i, 0.5, ts=1000.0 + i) for i in range(8)]
    stats = t.reset(replay, epochs=1, batch_size=4)
    assert stats.applied == 8
    after = params(t)
    assert all(not torch.equal(before[k], after[k]) for k in before if k != "alpha")
    last = trainer(reset_scope="last_layer")
    for i in range(3):
        last.update([fb(i, 1.0)])
    before = params(last)
    last.reset([], epochs=0)
    assert torch.equal(before["hidden.weight"], params(last)["hidden.weight"])
    assert not torch.equal(before["out.weight"], params(last)["out.weight"])
    with pytest.raises(ValueError):
        trainer(reset_scope="half").reset([])


def test_simulator_attribution_rate_zero_keeps_the_stream_and_one_measures_each_memory() -> None:
    from causalmem_lab.simulator import Environment, Scenario

    from topics.feedback import LLMFeedback

    small = Scenario(embedding_dim=8, slots=64, intents=2, background=10, utility_noise=0.0)
    a, b = Environment(small), Environment(small.replace(attribution_rate=0.0))
    for env in (a, b):
        env.next_query()
    sel = a.helpful(0)[:2] + a.harmful(0)[:1]
    fa = [a.feedback(0, sel) for _ in range(5)]
    assert fa == [b.feedback(0, sel) for _ in range(5)]
    assert all(f[3] is None for f in fa)  # rate 0: no per-memory NLLs, the same random stream
    c = Environment(small.replace(attribution_rate=1.0))
    true_u, nll_with, nll_without, per_slot = c.feedback(0, sel)
    assert per_slot is not None and set(per_slot) == set(sel)
    effects = LLMFeedback("f", "q", 0, 1.0, nll_without - nll_with, nll_with, nll_without, per_slot).slot_effects(sel)
    assert effects == pytest.approx({s: c.effect(0, s) for s in sel}, abs=1e-9)  # noise-free scenario
    assert sum(effects.values()) == pytest.approx(true_u)  # the effects add up to the utility
    assert effects[sel[0]] > 0 > effects[sel[2]]


# ---------------------------------------------------------------- imputed credit (doubly robust)


def test_imputed_effects_share_the_residual_and_keep_known_means() -> None:
    u = np.array([1.0, 0.2])
    means = np.array([[0.5, -0.1, 0.3], [0.0, 0.0, 0.0]])
    valid = np.array([[True, True, False], [True, True, True]])
    e = impute_effects(u, means, valid, residual_baseline=0.2)
    # Row 0: r = 1 − 0.2 − 0.4 = 0.4 → +0.2 each; row 1 (nothing known): (0.2 − 0.2) / 3 = 0.
    assert e.round(9).tolist() == [[0.7, 0.1, 0.0], [0.0, 0.0, 0.0]]
    # The imputed effects add up to the utility less the residual's mean.
    assert float(e[0].sum()) == pytest.approx(1.0 - 0.2)


def test_a_step_without_credit_moves_away_from_a_memory_known_to_hurt() -> None:
    """At partial attribution: a bad step without nll_without_slot blamed every
    memory it read alike. Once slot 3 is known to hurt (b̂ = −1) and the step's utility is
    what that explains (residual 0), the imputed credit lowers slot 3 and raises slot 7."""
    ev = event(0, candidates=[3, 7, 11, 20, 31], selected=[7, 3])

    def masks(t: object) -> torch.Tensor:
        net = t.net  # type: ignore[attr-defined]
        return net.candidate_masks(net.features(*_feats(ev)), torch.tensor([ev.candidates])).detach()[0]

    t = trainer()
    t.baseline.slots.update(3, -1.0)
    m0 = masks(t)
    t.update([Experience("e0", "feedback", ev, -1.0)])
    m1 = masks(t)
    assert float(m1[0] - m0[0]) < 0 < float(m1[1] - m0[1])  # slot 3 down, slot 7 up
    assert t.baseline.slots.n(3) == 1  # imputed effects never feed the per-slot means
    # With imputation off, the step reward (A = −1) pushes both memories it read down.
    off = plain()
    off.baseline.slots.update(3, -1.0)
    off.update([Experience("e0", "feedback", ev, -1.0)])
    m2 = masks(off)
    assert float(m2[0] - m0[0]) < 0 and float(m2[1] - m0[1]) < 0


def test_without_any_credit_seen_the_step_reward_is_unchanged() -> None:
    a, b = trainer(), plain()
    for i in range(3):
        a.update([fb(i, 0.5 * i)])
        b.update([fb(i, 0.5 * i)])
    assert all(torch.equal(v, params(b)[k]) for k, v in params(a).items())


def test_the_residual_baseline_follows_the_unexplained_utility_and_is_saved() -> None:
    t = trainer()
    t.update([Experience("e0", "feedback", event(0, selected=[7, 3]), 0.3, slot_effects={7: 1.0, 3: -0.5})])
    t.update([Experience("e1", "feedback", event(1, selected=[7, 3]), 0.9)])
    slots = t.baseline.slots
    # The second batch's residual: u − (b̂_7 + b̂_3) = 0.9 − 0.5 = 0.4, its first value.
    assert (slots.residual_n, slots.residual) == (1, pytest.approx(0.4))
    restored = make_baseline("moving", 0.01, t.baseline.state()).slots
    assert (restored.residual_n, restored.residual) == (1, pytest.approx(0.4))


def _easy_and_hard(t: PolicyTrainer) -> list[bytes]:
    """Credit arrives (b̂ = 0), then a question that scores 2 whatever it reads and one that scores 0."""
    t.update([Experience("c", "feedback", event(9, selected=[7, 3]), 0.0, slot_effects={7: 0.0, 3: 0.0})])
    easy, hard = event(0, selected=[7, 3]), event(1, selected=[7, 3])
    for i in range(4):
        t.update([Experience(f"a{i}", "feedback", easy, 2.0), Experience(f"b{i}", "feedback", hard, 0.0)])
    return [query_key(easy.features.query_embedding), query_key(hard.features.query_embedding), b"unseen"]


def test_the_residual_baseline_is_each_querys_own() -> None:
    """Real LM utilities differ most by question: one that scores 2 whatever it reads has a
    residual mean of 2 of its own, so its steps at 2 are no credit for what they read, where the
    mean over all questions (between 0 and 2) would call them better than usual."""
    t = trainer()
    keys = _easy_and_hard(t)
    overall = t.baseline.slots.residual
    assert t.query_means.residuals(keys, overall).tolist() == pytest.approx([2.0, 0.0, overall])
    assert 0.0 < overall < 2.0
    # A rollback or a cut-over loads other weights: the queries' levels stay.
    t.load(t.tensors(), t.baseline.state())
    assert t.query_means.residuals(keys, overall).tolist() == pytest.approx([2.0, 0.0, overall])
    # Not saved: a learner restarted from the state imputes every query with the mean over all.
    restarted = trainer()
    restarted.load(t.tensors(), t.baseline.state())
    assert restarted.query_means.residuals(keys, 9.0).tolist() == [9.0] * 3


def test_a_memorys_mean_effect_is_each_querys_own() -> None:
    """A fact helps its own question and misleads its look-alike: over all queries its mean
    effect is about 0, so reading it for the look-alike would look harmless; each query's own
    mean says +1 and −1. A query never credited with the slot gets the mean over all; a slot given
    to a new memory (``init_rows``) is forgotten by every query, as by the mean over all."""
    t = trainer()
    own, lookalike = event(0, selected=[7, 3]), event(1, selected=[7, 3])
    t.update(
        [
            Experience("o", "feedback", own, 1.0, slot_effects={7: 1.0, 3: 0.0}),
            Experience("l", "feedback", lookalike, -1.0, slot_effects={7: -1.0, 3: 0.0}),
        ]
    )
    keys = [query_key(e.features.query_embedding) for e in (own, lookalike)] + [b"unseen"]
    slot7 = np.full((3, 1), 7)
    overall = float(t.baseline.slots.means(slot7[:1])[0, 0])
    assert overall == pytest.approx(0.0, abs=1e-6)
    assert t.query_means.effects(keys, slot7, np.full((3, 1), overall)).ravel().tolist() == pytest.approx(
        [1.0, -1.0, overall]
    )
    # Imputed credit reads them: the look-alike at −1 after reading 7 (−1) and 3 (0) is what its
    # own means expect, a residual of 0 (the means over all, ≈ 0 each, would leave −1).
    t.update([Experience("l2", "feedback", lookalike, -1.0)])
    assert t.query_means.residuals(keys[1:2], fallback=9.0).tolist() == pytest.approx([0.0], abs=1e-6)
    t.init_rows([7])
    assert t.query_means.effects(keys, slot7, np.full((3, 1), 0.5)).ravel().tolist() == [0.5] * 3


def test_without_a_baseline_no_query_has_a_residual_mean_of_its_own() -> None:
    t = trainer(baseline="none")
    keys = _easy_and_hard(t)
    assert len(t.query_means) == 0 and t.query_means.residuals(keys, 0.0).tolist() == [0.0] * 3


def test_a_skipped_or_weightless_step_leaves_the_query_means_as_they_were() -> None:
    t = trainer()
    keys = _easy_and_hard(t)
    before = t.query_means.residuals(keys, -1.0).tolist()
    effects_before = t.query_means.effects(keys, np.array([[7, 3]] * 3), np.full((3, 2), -1.0)).tolist()
    new = event(5, selected=[7, 3], logprob=float("nan"))  # a non-finite weight: the step is skipped
    stats = t.update(
        [
            Experience("n", "feedback", new, 5.0),
            Experience("a", "feedback", event(0, selected=[7, 3]), 9.0, slot_effects={7: 9.0}),
        ]
    )
    assert stats.skipped_non_finite == 1
    quarantined = Experience("q", "feedback", event(6, selected=[7, 3]), 7.0, slot_effects={3: 7.0})
    t.update([quarantined, Experience("h", "feedback", event(1, selected=[7, 3]), 0.0)], np.array([0.0, 1.0]))
    assert t.query_means.residuals(keys, -1.0).tolist() == pytest.approx(before)
    assert t.query_means.effects(keys, np.array([[7, 3]] * 3), np.full((3, 2), -1.0)).tolist() == effects_before
    q = [query_key(quarantined.event.features.query_embedding)]
    assert t.query_means.residuals(q, -1.0).tolist() == [-1.0]
    assert t.query_means.effects(q, np.array([[3]]), np.full((1, 1), -1.0)).tolist() == [[-1.0]]


def test_the_query_means_are_bounded() -> None:
    q = QueryMeans(fading_factor=0.5, max_queries=3)
    for k in (b"a", b"b", b"c", b"a", b"d"):  # "a" seen again: "b" is the least recently seen
        q.update(k, 1.0)
    assert len(q) == 3 and q.residuals([b"b", b"a"], fallback=-1.0).tolist() == [-1.0, 1.0]
    # A query's slots too: credited again, slot 0 is the most recent; slot 1 goes first.
    n = MAX_SLOTS_PER_QUERY
    for s in [*range(n), 0, n]:
        q.update_effect(b"a", s, 1.0)
    own = q.effects([b"a"], np.arange(n + 1)[None, :], np.full((1, n + 1), -1.0))[0]
    assert own[1] == -1.0 and (own[[0, *range(2, n + 1)]] == 1.0).all()


def test_the_per_slot_means_take_each_experience_at_its_sample_weight() -> None:
    """The per-slot means impute credit for other steps, so a principal held to a share of the
    updates (its influence weight) is held to it there too: at weight 0 (quarantined) its
    effects leave them as they were, at 0.25 they move them a quarter of the way."""
    honest = Experience("h", "feedback", event(0, selected=[7, 3]), 0.3, slot_effects={7: 1.0, 3: -0.5})
    liar = Experience("l", "feedback", event(1, selected=[7, 3]), 0.3, slot_effects={7: -9.0, 3: 9.0})
    means = []
    for w in (1.0, 0.25, 0.0):
        t = trainer()
        t.update([honest, liar], np.array([1.0, w]))
        means.append((t.baseline.slots.get(7), t.baseline.slots.get(3)))
    full, quarter, none = means
    assert none == pytest.approx((1.0, -0.5))  # the honest effects alone
    assert quarter[0] == pytest.approx(1.0 + 0.25 * 0.5 * (-9.0 - 1.0))  # running mean of two, a quarter step
    assert full[0] < quarter[0] < none[0] and full[1] > quarter[1] > none[1]
