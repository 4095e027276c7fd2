"""Contract 1.15, the learner's bound on each principal's influence (docs/learning.md, "Influence
per principal"): the rule by property, and the learner applying it to its micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from models.policy.trainer import PolicyTrainer
from pipeline.config import Settings
from pipeline.learner.influence import InfluenceWindow, capped_weights, influence_weights, per_memory_weights
from pipeline.learner.loop import Learner
from pipeline.promtext import metric, parse
from tests.helpers import experience
from topics.internal import Experience

S = Settings(embedding_dim=8, slots=16, hidden=16, gate=False)

counts = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3), st.integers(0, 10_000), max_size=12)
caps = st.floats(0.01, 1.0)


@settings(max_examples=500, deadline=None)
@given(counts, caps)
def test_no_principal_carries_more_than_the_bound_and_those_within_it_keep_weight_1(
    window: dict[str, int], cap: float
) -> None:
    w = capped_weights(window, cap)
    live = {p: c for p, c in window.items() if c > 0}
    assert set(w) == set(window) and all(0.0 < x <= 1.0 for x in w.values())
    if len(live) <= 1:
        assert all(x == 1.0 for x in w.values())
        return
    bound = max(cap, 1 / len(live))
    total = sum(w[p] * c for p, c in live.items())
    shares = {p: w[p] * c / total for p, c in live.items()}
    assert max(shares.values()) <= bound + 1e-9
    for p in live:  # a principal held down is held at the bound exactly, never below it
        if w[p] < 1.0:
            assert shares[p] == pytest.approx(bound, rel=1e-9)
    # The smallest principal's weight is never lowered; nor is any whose raw share is within the cap of the rest.
    assert w[min(live, key=live.__getitem__)] == 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=50), caps, st.sets(st.sampled_from("abc")))
def test_quarantined_principals_weigh_zero_and_leave_the_others_bound_unchanged(
    batch: list[str], cap: float, blocked: set[str]
) -> None:
    window = {"a": 60, "b": 30, "c": 10}
    w = influence_weights(batch, window, cap, quarantined=blocked)
    kept = {p: c for p, c in window.items() if p not in blocked}
    expected = capped_weights(kept, cap)
    assert w.tolist() == [0.0 if p in blocked else expected[p] for p in batch]


experiences = st.tuples(st.sampled_from(["a", "b", "c"]), st.lists(st.integers(0, 5), max_size=3))
batches = st.lists(st.lists(experiences, min_size=1, max_size=8), min_size=1, max_size=6)
blocked_sets = st.sets(st.sampled_from("abc"), max_size=2)


def split(batch: list[tuple[str, list[int]]]) -> tuple[list[str], list[list[int]]]:
    """A drawn micro-batch as ``InfluenceWindow.weights`` takes it: principals, and each one's reads."""
    return [p for p, _ in batch], [r for _, r in batch]


@settings(max_examples=300, deadline=None)
@given(batches, caps, st.lists(blocked_sets, min_size=6, max_size=6), st.integers(1, 20))
def test_the_window_weighs_every_micro_batch_by_the_rule_over_its_counts(
    micro_batches: list[list[tuple[str, list[int]]]], cap: float, blocked: list[set[str]], size: int
) -> None:
    # Who is quarantined or held changes from batch to batch: a principal counted earlier is held later.
    win = InfluenceWindow(size=size, cap=cap)
    for batch, out in zip(micro_batches, blocked, strict=False):
        principals, reads = split(batch)
        got = win.weights(principals, out, reads=reads)
        # The window has now counted the batch: its weights are the rule's over those counts.
        overall = influence_weights(principals, win.counts, cap, out)
        expected = per_memory_weights(overall, principals, reads, win.memory_counts, cap, out)
        assert got.tolist() == expected.tolist()


@settings(max_examples=300, deadline=None)
@given(batches, caps, batches)
def test_quarantining_a_principal_weighs_the_others_as_if_it_had_never_been_counted(
    earlier: list[list[tuple[str, list[int]]]], cap: float, later: list[list[tuple[str, list[int]]]]
) -> None:
    seen, never = InfluenceWindow(size=10_000, cap=cap), InfluenceWindow(size=10_000, cap=cap)
    for batch in earlier:
        principals, reads = split(batch)
        seen.weights(principals, reads=reads)
        principals, reads = split([(p, r) for p, r in batch if p != "b"])
        never.weights(principals, reads=reads)
    for batch in later:
        principals, reads = split([(p, r) for p, r in batch if p != "b"])
        assert seen.weights(principals, {"b"}, reads=reads).tolist() == never.weights(principals, reads=reads).tolist()


