"""Wire-contract codec (docs/contract.md): the decoders of topics/ (events, feedback, labels,
internal, manifest).

Every decoder either returns a typed value or raises :class:`topics.fields.Rejected` with one
of the machine-readable ``REASONS``; these tests pin each reason to a crafted input, check
that valid values round-trip, and fuzz the decoders with Hypothesis.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topics import events
from topics.events import RetrievalEvent, decode_retrieval_event
from topics.feedback import LLMFeedback, decode_llm_feedback
from topics.fields import NO_KEY_CHECK, REASONS, SCHEMA_RETRIEVAL, Limits, Rejected, encode
from topics.internal import Control, Experience, decode_control, decode_experience
from topics.labels import ActiveLearningSample, HumanLabel, decode_active_learning_sample, decode_human_label
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

D = 4
S = 6
LIMITS = Limits(embedding_dim=D, slots=S)
SHA = "0123456789abcdef" * 4


# --------------------------------------------------------------------------- valid examples


def retrieval_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "retrieval_event/v1",
        "event_id": "e1",
        "query_id": "q1",
        "step": 2,
        "ts": 1_700_000_000.25,
        "policy": "default",
        "policy_version": 3,
        "features": {"query_embedding": [0.5, -0.1, 0.3, 0.8], "last_step_loss": 0.75, "last_step_entropy": 1.5},
        "candidates": [0, 1, 2, 5],
        "scores": [0.9, 0.8, 0.7, 0.5],
        "selected": [0, 5],
        "temperature": 0.5,
        "logprob": -1.25,
        "fallback": False,
        "mask_max": 1.125,
        "query_text": "who wrote it?",
        "memory_texts": {"0": "alpha", "5": "beta"},
        "dropped": [3],
        "candidate_masks": [1.0, 0.5, 0.25, 0.125],
        "candidate_probs": [0.4, 0.3, 0.2, 0.1],
    }
    d.update(changes)
    return d


def feedback_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "llm_feedback/v1",
        "event_id": "f1",
        "query_id": "q1",
        "step": 2,
        "ts": 1_700_000_001.0,
        "nll_with": 1.5,
        "nll_without": 2.25,
    }
    d.update(changes)
    return d


def label_dict(kind: str = "rating", **changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "human_label/v1",
        "event_id": "l1",
        "query_id": "q1",
        "ts": 1_700_000_002.0,
        "labeler": "alice",
        "kind": kind,
    }
    if kind == "rating":
        d["rating"] = 4
    elif kind == "verdict":
        d["answer_correct"] = False
    else:
        d.update(sample_id="s1", correct_memories=[1, 5], step=2, rating=3)
    d.update(changes)
    return d


def al_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "active_learning_sample/v1",
        "sample_id": "s1",
        "query_id": "q1",
        "step": 2,
        "ts": 1_700_000_003.0,
        "reason": "low_utility",
        "utility": -0.5,
        "policy_version": 3,
        "policy": "default",
        "features": {"query_embedding": [0.5, -0.1, 0.3, 0.8], "last_step_loss": 0.75, "last_step_entropy": 1.5},
        "candidates": [0, 1, 2],
        "selected": [1],
        "top_slots": [{"slot": 1, "prob": 0.5}, {"slot": 0, "prob": 0.25}],
        "query_text": "who?",
        "memory_texts": {"1": "x"},
        "scores": [0.9, 0.8, 0.7],
        "temperature": 0.5,
    }
    d.update(changes)
    return d


def experience_dict(**changes: Any) -> dict[str, Any]:
    event = retrieval_dict()
    del event["memory_texts"], event["query_text"]
    embedding = np.asarray(event["features"].pop("query_embedding"), dtype="<f4")
    d: dict[str, Any] = {
        "schema": "experience/v2",
        "id": "e1",
        "kind": "label",
        "utility": 0.75,
        "embedding_f32": base64.b64encode(embedding.tobytes()).decode("ascii"),
        "event": event,
        "correct_memories": [5],
    }

    d.update(changes)
    return d


def control_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "control/v1",
        "id": "c1",
        "command": "reset",
        "ts": 1_700_000_004.0,
        "reason": "drift",
        "details": {"correlation": 0.25, "reference": 0.75},
    }
    d.update(changes)
    return d


def manifest_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "policy_checkpoint/v1",
        "policy": "default",
        "version": 7,
        "created_ts": 1_700_000_005.0,
        "reason": "periodic",
        "arch": {"input_dim": D + 2, "hidden": 512, "slots": S, "embedding_dim": D},
        "alpha": 0.5,
        "baseline": -0.125,
        "sha256": SHA,
        "size": MAX_CHUNK_BYTES + 1,
        "chunks": 2,
        "metrics": {"reward": 0.5},
        "input_offsets": {"experiences/0": 12, "experiences/1": 0},
    }
    d.update(changes)
    return d


def dec_retrieval(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_retrieval_event(raw, LIMITS, key=key)


def dec_feedback(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_llm_feedback(raw, LIMITS, key=key)


def dec_label(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_human_label(raw, LIMITS, key=key)


def dec_al(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_active_learning_sample(raw, LIMITS, key=key)


def dec_experience(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_experience(raw, LIMITS)


def dec_control(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_control(raw, LIMITS)


def dec_manifest(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_manifest(raw, Limits(embedding_dim=D, slots=S, max_bytes=1024 * 1024))


# (name, decoder, valid dict factory)
DECODERS = [
    ("retrieval", dec_retrieval, retrieval_dict),
    ("feedback", dec_feedback, feedback_dict),
    ("label", dec_label, label_dict),
    ("al", dec_al, al_dict),
    ("experience", dec_experience, experience_dict),
    ("control", dec_control, control_dict),
    ("manifest", dec_manifest, manifest_dict),
]
DECODER_IDS = [name for name, _, _ in DECODERS]


def raw_of(obj: Any) -> bytes:
    return orjson.dumps(obj)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Field-by-field equality that understands numpy arrays and (slotted) dataclasses."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def expect_reason(reason: str, fn: Any, *args: Any, **kwargs: Any) -> Rejected:
    with pytest.raises(Rejected) as info:
        fn(*args, **kwargs)
    assert info.value.reason == reason, f"expected {reason}, got {info.value.reason} ({info.value})"
    return info.value


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


def _drop(d: dict[str, Any], *path: str) -> dict[str, Any]:
    d = copy.deepcopy(d)
    node = d
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return d


def _set(d: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    d = copy.deepcopy(d)
    node = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return d


VALID_RAW = raw_of(retrieval_dict())
MISSING_KEY = object()  # table marker: the message arrived without a key (key=None)
_fb_no_utility = _drop(_drop(feedback_dict(), "nll_with"), "nll_without")

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
    ("missing_field", "schema", dec_retrieval, raw_of(_drop(retrieval_dict(), "schema")), None),
    ("missing_field", "query_id", dec_retrieval, raw_of(_drop(retrieval_dict(), "query_id")), None),
    (
        "missing_field",
        "features.loss",
        dec_retrieval,
        raw_of(_drop(retrieval_dict(), "features", "last_step_loss")),
        None,
    ),
    ("missing_field", "embedding", dec_retrieval, raw_of(_drop(retrieval_dict(), "features", "query_embedding")), None),
    ("missing_field", "null-step", dec_retrieval, raw_of(retrieval_dict(step=None)), None),
    ("missing_field", "logprob", dec_retrieval, raw_of(_drop(retrieval_dict(), "logprob")), None),
    ("missing_field", "no-utility", dec_feedback, raw_of(_fb_no_utility), None),
    ("missing_field", "half-nll", dec_feedback, raw_of(_drop(feedback_dict(), "nll_with")), None),
    ("missing_field", "rating", dec_label, raw_of(_drop(label_dict("rating"), "rating")), None),
    ("missing_field", "verdict", dec_label, raw_of(_drop(label_dict("verdict"), "answer_correct")), None),
    (
        "missing_field",
        "correct_memories",
        dec_label,
        raw_of(_drop(label_dict("memory_choice"), "correct_memories")),
        None,
    ),
    ("missing_field", "top_slots", dec_al, raw_of(_drop(al_dict(), "top_slots")), None),
    ("missing_field", "event", dec_experience, raw_of(_drop(experience_dict(), "event")), None),
    ("missing_field", "command", dec_control, raw_of(_drop(control_dict(), "command")), None),
    ("missing_field", "sha256", dec_manifest, raw_of(_drop(manifest_dict(), "sha256")), None),
    ("missing_field", "arch.slots", dec_manifest, raw_of(_drop(manifest_dict(), "arch", "slots")), None),
    # wrong_type
    ("wrong_type", "bool-as-int", dec_retrieval, raw_of(retrieval_dict(step=True)), None),
    ("wrong_type", "bool-as-slot", dec_retrieval, raw_of(retrieval_dict(candidates=[0, True, 2, 5])), None),
    ("wrong_type", "bool-as-rating", dec_label, raw_of(label_dict(rating=True)), None),
    ("wrong_type", "bool-as-float", dec_retrieval, raw_of(retrieval_dict(temperature=True)), None),
    (
        "wrong_type",
        "bool-in-embedding",
        dec_retrieval,
        raw_of(_set(retrieval_dict(), ("features", "query_embedding"), [True, 0.1, 0.2, 0.3])),
        None,
    ),
    ("wrong_type", "string-in-slots", dec_retrieval, raw_of(retrieval_dict(selected=["0"])), None),
    ("wrong_type", "string-in-scores", dec_retrieval, raw_of(retrieval_dict(scores=[0.9, "0.8", 0.7, 0.5])), None),
    (
        "wrong_type",
        "string-in-embedding",
        dec_retrieval,
        raw_of(_set(retrieval_dict(), ("features", "query_embedding"), ["0.5", 0.1, 0.2, 0.3])),
        None,
    ),
    (
        "wrong_type",
        "nested-embedding",
        dec_retrieval,
        raw_of(_set(retrieval_dict(), ("features", "query_embedding"), [[0.5], [0.1], [0.2], [0.3]])),
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
        raw_of(_set(retrieval_dict(), ("features", "query_embedding"), [0.1, 0.2, 0.3])),
        None,
    ),
    (
        "embedding_length",
        "long",
        dec_retrieval,
        raw_of(_set(retrieval_dict(), ("features", "query_embedding"), [0.1] * (D + 1))),
        None,
    ),
    ("embedding_length", "empty", dec_al, raw_of(_set(al_dict(), ("features", "query_embedding"), [])), None),
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
    assert {r for r, *_ in REJECTIONS} == set(REASONS)


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


# --------------------------------------------------------------------------- property tests

ALL_DECODERS = [dec for _, dec, _ in DECODERS]


def _decode_all(raw: Any) -> None:
    for dec in ALL_DECODERS:
        try:
            dec(raw, key=b"q1")
        except Rejected as exc:
            assert exc.reason in REASONS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_crash(raw: bytes) -> None:
    _decode_all(raw)


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6),
    max_leaves=25,
)


def _json_bytes(obj: Any) -> bytes:
    # The standard library writes NaN/Infinity tokens and big integers, which orjson would not.
    return json.dumps(obj).encode()


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_arbitrary_json_never_crashes(obj: Any) -> None:
    _decode_all(_json_bytes(obj))


FIELD_PATHS: dict[str, list[tuple[str, ...]]] = {}
for _name, _dec, _factory in DECODERS:
    _d = _factory()
    _paths = [(k,) for k in _d]
    for _k, _v in _d.items():
        if isinstance(_v, dict):
            _paths += [(_k, kk) for kk in _v]
    FIELD_PATHS[_name] = _paths


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_valid_examples_with_arbitrary_fields_never_crash(data: st.DataObject) -> None:
    """Deep fuzzing: a valid value with a few fields replaced by arbitrary JSON values."""
    name, dec, factory = data.draw(st.sampled_from(DECODERS), label="decoder")
    d = factory()
    paths = data.draw(st.lists(st.sampled_from(FIELD_PATHS[name]), min_size=1, max_size=3, unique=True))
    for path in paths:
        value = data.draw(json_values, label=".".join(path))
        try:
            d = _set(d, path, value)
        except (TypeError, KeyError):  # parent already replaced by a non-object
            continue
    try:
        dec(_json_bytes(d), key=b"q1")
    except Rejected as exc:
        assert exc.reason in REASONS


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
S_PROP = 16
LIMITS_PROP = Limits(embedding_dim=D, slots=S_PROP)


@st.composite
def valid_events(draw: st.DrawFn) -> dict[str, Any]:
    candidates = draw(st.lists(st.integers(0, S_PROP - 1), min_size=1, max_size=S_PROP, unique=True))
    n = len(candidates)
    selected = draw(st.lists(st.sampled_from(candidates), max_size=n, unique=True))
    d: dict[str, Any] = {
        "schema": "retrieval_event/v1",
        "event_id": draw(st.text(min_size=1, max_size=20)),
        "query_id": draw(st.text(min_size=1, max_size=20)),
        "step": draw(st.integers(0, 2**31)),
        "ts": draw(st.floats(0.0, 1e10)),
        "features": {
            "query_embedding": draw(st.lists(finite, min_size=D, max_size=D)),
            "last_step_loss": draw(finite),
            "last_step_entropy": draw(finite),
        },
        "candidates": candidates,
        "scores": draw(st.lists(finite, min_size=n, max_size=n)),
        "selected": selected,
        "temperature": draw(st.floats(min_value=1e-3, max_value=1e3)),
        "logprob": draw(st.floats(min_value=-1e5, max_value=0.0)),
        "fallback": draw(st.booleans()),
    }
    if draw(st.booleans()):
        d["policy"] = draw(st.text(min_size=1, max_size=10))
        d["policy_version"] = draw(st.integers(0, 2**40))
    if draw(st.booleans()):
        d["candidate_probs"] = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    if draw(st.booleans()):
        d["memory_texts"] = {str(s): draw(st.text(max_size=10)) for s in selected}
    return d


@settings(max_examples=200, deadline=None)
@given(valid_events())
def test_generated_valid_events_decode_and_round_trip(d: dict[str, Any]) -> None:
    raw = orjson.dumps(d)
    ev = decode_retrieval_event(raw, LIMITS_PROP, key=d["query_id"].encode())
    assert ev.candidates == d["candidates"] and ev.selected == d["selected"]
    assert ev.step == d["step"] and ev.ts == d["ts"] and ev.temperature == d["temperature"]
    assert ev.logprob == d["logprob"] and ev.fallback is d["fallback"]
    np.testing.assert_array_equal(ev.scores, np.asarray(d["scores"], np.float64))
    np.testing.assert_array_equal(ev.features.query_embedding, np.asarray(d["features"]["query_embedding"], np.float32))
    again = decode_retrieval_event(encode(ev.to_dict()), LIMITS_PROP, key=ev.query_id)
    assert_same(ev, again)


WRONG_FOR: dict[str, st.SearchStrategy[Any]] = {
    "str": st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.lists(st.text(max_size=3), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    "int": st.text(max_size=5)
    | st.booleans()
    | st.lists(st.integers(), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not float(x).is_integer()),
    "float": st.text(max_size=5)
    | st.booleans()
    | st.lists(st.floats(0, 1), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    "bool": st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5)
    | st.lists(st.booleans(), max_size=2),
    "array": st.text(max_size=5)
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    "object": st.text(max_size=5) | st.integers() | st.booleans() | st.lists(st.integers(), max_size=2),
    "element": st.text(max_size=5)
    | st.booleans()
    | st.lists(st.integers(), min_size=1, max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2),
}
MUTABLE_FIELDS: list[tuple[tuple[str, ...], str]] = [
    (("event_id",), "str"),
    (("query_id",), "str"),
    (("policy",), "str"),
    (("query_text",), "str"),
    (("step",), "int"),
    (("policy_version",), "int"),
    (("ts",), "float"),
    (("temperature",), "float"),
    (("logprob",), "float"),
    (("mask_max",), "float"),
    (("fallback",), "bool"),
    (("features",), "object"),
    (("memory_texts",), "object"),
    (("features", "last_step_loss"), "float"),
    (("features", "last_step_entropy"), "float"),
    (("features", "query_embedding"), "array"),
    (("candidates",), "array"),
    (("scores",), "array"),
    (("selected",), "array"),
    (("dropped",), "array"),
    (("candidate_masks",), "array"),
]
ELEMENT_FIELDS = [("features", "query_embedding"), ("candidates",), ("scores",), ("selected",), ("candidate_probs",)]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_one_field_of_wrong_type_is_rejected(data: st.DataObject) -> None:
    d = retrieval_dict()
    if data.draw(st.booleans(), label="whole field"):
        path, kind = data.draw(st.sampled_from(MUTABLE_FIELDS), label="field")
        d = _set(d, path, data.draw(WRONG_FOR[kind], label="value"))
    else:  # one element of an array, keeping its length
        path = data.draw(st.sampled_from(ELEMENT_FIELDS), label="array")
        node = d
        for p in path:
            node = node[p]
        items = list(node)
        items[data.draw(st.integers(0, len(items) - 1), label="index")] = data.draw(WRONG_FOR["element"])
        d = _set(d, path, items)
    with pytest.raises(Rejected) as info:
        decode_retrieval_event(_json_bytes(d), LIMITS, key=b"q1")
    assert info.value.reason == "wrong_type", str(info.value)


def test_non_finite_helper_values() -> None:
    # float('nan') cannot reach the wire through orjson (it writes null); the stdlib token can.
    assert math.isnan(float("nan"))
    assert orjson.dumps(float("nan")) == b"null"
    expect_reason("missing_field", dec_retrieval, orjson.dumps(retrieval_dict(temperature=float("nan"))))


# --------------------------------------------------------------------------- the fast path


def _events_equal(a: Any, b: Any) -> bool:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name == "features":
            if not (
                np.array_equal(x.query_embedding, y.query_embedding)
                and x.last_step_loss == y.last_step_loss
                and x.last_step_entropy == y.last_step_entropy
            ):
                return False
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if x is None or y is None or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
    st.lists(st.integers(-3, 40), max_size=5),
    st.lists(st.floats(-2, 2), max_size=5),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_PATHS = [
    "schema",
    "event_id",
    "query_id",
    "step",
    "ts",
    "policy",
    "policy_version",
    "candidates",
    "scores",
    "selected",
    "temperature",
    "logprob",
    "fallback",
    "mask_max",
    "query_text",
    "memory_texts",
    "dropped",
    "candidate_masks",
    "candidate_probs",
    "features",
    "features.query_embedding",
    "features.last_step_loss",
    "features.last_step_entropy",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(_PATHS), value=_JSON_VALUES, drop=st.booleans())
def test_fast_path_never_accepts_what_the_full_validator_rejects(path: str, value: Any, drop: bool) -> None:
    obj = retrieval_dict()
    obj.pop("memory_texts", None)  # texts always take the full path
    target, _, leaf = path.rpartition(".")
    holder = obj[target] if target else obj
    if drop:
        holder.pop(leaf, None)
    else:
        holder[leaf] = value
    lim = LIMITS
    fast = events._fast_retrieval_event(copy.deepcopy(obj), lim, NO_KEY_CHECK, SCHEMA_RETRIEVAL, None)
    try:
        full = events._validated_retrieval_event(copy.deepcopy(obj), lim, NO_KEY_CHECK, SCHEMA_RETRIEVAL, None)
    except Rejected:
        full = None
    if fast is not None:
        assert full is not None, f"the fast path accepted what the validator rejects ({path}={value!r})"
        assert _events_equal(fast, full)


def test_fast_path_takes_the_common_case() -> None:
    obj = retrieval_dict()
    obj.pop("memory_texts")
    assert events._fast_retrieval_event(obj, LIMITS, NO_KEY_CHECK, SCHEMA_RETRIEVAL, None) is not None
