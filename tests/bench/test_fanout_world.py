"""The real-data bank of the real-LM benchmark: FanOutQA's sub-questions as memories and questions
(lab/causalmem_lab/fanout.py), and its path through the LM cache, the LM world and the bench's measures."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from causalmem_lab import fanout
from causalmem_lab.bench import lmlearning
from causalmem_lab.fanout import build_fanout_dataset
from causalmem_lab.lmdata import LMDataset, lm_utilities, subset_masks
from causalmem_lab.lmworld import LMScenario, LMWorld, policy_slots
from causalmem_lab.roles import HARMFUL, HELPFUL, IRRELEVANT

import pipeline.cli as cli
from tests.bench.test_lm_bench import fake_embed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fanoutqa") is None, reason="needs the fanoutqa package")


@pytest.fixture(scope="module")
def worlds() -> dict[str, LMDataset]:
    return {"some": build_fanout_dataset(), "every": build_fanout_dataset(lookalikes="every")}


def tops_of_notes() -> dict[str, set[int]]:
    """Each note's top-level questions (a note two sub-questions share is stored once)."""
    out: dict[str, set[int]] = {}
    for s in fanout.sub_questions(json.loads(fanout.dev_set_path().read_text())):
        if s.answer:
            out.setdefault(s.note, set()).add(s.top)
    return out


# --------------------------------------------------------------------------- the bank


def test_both_worlds_have_the_documented_counts(worlds: dict[str, LMDataset]) -> None:
    for name, ds in worlds.items():
        assert len(ds.questions) == len(set(ds.questions)) == 400
        assert len(ds.texts) == len(set(ds.texts)) >= 2000
        assert ds.meta["questions"] == 400 and ds.meta["top_level_questions"] == 310
        assert ds.meta["notes"] + ds.meta["lookalikes"] == len(ds.texts)
        assert ds.meta["lookalikes"] == sum(len(h) for h in ds.harmful)
        assert ds.fact == list(range(400)) and ds.paraphrase == [0] * 400
        assert all(len(a.split()) <= fanout.MAX_ANSWER_WORDS for a in ds.answers), name
    some, every = worlds["some"], worlds["every"]
    assert some.meta["with_lookalikes"] == some.meta["lookalikes"] == 40  # a tenth, one each
    assert every.meta["with_lookalikes"] == 400 and all(1 <= len(h) <= 2 for h in every.harmful)
    assert some.texts[: some.meta["notes"]] == every.texts[: every.meta["notes"]]  # the same notes
    assert some.questions == every.questions  # the same questions for one seed


def test_roles_are_consistent(worlds: dict[str, LMDataset]) -> None:
    tops = tops_of_notes()
    for ds in worlds.values():
        notes = set(ds.texts[: ds.meta["notes"]])
        for q in range(len(ds.questions)):
            question, answer, gold = ds.questions[q], ds.answers[q], ds.texts[ds.gold[q]]
            assert gold in notes and answer in gold and question in gold  # its own note
            assert answer not in question
            for h in ds.harmful[q]:  # a look-alike: the question's wording, a wrong answer
                assert h >= ds.meta["notes"] and ds.texts[h].startswith(question + " ")
                assert answer not in ds.texts[h]
            for d in ds.distractors[q]:  # a sibling: another note of the same top-level question
                assert ds.texts[d] in notes and d != ds.gold[q]
                assert tops[ds.texts[d]] & tops[gold]
            roles = ds.roles(q)
            assert roles[ds.gold[q]] == HELPFUL
            assert all(roles[h] == HARMFUL for h in ds.harmful[q])
            assert all(roles[d] == IRRELEVANT for d in ds.distractors[q])
    every = worlds["every"]
    assert np.mean([bool(d) for d in every.distractors]) > 0.9  # nearly every question has siblings


def test_the_bank_is_deterministic_by_seed(worlds: dict[str, LMDataset]) -> None:
    ds = worlds["some"]
    assert build_fanout_dataset() == ds and build_fanout_dataset().digest() == ds.digest()
    other = build_fanout_dataset(seed=1)
    assert other.digest() != ds.digest() and other.questions != ds.questions
    assert worlds["every"].digest() != ds.digest()
    with pytest.raises(ValueError):
        build_fanout_dataset(lookalikes="many")
    with pytest.raises(ValueError):
        build_fanout_dataset(questions=100_000)  # more than are eligible


def test_a_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fanoutqa"):
        fanout.dev_set_path()


# --------------------------------------------------------------------------- through the LM world


class FakeScorer:
    """Answer NLL the question's answer in the context lowers and its look-alike raises."""

    cache_key = "fake-model"

    def nll(self, prompts: Sequence[str], answers: Sequence[str]) -> np.ndarray:
        out = []
        for p, a in zip(prompts, answers, strict=True):
            question = p.rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")
            context = [x[2:] for x in p.split("\n") if x.startswith("- ")]
            out.append(4.0 - 3.0 * any(a in x for x in context) + 1.0 * any(x.startswith(question) for x in context))
        return np.array(out)