@settings(max_examples=300, deadline=None)
@given(batches, st.lists(blocked_sets, min_size=6, max_size=6), st.integers(1, 20))
def test_the_window_counts_exactly_the_last_experiences_not_left_out(
    micro_batches: list[list[tuple[str, list[int]]]], blocked: list[set[str]], size: int
) -> None:
    win, counted = InfluenceWindow(size=size, cap=0.2), []
    for batch, out in zip(micro_batches, blocked, strict=False):
        principals, reads = split(batch)
        win.weights(principals, out, reads=reads)
        counted = [*counted, *((p, r) for p, r in batch if p not in out)][-size:]
    assert win.counts == Counter(p for p, _ in counted)
    per_memory: dict[int, Counter[str]] = {}
    for p, read in counted:
        for m in read:
            per_memory.setdefault(m, Counter())[p] += 1
    assert win.memory_counts == per_memory


def test_one_principal_or_only_anonymous_traffic_weighs_1() -> None:
    win = InfluenceWindow(size=100, cap=0.2)
    assert win.weights(["anonymous"] * 64, reads=[[i % 3] for i in range(64)]).tolist() == [1.0] * 64
    assert InfluenceWindow(size=100, cap=0.2).weights(["svc-a"] * 10, reads=[[1, 2]] * 10).tolist() == [1.0] * 10


def test_the_window_forgets_the_oldest_experiences() -> None:
    win = InfluenceWindow(size=10, cap=0.2)
    win.weights(["liar"] * 10, reads=[[7]] * 10)
    w = win.weights([f"h{i}" for i in range(10)], reads=[[7]] * 10)  # the liar has left the window
    assert w.tolist() == [1.0] * 10 and "liar" not in win.counts and "liar" not in win.memory_counts[7]
    win.weights([f"h{i}" for i in range(10)], reads=[[8]] * 10)
    assert 7 not in win.memory_counts  # a memory no one read in the window is forgotten


def test_a_minority_concentrated_on_a_few_memories_is_bounded_on_them() -> None:
    """12% of the traffic, every step of it on the same memories, is most of their reads: held to
    the cap there. Honest principals spread over every memory keep weight 1, or nearly."""
    rng = np.random.default_rng(0)
    win = InfluenceWindow(size=2000, cap=0.2)
    honest = [f"h{i}" for i in range(8)]
    for _ in range(20):
        principals = [*(str(rng.choice(honest)) for _ in range(88)), *(["liar"] * 12)]
        reads = [[int(m) for m in rng.choice(40, size=3, replace=False)] for _ in range(88)] + [[0, 1, 2]] * 12
        w = win.weights(principals, reads=reads)
    assert win.counts["liar"] / sum(win.counts.values()) < 0.2  # under the cap over the window
    liar = w[88:]
    assert np.all(liar < 0.5)  # bounded on memories 0-2, where it is most of the reads
    on_0 = win.memory_counts[0]
    assert (
        liar[0] * on_0["liar"] / (liar[0] * on_0["liar"] + sum(c for p, c in on_0.items() if p != "liar")) <= 0.2 + 1e-9
    )
    # An honest principal over the cap on a memory is so by chance, and only a little.
    assert np.median(w[:88]) == 1.0 and w[:88].min() > 0.8


def test_a_bad_cap_or_window_is_refused() -> None:
    for cap in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            capped_weights({"a": 1}, cap)
        with pytest.raises(ValueError):
            dataclasses.replace(S.learner(), influence_cap=cap)
    with pytest.raises(ValueError):
        InfluenceWindow(size=0, cap=0.2)


def _learner(tmp_path: Path) -> Learner:
    return Learner(S.replace(state_dir=str(tmp_path)).learner(), "127.0.0.1:1")


def _batch(principals: list[str | None], start: int = 0) -> list[Experience]:
    out = []
    for i, p in enumerate(principals):
        e = experience(S, start + i)
        out.append(dataclasses.replace(e, feedback_principal=p))
    return out


