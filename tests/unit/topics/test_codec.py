"""Wire-contract codec (docs/contract.md): the decoders of topics/ (events, feedback, labels,
internal, manifest): valid values round-trip and decode to the typed values they describe.

Every decoder either returns a typed value or raises :class:`topics.fields.Rejected` with one
of the machine-readable ``REASONS``; each reason's inputs are in tests/unit/topics/test_codec_rejections.py.
Fuzzing and the fast path are in tests/unit/topics/test_codec_properties.py; the examples in
tests/codec_examples.py.
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
    expect_reason,
    experience_dict,
    feedback_dict,
    label_dict,
    manifest_dict,
    raw_of,
    retrieval_dict,
)
from topics.events import RetrievalEvent
from topics.feedback import LLMFeedback
from topics.fields import encode
from topics.internal import (
    Control,
    Experience,
)
from topics.labels import ActiveLearningSample, HumanLabel
from topics.manifest import (
    MAX_CHUNK_BYTES,
    Manifest,
    base_key,
    canary_key,
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
    assert parse_key(canary_key("p")) == ("canary", "p", None, None)  # contract 1.4
    assert parse_key(base_key("p")) == ("base", "p", None, None)  # contract 1.25
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
