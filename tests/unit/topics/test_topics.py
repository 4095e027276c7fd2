"""topics/ beyond the input decoders: the worker-stage values (outcomes, rating pairs), the
epoch marker, the shared to_dict, the decoder table, and what topics/ and models/ import."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from tests.codec_examples import (
    LIMITS,
    al_dict,
    dec_outcomes,
    dec_rating_pair,
    expect_reason,
    outcomes_dict,
    rating_pair_dict,
    raw_of,
    retrieval_dict,
    set_field,
)
from tests.paths import REPO_ROOT
from topics.events import Features, RetrievalEvent
from topics.fields import REASONS, Limits, encode, wire_dict
from topics.internal import (
    EpochMarker,
    Outcome,
    Outcomes,
    RatingPair,
    decode_outcomes,
    decode_rating_pair,
    outcomes_bytes,
)
from topics.labels import decode_active_learning_sample
from topics.names import DECODERS, Topics

ROOT = REPO_ROOT


def test_outcomes_decode_typed_records_with_the_candidates_sample() -> None:
    d = outcomes_dict()
    out = dec_outcomes(raw_of(d))
    plain, candidate = out.records
    assert (plain.query_id, plain.step, plain.utility, plain.policy, plain.al, plain.sample) == (
        "q1",
        1,
        0.25,
        "p",
        None,
        None,
    )
    assert (candidate.al, candidate.policy) == ("error", "default")
    # The sample stays the text the join wrote: forwarded to active-learning byte for byte.
    assert candidate.sample == d["records"][1]["sample"]
    assert decode_active_learning_sample(candidate.sample.encode(), LIMITS).sample_id == "s1"


def test_outcomes_encode_as_the_join_writes_them() -> None:
    sample = raw_of(al_dict()).decode()
    body = Outcomes([Outcome("q1", 2, 5.0, -0.5, False, "default", "uncertain", sample)]).to_dict()
    assert body["schema"] == "outcomes/v1"
    (rec,) = body["records"]
    assert list(rec) == ["query_id", "step", "ts", "utility", "fallback", "policy", "al", "sample"]
    assert rec["sample"] == sample
    plain = Outcome("q1", 3, 5.0, 0.5, False)
    assert outcomes_bytes([plain]) == encode({"schema": "outcomes/v1", "records": [plain.to_dict()]})
    back = decode_outcomes(encode(body), LIMITS).records[0]
    assert back == Outcome("q1", 2, 5.0, -0.5, False, "default", "uncertain", sample)


def test_an_older_joins_candidate_record_counts_its_utility_only() -> None:
    """Before the sample, the join sent the candidate's whole event: it reads as a plain record."""
    old = {**outcomes_dict()["records"][1], "event": retrieval_dict()}
    del old["sample"]
    (rec,) = dec_outcomes(raw_of(outcomes_dict(records=[old]))).records
    assert (rec.utility, rec.al, rec.sample) == (-0.5, None, None)


def test_an_outcomes_message_is_not_bound_by_the_input_message_limit() -> None:
    """One message holds a whole join batch: thousands of records are well over 256 KiB."""
    records = [Outcome(f"q{i}", i, 1.0 + i, 0.5, False) for i in range(4000)]
    raw = outcomes_bytes(records)
    assert len(raw) > LIMITS.max_bytes
    assert decode_outcomes(raw, LIMITS).records == records
    expect_reason(
        "oversize", dec_outcomes, raw_of(outcomes_dict(records=[{**records[0].to_dict(), "query_id": "q" * 257}]))
    )


@pytest.mark.parametrize(
    ("reason", "change"),
    [
        ("out_of_range", lambda d: set_field(d, ("records",), [{**d["records"][0], "al": "bored"}])),
        ("wrong_type", lambda d: set_field(d, ("records",), [7])),
        ("wrong_type", lambda d: set_field(d, ("records",), [{**d["records"][1], "sample": {"x": 1}}])),
        ("inconsistent", lambda d: set_field(d, ("records",), [{**d["records"][0], "sample": "{}"}])),
        ("out_of_range", lambda d: set_field(d, ("records",), [{**d["records"][0], "step": -1}])),
        ("non_finite", lambda d: set_field(d, ("records",), [{**d["records"][0], "utility": float("nan")}])),
        ("missing_field", lambda d: set_field(d, ("records",), [{**d["records"][0], "utility": None}])),
        ("wrong_type", lambda d: set_field(d, ("records",), [{**d["records"][0], "fallback": 0}])),
        ("unknown_schema", lambda d: set_field(d, ("schema",), "outcomes/v2")),
    ],
)
def test_outcomes_rejections(reason: str, change: Any) -> None:
    expect_reason(reason, dec_outcomes, _json(change(outcomes_dict())))


def _json(obj: Any) -> bytes:
    # The standard library writes NaN as a token, which orjson would refuse to encode.
    return json.dumps(obj).encode()


def test_rating_pair_round_trip_and_rejections() -> None:
    pair = RatingPair("q9", 12.0, -0.25, 3.5)
    assert pair.to_dict() == {"schema": "rating_pair/v1", "id": "q9", "t": 12.0, "u_query": -0.25, "rating": 3.5}
    assert decode_rating_pair(encode(pair.to_dict()), LIMITS, key=b"q9") == pair
    # An integer rating (as a labeler gives it) reads as a float: the drift stage correlates floats.
    assert decode_rating_pair(raw_of(rating_pair_dict(rating=4)), LIMITS).rating == 4.0
    expect_reason("key_mismatch", dec_rating_pair, raw_of(rating_pair_dict()), b"q2")
    expect_reason("out_of_range", dec_rating_pair, raw_of(rating_pair_dict(rating=6)))
    expect_reason("out_of_range", dec_rating_pair, raw_of(rating_pair_dict(rating=-0.5)))
    expect_reason("wrong_type", dec_rating_pair, raw_of(rating_pair_dict(rating="4")))
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
