"""The active-learning rule without Kafka: candidates, verdicts in either order, once per step, sample ids.

The last tests run the join's emission and the outcomes and labels stages on plain
dictionaries in place of faust tables, so the whole rule is checked end to end in
milliseconds; tests/integration/test_active_learning.py checks the same through a real worker.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from pipeline.config import ActiveLearningConfig, DriftConfig, Settings
from pipeline.metrics import Metrics
from pipeline.worker.active_learning import (
    CandidateRule,
    first_send,
    hold,
    on_candidate,
    on_verdict,
    uncertainty_margin,
)
from pipeline.worker.drift import DriftStage
from pipeline.worker.join import JoinStage, _BatchTally
from pipeline.worker.labels import LabelsStage
from pipeline.worker.outcomes import OutcomesStage, counted
from pipeline.worker.records import MAX_STEPS_PER_QUERY, PendingSamples, QueryUtility
from pipeline.worker.tables import Outputs, Tables
from tests.helpers import feedback, label, retrieval_event
from tests.join_fakes import FakeTopic
from topics.convert import make_sample, sample_id_for
from topics.fields import encode
from topics.internal import Outcome, RatingPair, decode_experience, decode_outcomes, outcomes_bytes
from topics.labels import decode_active_learning_sample

S = Settings(embedding_dim=8, slots=32, partitions=4)
T0 = 1_800_000_000.0


# --------------------------------------------------------------------------- the join's side


def test_error_threshold_is_strict_and_fallback_is_never_a_candidate() -> None:
    rule = CandidateRule(ActiveLearningConfig(threshold=-0.3))
    assert rule.reason(-0.3, fallback=False, margin=None) is None  # at the threshold: not below it
    assert rule.reason(-0.3000001, fallback=False, margin=None) == "error"
    assert rule.reason(-5.0, fallback=True, margin=0.0) is None
    assert rule.steps == 3  # every joined step counts toward the uncertainty budget


def test_error_wins_over_uncertain_and_uncertainty_needs_a_small_logged_margin() -> None:
    rule = CandidateRule(ActiveLearningConfig(threshold=-0.3, uncertainty_budget=1.0, uncertainty_margin=0.05))
    assert rule.reason(-0.9, False, margin=0.0) == "error"
    assert rule.uncertain == 0
    assert rule.reason(0.1, False, margin=None) is None  # no candidate_probs logged
    assert rule.reason(0.1, False, margin=0.05) is None  # not below the margin
    assert rule.reason(0.1, False, margin=0.049) == "uncertain"
    off = CandidateRule(ActiveLearningConfig(uncertainty_budget=0.0))
    assert off.reason(0.1, False, margin=0.0) is None


def test_uncertainty_budget_is_a_fraction_of_every_prefix_of_joined_steps() -> None:
    rule = CandidateRule(ActiveLearningConfig(uncertainty_budget=0.25, uncertainty_margin=0.05))
    marks = [rule.reason(0.2, False, margin=0.001) == "uncertain" for _ in range(40)]
    running = np.cumsum(marks)
    # A step may be marked while fewer than budget × steps-so-far were: never more than the ceiling.
    assert all(running[i] <= np.ceil(0.25 * (i + 1)) for i in range(40))
    assert running[-1] == 10  # the budget is used, not just respected
    assert rule.uncertain == 10


def test_classify_reads_the_margin_from_the_logged_first_draw_probabilities() -> None:
    rule = CandidateRule(ActiveLearningConfig(uncertainty_budget=1.0, uncertainty_margin=0.05))
    ev = retrieval_event(S, "q")
    n = len(ev.candidates)
    ev.candidate_probs = np.array([0.30, 0.29] + [0.41 / (n - 2)] * (n - 2))
    assert uncertainty_margin(ev) == pytest.approx(0.01)
    assert rule.classify(ev, 0.2) == "uncertain"
    ev.candidate_probs = np.array([0.6, 0.1] + [0.3 / (n - 2)] * (n - 2))
    assert rule.classify(ev, 0.2) is None
    ev.candidate_probs = None
    assert uncertainty_margin(ev) is None and rule.classify(ev, 0.2) is None


# --------------------------------------------------------------------------- the tables' side


def test_candidate_action_by_verdict() -> None:
    assert [on_candidate("error", v) for v in (None, False, True)] == ["hold", "emit", "drop"]
    assert [on_candidate("uncertain", v) for v in (None, False, True)] == ["emit", "emit", "emit"]


def test_a_wrong_verdict_releases_waiting_samples_in_numeric_step_order() -> None:
    pending = None
    for step in (10, 9, 2):
        pending = hold(pending, step, f"sample-{step}", T0 + step)
    assert isinstance(pending, PendingSamples) and pending.ts == T0 + 10
    assert on_verdict(False, pending) == [(2, "sample-2"), (9, "sample-9"), (10, "sample-10")]
    assert on_verdict(True, pending) == []
    assert on_verdict(False, None) == []


def test_a_step_is_sent_once() -> None:
    sent = first_send(None, 3, T0)
    assert sent is not None and sent.steps == [3]
    assert first_send(sent, 3, T0 + 1) is None
    again = first_send(sent, 4, T0 + 2)
    assert again is not None and again.steps == [3, 4] and again.ts == T0 + 2
    many = sent
    for step in range(4, 4 + 2 * MAX_STEPS_PER_QUERY):
        many = first_send(many, step, T0) or many
    assert len(many.steps) == MAX_STEPS_PER_QUERY  # bounded per query


def test_sample_ids_are_deterministic_per_query_and_step() -> None:
    ids = {sample_id_for(q, step) for q in ("a", "b") for step in (0, 1)}
    assert len(ids) == 4
    assert sample_id_for("a", 1) == sample_id_for("a", 1)
    ev = retrieval_event(S, "a", step=1)
    assert make_sample(ev, -0.5, "error", T0).sample_id == sample_id_for("a", 1)


def test_utility_counts_each_step_once() -> None:
    recs = [Outcome("q", s, T0 + s, u, False, "default") for s, u in ((0, 0.5), (1, -0.5), (0, 0.5))]
    q, fresh = counted(None, recs)
    assert (q.n, q.u_query, q.ts, [r.step for r in fresh]) == (2, 0.0, T0 + 1, [0, 1])
    q2, fresh2 = counted(q, [Outcome("q", 1, T0 + 9, 3.0, False, "default")])
    assert fresh2 == [] and q2.n == 2


# --------------------------------------------------------------------------- end to end, without Kafka


def _stages() -> tuple[OutcomesStage, LabelsStage, Tables, Outputs]:
    names = Tables.__dataclass_fields__
    tables = Tables(**{name: {} for name in names})
    outputs = Outputs(**{name: FakeTopic() for name in Outputs.__dataclass_fields__})
    metrics = Metrics()
    outcomes = OutcomesStage(tables, outputs, metrics, S.limits())
    labels = LabelsStage(tables, outputs, metrics, outcomes, S.topics(), S.limits())
    return outcomes, labels, tables, outputs


def _joined(stage: JoinStage, qid: str, utility: float, step: int = 0) -> list[Outcome]:
    """What the join sends to ``outcomes`` for one joined step (through the wire format)."""
    ev = retrieval_event(S, qid, step=step, ts=T0)
    ev.query_text, ev.memory_texts = f"question {qid}", {c: f"memory {c}" for c in ev.candidates}
    out: dict[int, list[Outcome]] = {}
    stage._emit(ev, feedback(qid, step, ts=T0 + 1, utility=utility), [], out, _BatchTally(), 0)
    return decode_outcomes(outcomes_bytes(out[0]), S.limits()).records


async def _feed(outcomes: OutcomesStage, recs: list[Outcome]) -> None:
    await outcomes.on_query(recs[0].query_id, recs)


def _samples(outputs: Outputs) -> list[Any]:
    sent = outputs.active_learning.sent
    return [decode_active_learning_sample(m["value"], S.limits(), m["key"]) for m in sent]


async def test_the_join_encodes_a_candidates_sample_once_and_the_stage_forwards_those_bytes() -> None:
    stage = JoinStage(S.join(), "127.0.0.1:9", Metrics())
    ev = retrieval_event(S, "q1", ts=T0)
    out: dict[int, list[Outcome]] = {}
    stage._emit(ev, feedback("q1", ts=T0 + 1, utility=-0.8), [], out, _BatchTally(), 2)
    [rec] = decode_outcomes(outcomes_bytes(out[2]), S.limits()).records
    assert rec.al == "error" and rec.sample is not None
    assert rec.sample.encode() == encode(make_sample(ev, -0.8, "error", T0 + 1).to_dict())
    stage._emit(retrieval_event(S, "q2"), feedback("q2", utility=0.4), [], out, _BatchTally(), 2)
    [good] = [r for r in out[2] if r.query_id == "q2"]
    assert good.al is None and good.sample is None
    outcomes, labels, _, outputs = _stages()
    await labels.on_label(label("q1", "verdict", ts=T0 + 5, answer_correct=False))
    await _feed(outcomes, [rec])
    assert [m["value"] for m in outputs.active_learning.sent] == [rec.sample.encode()]


@pytest.mark.parametrize("verdict_first", [False, True])
async def test_error_sample_in_either_order_once_and_its_answer_becomes_a_label_experience(verdict_first: bool) -> None:
    stage = JoinStage(S.join(), "127.0.0.1:9", Metrics())

    outcomes, labels, tables, outputs = _stages()
    bad = _joined(stage, "q", -0.9)
    verdict = label("q", "verdict", ts=T0 + 5, answer_correct=False)
    if verdict_first:
        await labels.on_label(verdict)
        await _feed(outcomes, bad)
    else:
        await _feed(outcomes, bad)
        assert outputs.active_learning.sent == [] and b"q" in tables.al_pending
        await labels.on_label(verdict)
    # Delivered again (a re-read after a takeover), and a second verdict: still one sample.
    await _feed(outcomes, bad)
    await labels.on_label(label("q", "verdict", ts=T0 + 6, answer_correct=False))
    [sample] = _samples(outputs)
    assert (sample.query_id, sample.reason, sample.query_text) == ("q", "error", "question q")
    assert sample.utility == pytest.approx(-0.9) and b"q" not in tables.al_pending
    # The labeler's answer to it → one label experience for the learner.
    answer = label("q", "memory_choice", ts=T0 + 9, sample_id=sample.sample_id, correct_memories=[sample.candidates[1]])
    await labels.on_label(answer)
    await labels.on_label(answer)  # the same label event again: applied once
    [sent] = outputs.experiences.sent
    exp = decode_experience(sent["value"], S.limits())
    assert (exp.kind, exp.id, exp.correct_memories) == ("label", answer.event_id, [sample.candidates[1]])
    assert exp.event.candidates == sample.candidates and exp.event.event_id == sample.sample_id
    np.testing.assert_allclose(exp.event.features.query_embedding, sample.features.query_embedding)


async def test_no_sample_for_a_correct_answer_a_good_step_or_an_unknown_sample() -> None:
    stage = JoinStage(S.join(), "127.0.0.1:9", Metrics())

    outcomes, labels, tables, outputs = _stages()
    await _feed(outcomes, _joined(stage, "right", -0.9))
    await labels.on_label(label("right", "verdict", ts=T0 + 5, answer_correct=True))
    await labels.on_label(label("good", "verdict", ts=T0 + 5, answer_correct=False))
    await _feed(outcomes, _joined(stage, "good", 0.4))
    assert outputs.active_learning.sent == [] and tables.al_pending == {}
    await labels.on_label(label("right", "memory_choice", ts=T0 + 9, sample_id="nope", correct_memories=[1]))
    assert outputs.experiences.sent == []


async def test_a_rating_pairs_with_u_query_once() -> None:
    stage = JoinStage(S.join(), "127.0.0.1:9", Metrics())

    outcomes, labels, tables, outputs = _stages()
    await labels.on_label(label("r", "rating", ts=T0 + 2, rating=4))
    assert outputs.rating_pairs.sent == []  # no U_query yet
    await _feed(outcomes, _joined(stage, "r", 0.25) + _joined(stage, "r", 0.75, step=1))
    await _feed(outcomes, _joined(stage, "r", 0.75, step=1))  # re-delivered: no second pair
    [pair] = outputs.rating_pairs.sent
    assert pair["key"] == b"r" and tables.ratings[b"r"].paired
    body = orjson.loads(pair["value"])
    assert (body["u_query"], body["rating"]) == (pytest.approx(0.5), 4)
    assert isinstance(tables.query_util[b"r"], QueryUtility)


async def test_a_labeler_answers_a_sample_once_whatever_the_event_id() -> None:
    """A second answer by the same labeler to the same sample (another event id, e.g. a
    second consumer group or a hand-made label) is counted as a duplicate and ignored;
    another labeler's answer to that sample still counts."""
    stage = JoinStage(S.join(), "127.0.0.1:9", Metrics())
    outcomes, labels, tables, outputs = _stages()
    await _feed(outcomes, _joined(stage, "q", -0.9))
    await labels.on_label(label("q", "verdict", ts=T0 + 5, answer_correct=False))
    [sample] = _samples(outputs)
    sid, c = sample.sample_id, sample.candidates

    def answer(who: str, slots: list[int], rating: int) -> Any:
        lab = label("q", "memory_choice", ts=T0 + 9, sample_id=sid, correct_memories=slots, rating=rating)
        lab.labeler = who
        return lab

    dup = labels.metrics.duplicates.labels(topic=S.topics().human_labels.name)
    await labels.on_label(answer("ann", [c[1]], 4))
    await labels.on_label(answer("ann", [c[0]], 0))  # the same person again, another event id
    assert dup._value.get() == 1
    assert tables.ratings[b"q"].rating == 4
    [first] = [decode_experience(m["value"], S.limits()) for m in outputs.experiences.sent]
    assert first.correct_memories == [c[1]]
    await labels.on_label(answer("bob", [c[0]], 1))  # another labeler: a second opinion
    assert [decode_experience(m["value"], S.limits()).correct_memories for m in outputs.experiences.sent] == [
        [c[1]],
        [c[0]],
    ]