def test_a_one_principal_deployment_learns_exactly_as_without_principals(tmp_path: Path) -> None:
    learner = _learner(tmp_path)
    plain = PolicyTrainer(S.learner().trainer)
    for k in range(3):
        chunk = _batch(["svc-a"] * 16, start=16 * k)
        learner.apply(chunk)
        plain.update([dataclasses.replace(e, feedback_principal=None) for e in chunk])
    mine, theirs = learner.trainer.tensors(), plain.tensors()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_the_learner_weighs_a_principal_over_the_cap_and_exports_it(tmp_path: Path) -> None:
    learner = _learner(tmp_path)
    honest = [f"h{i}" for i in range(6)]
    principals: list[str | None] = ["liar"] * 6 + honest  # the liar: half of the traffic
    learner.apply(_batch(principals))
    view = learner.principals.view()
    # Six honest principals and the liar at 1/2: the liar is held at 0.2 of the weight.
    assert view["liar"]["weight"] == pytest.approx(0.25)
    assert all(view[h]["weight"] == 1.0 for h in honest)
    text = _exposition(learner)
    assert metric(text, "causalmem_principal_weight", principal="liar") == pytest.approx(0.25)
    assert metric(text, "causalmem_principal_share", principal="liar") == pytest.approx(0.5)


def test_a_quarantined_principals_experiences_weigh_zero_and_are_counted(tmp_path: Path) -> None:
    learner = _learner(tmp_path)
    learner.progress.quarantined = ["liar"]
    before = learner.trainer.tensors()
    learner.apply(_batch(["liar"] * 8))
    after = learner.trainer.tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing of it was learned
    assert len(learner.replay) == 0  # nor kept for a warm-up
    learner.apply(_batch(["liar", "svc-a", None], start=8))
    assert [e.principal for e in learner.replay] == ["svc-a", "anonymous"]
    text = _exposition(learner)
    assert metric(text, "causalmem_learner_quarantined_experiences_total", principal="liar") == 9
    assert metric(text, "causalmem_principal_weight", principal="liar") == 0.0


def test_experiences_left_out_at_weight_0_do_not_make_the_others_steps_more_frequent(tmp_path: Path) -> None:
    """A principal held at weight 0 thinned the others' micro-batches, so they were stepped on more
    often, each step as long (Adam's does not shrink with the batch): a liar with no weight at all
    took the honest clients' harmful-read rate +7.7 points over honest-only (the poisoning bench,
    25% spread). The step now moves as far as the weight the micro-batch carries."""
    learner = _learner(tmp_path)
    learner.progress.quarantined = ["liar"]
    chunk = _batch(["liar", "svc-a"] * 8)
    learner.apply(chunk)
    plain = PolicyTrainer(S.learner().trainer)
    plain.update([e for e in chunk if e.principal == "svc-a"], step_scale=0.5)
    mine, theirs = learner.trainer.tensors(), plain.tensors()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def _exposition(learner: Learner) -> dict[str, float]:
    return parse(generate_latest(learner.metrics.registry).decode())


def test_the_weights_reach_the_update(tmp_path: Path) -> None:
    """The trainer's importance weights of an update are the principal weights times the clipped ratio."""
    trainer = PolicyTrainer(S.learner().trainer)
    chunk = _batch(["a", "b"])
    w = np.array([0.25, 1.0])
    stats = trainer.update(chunk, w)
    plain = PolicyTrainer(S.learner().trainer).update(chunk)
    assert np.allclose(stats.weights, np.array(plain.weights) * w)


def test_the_gates_evidence_is_thinned_to_the_same_caps() -> None:
    """The promotion rule judged on every non-quarantined experience at full weight, so a principal
    over the cap still carried its whole share of the gate's judgement. The gate now keeps each
    experience with probability its weight, decided by its id (a replay keeps the same ones)."""
    from pipeline.learner.evidence import thin

    principals: list[str | None] = ["liar"] * 2000 + [f"h{i % 6}" for i in range(2000)]
    batch = _batch(principals)
    weights = np.where(np.array([p == "liar" for p in principals]), 0.25, 1.0)
    kept = thin(batch, weights)
    liar = sum(e.principal == "liar" for e in kept)
    assert liar == pytest.approx(500, abs=70) and len(kept) - liar == 2000  # 0.25 of the liar's, all the others'
    assert [e.id for e in thin(batch, weights)] == [e.id for e in kept]  # by id: the same ones again
    assert thin(batch, np.ones(len(batch))) == batch  # within the cap: everything
