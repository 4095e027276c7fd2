"""Contract 1.15: the optional ``principal`` of RetrievalEvent and LLMFeedback, and the two
principals an experience records.

By property: a well-formed principal (1-128 characters of ``[A-Za-z0-9._:@-]``) round-trips
through both decoders and an experience; any other value is rejected with a known reason
(never a crash); an experience of an older worker, without principals, reads as anonymous.
"""

from __future__ import annotations

import re
import string
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.client.publisher import SyncEventPublisher
from tests.codec_examples import LIMITS, experience_dict, feedback_dict, raw_of, retrieval_dict
from topics.events import Features, RetrievalEvent, decode_retrieval_event
from topics.feedback import LLMFeedback, decode_llm_feedback
from topics.fields import REASONS, Rejected, encode
from topics.internal import decode_experience, experience_bytes
from topics.principal import MAX_PRINCIPAL_LEN, check_principal

ALPHABET = string.ascii_letters + string.digits + "._:@-"
GOOD = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
principals = st.text(alphabet=ALPHABET, min_size=1, max_size=MAX_PRINCIPAL_LEN)
anything = st.one_of(
    st.text(max_size=140),
    st.text(alphabet=ALPHABET, min_size=120, max_size=140),
    st.integers(-(2**40), 2**40),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),  # JSON has no infinity: orjson writes it as null (absent)
    st.lists(st.text(max_size=3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2),
)


def _event_dict(principal: Any, fast: bool) -> dict[str, Any]:
    d = retrieval_dict(principal=principal)
    if fast:  # texts take the full validator; without them the event takes the fast path
        for text in ("memory_texts", "query_text", "answer_text"):
            d.pop(text)
    return d


@settings(max_examples=200, deadline=None)
@given(principals, st.booleans())
def test_a_well_formed_principal_round_trips_on_events_and_feedback(principal: str, fast: bool) -> None:
    event = decode_retrieval_event(raw_of(_event_dict(principal, fast)), LIMITS)
    assert event.principal == principal
    assert decode_retrieval_event(encode(event.to_dict()), LIMITS).principal == principal
    fb = decode_llm_feedback(raw_of(feedback_dict(principal=principal)), LIMITS)
    assert fb.principal == principal
    assert decode_llm_feedback(encode(fb.to_dict()), LIMITS).principal == principal


@settings(max_examples=300, deadline=None)
@given(anything, st.booleans())
def test_any_other_principal_is_rejected_with_a_known_reason(value: Any, fast: bool) -> None:
    good = isinstance(value, str) and GOOD.fullmatch(value) is not None
    for decode, obj in (
        (decode_retrieval_event, _event_dict(value, fast)),
        (decode_llm_feedback, feedback_dict(principal=value)),
    ):
        try:
            decoded = decode(raw_of(obj), LIMITS)
        except Rejected as rej:
            assert not good, f"{value!r} rejected ({rej})"
            assert rej.reason in REASONS and rej.reason in ("wrong_type", "oversize", "out_of_range")
        else:
            assert good, f"{value!r} accepted"
            assert decoded.principal == value


def test_rejection_reasons_say_what_is_wrong() -> None:
    for value, reason in ((5, "wrong_type"), ("x" * 129, "oversize"), ("", "out_of_range"), ("a b", "out_of_range")):
        with pytest.raises(Rejected) as exc:
            check_principal(value)
        assert exc.value.reason == reason


def test_null_principal_is_absent() -> None:
    assert decode_retrieval_event(raw_of(retrieval_dict(principal=None)), LIMITS).principal is None
    assert decode_llm_feedback(raw_of(feedback_dict()), LIMITS).principal is None
    assert "principal" not in LLMFeedback("f", "q", 0, 1.0, 0.5).to_dict()


def _event(principal: str | None) -> RetrievalEvent:
    return RetrievalEvent(
        "e1", "q1", 0, 1.0, Features(np.zeros(4, np.float32), 0.0, 0.0), [0, 1], np.array([0.2, 0.1]), [1],
        1.0, -0.5, False, principal=principal,
    )  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(st.none() | principals, st.none() | principals)
def test_an_experience_records_both_principals(event_principal: str | None, feedback_principal: str | None) -> None:
    raw = experience_bytes(_event(event_principal), 0.5, feedback_principal=feedback_principal)
    exp = decode_experience(raw, LIMITS)
    assert (exp.event_principal, exp.feedback_principal) == (event_principal, feedback_principal)
    assert exp.principal == (feedback_principal or event_principal or "anonymous")


def test_an_older_experience_reads_as_anonymous() -> None:
    exp = decode_experience(raw_of(experience_dict()), LIMITS)
    assert exp.event_principal is None and exp.feedback_principal is None and exp.principal == "anonymous"


@pytest.mark.parametrize("field", ["event_principal", "feedback_principal"])
def test_a_bad_principal_in_an_experience_is_rejected(field: str) -> None:
    with pytest.raises(Rejected) as exc:
        decode_experience(raw_of(experience_dict(**{field: "no spaces"})), LIMITS)
    assert exc.value.reason == "out_of_range"


def test_a_publisher_refuses_a_malformed_principal_and_a_value_naming_another() -> None:
    with pytest.raises(ValueError, match="principal"):
        SyncEventPublisher("127.0.0.1:1", principal="not valid")
    pub = SyncEventPublisher("127.0.0.1:1", principal="svc-a")
    try:
        with pytest.raises(Rejected) as exc:
            pub.publish(LLMFeedback("f", "q", 0, 1.0, 0.5, principal="svc-b"))
        assert exc.value.reason == "inconsistent"
        pub.publish(LLMFeedback("f", "q", 0, 1.0, 0.5))  # stamped, accepted
        pub.publish(LLMFeedback("f", "q", 0, 1.0, 0.5, principal="svc-a"))
    finally:
        pub.close(timeout=0.1)