async def _stream(*values: bytes) -> Any:
    for value in values:
        yield value


async def test_the_stage_agents_skip_a_malformed_internal_value_and_go_on(caplog: pytest.LogCaptureFixture) -> None:
    """A bad ``outcomes`` or ``rating-pairs`` value is logged and skipped, never fatal to the worker."""
    stage = JoinStage(S.join(), "127.0.0.1:9", Metrics())
    outcomes, _, tables, outputs = _stages()
    good = outcomes_bytes(_joined(stage, "q", 0.25))
    wrong = encode({"schema": "outcomes/v1", "records": [{"query_id": "q", "step": "one"}]})
    await outcomes.agent(_stream(b"{not json", wrong, good))
    assert tables.query_util[b"q"].n == 1
    assert "unreadable internal message skipped (wrong_type" in caplog.text

    drift = DriftStage(DriftConfig(), tables, outputs, Metrics(), S.limits())
    pair = encode(RatingPair("q", T0, 0.25, 4.0).to_dict())
    await drift.agent(_stream(encode({"schema": "rating_pair/v1", "id": "q", "t": T0, "u_query": 0.1}), pair))
    assert tables.drift_pairs[b"q"].r == 4.0 and len(tables.drift_pairs) == 1
    assert "drift: unreadable pair skipped (missing_field" in caplog.text


