"""Human labels and the active-learning samples they answer (docs/contract.md §3, §4).

The pipeline publishes an :class:`ActiveLearningSample` for a retrieval worth a human's
look; a labeler answers with a :class:`HumanLabel`: a ``rating`` (0–5), a ``verdict`` on
the answer, or a ``memory_choice`` that names the memories that should have been used.

>>> from topics.fields import Limits, encode
>>> label = HumanLabel("e1", "q1", 1.0, "ann", "memory_choice", sample_id="s1", correct_memories=[4])
>>> back = decode_human_label(encode(label.to_dict()), Limits(), key=b"q1")
>>> back.correct_memories, back.rating
([4], None)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from topics.events import Features, read_features
from topics.fields import (
    LABEL_KINDS,
    NO_KEY_CHECK,
    SCHEMA_AL_SAMPLE,
    SCHEMA_LABEL,
    Fields,
    Limits,
    Rejected,
    WireValue,
    open_value,
)

# A memory_choice label whose sample_id has this prefix is a labeler's "do not use" for the
# memories in ``harmful_memories`` (contract 1.2), not an answer to a queued sample.
DO_NOT_USE_PREFIX = "do-not-use:"


@dataclass(slots=True)
class HumanLabel(WireValue):
    """A person's answer about one query: a rating, a verdict, or a choice of memories."""

    SCHEMA = SCHEMA_LABEL
    FIELDS = ("event_id", "query_id", "ts", "labeler", "kind")
    OPTIONAL = (
        "rating",
        "answer_correct",
        "sample_id",
        "correct_memories",
        "step",
        "skip_reason",
        "harmful_memories",
    )

    event_id: str
    query_id: str
    ts: float
    labeler: str
    kind: str
    rating: int | None = None
    answer_correct: bool | None = None
    sample_id: str | None = None
    correct_memories: list[int] | None = None
    step: int | None = None
    skip_reason: str | None = None  # optional addition: why a labeler skipped (kind memory_choice)
    # Contract 1.2: memories the labeler marked harmful ("do not use"); kind memory_choice only.
    harmful_memories: list[int] | None = None


