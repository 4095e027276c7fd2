"""The evaluator: retrieval events with texts in, LLM feedback out.

Unit tests cover the prompts, the leave-one-out sets, the attribution sampling and the
skipping rules with a fake scorer; the real model (the default GGUF, loaded once for the
module) checks that a fictional supporting fact lowers the answer's NLL, and the broker
test runs the service end to end.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from pipeline.config import EvaluatorConfig, ScorerConfig, Settings
from pipeline.lm_evaluator.plan import SKIP_REASONS, Plan, attributed, feedback, feedback_id, plan
from pipeline.lm_evaluator.scoring import build_prompt
from pipeline.lm_evaluator.service import Evaluator, score_plans
from pipeline.metrics import Metrics
from pipeline.probes import total
from tests.helpers import retrieval_event, until
from topics.feedback import decode_llm_feedback
from topics.fields import Limits, encode
from topics.principal import EVALUATOR, Keyring

FACTS = {
    3: "The staging broker of Acme listens on port 19092.",
    7: "Acme's office cat is called Biscuit.",
    9: "Zorblat invoices are archived for seven years.",
}
QUESTION = "Which port does the Acme staging broker listen on?"
ANSWER = "19092"


def _event(selected: list[int], **fields: Any) -> Any:
    s = Settings(embedding_dim=8, slots=32)
    e = retrieval_event(s, fields.pop("query_id", "q1"), selected=selected, event_id=fields.pop("event_id", None))
    e.candidates = sorted(set(e.candidates) | set(selected))
    e.scores = np.full(len(e.candidates), 0.5)
    e.query_text = QUESTION
    e.memory_texts = {s_: FACTS[s_] for s_ in selected}
    e.answer_text = ANSWER
    for k, v in fields.items():
        setattr(e, k, v)
    return e


class FakeScorer:
    """NLL = 3 minus 1 per supporting fact in the prompt (and 0.1 per other line): checks the wiring."""

    def __init__(self) -> None:
        self.tokens_scored = 0
        self.calls: list[int] = []

    def nll(self, prompts: list[str], answers: list[str]) -> np.ndarray:
        self.calls.append(len(prompts))
        self.tokens_scored += sum(len(p) + len(a) for p, a in zip(prompts, answers, strict=True))
        return np.array([3.0 - 2.0 * (FACTS[3] in p) - 0.1 * p.count("- ") for p in prompts])


# --------------------------------------------------------------------------- plans


def test_with_and_without_prompts_keep_the_draw_order() -> None:
    p = plan(_event([7, 3]), attribution_rate=0.0, max_attributed=16)
    assert isinstance(p, Plan)
    assert p.prompts == [build_prompt(QUESTION, [FACTS[7], FACTS[3]]), build_prompt(QUESTION, [])]
    assert p.loo_slots == [] and p.index == [0, 1] and p.answer == ANSWER


def test_leave_one_out_prompts_drop_each_selected_memory_once() -> None:
    p = plan(_event([9, 3, 7]), attribution_rate=1.0, max_attributed=16)
    assert isinstance(p, Plan)
    assert p.loo_slots == [9, 3, 7]
    loo = [p.prompts[i] for i in p.index[2:]]
    assert loo == [
        build_prompt(QUESTION, [FACTS[3], FACTS[7]]),
        build_prompt(QUESTION, [FACTS[9], FACTS[7]]),
        build_prompt(QUESTION, [FACTS[9], FACTS[3]]),
    ]
    # one selected memory: its leave-one-out prompt is the one without memories, scored once
    single = plan(_event([3]), attribution_rate=1.0, max_attributed=16)
    assert isinstance(single, Plan)
    assert len(single.prompts) == 2 and single.index == [0, 1, 1]


def test_attribution_sampling_is_deterministic_per_event_id_and_near_the_rate() -> None:
    ids = [f"ev-{i}" for i in range(5000)]
    first = [attributed(i, 0.25) for i in ids]
    assert first == [attributed(i, 0.25) for i in ids], "replays and other evaluators must agree"
    assert 0.23 < sum(first) / len(ids) < 0.27
    # a larger rate attributes a superset (the same hash, a higher threshold)
    assert all(attributed(i, 0.5) for i, yes in zip(ids, first, strict=True) if yes)
    assert not any(attributed(i, 0.0) for i in ids) and all(attributed(i, 1.0) for i in ids)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"query_text": None}, "no_query_text"),
        ({"query_text": "  "}, "no_query_text"),
        ({"answer_text": None}, "no_answer"),
        ({"answer_text": ""}, "no_answer"),
        ({"selected": [], "fallback": True}, "nothing_selected"),
        ({"memory_texts": None}, "no_memory_texts"),
        ({"memory_texts": {3: FACTS[3]}}, "no_memory_texts"),  # slot 7's text is missing
    ],
)
def test_events_without_what_scoring_needs_are_skipped_with_a_reason(change: dict[str, Any], reason: str) -> None:
    assert reason in SKIP_REASONS
    e = _event([3, 7])
    for k, v in change.items():
        setattr(e, k, v)
    assert plan(e, attribution_rate=1.0, max_attributed=16) == reason


def test_feedback_carries_the_event_time_the_pair_and_the_per_slot_nll() -> None:
    scorer = FakeScorer()
    plans = [
        plan(_event([7, 3], event_id="a"), 1.0, max_attributed=16),
        plan(_event([7], event_id="b", query_id="q2"), 0.0, max_attributed=16),
    ]
    fbs = score_plans(scorer, [p for p in plans if isinstance(p, Plan)])
    assert scorer.calls == [4 + 2], "one scoring call for the whole batch"
    a, b = fbs
    assert a is not None and b is not None
    assert (a.event_id, a.query_id, a.ts) == ("fb-a", "q1", 1_767_225_600.0)
    assert a.nll_with == pytest.approx(0.8) and a.nll_without == pytest.approx(3.0)
    assert a.utility == pytest.approx(2.2)
    # without the supporting fact (slot 3) the answer is much harder than without the cat (slot 7)
    assert a.nll_without_slot == pytest.approx({7: 0.9, 3: 2.9})
    assert a.slot_effects([7, 3]) == pytest.approx({7: 0.1, 3: 2.1})
    assert b.nll_without_slot is None and b.utility == pytest.approx(0.1)
    assert a.principal == EVALUATOR  # contract 1.18: the evaluator names itself
    # what is published decodes under the contract, with the key the join checks
    back = decode_llm_feedback(encode(a.to_dict()), Limits(), key=b"q1")
    assert back.nll_without_slot == a.nll_without_slot


def test_an_answer_that_scores_nan_yields_no_feedback() -> None:
    class NanScorer(FakeScorer):
        def nll(self, prompts: list[str], answers: list[str]) -> np.ndarray:
            return np.full(len(prompts), np.nan)

    p = plan(_event([3]), 1.0, max_attributed=16)
    assert isinstance(p, Plan)
    assert score_plans(NanScorer(), [p]) == [None]


def test_long_event_ids_get_a_feedback_id_within_the_contracts_limit() -> None:
    long = "x" * 300
    assert len(feedback_id(long)) <= Limits().max_id_len
    assert feedback_id(long) == feedback_id(long) != feedback_id("y" * 300)


def test_the_configuration_rejects_a_rate_outside_0_1() -> None:
    with pytest.raises(ValueError, match="attribution rate"):
        Settings(evaluator_attribution_rate=1.5).evaluator()
    cfg = Settings.from_env({"CAUSALMEM_EVALUATOR_ATTRIBUTION_RATE": "0.5", "CAUSALMEM_EVALUATOR_THREADS": "2"})
    ev = cfg.evaluator()
    assert isinstance(ev, EvaluatorConfig) and ev.attribution_rate == 0.5
    assert ev.scorer == ScorerConfig(threads=2) and ev.group_id == "causalmem-evaluator"


# --------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def scorer() -> Any:
    from pipeline.lm_evaluator.scoring import AnswerScorer

    return AnswerScorer(ScorerConfig(threads=2))


def test_the_real_model_finds_the_answer_easier_with_its_supporting_fact(scorer: Any) -> None:
    with_fact = build_prompt(QUESTION, [FACTS[7], FACTS[3]])
    without = build_prompt(QUESTION, [FACTS[7]])
    nll = scorer.nll([with_fact, without, build_prompt(QUESTION, [])], [ANSWER] * 3)
    assert nll[0] + 1.0 < nll[1], f"a fictional fact in context must help: {nll}"
    assert nll[0] + 1.0 < nll[2]
    assert scorer.tokens_scored > 0
    # the head computed only where answer tokens are predicted gives the full computation's NLL
    assert scorer._keeps_logits
    scorer._keeps_logits = False
    try:
        full = scorer.nll([with_fact, without, build_prompt(QUESTION, [])], [ANSWER] * 3)
    finally:
        scorer._keeps_logits = True
    np.testing.assert_allclose(nll, full, rtol=1e-5)


def test_loading_the_model_prints_no_progress_bar(capfd: pytest.CaptureFixture[str]) -> None:
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from pipeline.lm_evaluator.scoring import _quiet_gguf

    bar = gguf_utils.tqdm

    with _quiet_gguf():  # what AnswerScorer loads the model under
        assert list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")) == [0, 1, 2]
    out, err = capfd.readouterr()
    assert "de-quantizing" not in out + err
    assert gguf_utils.tqdm is bar, "the bar is put back after loading"


# --------------------------------------------------------------------------- the service


@pytest.mark.broker
def test_the_service_scores_skips_and_dead_letters(topics_ready: Settings, scorer: Any, tmp_path: Path) -> None:
    from pipeline import kafka
    from pipeline.client.publisher import EventPublisher

    secret = tmp_path / "evaluator.key"
    secret.write_bytes(b"evaluator-secret")
    s = topics_ready.replace(evaluator_attribution_rate=1.0, evaluator_batch_size=8, evaluator_key_file=str(secret))
    topics = s.topics()
    bootstrap = s.bootstrap or ""
    scored = [_event([7, 3], query_id=f"q{i}", event_id=f"e{i}") for i in range(3)]
    skipped = [_event([3], query_id="q-no-answer", answer_text=None), _event([], query_id="q-fb", fallback=True)]

    async def main() -> None:
        metrics = Metrics(role="evaluator")
        ev = Evaluator(s.evaluator(), bootstrap, metrics, scorer)
        async with ev, EventPublisher(bootstrap, s) as pub:
            task = asyncio.create_task(ev.run())
            await pub.send_raw("retrieval-events", b'{"schema": "retrieval_event/v1", "query_id": 5', "q-bad")
            for e in scored + skipped:
                await pub.send_raw("retrieval-events", encode(e.to_dict()), e.query_id)
            await pub.flush()
            consumer = kafka.consumer(
                bootstrap, s, topics.llm_feedback.name, topics.dead_letter.name, group_id=uuid.uuid4().hex
            )
            await consumer.start()
            got: dict[str, list[Any]] = {topics.llm_feedback.name: [], topics.dead_letter.name: []}
            try:

                async def poll() -> bool:
                    for tp, msgs in (await consumer.getmany(timeout_ms=200)).items():
                        got[tp.topic].extend(msgs)
                    return len(got[topics.llm_feedback.name]) >= 3 and bool(got[topics.dead_letter.name])

                deadline = asyncio.get_running_loop().time() + 30
                while not await poll():
                    assert asyncio.get_running_loop().time() < deadline, f"timed out: {got}"
                await until(lambda: total(ev.own.skipped) >= 2, 10, "skips counted")
            finally:
                await consumer.stop()
            assert not task.done(), "the evaluator keeps running after bad input"
            await ev.stop()
            task.cancel()
        fbs = [decode_llm_feedback(m.value, s.limits(), m.key) for m in got[topics.llm_feedback.name]]
        # Signed as the evaluator (contract 1.18 with 1.16's header): a worker holding its key proves the name.
        ring = Keyring({EVALUATOR: b"evaluator-secret"})
        assert all(
            ring.proven(f.principal, m.value, m.headers) == EVALUATOR
            for f, m in zip(fbs, got[topics.llm_feedback.name], strict=True)
        )
        assert sorted(f.event_id for f in fbs) == ["fb-e0", "fb-e1", "fb-e2"]
        for f in fbs:
            assert f.ts == 1_767_225_600.0 and f.nll_with is not None and f.nll_without is not None
            assert f.utility > 0.5, "the supporting fact lowers the answer's NLL"
            assert f.nll_without_slot is not None and set(f.nll_without_slot) == {7, 3}
            effects = f.slot_effects([7, 3]) or {}
            assert effects[3] > effects[7], "dropping the supporting fact hurts more than dropping the cat"
        (dead,) = got[topics.dead_letter.name]
        assert orjson.loads(dead.value)["reason"] == "bad_json"
        assert total(ev.own.skipped, reason="no_answer") == 1
        assert total(ev.own.skipped, reason="nothing_selected") == 1
        assert total(ev.own.evaluations) == 3 and total(ev.own.tokens) > 0
        assert total(metrics.rejected, reason="bad_json") == 1

    asyncio.run(main())


# --------------------------------------------------------------------------- the command line


def test_without_the_lm_extra_the_verb_is_one_line_and_exit_2() -> None:
    from tests.unit.cli.test_extras import _run_without

    code = "import sys; from pipeline.cli import main; sys.exit(main(['evaluator', '--bootstrap', '127.0.0.1:1']))"
    done = _run_without({"transformers"}, code)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "causalmem evaluator: this needs transformers, from the 'lm' extra: pip install 'causal-memory-pipeline[lm]'"
    )


def test_a_missing_model_is_one_line_and_exit_2(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import main

    missing = tmp_path / "nowhere.gguf"
    assert main(["evaluator", "--model", str(missing), "--bootstrap", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"causalmem evaluator: cannot load the model: model {missing} not found (a local model directory or .gguf file)"
    ]


def test_readiness_needs_partitions_and_the_exposition_is_the_evaluators() -> None:
    from aiokafka import TopicPartition
    from prometheus_client import generate_latest

    from pipeline.cli.evaluator import watch_evaluator
    from pipeline.probes import Probes

    s = Settings()
    metrics = Metrics(role="evaluator")
    ev = Evaluator(s.evaluator(), "127.0.0.1:1", metrics, FakeScorer())
    probes = Probes()
    watch_evaluator(probes, metrics, ev)
    probes.beat()
    assert any("no input partitions" in p for p in probes.ready())
    ev.on_assigned({TopicPartition(s.topics().retrieval_events.name, 0)})
    probes.beat()
    assert probes.ready() == []
    text = generate_latest(metrics.registry).decode()
    for name in ("evaluations_total", "skipped_total", "tokens_total", "batch_seconds_bucket", "partitions_owned"):
        assert f"causalmem_evaluator_{name}" in text, name
    assert 'causalmem_evaluator_skipped_total{reason="no_answer"} 0.0' in text
    assert "causalmem_events_in_total" in text or "causalmem_events_in" in text
    assert "causalmem_joins_total" not in text and "causalmem_learner_loss" not in text


def test_the_benchs_text_events_are_scored_on_the_real_path() -> None:
    from causalmem_lab.bench.evaluator import make_text_events, scoring_path

    events = make_text_events(20)
    assert all(isinstance(plan(e, 1.0, max_attributed=16), Plan) for e in events), (
        "every generated event has what scoring needs"
    )
    assert len({e.query_text for e in events}) > 5 and all(len(e.selected) == 3 for e in events)
    scorer = FakeScorer()
    scorer.config = ScorerConfig()  # type: ignore[attr-defined]  # the bench sets its batch size
    row = scoring_path(scorer, events, rate=1.0, batch=8)
    assert row["events"] == 20 and row["prompts_per_event"] == 5.0
    assert scorer.calls == [40, 40, 20], "8 events (5 prompts each) per scoring call"
    assert row["evaluations_per_s"] > 0 and row["tokens_per_s"] > 0


def _wide_event(n: int, event_id: str = "wide") -> Any:
    """An event that selected ``n`` memories (the contract allows up to 1,024)."""
    e = _event([3], event_id=event_id)
    e.selected = list(range(n))
    e.candidates = list(range(n))
    e.scores = np.full(n, 0.5)
    e.memory_texts = {s: f"note {s}" for s in range(n)}
    return e


def test_one_event_costs_at_most_max_attributed_leave_one_out_prompts() -> None:
    e = _wide_event(1024)
    p = plan(e, 1.0, max_attributed=16)
    assert isinstance(p, Plan)
    assert p.capped and len(p.loo_slots) == 16 and len(p.prompts) == 2 + 16
    assert p.loo_slots == [s for s in e.selected if s in set(p.loo_slots)], "draw order kept"
    again = plan(_wide_event(1024), 1.0, max_attributed=16)
    assert isinstance(again, Plan) and again.loo_slots == p.loo_slots, "replays and replicas choose the same"
    other = plan(_wide_event(1024, event_id="wide-2"), 1.0, max_attributed=16)
    assert isinstance(other, Plan) and other.loo_slots != p.loo_slots, "not always the same memories"
    # each leave-one-out prompt leaves out the memory it is scored for
    for slot, row in zip(p.loo_slots, p.index[2:], strict=True):
        assert f"- note {slot}\n" not in p.prompts[row] and "- note 1023\n" in p.prompts[0]
    fb = feedback(p, [1.0] * len(p.prompts))
    assert sorted(fb.nll_without_slot or {}) == sorted(p.loo_slots)
    # within the cap: every memory, not capped; a cap of 0: no leave-one-out at all
    small = plan(_wide_event(16), 1.0, max_attributed=16)
    assert isinstance(small, Plan) and small.loo_slots == list(range(16)) and not small.capped
    off = plan(e, 1.0, max_attributed=0)
    assert isinstance(off, Plan) and off.loo_slots == [] and len(off.prompts) == 2
    with pytest.raises(ValueError, match="max attributed"):
        EvaluatorConfig(connection=Settings().connection(), max_attributed=-1)


async def test_the_service_counts_events_attributed_on_a_subset() -> None:
    """An event over the cap is scored with 18 prompts and counted in attribution_capped_total."""
    s = Settings(embedding_dim=8, slots=1024, evaluator_attribution_rate=1.0, evaluator_max_attributed=16)
    assert s.evaluator().max_attributed == 16
    metrics = Metrics(role="evaluator")

    class FlatScorer(FakeScorer):
        def nll(self, prompts: list[str], answers: list[str]) -> np.ndarray:
            out: np.ndarray = np.maximum(super().nll(prompts, answers), 0.5)  # 1,023 context lines: a valid NLL
            return out

    scorer = FlatScorer()
    ev = Evaluator(s.evaluator(), "127.0.0.1:1", metrics, scorer)
    sent: list[bytes] = []

    class Dead:
        def send(self, msg: Any, reason: str, detail: str) -> None:
            raise AssertionError(f"dead-lettered: {reason} {detail}")

        async def flush(self) -> None:
            return None

    class Producer:
        async def send(self, topic: str, value: bytes, key: bytes, headers: Any = None) -> asyncio.Future[None]:
            assert headers is None  # no evaluator_key_file: unsigned
            sent.append(value)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

    async def commit(ends: Any) -> None:
        return None

    ev._dead = Dead()  # type: ignore[assignment]
    ev._producer = Producer()
    ev.commit = commit  # type: ignore[method-assign,assignment]

    class Msg:
        def __init__(self, offset: int, event: Any) -> None:
            self.topic, self.partition, self.offset = s.topics().retrieval_events.name, 0, offset
            self.key, self.value = event.query_id.encode(), encode(event.to_dict())

    wide = _wide_event(1024)
    wide.features.query_embedding = np.zeros(8, dtype=np.float32)
    narrow = _event([7, 3], event_id="narrow")
    narrow.features.query_embedding = np.zeros(8, dtype=np.float32)
    assert await ev.process([Msg(0, wide), Msg(1, narrow)]) == 2
    assert scorer.calls == [(2 + 16) + (2 + 2)], "the wide event costs 18 prompts, not 1,026"
    assert total(ev.own.attribution_capped) == 1
    assert total(ev.own.attributed) == 2
    per_slot = decode_llm_feedback(sent[0], s.limits()).nll_without_slot
    assert per_slot is not None and len(per_slot) == 16