def test_table_records_survive_the_changelog_round_trip() -> None:
    from faust.serializers.registry import Registry

    from models.drift import DriftTrigger
    from pipeline.worker.records import DriftStatus, StoredSamples, TriggerState

    trig = DriftTrigger(reference=0.7, resets=2, since_reset=5, peak=0.8, peak_t=T0)
    records = [
        QueryUtility(sum=1.5, n=3, steps=[0, 1, 5], ts=T0),
        hold(None, 12, '{"sample": 1}', T0),
        StoredSamples(samples={"abc": '{"x": "y"}'}, ts=T0),
        TriggerState.of(trig),
        DriftStatus(correlation=0.5, pairs=60, reference=None, t=T0, resets=0),
    ]
    reg = Registry()
    for rec in records:
        back = reg.loads_value(type(rec), reg.dumps_value(type(rec), rec, serializer="json"))
        assert type(back) is type(rec) and back.asdict() == rec.asdict()
    restored = DriftTrigger()
    restored.load(TriggerState.of(trig).state())
    assert restored.state() == trig.state()


def test_settings_compose_the_worker_configuration() -> None:
    s = Settings.from_env(
        {
            "CAUSALMEM_TOPIC_PREFIX": "dev.",
            "CAUSALMEM_PARTITIONS": "6",
            "CAUSALMEM_AL_THRESHOLD": "-0.5",
            "CAUSALMEM_AL_UNCERTAINTY_BUDGET": "0.1",
            "CAUSALMEM_JOIN_WINDOW_S": "120",
            "CAUSALMEM_DRIFT_RESET": "false",
            "CAUSALMEM_LABEL_WINDOW_S": "3600",
        }
    )
    w = s.worker()
    assert (w.app_id, w.join.group_id, w.partitions) == ("dev.causalmem-worker", "dev.causalmem-join", 6)
    assert w.connection.topics.outcomes.name == "dev.outcomes" and w.connection.security is s.security
    assert w.join.connection == w.connection and w.join.window_s == 120.0
    assert (w.join.active_learning.threshold, w.join.active_learning.uncertainty_budget) == (-0.5, 0.1)
    assert w.drift.reset is False and w.label_window_s == 3600.0