def decode_human_label(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> HumanLabel:
    """A ``human-labels`` value, validated; the fields its ``kind`` needs are required.

    Arguments and errors follow the decoder contract in :mod:`topics.fields`.
    """
    f = open_value(raw, limits, SCHEMA_LABEL)
    query_id = f.query_id(key)
    kind = f.str_("kind")
    if kind not in LABEL_KINDS:
        raise Rejected("out_of_range", f"kind {kind!r} not in {LABEL_KINDS}")
    label = HumanLabel(
        event_id=f.str_("event_id"),
        query_id=query_id,
        ts=f.float_("ts", 0.0, 1e11),
        labeler=f.str_("labeler"),
        kind=kind,
        step=f.int_("step", 0, 2**31, required=False),
    )
    if kind == "rating":
        label.rating = f.int_("rating", 0, 5)
    elif kind == "verdict":
        label.answer_correct = f.bool_("answer_correct")
    else:
        label.sample_id = f.str_("sample_id")
        label.correct_memories = f.slots_("correct_memories")
        label.skip_reason = f.str_("skip_reason", required=False, max_len=1024, empty_ok=True)
        label.harmful_memories = f.slots_("harmful_memories", required=False)
        if label.harmful_memories and set(label.harmful_memories) & set(label.correct_memories or ()):
            raise Rejected("inconsistent", "a slot is both correct and harmful")
        # A rating may ride along with an answer (the labeling tool asks for both).
        label.rating = f.int_("rating", 0, 5, required=False)
    return label


@dataclass(slots=True)
class ActiveLearningSample(WireValue):
    """A retrieval worth a labeler's look (``reason``), with what the labeler needs to see."""

    SCHEMA = SCHEMA_AL_SAMPLE
    FIELDS = (
        "sample_id",
        "query_id",
        "step",
        "ts",
        "reason",
        "utility",
        "policy_version",
        "policy",
        "features",
        "candidates",
        "selected",
        "top_slots",
    )
    OPTIONAL = ("query_text", "memory_texts", "scores", "temperature")
    NESTED = ("features", "memory_texts")

    sample_id: str
    query_id: str
    step: int
    ts: float
    reason: str
    utility: float
    policy_version: int
    features: Features
    candidates: list[int]
    selected: list[int]
    top_slots: list[dict[str, float]]
    query_text: str | None = None
    memory_texts: dict[int, str] | None = None
    # Optional additions needed to train on the answer with the serving rule (docs/learning.md).
    scores: np.ndarray | None = None
    temperature: float | None = None
    policy: str = "default"


# Any slot number a JSON integer can carry: what a reader without the model's configuration accepts.
ANY_SLOT = 2**31


def decode_active_learning_sample(
    raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK, *, any_shape: bool = False
) -> ActiveLearningSample:
    """An ``active-learning`` value, validated.

    Arguments and errors follow the decoder contract in :mod:`topics.fields`. With
    ``any_shape`` the model's sizes are not checked: the embedding may have any length
    (it is read as it comes) and slot numbers any non-negative value. A labeler shows a
    sample to a person and needs no model configuration; the worker, which turns answers
    into training data, decodes with its own sizes.

    >>> from topics.fields import encode
    >>> s = ActiveLearningSample("s1", "q1", 0, 1.0, "error", -0.5, 1, Features(np.zeros(3), 0.0, 0.0),
    ...                          [2000], [2000], [{"slot": 2000, "prob": 1.0}])
    >>> raw = encode(s.to_dict())
    >>> decode_active_learning_sample(raw, Limits(), any_shape=True).features.query_embedding.shape
    (3,)
    >>> decode_active_learning_sample(raw, Limits())
    Traceback (most recent call last):
    ...
    topics.fields.Rejected: out_of_range: candidates[]=2000 outside [0, 1023]
    """
    if any_shape:
        limits = replace(limits, slots=ANY_SLOT)
    f = open_value(raw, limits, SCHEMA_AL_SAMPLE)
    query_id = f.query_id(key)
    features = f.obj_("features")
    assert features is not None
    if any_shape:
        embedding = features.obj.get("query_embedding")
        if isinstance(embedding, list):
            if not embedding:  # any length, but not none: Limits needs D >= 1, and no model reads D = 0
                raise Rejected("embedding_length", "query_embedding is empty")
            limits = replace(limits, embedding_dim=len(embedding))
            features = Fields(features.obj, limits, features.path)
    candidates = f.slots_("candidates")
    assert candidates is not None
    top_items = f.list_("top_slots")
    assert top_items is not None
    top_slots = []
    for item in top_items:
        if not isinstance(item, dict):
            raise Rejected("wrong_type", "top_slots[] must be objects")
        g = Fields(item, limits, "top_slots[].")
        top_slots.append({"slot": g.int_("slot", 0, limits.slots - 1), "prob": g.float_("prob", 0.0, 1.0 + 1e-6)})
    scores = f.floats_("scores", required=False)
    if scores is not None and len(scores) != len(candidates):
        raise Rejected("inconsistent", "scores and candidates differ in length")
    return ActiveLearningSample(
        sample_id=f.str_("sample_id"),
        query_id=query_id,
        step=f.int_("step", 0, 2**31),
        ts=f.float_("ts", 0.0, 1e11),
        reason=f.str_("reason"),
        utility=f.float_("utility"),
        policy_version=f.int_("policy_version", 0, 2**62),
        features=read_features(features, limits),
        candidates=candidates,
        selected=f.slots_("selected") or [],
        top_slots=top_slots,
        query_text=f.str_("query_text", required=False, max_len=limits.max_text_len, empty_ok=True),
        memory_texts=f.texts_("memory_texts"),
        scores=scores,
        temperature=f.float_("temperature", 1e-6, 1e6, required=False),
        policy=f.str_("policy", required=False) or "default",
    )
