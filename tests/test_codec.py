"""Wire-contract codec (docs/contract.md): the decoders of topics/ (events, feedback, labels,
internal, manifest): valid values round-trip and each rejection reason has its input.

Every decoder either returns a typed value or raises :class:`topics.fields.Rejected` with one
of the machine-readable ``REASONS``. Fuzzing and the fast path are in
tests/test_codec_properties.py; the examples in tests/codec_examples.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.codec_examples import (
    DECODER_IDS,
    DECODERS,
    SHA,
    D,
    S,
    al_dict,
    assert_same,
    control_dict,
    dec_al,
    dec_control,
    dec_experience,
    dec_feedback,
    dec_label,
    dec_manifest,
    dec_retrieval,
    drop_field,
    expect_reason,
    experience_dict,
    feedback_dict,
    label_dict,
    manifest_dict,
    raw_of,
    retrieval_dict,
    set_field,
)
from topics.events import RetrievalEvent, decode_retrieval_event
from topics.feedback import LLMFeedback, decode_llm_feedback
from topics.fields import NO_KEY_CHECK, REASONS, Limits, Rejected, encode
from topics.internal import (
    Control,
    Experience,
)
from topics.labels import ActiveLearningSample, HumanLabel
from topics.manifest import (
    MAX_CHUNK_BYTES,
    Manifest,
    candidate_key,
    chunk_key,
    decode_manifest,
    parse_key,
    serving_key,
    validate_policy_name,
)

# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(("name", "dec", "factory"), DECODERS, ids=DECODER_IDS)
def test_valid_example_round_trips(name: str, dec: Any, factory: Any) -> None:
    first = dec(raw_of(factory()), key=b"q1")
    again = dec(encode(first.to_dict()), key=b"q1")
    assert_same(first, again)
    # ... and once more from the re-encoded bytes: encoding is stable.
    assert encode(again.to_dict()) == encode(first.to_dict())


@pytest.mark.parametrize("kind", ["rating", "verdict", "memory_choice"])
def test_every_label_kind_round_trips(kind: str) -> None:
    first = dec_label(raw_of(label_dict(kind)), key="q1")
    assert isinstance(first, HumanLabel)
    assert first.kind == kind
    assert_same(first, dec_label(encode(first.to_dict())))


def test_retrieval_event_fields_decoded() -> None:
    ev = dec_retrieval(raw_of(retrieval_dict()), key=b"q1")
    assert isinstance(ev, RetrievalEvent)
    assert (ev.event_id, ev.query_id, ev.step, ev.ts) == ("e1", "q1", 2, 1_700_000_000.25)
    assert ev.features.query_embedding.dtype == np.float32
    np.testing.assert_array_equal(ev.features.query_embedding, np.float32([0.5, -0.1, 0.3, 0.8]))
    assert (ev.features.last_step_loss, ev.features.last_step_entropy) == (0.75, 1.5)
    assert ev.candidates == [0, 1, 2, 5] and ev.selected == [0, 5] and ev.dropped == [3]
    np.testing.assert_array_equal(ev.scores, [0.9, 0.8, 0.7, 0.5])
    assert (ev.temperature, ev.logprob, ev.fallback, ev.mask_max) == (0.5, -1.25, False, 1.125)
    assert ev.memory_texts == {0: "alpha", 5: "beta"}
    assert (ev.policy, ev.policy_version) == ("default", 3)


def test_retrieval_event_optional_fields_default() -> None:
    d = retrieval_dict()
    for name in (
        "policy",
        "policy_version",
        "mask_max",
        "query_text",
        "memory_texts",
        "dropped",
        "candidate_masks",
        "candidate_probs",
    ):
        del d[name]
    ev = dec_retrieval(raw_of(d))
    assert ev.policy == "default" and ev.policy_version == 0
    assert ev.mask_max is None and ev.memory_texts is None and ev.candidate_masks is None
    assert "mask_max" not in ev.to_dict()
    assert_same(ev, dec_retrieval(encode(ev.to_dict())))


def test_fallback_event_may_have_no_candidates() -> None:
    ev = dec_retrieval(
        raw_of(
            retrieval_dict(
                fallback=True, candidates=[], scores=[], selected=[], candidate_masks=None, candidate_probs=None
            )
        )
    )
    assert ev.fallback and ev.candidates == []


def test_feedback_utility_is_nll_without_minus_nll_with() -> None:
    fb = dec_feedback(raw_of(feedback_dict(nll_with=1.5, nll_without=2.25)))
    assert isinstance(fb, LLMFeedback)
    assert fb.utility == 0.75
    hurt = dec_feedback(raw_of(feedback_dict(nll_with=3.0, nll_without=1.0)))
    assert hurt.utility == -2.0  # memories made the answer less likely
    for w, wo in [(0.1, 0.3), (2.7, 0.4), (0.0, 5.5)]:
        assert dec_feedback(raw_of(feedback_dict(nll_with=w, nll_without=wo))).utility == wo - w


def test_feedback_utility_only_form() -> None:
    d = feedback_dict(utility=-0.3)
    del d["nll_with"], d["nll_without"]
    fb = dec_feedback(raw_of(d))
    assert fb.utility == -0.3 and fb.nll_with is None and fb.nll_without is None
    assert "utility" in fb.to_dict() and "nll_with" not in fb.to_dict()
    assert_same(fb, dec_feedback(encode(fb.to_dict())))


def test_feedback_consistent_utility_with_nlls_accepted() -> None:
    assert dec_feedback(raw_of(feedback_dict(utility=0.75))).utility == 0.75


def test_active_learning_sample_fields() -> None:
    s = dec_al(raw_of(al_dict()))
    assert isinstance(s, ActiveLearningSample)
    assert s.top_slots == [{"slot": 1, "prob": 0.5}, {"slot": 0, "prob": 0.25}]
    assert s.temperature == 0.5 and s.utility == -0.5
    np.testing.assert_array_equal(s.scores, [0.9, 0.8, 0.7])


def test_experience_and_control_values() -> None:
    e = dec_experience(raw_of(experience_dict()))
    assert isinstance(e, Experience) and isinstance(e.event, RetrievalEvent)
    assert e.kind == "label" and e.correct_memories == [5] and e.utility == 0.75
    # to_dict strips the texts the learner never needs
    ev = dec_retrieval(raw_of(retrieval_dict()))
    body = Experience("e1", "feedback", ev, utility=0.5).to_dict()
    assert "memory_texts" not in body["event"] and "query_text" not in body["event"]
    c = dec_control(raw_of(control_dict()))
    assert isinstance(c, Control)
    assert (c.command, c.reason, c.id, c.details) == ("reset", "drift", "c1", {"correlation": 0.25, "reference": 0.75})


def test_manifest_fields_and_keys() -> None:
    m = dec_manifest(raw_of(manifest_dict()))
    assert isinstance(m, Manifest)
    assert m.arch == {"input_dim": D + 2, "hidden": 512, "slots": S, "embedding_dim": D}
    assert m.input_offsets == {"experiences/0": 12, "experiences/1": 0}
    assert (m.version, m.size, m.chunks, m.sha256) == (7, MAX_CHUNK_BYTES + 1, 2, SHA)
    # default limits accept a manifest too
    assert decode_manifest(raw_of(manifest_dict())).version == 7
    assert chunk_key("p", 3, 1) == "p/3/1" and serving_key("p") == "p" and candidate_key("p") == "p/candidate"
    assert parse_key(chunk_key("p", 3, 1)) == ("chunk", "p", 3, 1)
    assert parse_key(candidate_key("p")) == ("candidate", "p", None, None)
    assert parse_key("p") == ("serving", "p", None, None)
    assert parse_key("p/x/1")[0] == "unknown" and parse_key("a/b/c/d")[0] == "unknown"
    assert validate_policy_name("default") == "default"
    for bad in ("", "a/b", "x" * 129):
        with pytest.raises(ValueError):
            validate_policy_name(bad)


def test_unknown_extra_fields_are_ignored() -> None:
    d = retrieval_dict(extra_top={"nested": [1, 2, {"x": None}]}, future_field="v2-only")
    d["features"]["future_feature"] = [1.0, 2.0]
    with_extra = dec_retrieval(raw_of(d))
    assert_same(with_extra, dec_retrieval(raw_of(retrieval_dict())))
    assert "extra_top" not in with_extra.to_dict()
    for _, dec, factory in DECODERS:
        plain = dec(raw_of(factory()))
        extra = dec(raw_of(factory(zz_unknown=[1, {"a": "b"}], zz_flag=True)))
        assert_same(plain, extra)


def test_decoders_accept_str_and_bytes_keys() -> None:
    raw = raw_of(retrieval_dict())
    assert dec_retrieval(raw, key="q1").query_id == "q1"
    assert dec_retrieval(raw, key=b"q1").query_id == "q1"
    assert dec_retrieval(raw).query_id == "q1"  # no key given: no key check (e.g. replay)
    # a message read from a keyed topic without a key breaks co-partitioning
    assert expect_reason("key_mismatch", dec_retrieval, raw, key=None).reason == "key_mismatch"


# --------------------------------------------------------------------------- rejections


VALID_RAW = raw_of(retrieval_dict())
MISSING_KEY = object()  # table marker: the message arrived without a key (key=None)
_fb_no_utility = drop_field(drop_field(feedback_dict(), "nll_with"), "nll_without")

# (reason, id, decoder, raw bytes, key)
REJECTIONS: list[tuple[str, str, Any, Any, Any]] = [
    # bad_json
    ("bad_json", "truncated", dec_retrieval, VALID_RAW[: len(VALID_RAW) // 2], None),
    ("bad_json", "truncated-1", dec_feedback, raw_of(feedback_dict())[:-1], None),
    ("bad_json", "invalid-utf8", dec_retrieval, b'{"schema": "retrieval_event/v1", "x": "\xff\xfe"}', None),
    ("bad_json", "invalid-utf8-bare", dec_label, b"\xc3\x28", None),
    ("bad_json", "surrogate", dec_label, b'{"a": "\xed\xa0\x80"}', None),
    ("bad_json", "empty", dec_control, b"", None),
    ("bad_json", "tombstone", dec_feedback, None, None),
    ("bad_json", "garbage", dec_manifest, b"{not json", None),
    ("bad_json", "too-deep", dec_retrieval, b"[" * 2000 + b"]" * 2000, None),
    # not_object
    ("not_object", "array", dec_retrieval, b"[1, 2]", None),
    ("not_object", "string", dec_feedback, b'"retrieval_event/v1"', None),
    ("not_object", "number", dec_label, b"3", None),
    ("not_object", "null", dec_experience, b"null", None),
    ("not_object", "manifest-array", dec_manifest, b"[]", None),
    # oversize
    (
        "oversize",
        "bytes",
        lambda raw, key=NO_KEY_CHECK: decode_retrieval_event(raw, Limits(D, S, max_bytes=64)),
        VALID_RAW,
        None,
    ),
    ("oversize", "id", dec_retrieval, raw_of(retrieval_dict(event_id="x" * 257)), None),
    (
        "oversize",
        "candidates",
        lambda raw, key=NO_KEY_CHECK: decode_retrieval_event(raw, Limits(D, S, max_candidates=3)),
        VALID_RAW,
        None,
    ),
    ("oversize", "query_text", dec_retrieval, raw_of(retrieval_dict(query_text="t" * (16 * 1024 + 1))), None),
    ("oversize", "memory_text", dec_retrieval, raw_of(retrieval_dict(memory_texts={"0": "m" * (16 * 1024 + 1)})), None),
    # unknown_schema
    ("unknown_schema", "v2", dec_retrieval, raw_of(retrieval_dict(schema="retrieval_event/v2")), None),
    ("unknown_schema", "other-topic", dec_feedback, raw_of(feedback_dict(schema="retrieval_event/v1")), None),
    ("unknown_schema", "label", dec_label, raw_of(label_dict(schema="human_label/v0")), None),
    ("unknown_schema", "al", dec_al, raw_of(al_dict(schema="x")), None),
    ("unknown_schema", "experience", dec_experience, raw_of(experience_dict(schema="experience/v9")), None),
    ("unknown_schema", "control", dec_control, raw_of(control_dict(schema="control/v2")), None),
    ("unknown_schema", "manifest", dec_manifest, raw_of(manifest_dict(schema="policy_checkpoint/v2")), None),
    ("unknown_schema", "schema-int", dec_retrieval, raw_of(retrieval_dict(schema=1)), None),
    # missing_field
    ("missing_field", "schema", dec_retrieval, raw_of(drop_field(retrieval_dict(), "schema")), None),
    ("missing_field", "query_id", dec_retrieval, raw_of(drop_field(retrieval_dict(), "query_id")), None),
    (
        "missing_field",
        "features.loss",
        dec_retrieval,
        raw_of(drop_field(retrieval_dict(), "features", "last_step_loss")),
        None,
    ),
    (
        "missing_field",
        "embedding",
        dec_retrieval,
        raw_of(drop_field(retrieval_dict(), "features", "query_embedding")),
        None,
    ),
    ("missing_field", "null-step", dec_retrieval, raw_of(retrieval_dict(step=None)), None),
    ("missing_field", "logprob", dec_retrieval, raw_of(drop_field(retrieval_dict(), "logprob")), None),
    ("missing_field", "no-utility", dec_feedback, raw_of(_fb_no_utility), None),
    ("missing_field", "half-nll", dec_feedback, raw_of(drop_field(feedback_dict(), "nll_with")), None),
    ("missing_field", "rating", dec_label, raw_of(drop_field(label_dict("rating"), "rating")), None),
    ("missing_field", "verdict", dec_label, raw_of(drop_field(label_dict("verdict"), "answer_correct")), None),
    (
        "missing_field",
        "correct_memories",
        dec_label,
        raw_of(drop_field(label_dict("memory_choice"), "correct_memories")),
        None,
    ),
    ("missing_field", "top_slots", dec_al, raw_of(drop_field(al_dict(), "top_slots")), None),
    ("missing_field", "event", dec_experience, raw_of(drop_field(experience_dict(), "event")), None),
    ("missing_field", "command", dec_control, raw_of(drop_field(control_dict(), "command")), None),
    ("missing_field", "sha256", dec_manifest, raw_of(drop_field(manifest_dict(), "sha256")), None),
    ("missing_field", "arch.slots", dec_manifest, raw_of(drop_field(manifest_dict(), "arch", "slots")), None),
    # wrong_type
    ("wrong_type", "bool-as-int", dec_retrieval, raw_of(retrieval_dict(step=True)), None),
    ("wrong_type", "bool-as-slot", dec_retrieval, raw_of(retrieval_dict(candidates=[0, True, 2, 5])), None),
    ("wrong_type", "bool-as-rating", dec_label, raw_of(label_dict(rating=True)), None),
    ("wrong_type", "bool-as-float", dec_retrieval, raw_of(retrieval_dict(temperature=True)), None),
    (
        "wrong_type",
        "bool-in-embedding",
        dec_retrieval,
        raw_of(set_field(retrieval_dict(), ("features", "query_embedding"), [True, 0.1, 0.2, 0.3])),
        None,
    ),
    ("wrong_type", "string-in-slots", dec_retrieval, raw_of(retrieval_dict(selected=["0"])), None),
    ("wrong_type", "string-in-scores", dec_retrieval, raw_of(retrieval_dict(scores=[0.9, "0.8", 0.7, 0.5])), None),
    (
        "wrong_type",
        "string-in-embedding",
        dec_retrieval,
        raw_of(set_field(retrieval_dict(), ("features", "query_embedding"), ["0.5", 0.1, 0.2, 0.3])),
        None,
    ),
    (
        "wrong_type",
        "nested-embedding",
        dec_retrieval,
        raw_of(set_field(retrieval_dict(), ("features", "query_embedding"), [[0.5], [0.1], [0.2], [0.3]])),
        None,
    ),
    ("wrong_type", "ragged-scores", dec_retrieval, raw_of(retrieval_dict(scores=[0.9, [0.8, 1], 0.7, 0.5])), None),
    ("wrong_type", "string-step", dec_retrieval, raw_of(retrieval_dict(step="2")), None),
    ("wrong_type", "fractional-step", dec_retrieval, raw_of(retrieval_dict(step=2.5)), None),
    ("wrong_type", "int-as-bool", dec_retrieval, raw_of(retrieval_dict(fallback=0)), None),
    ("wrong_type", "features-list", dec_retrieval, raw_of(retrieval_dict(features=[1, 2])), None),
    ("wrong_type", "candidates-dict", dec_retrieval, raw_of(retrieval_dict(candidates={"0": 1})), None),
    ("wrong_type", "id-int", dec_retrieval, raw_of(retrieval_dict(event_id=17)), None),
    ("wrong_type", "memory-text-key", dec_retrieval, raw_of(retrieval_dict(memory_texts={"zero": "a"})), None),
    ("wrong_type", "memory-text-value", dec_retrieval, raw_of(retrieval_dict(memory_texts={"0": 1})), None),
    ("wrong_type", "nll-string", dec_feedback, raw_of(feedback_dict(nll_with="1.5")), None),
    ("wrong_type", "verdict-int", dec_label, raw_of(label_dict("verdict", answer_correct=1)), None),
    ("wrong_type", "top-slot-int", dec_al, raw_of(al_dict(top_slots=[1, 2])), None),
    ("wrong_type", "event-list", dec_experience, raw_of(experience_dict(event=[1])), None),
    ("wrong_type", "details-list", dec_control, raw_of(control_dict(details=[1])), None),
    ("wrong_type", "sha-upper", dec_manifest, raw_of(manifest_dict(sha256=SHA.upper())), None),
    ("wrong_type", "offset-negative", dec_manifest, raw_of(manifest_dict(input_offsets={"t/0": -1})), None),
    ("wrong_type", "offset-bool", dec_manifest, raw_of(manifest_dict(input_offsets={"t/0": True})), None),
    ("wrong_type", "arch-string", dec_manifest, raw_of(manifest_dict(arch="small")), None),
    # non_finite
    ("non_finite", "bare-NaN", dec_retrieval, b"NaN", None),
    ("non_finite", "NaN-field", dec_retrieval, VALID_RAW.replace(b'"temperature":0.5', b'"temperature":NaN'), None),
    (
        "non_finite",
        "Infinity-field",
        dec_feedback,
        raw_of(feedback_dict()).replace(b'"nll_with":1.5', b'"nll_with":Infinity'),
        None,
    ),
    ("non_finite", "1e400", dec_retrieval, VALID_RAW.replace(b'"logprob":-1.25', b'"logprob":1e400'), None),
    (
        "non_finite",
        "-1e400-in-scores",
        dec_retrieval,
        VALID_RAW.replace(b"[0.9,0.8,0.7,0.5]", b"[0.9,-1e400,0.7,0.5]"),
        None,
    ),
    ("non_finite", "1e400-bare", dec_manifest, b"1e400", None),
    # out_of_range
    ("out_of_range", "slot>=S", dec_retrieval, raw_of(retrieval_dict(candidates=[0, 1, 2, S])), None),
    ("out_of_range", "slot<0", dec_retrieval, raw_of(retrieval_dict(selected=[-1])), None),
    ("out_of_range", "dropped-slot", dec_retrieval, raw_of(retrieval_dict(dropped=[S + 10])), None),
    ("out_of_range", "step<0", dec_retrieval, raw_of(retrieval_dict(step=-1)), None),
    ("out_of_range", "T=0", dec_retrieval, raw_of(retrieval_dict(temperature=0.0)), None),
    ("out_of_range", "T<0", dec_retrieval, raw_of(retrieval_dict(temperature=-0.5)), None),
    ("out_of_range", "logprob>0", dec_retrieval, raw_of(retrieval_dict(logprob=0.5)), None),
    ("out_of_range", "ts<0", dec_retrieval, raw_of(retrieval_dict(ts=-1.0)), None),
    ("out_of_range", "huge-score", dec_retrieval, raw_of(retrieval_dict(scores=[0.9, 2e6, 0.7, 0.5])), None),
    (
        "out_of_range",
        "negative-mask",
        dec_retrieval,
        raw_of(retrieval_dict(candidate_masks=[1.0, -0.5, 0.2, 0.1])),
        None,
    ),
    ("out_of_range", "empty-id", dec_retrieval, raw_of(retrieval_dict(event_id="")), None),
    ("out_of_range", "memory-text-slot", dec_retrieval, raw_of(retrieval_dict(memory_texts={str(S): "a"})), None),
    ("out_of_range", "negative-nll", dec_feedback, raw_of(feedback_dict(nll_with=-0.1)), None),
    ("out_of_range", "rating=6", dec_label, raw_of(label_dict(rating=6)), None),
    ("out_of_range", "rating<0", dec_label, raw_of(label_dict(rating=-1)), None),
    ("out_of_range", "label-kind", dec_label, raw_of(label_dict(kind="stars")), None),
    ("out_of_range", "prob>1", dec_al, raw_of(al_dict(top_slots=[{"slot": 0, "prob": 1.5}])), None),
    ("out_of_range", "experience-kind", dec_experience, raw_of(experience_dict(kind="other")), None),
    ("out_of_range", "control-command", dec_control, raw_of(control_dict(command="explode")), None),
    ("out_of_range", "manifest-reason", dec_manifest, raw_of(manifest_dict(reason="whim")), None),
    ("out_of_range", "manifest-version", dec_manifest, raw_of(manifest_dict(version=-1)), None),
    # embedding_length
    (
        "embedding_length",
        "short",
        dec_retrieval,
        raw_of(set_field(retrieval_dict(), ("features", "query_embedding"), [0.1, 0.2, 0.3])),
        None,
    ),
    (
        "embedding_length",
        "long",
        dec_retrieval,
        raw_of(set_field(retrieval_dict(), ("features", "query_embedding"), [0.1] * (D + 1))),
        None,
    ),
    ("embedding_length", "empty", dec_al, raw_of(set_field(al_dict(), ("features", "query_embedding"), [])), None),
    # inconsistent
    ("inconsistent", "scores-length", dec_retrieval, raw_of(retrieval_dict(scores=[0.9, 0.8, 0.7])), None),
    ("inconsistent", "selected-not-subset", dec_retrieval, raw_of(retrieval_dict(selected=[0, 3])), None),
    ("inconsistent", "repeated-slot", dec_retrieval, raw_of(retrieval_dict(selected=[0, 0])), None),
    (
        "inconsistent",
        "no-candidates",
        dec_retrieval,
        raw_of(retrieval_dict(candidates=[], scores=[], selected=[], candidate_masks=None, candidate_probs=None)),
        None,
    ),
    ("inconsistent", "masks-length", dec_retrieval, raw_of(retrieval_dict(candidate_masks=[1.0])), None),
    ("inconsistent", "utility-vs-nll", dec_feedback, raw_of(feedback_dict(utility=0.5)), None),
    ("inconsistent", "al-scores-length", dec_al, raw_of(al_dict(scores=[0.9])), None),
    (
        "inconsistent",
        "arch-input-dim",
        dec_manifest,
        raw_of(manifest_dict(arch={"input_dim": D, "hidden": 512, "slots": S, "embedding_dim": D})),
        None,
    ),
    ("inconsistent", "too-few-chunks", dec_manifest, raw_of(manifest_dict(size=MAX_CHUNK_BYTES + 1, chunks=1)), None),
    # key_mismatch
    ("key_mismatch", "retrieval", dec_retrieval, VALID_RAW, b"q2"),
    ("key_mismatch", "feedback-str", dec_feedback, raw_of(feedback_dict()), "other"),
    ("key_mismatch", "label", dec_label, raw_of(label_dict()), b"Q1"),
    ("key_mismatch", "al", dec_al, raw_of(al_dict()), b"q1 "),
    ("key_mismatch", "no-key", dec_feedback, raw_of(feedback_dict()), MISSING_KEY),
]


@pytest.mark.parametrize(
    ("reason", "dec", "raw", "key"),
    [(r, d, raw, k) for r, _, d, raw, k in REJECTIONS],
    ids=[f"{r}-{i}" for r, i, _, _, _ in REJECTIONS],
)
def test_rejection_reason(reason: str, dec: Any, raw: Any, key: Any) -> None:
    # None in the table: no key check; MISSING_KEY: read from a keyed topic without a key
    key = NO_KEY_CHECK if key is None else None if key is MISSING_KEY else key
    exc = expect_reason(reason, dec, raw, key=key)
    assert isinstance(exc, ValueError)
    assert exc.reason in REASONS


def test_truncated_message_mentioning_infinity_in_text_is_bad_json() -> None:
    raw = raw_of(retrieval_dict(query_text="Avengers: Infinity War"))
    expect_reason("bad_json", dec_retrieval, raw[:-5])


def test_every_reason_is_exercised() -> None:
    # ts_in_future needs the receiver's clock: the join gives it (tests/test_join_time.py).
    assert {r for r, *_ in REJECTIONS} == set(REASONS) - {"ts_in_future"}


def test_rejected_only_accepts_known_reasons() -> None:
    assert Rejected("bad_json", "x").reason == "bad_json"
    with pytest.raises(AssertionError):
        Rejected("made_up_reason")


def test_oversize_message_limit_is_inclusive() -> None:
    raw = raw_of(feedback_dict())
    assert decode_llm_feedback(raw, Limits(D, S, max_bytes=len(raw))).utility == 0.75
    expect_reason("oversize", decode_llm_feedback, raw, Limits(D, S, max_bytes=len(raw) - 1))


def test_boundary_values_accepted() -> None:
    assert dec_retrieval(raw_of(retrieval_dict(candidates=[0, 1, 2, S - 1], selected=[S - 1]))).selected == [S - 1]
    assert dec_retrieval(raw_of(retrieval_dict(logprob=0.0))).logprob == 0.0
    assert dec_retrieval(raw_of(retrieval_dict(step=0))).step == 0
    assert dec_label(raw_of(label_dict(rating=5))).rating == 5
    assert dec_label(raw_of(label_dict(rating=0))).rating == 0
    # an integral float is an integer on the wire (JSON does not distinguish 2 and 2.0)
    assert dec_retrieval(raw_of(retrieval_dict(step=2.0))).step == 2
