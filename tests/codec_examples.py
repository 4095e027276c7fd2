"""Valid example values of every wire type, their decoders, and comparison helpers.

Shared by tests/unit/topics/test_codec.py (round trips), tests/unit/topics/test_codec_rejections.py (one rejection
per reason) and tests/unit/topics/test_codec_properties.py (fuzzing, the fast path).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
from typing import Any

import numpy as np
import orjson
import pytest

from topics.events import decode_retrieval_event
from topics.feedback import decode_llm_feedback
from topics.fields import NO_KEY_CHECK, Limits, Rejected
from topics.internal import (
    decode_control,
    decode_experience,
    decode_outcomes,
    decode_rating_pair,
)
from topics.labels import decode_active_learning_sample, decode_human_label
from topics.manifest import (
    MAX_CHUNK_BYTES,
    decode_manifest,
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
        "answer_text": "alpha and beta",  # contract 1.1
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


def feedback_slots_dict(**changes: Any) -> dict[str, Any]:
    """Contract 1.1: the NLL pair and the leave-one-out NLL of each selected slot (as the evaluator sends)."""
    d = feedback_dict(nll_without_slot={"0": 2.0, "5": 1.5})
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
    del event["memory_texts"], event["query_text"], event["answer_text"]
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


def outcomes_dict(**changes: Any) -> dict[str, Any]:
    # A candidate carries its ActiveLearningSample as the join encoded it: text.
    sample = orjson.dumps(al_dict(reason="error")).decode()
    d: dict[str, Any] = {
        "schema": "outcomes/v1",
        "records": [
            {"query_id": "q1", "step": 1, "ts": 1_700_000_000.0, "utility": 0.25, "fallback": False, "policy": "p"},
            {
                "query_id": "q1",
                "step": 2,
                "ts": 1_700_000_000.5,
                "utility": -0.5,
                "fallback": False,
                "policy": "default",
                "al": "error",
                "sample": sample,
            },
        ],
    }
    d.update(changes)
    return d


def rating_pair_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"schema": "rating_pair/v1", "id": "q1", "t": 1_700_000_006.0, "u_query": 0.5, "rating": 4.0}
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


def dec_outcomes(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_outcomes(raw, LIMITS)


def dec_rating_pair(raw: Any, key: Any = NO_KEY_CHECK) -> Any:
    return decode_rating_pair(raw, LIMITS, key=key)


# (name, decoder, valid dict factory)
DECODERS = [
    ("retrieval", dec_retrieval, retrieval_dict),
    ("feedback", dec_feedback, feedback_dict),
    ("label", dec_label, label_dict),
    ("al", dec_al, al_dict),
    ("experience", dec_experience, experience_dict),
    ("control", dec_control, control_dict),
    ("manifest", dec_manifest, manifest_dict),
    ("outcomes", dec_outcomes, outcomes_dict),
    ("rating_pair", dec_rating_pair, rating_pair_dict),
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


def drop_field(d: dict[str, Any], *path: str) -> dict[str, Any]:
    """A deep copy of ``d`` without the field at ``path``."""
    d = copy.deepcopy(d)
    node = d
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return d


def set_field(d: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A deep copy of ``d`` with the field at ``path`` set to ``value``."""
    d = copy.deepcopy(d)
    node = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return d