def head(full: LMDataset, n: int) -> LMDataset:
    """Every memory of ``full``, its first ``n`` questions."""
    return dataclasses.replace(
        full,
        **{f: getattr(full, f)[:n] for f in ("questions", "answers", "fact", "paraphrase", "gold")},
        harmful=full.harmful[:n],
        distractors=full.distractors[:n],
    )


def use_a_slice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, bench: Any, data: str) -> None:
    """Make ``bench``'s bank ``data`` a 6-question slice of the look-alike bank, scored by the fake
    LM and embedder (what the benches on the real-data world are tested on)."""
    ds = head(build_fanout_dataset(questions=20, lookalikes="every"), 6)
    monkeypatch.setitem(lmlearning.DATA, data, (lambda: ds, 6))

    def cached(data: Any, **kw: Any) -> Any:
        return lm_utilities(data, FakeScorer(), c=kw["c"], cache_dir=tmp_path, embedder=fake_embed)

    monkeypatch.setattr(bench, "lm_utilities", cached)


def test_a_slice_of_the_bank_runs_through_the_cache_the_world_and_the_measures(
    worlds: dict[str, LMDataset], tmp_path: Path
) -> None:
    n = 4
    ds = head(worlds["every"], n)
    u = lm_utilities(ds, FakeScorer(), c=12, k=3, cache_dir=tmp_path, embedder=fake_embed)
    assert u.candidates.shape == (n, 12) and u.nll.shape == (n, 1 << 12)
    assert int(np.isfinite(u.nll[0]).sum()) == len(subset_masks(12, 3)) == 299
    with pytest.raises(ValueError, match="policy slots"):
        LMWorld(LMScenario(n_candidates=12), ds, u)  # 512 slots cannot hold 2,000+ memories
    scenario = LMScenario(events=40, n_candidates=12, slots=policy_slots(len(ds.texts)))
    world = LMWorld(scenario, ds, u)
    assert world.train == world.test == list(range(n))  # one wording each: measured on what traffic asks
    assert {world.next_query().intent for _ in range(40)} == set(range(n))
    for q in range(n):
        sel = [int(s) for s in u.candidates[q, :3]]
        true_u, nll_with, nll_without, _ = world.feedback(q, sel)
        assert true_u == pytest.approx(nll_without - nll_with) == pytest.approx(u.utility(q, sel))
        if ds.gold[q] in u.candidates[q]:
            assert u.utility(q, [ds.gold[q]]) == pytest.approx(3.0)
        assert world.leak(q, ds.harmful[q]) and world.recall(q, [ds.gold[q]]) == 1.0
    sim = lmlearning.measure(u, ds, world.test)
    best = lmlearning.oracle(u, ds, world.test)
    assert best["value"] >= sim["value"] and best["leak"] == 0.0


def test_the_bench_picks_the_bank_and_its_candidates() -> None:
    assert lmlearning.DATA["templated"][1] == 6 and lmlearning.DATA["fanout"][1] == 6
    assert lmlearning.DATA["fanout-lookalike"][0]().meta["with_lookalikes"] == lmlearning.FANOUT_QUESTIONS
    argv = ["bench", "learning", "--lm", "--quick", "--data", "fanout-lookalike", "--candidates", "10"]
    a = cli.build_parser(argv).parse_args(argv)
    assert (a.data, a.candidates) == ("fanout-lookalike", 10)
    argv = ["bench", "learning", "--lm", "--quick"]
    a = cli.build_parser(argv).parse_args(argv)
    assert (a.data, a.candidates) == ("templated", None)  # today's bench
    assert policy_slots(300) == LMScenario.slots and policy_slots(2215) >= 2215


def test_the_bench_runs_on_the_bank_with_enough_policy_slots(
    worlds: dict[str, LMDataset], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = head(worlds["some"], 3)
    monkeypatch.setitem(lmlearning.DATA, "fanout", (lambda: ds, 12))
    real = lmlearning.lm_utilities

    def cached(data: LMDataset, **kw: Any) -> Any:  # the fake LM and embedder, the bench's C and k
        return real(data, FakeScorer(), c=kw["c"], cache_dir=tmp_path, embedder=fake_embed)

    monkeypatch.setattr(lmlearning, "lm_utilities", cached)
    argv = ["bench", "learning", "--lm", "--quick", "--data", "fanout", "--rows", "similarity"]
    args: argparse.Namespace = cli.build_parser(argv).parse_args(argv)
    report = asyncio.run(lmlearning.run(args))  # the similarity row alone: no broker, no pipeline
    d = report["dataset"]
    assert (d["data"], d["candidates"], d["k"], d["measured_on"]) == ("fanout", 12, 3, "trained")
    assert d["policy_slots"] >= d["memories"] == len(ds.texts) and d["held_out_questions"] == 3
    assert "trained questions" in lmlearning.table(report)
