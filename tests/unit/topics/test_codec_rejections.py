"""Wire-contract codec (docs/contract.md): each rejection reason has its inputs.

A table of malformed messages, at least one per machine-readable reason in
``topics.fields.REASONS``, each of which a decoder of topics/ must reject with that reason;
and the limits' edges, inclusive. Round trips are in tests/unit/topics/test_codec.py; the examples in
tests/codec_examples.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.codec_examples import (
    SHA,
    D,
    S,
    al_dict,
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
from topics.events import decode_retrieval_event
from topics.feedback import decode_llm_feedback
from topics.fields import NO_KEY_CHECK, REASONS, Limits, Rejected, encode
from topics.manifest import MAX_CHUNK_BYTES

# --------------------------------------------------------------------------- rejections


VALID_RAW = raw_of(retrieval_dict())
MISSING_KEY = object()  # table marker: the message arrived without a key (key=None)
_fb_no_utility = drop_field(drop_field(feedback_dict(), "nll_with"), "nll_without")


def _probe_over(base: Any) -> dict[str, Any]:
    """Contract 1.23: a probe (version 7) over the certified version ``base``."""
    return manifest_dict(reason="probe", serving={"base": base, "temperature": 0.05})


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
    # 1.19: a probe is served as an incumbent; one that does not say so is rejected.
    ("inconsistent", "manifest-probe-not-incumbent", dec_manifest, raw_of(manifest_dict(reason="probe")), None),
    # 1.23: or over the certified version serving.base names: a version ≥ 1, below the probe's own.
    ("out_of_range", "manifest-base-0", dec_manifest, raw_of(_probe_over(0)), None),
    ("out_of_range", "manifest-base<0", dec_manifest, raw_of(_probe_over(-3)), None),
    ("wrong_type", "manifest-base-bool", dec_manifest, raw_of(_probe_over(True)), None),
    ("wrong_type", "manifest-base-str", dec_manifest, raw_of(_probe_over("6")), None),
    ("wrong_type", "manifest-base-fraction", dec_manifest, raw_of(_probe_over(6.5)), None),
    ("inconsistent", "manifest-base=version", dec_manifest, raw_of(_probe_over(7)), None),
    ("inconsistent", "manifest-base>version", dec_manifest, raw_of(_probe_over(8)), None),
    (
        "inconsistent",
        "manifest-base-and-incumbent",
        dec_manifest,
        raw_of(manifest_dict(reason="probe", serving={"base": 6, "incumbent": True})),
        None,
    ),
    ("inconsistent", "manifest-base-not-probe", dec_manifest, raw_of(manifest_dict(serving={"base": 6})), None),
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
    # 1.23: the base's draw is not the client's own first k, a fallback or the canary's request.
    (
        "inconsistent",
        "base-and-incumbent",
        dec_retrieval,
        raw_of(retrieval_dict(base=True, incumbent=True, logprob=0.0, selected=[0, 1])),
        None,
    ),
    ("inconsistent", "base-fallback", dec_retrieval, raw_of(retrieval_dict(base=True, fallback=True)), None),
    ("inconsistent", "base-canary", dec_retrieval, raw_of(retrieval_dict(base=True, canary=True)), None),
    ("wrong_type", "base-not-bool", dec_retrieval, raw_of(retrieval_dict(base=1)), None),
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
    # ts_in_future needs the receiver's clock: the join gives it (tests/unit/worker/test_join_time.py).
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


def test_a_probe_served_as_an_incumbent_decodes() -> None:
    """Contract 1.19: the probe the rejection table refuses without ``incumbent`` is valid with it."""
    m = dec_manifest(raw_of(manifest_dict(reason="probe", serving={"incumbent": True, "temperature": 0.001})), None)
    assert m.reason == "probe" and m.serving == {"incumbent": True, "temperature": 0.001}


def test_a_probe_over_a_certified_version_decodes() -> None:
    """Contract 1.23: a probe that is not an incumbent names ``serving.base``, kept in ``serving``;
    the lowest version there is, and the one just below the probe's own, are both a base."""
    for base in (1, 6, 6.0):  # an integral float is an integer on the wire
        m = dec_manifest(raw_of(_probe_over(base)), None)
        assert m.reason == "probe" and m.serving == {"temperature": 0.05, "base": int(base)}
        assert type(m.serving["base"]) is int
    # null counts as absent: a probe without incumbent and without base is still refused
    expect_reason("inconsistent", dec_manifest, raw_of(_probe_over(None)))
    m = dec_manifest(raw_of(manifest_dict(reason="probe", serving={"incumbent": True, "base": None})), None)
    assert m.serving == {"incumbent": True}


def test_an_event_drawn_under_the_base_decodes_and_round_trips() -> None:
    """Contract 1.23: ``base: true`` with the base's own draw (a logprob that is not 0, any order);
    ``false`` reads as absent, and only ``true`` is written."""
    raw = raw_of(retrieval_dict(base=True, selected=[5, 0], logprob=-2.5))
    ev = dec_retrieval(raw)
    assert ev.base is True and ev.logprob == -2.5
    assert ev.to_dict()["base"] is True and dec_retrieval(encode(ev.to_dict())).base is True
    plain = dec_retrieval(raw_of(retrieval_dict(base=False)))
    assert plain.base is None and "base" not in plain.to_dict()
