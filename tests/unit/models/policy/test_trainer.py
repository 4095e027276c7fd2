"""PolicyTrainer (models/policy/trainer.py): REINFORCE steps, skipping, label fine-tune, last-layer reset,
optimizer state round trip. Small dims: D=8, S=32, hidden=16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.policy.baseline import make_baseline
from models.policy.batch import make_batch
from models.policy.network import LAST_LAYER, TENSOR_NAMES
from models.policy.trainer import PolicyTrainer, TrainerConfig
from models.serving.rule import (
    adjusted_logits,
    adjusted_logits_torch,
    first_draw_probs,
    plackett_luce_logprob,
    plackett_luce_logprob_torch,
)
from topics.events import Features, RetrievalEvent
from topics.internal import Experience

D, S, H = 8, 32, 16


def trainer(**kw: object) -> PolicyTrainer:
    args: dict[str, object] = dict(embedding_dim=D, slots=S, hidden=H, lr=1e-2, seed=0)
    args.update(kw)
    return PolicyTrainer(TrainerConfig(**args))  # type: ignore[arg-type]


def event(
    i: int = 0,
    candidates: list[int] | None = None,
    selected: list[int] | None = None,
    ts: float = 1000.0,
    logprob: float = -1.0,
    seed: int | None = None,
) -> RetrievalEvent:
    rng = np.random.default_rng(i if seed is None else seed)
    cands = candidates if candidates is not None else [3, 7, 11, 20, 31]
    return RetrievalEvent(
        event_id=f"e{i}",
        query_id=f"q{i}",
        step=0,
        ts=ts,
        features=Features(rng.normal(size=D).astype(np.float32), float(rng.uniform(0, 2)), float(rng.uniform(0, 2))),
        candidates=cands,
        scores=np.linspace(0.9, 0.5, len(cands)),
        selected=selected if selected is not None else [cands[1], cands[0]],
        temperature=0.5,
        logprob=logprob,
        fallback=False,
    )


def fb(i: int, utility: float, **kw: object) -> Experience:
    return Experience(f"e{i}", "feedback", event(i, **kw), utility=utility)  # type: ignore[arg-type]


def label(i: int, correct: list[int], **kw: object) -> Experience:
    return Experience(f"l{i}", "label", event(i, **kw), utility=0.0, correct_memories=correct)  # type: ignore[arg-type]


def _masks(t: PolicyTrainer, ev: RetrievalEvent) -> np.ndarray:
    """The full mask m under the trainer's current parameters (float64)."""
    with torch.no_grad():
        m = t.net(
            torch.from_numpy(ev.features.query_embedding[None]),
            torch.tensor([ev.features.last_step_loss], dtype=torch.float32),
            torch.tensor([ev.features.last_step_entropy], dtype=torch.float32),
        )
    return m[0].double().numpy()


def _z(t: PolicyTrainer, ev: RetrievalEvent) -> np.ndarray:
    alpha = float(t.net.alpha.detach()[0])
    return adjusted_logits(ev.scores, _masks(t, ev)[ev.candidates], alpha, ev.temperature)


def logp_of(t: PolicyTrainer, e: Experience) -> float:
    """log π(selected) under the trainer's current parameters, through the numpy reference."""
    ev = e.event
    return plackett_luce_logprob(_z(t, ev), [ev.candidates.index(s) for s in ev.selected])


def first_draw(t: PolicyTrainer, e: Experience) -> np.ndarray:
    return first_draw_probs(_z(t, e.event))


def params(t: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.net.state_dict().items()}


def test_batch_logprob_matches_numpy_reference() -> None:
    t = trainer()
    exps = [fb(0, 1.0), fb(1, 1.0, candidates=[1, 2], selected=[2]), fb(2, 1.0, selected=[])]
    b = make_batch(exps)
    assert tuple(b.slots.shape) == (3, 5) and b.valid.sum().item() == 5 + 2 + 5
    with torch.no_grad():
        h = t.net.features(b.embedding, b.loss, b.entropy)
        z = adjusted_logits_torch(b.scores, t.net.candidate_masks(h, b.slots), t.net.alpha, b.temperature)
        logp = plackett_luce_logprob_torch(z, b.valid, b.selected, b.selected_valid)
    assert logp.tolist() == pytest.approx([logp_of(t, e) for e in exps], rel=1e-5, abs=1e-6)
    assert logp[2].item() == 0.0


