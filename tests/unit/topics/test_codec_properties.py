"""Wire-contract codec, by property: the decoders never crash on arbitrary input (they
accept or reject with a known reason), generated valid events round-trip, and the
retrieval event's fast path never accepts what the full validator rejects.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.codec_examples import (
    DECODERS,
    LIMITS,
    D,
    assert_same,
    dec_retrieval,
    expect_reason,
    retrieval_dict,
    set_field,
)
from tests.paths import REPO_ROOT
from topics import events
from topics.events import decode_retrieval_event
from topics.feedback import decode_llm_feedback
from topics.fields import NO_KEY_CHECK, REASONS, SCHEMA_RETRIEVAL, Limits, Rejected, encode

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
            d = set_field(d, path, value)
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
    if draw(st.booleans()):
        d["answer_text"] = draw(st.text(max_size=30))  # contract 1.1
    if draw(st.booleans()):
        d["canary"] = draw(st.booleans())  # contract 1.4
    if draw(st.booleans()):  # contract 1.5: a coupled request, its arm agreeing with canary
        arm = "canary" if d.get("canary") else draw(st.sampled_from(["tie", "serving"]))
        d["canary_arm"], d["canary_version"] = arm, draw(st.integers(0, 2**40))
        if arm != "tie":
            d["canary_other"] = draw(st.lists(st.integers(0, S_PROP - 1), min_size=1, max_size=4, unique=True))
    elif draw(st.booleans()):  # contract 1.9: drawn from the serving policy and the canary's mixture
        d["canary_rate"] = draw(st.floats(0.001, 0.999))
        d["alternative_version"] = draw(st.integers(0, 2**40))
    if not d["fallback"] and not d.get("canary") and draw(st.booleans()):  # contract 1.17: the own first k
        d.update(incumbent=True, logprob=0.0, selected=candidates[: len(selected)])
    elif not d["fallback"] and not d.get("canary") and draw(st.booleans()):  # contract 1.23: the base's draw
        d["base"] = True
    elif draw(st.booleans()):
        d["base"] = False  # says "not", as absent does
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
    assert ev.answer_text == d.get("answer_text")
    assert ev.canary is (True if d.get("canary") else None)
    assert (ev.canary_arm, ev.canary_version, ev.canary_other) == tuple(
        d.get(k) for k in ("canary_arm", "canary_version", "canary_other")
    )
    assert (ev.canary_rate, ev.alternative_version) == (d.get("canary_rate"), d.get("alternative_version"))
    assert ev.incumbent is d.get("incumbent")
    assert ev.base is (True if d.get("base") else None)
    again = decode_retrieval_event(encode(ev.to_dict()), LIMITS_PROP, key=ev.query_id)
    assert_same(ev, again)


# --------------------------------------------------------------------------- contract 1.1: nll_without_slot

nll = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
slot_nlls = st.dictionaries(st.integers(0, S_PROP - 1).map(str), nll, max_size=S_PROP)


def _feedback(**changes: Any) -> dict[str, Any]:
    return {
        "schema": "llm_feedback/v1",
        "event_id": "f1",
        "query_id": "q1",
        "step": 0,
        "ts": 1_767_225_600.0,
        **changes,
    }


@settings(max_examples=200, deadline=None)
@given(nll, nll, slot_nlls)
def test_valid_nll_without_slot_round_trips(nll_with: float, nll_without: float, per_slot: dict[str, float]) -> None:
    d = _feedback(nll_with=nll_with, nll_without=nll_without, nll_without_slot=per_slot)
    fb = decode_llm_feedback(orjson.dumps(d), LIMITS_PROP, key=b"q1")
    assert fb.nll_without_slot == ({int(k): v for k, v in per_slot.items()} or None)
    again = decode_llm_feedback(encode(fb.to_dict()), LIMITS_PROP, key=b"q1")
    assert again.nll_without_slot == fb.nll_without_slot and again.utility == fb.utility
    effects = fb.slot_effects(list(range(S_PROP)))
    assert effects == ({int(k): v - nll_with for k, v in per_slot.items()} or None)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([{}, {"utility": 0.5}, {"nll_with": 1.0}, {"nll_without": 1.0}]), slot_nlls.filter(bool))
def test_nll_without_slot_without_the_nll_pair_is_inconsistent(rest: dict[str, Any], per_slot: dict[str, Any]) -> None:
    d = _feedback(nll_without_slot=per_slot, **rest)
    with pytest.raises(Rejected) as exc:
        decode_llm_feedback(orjson.dumps(d), LIMITS_PROP)
    assert exc.value.reason == "inconsistent"


def _not_an_int(k: str) -> bool:
    try:
        int(k)
    except ValueError:
        return True
    return False


BAD_SLOT_KEYS = st.one_of(
    st.text(min_size=1, max_size=5).filter(_not_an_int).map(lambda k: (k, "wrong_type")),
    st.integers(S_PROP, 10**6).map(lambda k: (str(k), "out_of_range")),
    st.integers(-(10**6), -1).map(lambda k: (str(k), "out_of_range")),
)
BAD_SLOT_VALUES = st.one_of(
    st.floats(max_value=-1e-9, min_value=-1e6).map(lambda v: (v, "out_of_range")),
    st.sampled_from([("1.0", "wrong_type"), (True, "wrong_type"), ([1.0], "wrong_type"), (None, "wrong_type")]),
)


@settings(max_examples=200, deadline=None)
@given(BAD_SLOT_KEYS, slot_nlls)
def test_a_bad_slot_key_is_rejected_with_its_reason(bad: tuple[str, str], rest: dict[str, float]) -> None:
    key, reason = bad
    d = _feedback(nll_with=1.0, nll_without=2.0, nll_without_slot={**rest, key: 1.0})
    with pytest.raises(Rejected) as exc:
        decode_llm_feedback(orjson.dumps(d), LIMITS_PROP)
    assert exc.value.reason == reason, (key, exc.value)


@settings(max_examples=200, deadline=None)
@given(BAD_SLOT_VALUES, st.integers(0, S_PROP - 1))
def test_a_bad_slot_nll_is_rejected_with_its_reason(bad: tuple[Any, str], slot: int) -> None:
    value, reason = bad
    d = _feedback(nll_with=1.0, nll_without=2.0, nll_without_slot={str(slot): value})
    with pytest.raises(Rejected) as exc:
        decode_llm_feedback(orjson.dumps(d), LIMITS_PROP)
    assert exc.value.reason == reason, (value, exc.value)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"])
def test_a_non_finite_slot_nll_is_rejected(literal: bytes) -> None:
    raw = orjson.dumps(_feedback(nll_with=1.0, nll_without=2.0, nll_without_slot={"1": 12345.5}))
    raw = raw.replace(b"12345.5", literal)
    with pytest.raises(Rejected) as exc:
        decode_llm_feedback(raw, LIMITS_PROP)
    assert exc.value.reason in ("non_finite", "bad_json"), exc.value  # NaN/Infinity are not JSON
    if literal.endswith(b"e400"):
        assert exc.value.reason == "non_finite"


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
        d = set_field(d, path, data.draw(WRONG_FOR[kind], label="value"))
    else:  # one element of an array, keeping its length
        path = data.draw(st.sampled_from(ELEMENT_FIELDS), label="array")
        node = d
        for p in path:
            node = node[p]
        items = list(node)
        items[data.draw(st.integers(0, len(items) - 1), label="index")] = data.draw(WRONG_FOR["element"])
        d = set_field(d, path, items)
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
    "canary",  # contracts 1.4 and 1.5: with the fields that must agree with it
    "canary_arm",
    "canary_version",
    "canary_other",
    "canary_rate",  # contract 1.9: both or neither, never on a coupled request
    "alternative_version",
    "principal",  # contract 1.15
    "incumbent",  # contract 1.17: with logprob 0 and the first k of the candidates
    "base",  # contract 1.23: never with incumbent, on a fallback step or the canary's request
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(_PATHS),
    value=_JSON_VALUES,
    drop=st.booleans(),
    coupled=st.booleans(),
    mixed=st.booleans(),
    incumbent=st.booleans(),
    base=st.booleans(),
)
def test_fast_path_never_accepts_what_the_full_validator_rejects(
    path: str, value: Any, drop: bool, coupled: bool, mixed: bool, incumbent: bool, base: bool
) -> None:
    obj = retrieval_dict()
    if incumbent:  # contract 1.17: the client's own first k under an incumbent manifest
        obj.update(incumbent=True, logprob=0.0, selected=[0, 1])
    elif base:  # contract 1.23: drawn under the certified version a probe's manifest names
        obj.update(base=True)
    if coupled:  # contract 1.5: a coupled request that served the serving policy's slate
        obj.update(canary_arm="serving", canary_version=3, canary_other=[1, 0])
    elif mixed:  # contract 1.9: a request drawn from the serving policy and the canary's mixture
        obj.update(canary_rate=0.2, alternative_version=4)
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
    obj.pop("answer_text")  # texts (contract 1.1's answer too) take the full validator
    assert events._fast_retrieval_event(obj, LIMITS, NO_KEY_CHECK, SCHEMA_RETRIEVAL, None) is not None
    # Under a first policy most requests are incumbent steps (contract 1.17): the common case too.
    obj.update(incumbent=True, logprob=0.0, selected=[0, 1])
    fast = events._fast_retrieval_event(obj, LIMITS, NO_KEY_CHECK, SCHEMA_RETRIEVAL, None)
    assert fast is not None and fast.incumbent
    # Under a probe over a certified version most requests are the base's draws (contract 1.23).
    obj = retrieval_dict(base=True)
    obj.pop("memory_texts")
    obj.pop("answer_text")
    fast = events._fast_retrieval_event(obj, LIMITS, NO_KEY_CHECK, SCHEMA_RETRIEVAL, None)
    assert fast is not None and fast.base and fast.logprob == -1.25


@pytest.mark.parametrize(
    "changes",
    [
        {"base": True},
        {"base": False},
        {"base": True, "incumbent": True, "logprob": 0.0, "selected": [0, 1]},
        {"base": True, "fallback": True},
        {"base": True, "canary": True},
        {"base": 1},
        {"base": "true"},
    ],
    ids=["base", "not-base", "with-incumbent", "fallback", "canary", "int", "string"],
)
def test_both_decode_paths_agree_on_base(changes: dict[str, Any]) -> None:
    """Contract 1.23's ``base``: the fast path takes a valid one as the validator does, and leaves
    every invalid one to it, which rejects it."""
    obj = retrieval_dict(**changes)
    obj.pop("memory_texts")
    obj.pop("answer_text")
    fast = events._fast_retrieval_event(copy.deepcopy(obj), LIMITS, NO_KEY_CHECK, SCHEMA_RETRIEVAL, None)
    try:
        full = events._validated_retrieval_event(copy.deepcopy(obj), LIMITS, NO_KEY_CHECK, SCHEMA_RETRIEVAL, None)
    except Rejected:
        full = None
    assert (fast is None) == (full is None), changes
    if fast is not None:
        assert full is not None and _events_equal(fast, full)
        assert fast.base is (True if changes["base"] else None)


def test_the_contracts_feedback_examples_decode_with_the_effects_it_states() -> None:
    """docs/contract.md §3: its LLMFeedback examples decode, and the 1.1 one has the effects it states."""
    import re

    text = (REPO_ROOT / "docs" / "contract.md").read_text()
    blocks = [orjson.loads(b) for b in re.findall(r"```json\n(.*?)```", text, flags=re.S) if "llm_feedback/v1" in b]
    assert len(blocks) >= 2
    decoded = [decode_llm_feedback(orjson.dumps(b), Limits(), key=b["query_id"].encode()) for b in blocks]
    (with_slots,) = [fb for fb in decoded if fb.nll_without_slot]
    assert with_slots.utility == pytest.approx(0.75)
    effects = with_slots.slot_effects([12, 40]) or {}
    assert effects[12] == pytest.approx(0.68) and effects[40] == pytest.approx(-0.07)
