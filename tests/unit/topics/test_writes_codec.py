"""The ``memory-writes`` values (docs/contract.md §9.2): round trips, rejections, fuzzing."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.paths import REPO_ROOT
from topics.fields import REASONS, Limits, Rejected
from topics.names import DECODERS, Topics
from topics.writes import MemoryWrite, RejectedWrite, decode_memory_write, decode_rejected_write

D = 4
LIMITS = Limits(embedding_dim=D, slots=8)
BASE_TS = 1_767_225_600.0


def write_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "memory_write/v1",
        "write_id": "w1",
        "ts": BASE_TS,
        "text": "The export API pages at 500 rows; ask for 100.",
        "query_id": "q1",
        "step": 1,
        "reward": 0.8,
        "expected_reward": 0.1,
        "embedding": [0.5, -0.5, 0.25, 0.0],
        "query_embedding": [1.0, 0.0, 0.0, 0.0],
        "policy": "default",
        "source": "agent-7",
    }
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


def _reason(raw: bytes, key: Any = b"w1") -> str:
    with pytest.raises(Rejected) as info:
        decode_memory_write(raw, LIMITS, key)
    return info.value.reason


def test_a_full_proposal_round_trips_and_optional_fields_default() -> None:
    w = decode_memory_write(orjson.dumps(write_dict()), LIMITS, b"w1")
    assert (w.write_id, w.query_id, w.step, w.reward, w.expected_reward) == ("w1", "q1", 1, 0.8, 0.1)
    assert (
        w.embedding is not None and w.embedding.dtype == np.float32 and w.embedding.tolist() == [0.5, -0.5, 0.25, 0.0]
    )
    _same(decode_memory_write(w.to_bytes(), LIMITS, w.key), w)
    bare = decode_memory_write(
        orjson.dumps(write_dict(expected_reward=None, embedding=None, query_embedding=None, policy=None, source=None)),
        LIMITS,
    )
    assert bare.expected_reward is None and bare.embedding is None and bare.query_embedding is None
    assert set(bare.to_dict()) == {"schema", "write_id", "ts", "text", "query_id", "step", "reward"}


def _same(a: MemoryWrite, b: MemoryWrite) -> bool:
    for name in MemoryWrite.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert np.array_equal(x, y), name
        else:
            assert x == y, name
    return True


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"reward": None}, "missing_field"),  # the "a write proposal without a reward"
        ({"reward": "high"}, "wrong_type"),
        ({"embedding": [0.1, 0.2, 0.3]}, "embedding_length"),  # "an embedding of the wrong size"
        ({"query_embedding": [0.1] * (D + 1)}, "embedding_length"),
        ({"text": ""}, "out_of_range"),
        ({"text": None}, "missing_field"),
        ({"step": -1}, "out_of_range"),
        ({"schema": "memory_write/v9"}, "unknown_schema"),
        ({"expected_reward": True}, "wrong_type"),
    ],
)
def test_bad_proposals_are_rejected_with_their_reason(changes: dict[str, Any], reason: str) -> None:
    assert _reason(orjson.dumps(write_dict(**changes))) == reason


def test_non_finite_reward_and_wrong_key_are_rejected() -> None:
    raw = json.dumps(write_dict(reward=float("nan"))).encode()
    assert _reason(raw) == "non_finite"
    assert _reason(orjson.dumps(write_dict()), key=b"w2") == "key_mismatch"


def test_a_kept_rejection_round_trips_with_its_proposal() -> None:
    w = decode_memory_write(orjson.dumps(write_dict()), LIMITS)
    r = RejectedWrite("w1", BASE_TS + 5, 0.05, 0.75, "cluster", 0.3, w)
    back = decode_rejected_write(r.to_bytes(), LIMITS, key=b"w1")
    assert (back.rpe, back.expected_reward, back.estimate, back.theta) == (0.05, 0.75, "cluster", 0.3)
    _same(back.write, w)
    bad = r.to_dict()
    bad["write"] = dict(bad["write"], write_id="other")
    with pytest.raises(Rejected) as info:
        decode_rejected_write(orjson.dumps(bad), LIMITS)
    assert info.value.reason == "inconsistent"


def test_the_topics_exist_with_their_configs() -> None:
    t = Topics.build(prefix="p.", partitions=4, rejected_writes_retention_ms=3_600_000)
    assert t.memory_writes.name == "p.memory-writes" and t.memory_writes.partitions == 4
    rejected = t.memory_writes_rejected
    assert rejected.partitions == 1 and rejected.configs["cleanup.policy"] == "compact,delete"
    assert rejected.configs["retention.ms"] == "3600000"
    assert t.memory_writes in t.all() and t.memory_writes_rejected in t.all()
    assert DECODERS["memory-writes"] is decode_memory_write


# --------------------------------------------------------------------------- properties

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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_proposals_with_arbitrary_fields_are_accepted_or_rejected_never_crash(data: st.DataObject) -> None:
    d = write_dict()
    for name in data.draw(st.lists(st.sampled_from(sorted(d)), min_size=1, max_size=3, unique=True)):
        d[name] = data.draw(json_values, label=name)
    for decode in (decode_memory_write, decode_rejected_write):
        try:
            decode(json.dumps(d).encode(), LIMITS, b"w1")
        except Rejected as exc:
            assert exc.reason in REASONS


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
ids = st.text(min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(
    write_id=ids,
    text=st.text(min_size=1, max_size=200),
    step=st.integers(0, 10_000),
    reward=finite,
    expected=st.none() | finite,
    emb=st.none() | st.lists(finite, min_size=D, max_size=D),
)
def test_generated_proposals_round_trip(
    write_id: str, text: str, step: int, reward: float, expected: float | None, emb: list[float] | None
) -> None:
    embedding = None if emb is None else np.asarray(emb, np.float32)
    w = MemoryWrite(write_id, BASE_TS, text, "q", step, reward, expected, embedding)
    back = decode_memory_write(w.to_bytes(), LIMITS, key=w.key)
    assert (back.write_id, back.text, back.step, back.reward, back.expected_reward) == (
        write_id,
        text,
        step,
        reward,
        expected,
    )
    assert (back.embedding is None) == (embedding is None)
    if embedding is not None and back.embedding is not None:
        assert np.array_equal(back.embedding, embedding)


def test_the_contracts_example_proposal_decodes() -> None:
    import re

    text = (REPO_ROOT / "docs" / "contract.md").read_text()
    (block,) = [orjson.loads(b) for b in re.findall(r"```json\n(.*?)```", text, flags=re.S) if "memory_write/v1" in b]
    w = decode_memory_write(orjson.dumps(block), Limits(), key=block["write_id"].encode())
    assert (w.reward, w.expected_reward, w.step) == (0.82, None, 2)