@pytest.mark.parametrize(("utility", "direction"), [(1.0, 1), (-1.0, -1)])
def test_update_moves_logprob_with_sign_of_advantage(utility: float, direction: int) -> None:
    t = trainer()
    e = fb(0, utility)
    before = logp_of(t, e)
    stats = t.update([e])
    assert stats.applied == 1 and stats.skipped_non_finite == 0
    assert stats.advantages == [utility]  # fresh baseline: b = 0
    after = logp_of(t, e)
    assert direction * (after - before) > 1e-3
    assert t.updates == 1 and t.experiences == 1


def test_zero_advantage_changes_nothing_in_expectation() -> None:
    t = trainer()
    t.baseline.advantage(0.7)  # b = 0.7
    e = fb(0, 0.7)
    before = params(t)
    stats = t.update([e])
    assert stats.advantages == [0.0]
    after = params(t)
    # A = 0: zero gradient, Adam step of 0
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_importance_weight_is_clipped_and_reported() -> None:
    t = trainer(importance_clip=2.0)
    e = fb(0, 1.0, logprob=-50.0)  # logged far less likely than now: ratio huge
    stats = t.update([e])
    assert stats.weights == [2.0]
    t2 = trainer()
    e2 = fb(0, 1.0, logprob=0.0)  # logged certain: ratio = π_θ < 1
    w = t2.update([e2]).weights[0]
    assert w == pytest.approx(np.exp(logp_of(trainer(), e2)), rel=1e-4)


def test_non_finite_batch_is_skipped() -> None:
    t = trainer()
    before = params(t)
    opt_state_before = len(t.optimizer.state)
    stats = t.update([fb(0, float("inf")), fb(1, 0.5)])
    assert stats.skipped_non_finite == 1
    assert stats.applied == 0
    assert t.updates == 0
    after = params(t)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert len(t.optimizer.state) == opt_state_before  # no Adam step taken


def test_fine_tune_moves_mass_to_label_and_keeps_backbone() -> None:
    t = trainer()
    # pick a labelled slot that the policy currently does not favour
    e0 = label(0, [0])
    probs = first_draw(t, e0)
    target_pos = int(np.argmin(probs))
    target = e0.event.candidates[target_pos]
    e = label(0, [target, 99])  # a label outside the candidates is ignored
    frozen = {k: v.detach().clone() for k, v in t.net.state_dict().items() if k not in LAST_LAYER}
    last_before = {k: t.net.state_dict()[k].clone() for k in LAST_LAYER}
    stats = t.fine_tune([e], steps=5)
    assert stats.applied == 1 and stats.skipped_non_finite == 0
    assert t.labels_applied == 1
    after = first_draw(t, e)
    assert after[target_pos] > probs[target_pos] + 1e-3
    state = t.net.state_dict()
    for k, v in frozen.items():  # norm.*, hidden.*, alpha bit-identical
        assert torch.equal(state[k], v), k
    assert {k for k in frozen} == {"norm.weight", "norm.bias", "hidden.weight", "hidden.bias", "alpha"}
    assert not torch.equal(state["out.weight"], last_before["out.weight"])
    # the main optimizer is untouched by label fine-tuning
    assert len(t.optimizer.state) == 0


def test_fine_tune_ignores_unusable_labels() -> None:
    t = trainer()
    before = params(t)
    stats = t.fine_tune([label(0, [0]), label(1, [])])  # slot 0 is not a candidate; empty label
    assert stats.applied == 0
    after = params(t)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reset_last_layer_changes_only_out_and_clears_its_adam_state() -> None:
    t = trainer()
    t.update([fb(0, 1.0), fb(1, -0.5)])
    t.fine_tune([label(2, [7])])
    out_w, out_b = t.net.out.weight, t.net.out.bias
    assert out_w in t.optimizer.state and out_w in t.label_optimizer.state
    before = params(t)
    baseline_n = t.baseline.n
    assert baseline_n == 2
    stats = t.reset_last_layer([], epochs=0)
    assert stats.applied == 0
    after = params(t)
    for name in TENSOR_NAMES:
        same = torch.equal(before[name], after[name])
        assert same == (name not in LAST_LAYER), name
    # the parameters are the same objects (the optimizers still hold them), their state is gone
    assert t.net.out.weight is out_w and t.net.out.bias is out_b
    for opt in (t.optimizer, t.label_optimizer):
        assert out_w not in opt.state and out_b not in opt.state
    assert t.net.hidden.weight in t.optimizer.state  # the rest keeps its moments
    assert t.baseline.n == 0  # the baseline restarts


def test_reset_last_layer_warm_up_trains() -> None:
    t = trainer()
    replay = [fb(i, 1.0 if i % 2 else -1.0, ts=1000.0 + i) for i in range(6)]
    stats = t.reset_last_layer(replay, epochs=2, batch_size=4)
    assert stats.applied == 12 and stats.skipped_non_finite == 0
    assert t.updates == 4  # ceil(6/4) batches × 2 epochs


