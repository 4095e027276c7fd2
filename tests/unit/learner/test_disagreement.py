"""Contract 1.15: a principal whose utilities disagree with the others' for the same memories is
flagged (docs/learning.md, "Influence per principal"); honest principals with noisy, differing
traffic are not; the flag reaches the learner's metrics, its checkpoints and ``causalmem status``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from pipeline.config import Settings
from pipeline.learner.disagreement import Disagreement
from pipeline.learner.loop import Learner
from pipeline.learner.principals import PrincipalBook
from pipeline.learner.publishing import Progress, manifest_metrics
from pipeline.promtext import metric, parse
from pipeline.status.principals import principals_view_of
from pipeline.status.render import principals_text
from tests.helpers import experience
from topics.internal import Experience

S = Settings(embedding_dim=8, slots=16, hidden=16, gate=False)
INTENTS, SLATES = 8, 4  # each intent is served a few slates (k = 3 memories of its own)


def _run(
    seed: int, liar_bias: float | None, honest: int = 6, steps: int = 4000, liar_share: float = 0.2
) -> Disagreement:
    """Honest principals with skewed mixes of intents; a liar at ``liar_share`` (inverted when ``liar_bias`` is 0)."""
    rng = np.random.default_rng(seed + 100)
    slates = [
        [sorted(rng.choice(range(10 * k, 10 * k + 10), 3, replace=False)) for _ in range(SLATES)]
        for k in range(INTENTS)
    ]
    true = rng.normal(0.2, 0.5, (INTENTS, SLATES))  # each slate's mean utility
    mixes = [w / w.sum() for w in rng.gamma(0.7, size=(honest + 1, INTENTS))]  # what each principal's users ask
    d = Disagreement(tolerance=0.1, min_n=50)
    for _ in range(steps):
        liar = liar_bias is not None and rng.random() < liar_share
        who = "liar" if liar else f"h{rng.integers(honest)}"
        intent = int(rng.choice(INTENTS, p=mixes[honest if liar else int(who[1:])]))
        j = int(rng.integers(SLATES))
        u = float(true[intent, j] + rng.normal(0, 0.4))
        if liar:
            u = -u if liar_bias == 0 else u + liar_bias
        d.observe(who, slates[intent][j], u)
    return d


@pytest.mark.parametrize("seed", range(5))
def test_honest_principals_are_not_flagged(seed: int) -> None:
    d = _run(seed, liar_bias=None)
    assert not any(d.verdict(p).flagged for p in d.principals()), {p: d.verdict(p) for p in d.principals()}


@pytest.mark.parametrize("seed", range(3))
def test_a_principal_reporting_inverted_utilities_is_flagged_and_the_honest_ones_are_not(seed: int) -> None:
    d = _run(seed, liar_bias=0.0)
    assert d.verdict("liar").flagged and d.verdict("liar").high < -0.1
    assert not any(d.verdict(p).flagged for p in d.principals() if p != "liar")


@pytest.mark.parametrize("seed", range(3))
def test_a_bias_within_the_tolerance_is_not_flagged_one_beyond_it_is(seed: int) -> None:
    assert not _run(seed, liar_bias=0.05).verdict("liar").flagged
    assert _run(seed, liar_bias=0.5).verdict("liar").flagged


def test_too_few_residuals_never_flag() -> None:
    d = Disagreement(tolerance=0.1, min_n=50, min_per_key=1)
    for i in range(20):
        d.observe("a", [i % 3], 1.0)
        d.observe("b", [i % 3], 1.0 + 0.01 * (i % 2))
        d.observe("liar", [i % 3], -1.0)
    v = d.verdict("liar")
    assert v.n < 50 and not v.flagged and v.mean < -1.5
    assert d.verdict("nobody").n == 0


def test_non_finite_utilities_and_empty_slates_are_ignored() -> None:
    d = Disagreement(tolerance=0.1, min_n=2)
    d.observe("a", [1], float("nan"))
    d.observe("a", [], 1.0)
    assert d.verdict("a").n == 0 and d.per_key == {}


def test_the_learner_flags_a_liar_in_its_metrics_its_checkpoints_and_status(tmp_path: Path) -> None:
    learner = Learner(S.replace(state_dir=str(tmp_path)).learner(), "127.0.0.1:1")
    rng = np.random.default_rng(0)
    for k in range(40):
        chunk = []
        for j in range(16):
            e = experience(S, 16 * k + j, utility=0.0)
            e.event.candidates = [0, 1, 2, 3, 4, 5]
            e.event.selected = [j % 3, 3 + j % 3]  # three slates, served to everyone
            who = ["a", "b", "c", "liar"][j % 4]
            base = 0.3 + 0.1 * (j % 3) + 0.05 * float(rng.normal())
            chunk.append(dataclasses.replace(e, utility=-base if who == "liar" else base, feedback_principal=who))
        learner.apply(chunk)
    values = parse(generate_latest(learner.metrics.registry).decode())
    assert metric(values, "causalmem_principal_flagged", principal="liar") == 1.0
    assert all(metric(values, "causalmem_principal_flagged", principal=p) == 0.0 for p in "abc")
    # Held since it was flagged, its experiences left the window: no longer a quarter of it.
    assert 0.0 < metric(values, "causalmem_principal_share", principal="liar") < 0.25
    # What a checkpoint carries and status shows.
    metrics = manifest_metrics(
        learner.trainer, Progress(), None, 16, principals=learner.principals.view(learner.progress.quarantined)
    )
    view = principals_view_of(metrics)
    assert view["flagged"] == ["liar"] and view["quarantined"] == []
    # Flagged, it is held: its experiences weigh 0, out of the update, the gate and the replay.
    assert "FLAGGED liar (held at weight 0" in principals_text(view).plain
    assert metric(values, "causalmem_principal_weight", principal="liar") == 0.0
    held = metric(values, "causalmem_learner_held_experiences_total")
    assert held > 0 and sum(e.principal == "liar" for e in learner.replay) == 160 - held


def _chunk(book_rng: np.random.Generator, start: int, liar_sign: float) -> list[Experience]:
    """Three honest principals and one whose utilities are ``liar_sign`` times the truth, on three slates."""
    chunk = []
    for j in range(16):
        e = experience(S, start + j, utility=0.0)
        e.event.selected = [j % 3, 3 + j % 3]
        who = ["a", "b", "c", "liar"][j % 4]
        u = 0.3 + 0.1 * (j % 3) + 0.05 * float(book_rng.normal())
        chunk.append(dataclasses.replace(e, utility=liar_sign * u if who == "liar" else u, feedback_principal=who))
    return chunk


def test_a_flagged_principal_is_held_at_weight_zero_and_weighed_again_once_it_agrees() -> None:
    rng = np.random.default_rng(1)
    book = PrincipalBook(cap=0.5, window=1000, tolerance=0.1, min_n=30)
    for k in range(20):  # the liar inverts its utilities: flagged, then held
        weights = book.weigh(_chunk(rng, 16 * k, -1.0))
    assert book.disagreement.verdict("liar").flagged
    assert weights.tolist() == [1.0, 1.0, 1.0, 0.0] * 4 and book.held_experiences > 0
    assert book.view()["liar"]["weight"] == 0.0 and not book.view()["liar"]["quarantined"]
    for k in range(20, 400):  # still compared while held: once it agrees, it is weighed again
        weights = book.weigh(_chunk(rng, 16 * k, 1.0))
    assert not book.disagreement.verdict("liar").flagged and weights.tolist() == [1.0] * 16
    # With hold off (the poisoning bench's "cap" row), a flagged principal keeps its weight.
    off = PrincipalBook(cap=0.5, window=1000, tolerance=0.1, min_n=30, hold=False)
    for k in range(20):
        weights = off.weigh(_chunk(rng, 16 * k, -1.0))
    assert off.disagreement.verdict("liar").flagged and weights.tolist() == [1.0] * 16


def test_a_liar_that_comes_after_the_tables_are_full_is_still_flagged() -> None:
    """Past its bounds the table stopped keeping new slates and new principals, so a liar that
    appeared late, on slates or under a name it had not seen, was never compared: now the least
    recently reported slate or principal makes room."""
    d = Disagreement(tolerance=0.1, min_n=30, max_keys=8, max_principals=4)
    for i in range(40):  # fill both tables: old slates, principals that then go quiet
        for early in ("e1", "e2", "e3", "e4"):
            d.observe(early, [100 + i % 8, 200], 0.5)
    for i in range(60):  # later traffic on new slates: three honest principals and a liar
        slate = [i % 3, 10]
        for honest in ("a", "b", "c"):
            d.observe(honest, slate, 0.5 + 0.01 * (i % 3))
        d.observe("liar", slate, -0.5)
    assert d.verdict("liar").flagged and not d.verdict("a").flagged
    assert len(d.per_key) <= 8 and len(d.residuals) <= 4 and d.forgotten > 0


def test_when_most_principals_are_flagged_none_is_held() -> None:
    """Two principals whose utilities are opposite: both flagged, neither can be told the liar, and
    holding both would stop all learning: neither is held; the flag is for an operator."""
    book = PrincipalBook(cap=0.5, window=1000, tolerance=0.1, min_n=30)
    for k in range(40):
        chunk = [
            dataclasses.replace(
                experience(S, 2 * k + j, utility=(0.5 if j else -0.5)),
                feedback_principal="ab"[j],
            )
            for j in range(2)
        ]
        for e in chunk:
            e.event.selected = [1, 2]
        weights = book.weigh(chunk)
    assert book.disagreement.flagged == {"a", "b"}
    assert weights.tolist() == [1.0, 1.0] and book.held_experiences == 0
    # Names that sent a report or two are not compared enough to count: they cannot make the
    # flagged pair a minority and so hold all the real traffic at 0.
    for i in range(3):
        one_shot = dataclasses.replace(experience(S, 100 + i, utility=0.5), feedback_principal=f"probe-{i}")
        one_shot.event.selected = [40 + i]
        book.weigh([one_shot])
    assert book.held({"a", "b"}) == set()
