"""topics/ beyond the input decoders: the worker-stage values (outcomes, rating pairs), the
epoch marker, the shared to_dict, the decoder table, and what topics/ and models/ import."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from tests.codec_examples import (
    LIMITS,
    dec_outcomes,
    dec_rating_pair,
    expect_reason,
    outcomes_dict,
    rating_pair_dict,
    raw_of,
    retrieval_dict,
    set_field,
)
from topics.events import Features, RetrievalEvent, decode_retrieval_event
from topics.fields import REASONS, Limits, encode, wire_dict
from topics.internal import EpochMarker, Outcome, Outcomes, RatingPair, decode_outcomes, decode_rating_pair
from topics.names import DECODERS, Topics

ROOT = Path(__file__).resolve().parent.parent


def test_outcomes_decode_typed_records_with_the_candidates_event() -> None:
    out = dec_outcomes(raw_of(outcomes_dict()))
    plain, candidate = out.records
    assert (plain.query_id, plain.step, plain.utility, plain.policy, plain.al, plain.event) == (
        "q1",
        1,
        0.25,
        "p",
        None,
        None,
    )
    assert candidate.al == "error" and isinstance(candidate.event, RetrievalEvent)
    assert candidate.event.memory_texts == {0: "first memory", 1: "second memory"} or candidate.event.memory_texts
    assert candidate.policy == "default"


def test_outcomes_encode_as_the_join_writes_them() -> None:
    event = decode_retrieval_event(raw_of(retrieval_dict()), LIMITS)
    body = Outcomes([Outcome("q1", 2, 5.0, -0.5, False, "default", "uncertain", event)]).to_dict()
    assert body["schema"] == "outcomes/v1"
    (rec,) = body["records"]
    assert list(rec) == ["query_id", "step", "ts", "utility", "fallback", "policy", "al", "event"]
    assert rec["event"]["schema"] == "retrieval_event/v1" and rec["event"]["memory_texts"] == {
        "0": "alpha",
        "5": "beta",
    }
    back = decode_outcomes(encode(body), LIMITS).records[0]
    assert back.al == "uncertain" and back.event is not None and back.event.event_id == event.event_id


@pytest.mark.parametrize(
    ("reason", "change"),
    [
        ("missing_field", lambda d: set_field(d, ("records",), [{**d["records"][1], "event": None}])),
        ("out_of_range", lambda d: set_field(d, ("records",), [{**d["records"][0], "al": "bored"}])),
        ("wrong_type", lambda d: set_field(d, ("records",), [7])),
        ("wrong_type", lambda d: set_field(d, ("records",), [{**d["records"][1], "event": "e1"}])),
        (
            "inconsistent",
            lambda d: set_field(d, ("records",), [{**d["records"][1], "event": retrieval_dict(selected=[4])}]),
        ),
        ("out_of_range", lambda d: set_field(d, ("records",), [{**d["records"][0], "step": -1}])),
        ("unknown_schema", lambda d: set_field(d, ("schema",), "outcomes/v2")),
    ],
)
def test_outcomes_rejections(reason: str, change: Any) -> None:
    expect_reason(reason, dec_outcomes, raw_of(change(outcomes_dict())))


def test_rating_pair_round_trip_and_rejections() -> None:
    pair = RatingPair("q9", 12.0, -0.25, 0)
    assert pair.to_dict() == {"schema": "rating_pair/v1", "id": "q9", "t": 12.0, "u_query": -0.25, "rating": 0}
    assert decode_rating_pair(encode(pair.to_dict()), LIMITS, key=b"q9") == pair
    expect_reason("key_mismatch", dec_rating_pair, raw_of(rating_pair_dict()), b"q2")
    expect_reason("out_of_range", dec_rating_pair, raw_of(rating_pair_dict(rating=6)))
    expect_reason("missing_field", dec_rating_pair, raw_of(rating_pair_dict(u_query=None)))


def test_epoch_marker_is_what_topic_creation_writes() -> None:
    assert orjson.loads(encode(EpochMarker(3.5).to_dict())) == {"schema": "epoch/v1", "created_ts": 3.5}


def test_retrieval_event_to_dict_keeps_the_contract_order_and_omits_unset_fields() -> None:
    event = RetrievalEvent(
        "e1", "q1", 0, 1.0, Features(np.zeros(2, np.float32), 0.5, 0.1), [3], np.array([0.2]), [3], 1.0, -0.1, False
    )
    assert list(event.to_dict()) == [
        "schema", "event_id", "query_id", "step", "ts", "policy", "policy_version", "features",
        "candidates", "scores", "selected", "temperature", "logprob", "fallback",
    ]  # fmt: skip
    event.memory_texts, event.mask_max = {3: "text"}, 0.5
    d = event.to_dict()
    assert list(d)[-2:] == ["mask_max", "memory_texts"] and d["memory_texts"] == {"3": "text"}
    assert list(d["features"]) == ["query_embedding", "last_step_loss", "last_step_entropy"]


def test_wire_dict_without_schema_and_with_nested_values() -> None:
    feats = Features(np.ones(1, np.float32), 0.0, 1.0)
    holder = type("Holder", (), {"a": feats, "b": {1: "x"}, "c": None})()
    assert list(wire_dict(holder, "", ("a",), ("b", "c"))) == ["a", "b"]
    assert wire_dict(holder, "s/v1", ("b",), nested=("b", "c"))["b"] == {"1": "x"}
    assert wire_dict(holder, "", ("a",), nested=("a",))["a"]["last_step_entropy"] == 1.0
    assert wire_dict(holder, "", ("a",))["a"] is feats  # not declared nested: as it is


def test_decoder_table_names_topics_that_exist() -> None:
    topics = Topics.build(prefix="", partitions=1)
    names = {spec.name for spec in topics.all()}
    assert set(DECODERS) <= names
    assert {s.name for s in topics.inputs()} <= set(DECODERS)
    for name, dec in DECODERS.items():
        with pytest.raises(ValueError) as info:
            dec(b"[]", Limits(), b"q1")
        assert getattr(info.value, "reason", None) in REASONS, name


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", ["topics", "models"])
def test_models_and_topics_import_nothing_from_pipeline(package: str) -> None:
    for path in sorted((ROOT / package).glob("*.py")):
        assert "pipeline" not in _imports(path), path.name


def test_topics_need_neither_torch_nor_models() -> None:
    # Torch-free code (a serving-side client, the model-topic index) reads manifests and chunks.
    for path in sorted((ROOT / "topics").glob("*.py")):
        assert not _imports(path) & {"torch", "safetensors", "models"}, path.name