def _state_bytes(t: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.net.state_dict().items()}


def test_optimizer_tensors_round_trip_continues_identically() -> None:
    batch1 = [fb(i, u) for i, u in enumerate([0.5, -0.2, 1.0, 0.3])]
    batch2 = [fb(10 + i, u) for i, u in enumerate([-0.4, 0.8, 0.1])]
    labels1, labels2 = [label(20, [7])], [label(21, [11])]

    a = trainer()
    a.update(batch1)
    a.fine_tune(labels1)
    saved_params = a.tensors()
    saved_opt = a.optimizer_tensors()
    saved_baseline = a.baseline.state()
    assert any(k.startswith("main.") for k in saved_opt) and any(k.startswith("label.") for k in saved_opt)
    assert "main.hidden.weight.exp_avg" in saved_opt and "label.out.weight.exp_avg_sq" in saved_opt

    b = trainer(seed=123)  # different initial weights: everything must come from the saved state
    b.load(saved_params, saved_baseline)
    b.load_optimizer_tensors(saved_opt)

    for t in (a, b):
        t.update(batch2)
        t.fine_tune(labels2)
        t.update(batch1)
    pa, pb = _state_bytes(a), _state_bytes(b)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert a.baseline.state() == b.baseline.state()


def test_without_optimizer_state_training_diverges() -> None:
    """Control for the round-trip test: dropping Adam's moments does change the result."""
    batch1 = [fb(i, u) for i, u in enumerate([0.5, -0.2, 1.0, 0.3])]
    batch2 = [fb(10 + i, u) for i, u in enumerate([-0.4, 0.8, 0.1])]
    a = trainer()
    a.update(batch1)
    b = trainer(seed=123)
    b.load(a.tensors(), a.baseline.state())
    a.update(batch2)
    b.update(batch2)
    assert not torch.equal(a.net.hidden.weight, b.net.hidden.weight)


def test_skipped_batch_does_not_poison_later_updates() -> None:
    t = trainer()
    assert t.update([fb(0, float("inf"))]).skipped_non_finite == 1
    stats = t.update([fb(1, 0.5)])
    assert stats.skipped_non_finite == 0 and stats.applied == 1


def test_the_step_baseline_takes_each_utility_at_its_sample_weight() -> None:
    """A principal weighed to 0 by the influence bound moves neither the update nor b: its inverted
    utilities once lowered b, and so raised every honest step's advantage u − b."""
    t, plain = trainer(), trainer()
    honest = [fb(i, 1.0) for i in range(3)]
    stats = t.update([*honest, fb(3, -5.0)], np.array([1.0, 1.0, 1.0, 0.0]))
    plain.update(honest)
    assert t.baseline.get() == plain.baseline.get() == pytest.approx(1.0)
    assert stats.advantages[-1] == pytest.approx(-6.0)  # its advantage is measured, and weighs 0


def test_a_step_scale_scales_the_step_and_1_is_the_plain_step() -> None:
    """Adam's step does not shrink with the batch: the learner scales it by the weight the batch
    carries, so that experiences left out at weight 0 do not make the others' steps more frequent."""
    batch = [fb(i, 1.0 - 0.5 * i) for i in range(4)]
    start = params(trainer())
    moved = {}
    for scale in (1.0, 0.5):
        t = trainer()
        t.update(batch, step_scale=scale)
        moved[scale] = {k: v - start[k] for k, v in params(t).items()}
    plain = trainer()
    plain.update(batch)
    assert all(torch.equal(plain.net.tensors()[k], start[k] + moved[1.0][k]) for k in start)
    assert all(torch.allclose(moved[0.5][k], 0.5 * moved[1.0][k], atol=1e-7) for k in start)
    assert any(moved[1.0][k].abs().sum() > 0 for k in start)


def test_a_warm_up_baseline_follows_the_utilities_of_their_own_time_not_their_age() -> None:
    """The warm-up weighs old experiences down by age; the step baseline takes the principals'
    weights only, so after the last pass it is the plain moving mean of the utilities in order."""
    us = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5]
    replay = [fb(i, u, ts=1000.0 + 3600.0 * i) for i, u in enumerate(us)]
    t = trainer()
    t.reset(replay, epochs=1, batch_size=2, half_life_s=600.0)
    plain = make_baseline("moving", t.config.baseline_fading)
    for u in us:
        plain.advantage(u)
    assert t.baseline.get() == pytest.approx(plain.get())
