"""Bad input the codec alone judges (docs/contract.md): no broker.

Found by the bad-input generator (tests/bad_input_cases.py): a NaN/Infinity literal after
non-ASCII text must be ``non_finite`` like the same literal after ASCII text (character vs
byte positions).
"""

from __future__ import annotations

import pytest

from tests.bad_input_cases import RAW, F, Gen, L, Msg, R, codec_reason, dumps, set_path
from topics.fields import Limits

# ------------------------------------------------- found by the generator: character vs byte positions


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("topic", [R, F, L])
def test_non_finite_literal_after_non_ascii_text_is_non_finite(topic: str, literal: str) -> None:
    g = Gen(7, 8, 32)
    qid = "\u202eq-é"  # valid unicode before the literal
    base = {R: g.good_event(qid, "e1"), F: g.good_feedback(qid, "e1"), L: g.good_label(qid, "e1", "rating")}[topic]
    msg = Msg(topic, qid, dumps(set_path(base, "ts", RAW), literal), "nan-after-unicode", "non_finite")
    assert codec_reason(msg, Limits(embedding_dim=8, slots=32)) == "non_finite"


@pytest.mark.parametrize("qid,literal", [("q-ascii", "NaN"), ("q-ascii", "-Infinity"), ("\u202eq-é", "1e400")])
def test_non_finite_literal_control_cases(qid: str, literal: str) -> None:
    """The same messages with ASCII before the literal, or with 1e400, are non_finite today."""
    base = Gen(7, 8, 32).good_event(qid, "e1")
    msg = Msg(R, qid, dumps(set_path(base, "ts", RAW), literal), "control", "non_finite")
    assert codec_reason(msg, Limits(embedding_dim=8, slots=32)) == "non_finite"
