"""Encode, decode and validate every value on the wire (DESIGN §3, §5).

Values are UTF-8 JSON objects encoded with orjson. Decoders take the raw message bytes
(and, for keyed topics, the key) and either return a typed value or raise
:class:`Rejected` with a machine-readable ``reason``; the pipeline sends rejected input to
the dead-letter topic with that reason and never lets it reach the model. Unknown extra
fields are ignored.

>>> import orjson
>>> raw = orjson.dumps({"schema": "llm_feedback/v1", "event_id": "e1", "query_id": "q1",
...                     "step": 0, "ts": 1.0, "nll_with": 1.5, "nll_without": 2.0})
>>> decode_llm_feedback(raw, Limits(), key=b"q1").utility
0.5
>>> try:
...     decode_llm_feedback(b"{not json", Limits())
... except Rejected as e:
...     print(e.reason)
bad_json
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

# Machine-readable rejection reasons. Stable: dashboards and alerts key on them.
REASONS: tuple[str, ...] = (
    "bad_json",  # not parseable as JSON (truncated bytes, invalid UTF-8, too deeply nested)
    "not_object",  # JSON, but not an object
    "oversize",  # message larger than the configured limit, or an array/string over its limit
    "unknown_schema",  # schema field names a version this pipeline does not speak
    "missing_field",  # a required field is absent
    "wrong_type",  # a field has the wrong JSON type
    "non_finite",  # NaN or ±inf where a number is required
    "out_of_range",  # a number/int outside its allowed range (slot >= S, step < 0, T <= 0, ...)
    "embedding_length",  # query_embedding does not have D values
    "inconsistent",  # fields disagree (scores vs candidates, selected not among candidates, ...)
    "key_mismatch",  # Kafka key is not the value's query_id (breaks co-partitioning)
)

SCHEMA_RETRIEVAL = "retrieval_event/v1"
SCHEMA_FEEDBACK = "llm_feedback/v1"
SCHEMA_LABEL = "human_label/v1"
SCHEMA_AL_SAMPLE = "active_learning_sample/v1"
SCHEMA_MANIFEST = "policy_checkpoint/v1"
SCHEMA_DEAD_LETTER = "dead_letter/v1"
SCHEMA_EXPERIENCE = "experience/v2"
SCHEMA_OUTCOMES = "outcomes/v1"
SCHEMA_RATING_PAIR = "rating_pair/v1"
SCHEMA_CONTROL = "control/v1"

LABEL_KINDS = ("rating", "verdict", "memory_choice")
CHECKPOINT_REASONS = ("init", "periodic", "reset", "label", "shutdown", "rollback")


class Rejected(ValueError):
    """A message that must not reach the model; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """What validation accepts; D and S come from the deployment's configuration."""

    embedding_dim: int = 384
    slots: int = 1024
    max_bytes: int = 256 * 1024
    max_candidates: int = 1024
    max_id_len: int = 256
    max_text_len: int = 16 * 1024
    max_abs_value: float = 1e6


# --------------------------------------------------------------------------- helpers


def encode(value: Any) -> bytes:
    """orjson encoding used for every JSON value we write (numpy arrays allowed)."""
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def loads_object(raw: bytes | bytearray | memoryview | str | None, limits: Limits) -> dict[str, Any]:
    """Parse raw bytes as a JSON object, rejecting oversize and malformed input."""
    if raw is None:
        raise Rejected("bad_json", "empty value (tombstone)")
    if len(raw) > limits.max_bytes:
        raise Rejected("oversize", f"{len(raw)} bytes > {limits.max_bytes}")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        text = str(exc)
        if "infinity" in text or _non_finite_at(raw, exc.pos):
            raise Rejected("non_finite", "NaN/Infinity is not JSON") from None
        raise Rejected("bad_json", text[:200]) from None
    if not isinstance(obj, dict):
        raise Rejected("not_object", type(obj).__name__)
    return obj


def _non_finite_at(raw: bytes | bytearray | memoryview | str, pos: int) -> bool:
    """Did parsing stop on a NaN/Infinity literal (as Python's json.dumps writes them)?"""
    # orjson reports a character position, not a byte offset.
    text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8", "replace")
    return text[pos : pos + 3] == "NaN" or text[pos : pos + 8] == "Infinity"


class _Fields:
    """Typed access to one JSON object's fields; every failure is a :class:`Rejected`."""

    __slots__ = ("limits", "obj", "path")

    def __init__(self, obj: dict[str, Any], limits: Limits, path: str = "") -> None:
        self.obj = obj
        self.limits = limits
        self.path = path

    def _get(self, name: str, required: bool) -> Any:
        if name not in self.obj or self.obj[name] is None:
            if required:
                raise Rejected("missing_field", self.path + name)
            return None
        return self.obj[name]

    def schema(self, expected: str) -> None:
        value = self._get("schema", True)
        if value != expected:
            raise Rejected("unknown_schema", f"{value!r} (expected {expected!r})")

    def str_(self, name: str, required: bool = True, max_len: int | None = None, empty_ok: bool = False) -> Any:
        value = self._get(name, required)
        if value is None:
            return None
        if not isinstance(value, str):
            raise Rejected("wrong_type", f"{self.path}{name} must be a string")
        limit = max_len if max_len is not None else self.limits.max_id_len
        if len(value) > limit:
            raise Rejected("oversize", f"{self.path}{name} longer than {limit}")
        if not value and not empty_ok:
            raise Rejected("out_of_range", f"{self.path}{name} is empty")
        return value

    def int_(self, name: str, lo: int, hi: int | None = None, required: bool = True) -> Any:
        value = self._get(name, required)
        if value is None:
            return None
        return _as_int(value, lo, hi, self.path + name)

    def float_(self, name: str, lo: float | None = None, hi: float | None = None, required: bool = True) -> Any:
        value = self._get(name, required)
        if value is None:
            return None
        return _as_float(value, lo, hi, self.path + name, self.limits.max_abs_value)

    def bool_(self, name: str, required: bool = True, default: bool = False) -> bool:
        value = self._get(name, required)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise Rejected("wrong_type", f"{self.path}{name} must be a boolean")
        return value

    def obj_(self, name: str, required: bool = True) -> _Fields | None:
        value = self._get(name, required)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise Rejected("wrong_type", f"{self.path}{name} must be an object")
        return _Fields(value, self.limits, f"{self.path}{name}.")

    def list_(self, name: str, required: bool = True, max_len: int | None = None) -> list[Any] | None:
        value = self._get(name, required)
        if value is None:
            return None
        if not isinstance(value, list):
            raise Rejected("wrong_type", f"{self.path}{name} must be an array")
        limit = max_len if max_len is not None else self.limits.max_candidates
        if len(value) > limit:
            raise Rejected("oversize", f"{self.path}{name} has {len(value)} > {limit} items")
        return value

    def slots_(self, name: str, required: bool = True, unique: bool = True) -> list[int] | None:
        items = self.list_(name, required)
        if items is None:
            return None
        if items and set(map(type, items)) == _INT_TYPE and min(items) >= 0 and max(items) < self.limits.slots:
            slots = items  # the common case, checked in C
        else:
            slots = [_as_int(v, 0, self.limits.slots - 1, f"{self.path}{name}[]") for v in items]
        if unique and len(set(slots)) != len(slots):
            raise Rejected("inconsistent", f"{self.path}{name} repeats a slot")
        return slots

    def floats_(self, name: str, required: bool = True, lo: float | None = None) -> np.ndarray | None:
        items = self.list_(name, required)
        if items is None:
            return None
        return _float_array(items, f"{self.path}{name}", self.limits.max_abs_value, lo)

    def texts_(self, name: str) -> dict[int, str] | None:
        value = self._get(name, False)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise Rejected("wrong_type", f"{self.path}{name} must be an object")
        if len(value) > self.limits.max_candidates:
            raise Rejected("oversize", f"{self.path}{name} has too many entries")
        out: dict[int, str] = {}
        for k, v in value.items():
            try:
                slot = int(k)
            except ValueError:
                raise Rejected("wrong_type", f"{self.path}{name} keys must be slot numbers") from None
            if not 0 <= slot < self.limits.slots:
                raise Rejected("out_of_range", f"{self.path}{name} slot {slot}")
            if not isinstance(v, str):
                raise Rejected("wrong_type", f"{self.path}{name} values must be strings")
            if len(v) > self.limits.max_text_len:
                raise Rejected("oversize", f"{self.path}{name}[{slot}] too long")
            out[slot] = v
        return out


def _as_int(value: Any, lo: int, hi: int | None, where: str) -> int:
    # bool is an int subclass in Python but not an integer on the wire.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)
        else:
            raise Rejected("wrong_type", f"{where} must be an integer")
    if value < lo or (hi is not None and value > hi):
        raise Rejected("out_of_range", f"{where}={value} outside [{lo}, {hi if hi is not None else '∞'}]")
    return value


def _as_float(value: Any, lo: float | None, hi: float | None, where: str, max_abs: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Rejected("wrong_type", f"{where} must be a number")
    value = float(value)
    if not math.isfinite(value):
        raise Rejected("non_finite", where)
    # Explicit bounds win; a side without one is bounded by max_abs.
    if value < (lo if lo is not None else -max_abs) or value > (hi if hi is not None else max_abs):
        raise Rejected("out_of_range", f"{where}={value}")
    return value


_NUMBER_TYPES = {float, int}
_INT_TYPE = {int}


def _float_array(items: list[Any], where: str, max_abs: float, lo: float | None = None) -> np.ndarray:
    # np.asarray would accept booleans and numeric strings; the wire format does not.
    # (map(type) runs in C: ~30× cheaper than an isinstance loop over a 384-d embedding.)
    if not set(map(type, items)) <= _NUMBER_TYPES:
        raise Rejected("wrong_type", f"{where} must be an array of numbers")
    try:
        arr = np.asarray(items, dtype=np.float64)
    except (TypeError, ValueError):
        raise Rejected("wrong_type", f"{where} must be an array of numbers") from None
    if arr.ndim != 1:
        raise Rejected("wrong_type", f"{where} must be a flat array of numbers")

    if not np.isfinite(arr).all():
        raise Rejected("non_finite", where)
    if arr.size and (np.abs(arr).max() > max_abs or (lo is not None and arr.min() < lo)):
        raise Rejected("out_of_range", where)
    return arr


class _NoKeyCheck:
    """Decoding a value on its own (a file line, a value about to be sent): no key to check."""

    def __repr__(self) -> str:
        return "NO_KEY_CHECK"


NO_KEY_CHECK: Any = _NoKeyCheck()


def _check_key(key: bytes | str | None, query_id: str) -> None:
    """A message read from a keyed topic must be keyed by its query_id (co-partitioning)."""
    if key is NO_KEY_CHECK:
        return
    if key is None:
        raise Rejected("key_mismatch", "the message has no key; it must be the query_id")
    k = key.decode("utf-8", "replace") if isinstance(key, (bytes, bytearray)) else key
    if k != query_id:
        raise Rejected("key_mismatch", f"key {k[:64]!r} != query_id {query_id[:64]!r}")


# --------------------------------------------------------------------------- values


@dataclass(slots=True)
class Features:
    """What the policy sees: never memory content (seed 000 §2.2)."""

    query_embedding: np.ndarray
    last_step_loss: float
    last_step_entropy: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "query_embedding": self.query_embedding,
            "last_step_loss": self.last_step_loss,
            "last_step_entropy": self.last_step_entropy,
        }


def _features(f: _Fields, limits: Limits, embedding: np.ndarray | None = None) -> Features:
    if embedding is None:
        emb_items = f.list_("query_embedding", max_len=max(limits.embedding_dim, 1) * 4)
        assert emb_items is not None
        if len(emb_items) != limits.embedding_dim:
            raise Rejected("embedding_length", f"{len(emb_items)} values, expected {limits.embedding_dim}")
        embedding = _float_array(emb_items, "features.query_embedding", limits.max_abs_value).astype(np.float32)
    return Features(
        query_embedding=embedding,
        last_step_loss=f.float_("last_step_loss"),
        last_step_entropy=f.float_("last_step_entropy"),
    )


def _embedding_from_b64(text: Any, limits: Limits) -> np.ndarray:
    """The internal binary form of an embedding: little-endian float32, base64."""
    if not isinstance(text, str):
        raise Rejected("wrong_type", "embedding_f32 must be a base64 string")
    try:
        arr = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f4")
    except (ValueError, binascii.Error):
        raise Rejected("wrong_type", "embedding_f32 is not base64 of float32 values") from None
    if arr.shape[0] != limits.embedding_dim:
        raise Rejected("embedding_length", f"{arr.shape[0]} values, expected {limits.embedding_dim}")
    if not np.isfinite(arr).all():
        raise Rejected("non_finite", "embedding_f32")
    if arr.size and np.abs(arr).max() > limits.max_abs_value:
        raise Rejected("out_of_range", "embedding_f32")
    return arr.astype(np.float32)  # a writable copy


@dataclass(slots=True)
class RetrievalEvent:
    event_id: str
    query_id: str
    step: int
    ts: float
    features: Features
    candidates: list[int]
    scores: np.ndarray
    selected: list[int]
    temperature: float
    logprob: float
    fallback: bool
    policy: str = "default"
    policy_version: int = 0
    mask_max: float | None = None
    query_text: str | None = None
    memory_texts: dict[int, str] | None = None
    # Optional additions (DESIGN §3 allows added optional fields); written by CausalRetriever.
    dropped: list[int] | None = None  # slots the hard drop removed (intervention rate)
    candidate_masks: np.ndarray | None = None  # m_i of each kept candidate
    candidate_probs: np.ndarray | None = None  # first-draw probabilities over kept candidates

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA_RETRIEVAL,
            "event_id": self.event_id,
            "query_id": self.query_id,
            "step": self.step,
            "ts": self.ts,
            "policy": self.policy,
            "policy_version": self.policy_version,
            "features": self.features.to_dict(),
            "candidates": self.candidates,
            "scores": self.scores,
            "selected": self.selected,
            "temperature": self.temperature,
            "logprob": self.logprob,
            "fallback": self.fallback,
        }
        for name in ("mask_max", "query_text", "dropped", "candidate_masks", "candidate_probs"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.memory_texts is not None:
            out["memory_texts"] = {str(k): v for k, v in self.memory_texts.items()}
        return out


def decode_retrieval_event(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> RetrievalEvent:
    return retrieval_event_from_obj(loads_object(raw, limits), limits, key)


def _num(x: Any, lo: float, hi: float) -> bool:
    return type(x) in _NUMBER_TYPES and lo <= x <= hi


def _slot_list(x: Any, limits: Limits) -> bool:
    return (
        type(x) is list
        and len(x) <= limits.max_candidates
        and (not x or (set(map(type, x)) == _INT_TYPE and min(x) >= 0 and max(x) < limits.slots))
        and len(set(x)) == len(x)
    )


def _number_array(x: Any, n: int, lo: float, hi: float) -> np.ndarray | None:
    if type(x) is not list or len(x) != n or (x and not set(map(type, x)) <= _NUMBER_TYPES):
        return None
    arr = np.asarray(x, dtype=np.float64)
    if arr.size:
        # NaN fails every comparison, so these also reject non-finite values.
        if lo == -hi:
            if not np.abs(arr).max() <= hi:
                return None
        elif not (arr.min() >= lo and arr.max() <= hi):
            return None
    return arr


def _fast_retrieval_event(
    obj: dict[str, Any], limits: Limits, key: Any, schema: str, embedding: np.ndarray | None
) -> RetrievalEvent | None:
    """The common, well-formed case checked with few calls (the join's hot path).

    Returns None for anything unusual — a missing or null field, an integral float where an
    int is expected, texts, any doubt — and the caller then runs the full validator, which
    either accepts the value or says precisely why not. It never accepts what the full
    validator would reject (tests/test_codec.py checks the two agree).
    """
    big, n_max = limits.max_abs_value, limits.max_id_len
    try:
        if obj.get("schema") != schema or obj.get("memory_texts") is not None:
            return None
        qid, eid = obj["query_id"], obj["event_id"]
        if type(qid) is not str or type(eid) is not str or not (0 < len(qid) <= n_max and 0 < len(eid) <= n_max):
            return None
        if key is not NO_KEY_CHECK:
            k = key.decode("utf-8", "replace") if isinstance(key, (bytes, bytearray)) else key
            if k != qid:
                return None
        step, ts, temp, logprob = obj["step"], obj["ts"], obj["temperature"], obj["logprob"]
        if type(step) is not int or not 0 <= step <= 2**31 or not _num(ts, 0.0, 1e11):
            return None
        if not _num(temp, 1e-6, 1e6) or not _num(logprob, -big, 1e-6):
            return None
        fallback = obj["fallback"]
        feats = obj["features"]
        if type(fallback) is not bool or type(feats) is not dict:
            return None
        loss, entropy = feats["last_step_loss"], feats["last_step_entropy"]
        if not _num(loss, -big, big) or not _num(entropy, -big, big):
            return None
        if embedding is None:
            emb = _number_array(feats["query_embedding"], limits.embedding_dim, -big, big)
            if emb is None:
                return None
            embedding = emb.astype(np.float32)
        candidates, selected = obj["candidates"], obj["selected"]
        if not _slot_list(candidates, limits) or not _slot_list(selected, limits):
            return None
        n = len(candidates)
        scores = _number_array(obj["scores"], n, -big, big)
        if scores is None or (not fallback and (not n or not set(selected) <= set(candidates))):
            return None
        policy = obj.get("policy")
        version = obj.get("policy_version")
        mask_max = obj.get("mask_max")
        text = obj.get("query_text")
        dropped = obj.get("dropped")
        if policy is not None and (type(policy) is not str or not 0 < len(policy) <= n_max):
            return None
        if version is not None and (type(version) is not int or not 0 <= version <= 2**62):
            return None
        if mask_max is not None and not _num(mask_max, 0.0, big):
            return None
        if text is not None and (type(text) is not str or len(text) > limits.max_text_len):
            return None
        if dropped is not None and not _slot_list(dropped, limits):
            return None
        extras = {}
        for name in ("candidate_masks", "candidate_probs"):
            if obj.get(name) is not None:
                arr = _number_array(obj[name], n, 0.0, big)
                if arr is None:
                    return None
                extras[name] = arr
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return RetrievalEvent(
        event_id=eid,
        query_id=qid,
        step=step,
        ts=float(ts),
        features=Features(embedding, float(loss), float(entropy)),
        candidates=candidates,
        scores=scores,
        selected=selected,
        temperature=float(temp),
        logprob=float(logprob),
        fallback=fallback,
        policy=policy or "default",
        policy_version=version or 0,
        mask_max=float(mask_max) if mask_max is not None else None,
        query_text=text,
        memory_texts=None,
        dropped=dropped,
        **extras,
    )


def retrieval_event_from_obj(
    obj: dict[str, Any],
    limits: Limits,
    key: Any = NO_KEY_CHECK,
    schema: str = SCHEMA_RETRIEVAL,
    embedding: np.ndarray | None = None,
) -> RetrievalEvent:
    fast = _fast_retrieval_event(obj, limits, key, schema, embedding)
    return fast if fast is not None else _validated_retrieval_event(obj, limits, key, schema, embedding)


def _validated_retrieval_event(
    obj: dict[str, Any], limits: Limits, key: Any, schema: str, embedding: np.ndarray | None
) -> RetrievalEvent:
    """Every rule, field by field, with the precise rejection reason."""
    f = _Fields(obj, limits)

    f.schema(schema)
    query_id = f.str_("query_id")
    _check_key(key, query_id)
    features = f.obj_("features")
    assert features is not None
    fallback = f.bool_("fallback")
    candidates = f.slots_("candidates")
    scores = f.floats_("scores")
    selected = f.slots_("selected")
    assert candidates is not None and scores is not None and selected is not None
    if len(scores) != len(candidates):
        raise Rejected("inconsistent", "scores and candidates differ in length")
    if not fallback:
        if not candidates:
            raise Rejected("inconsistent", "no candidates on a non-fallback event")
        if not set(selected) <= set(candidates):
            raise Rejected("inconsistent", "selected is not a subset of candidates")
    event = RetrievalEvent(
        event_id=f.str_("event_id"),
        query_id=query_id,
        step=f.int_("step", 0, 2**31),
        ts=f.float_("ts", 0.0, 1e11),
        features=_features(features, limits, embedding),
        candidates=candidates,
        scores=scores,
        selected=selected,
        temperature=f.float_("temperature", 1e-6, 1e6),
        logprob=f.float_("logprob", None, 1e-6),
        fallback=fallback,
        policy=f.str_("policy", required=False) or "default",
        policy_version=f.int_("policy_version", 0, 2**62, required=False) or 0,
        mask_max=f.float_("mask_max", 0.0, None, required=False),
        query_text=f.str_("query_text", required=False, max_len=limits.max_text_len, empty_ok=True),
        memory_texts=f.texts_("memory_texts"),
        dropped=f.slots_("dropped", required=False),
    )
    n = len(candidates)
    for name, lo in (("candidate_masks", 0.0), ("candidate_probs", 0.0)):
        arr = f.floats_(name, required=False, lo=lo)
        if arr is not None:
            if len(arr) != n:
                raise Rejected("inconsistent", f"{name} and candidates differ in length")
            setattr(event, name, arr)
    return event


@dataclass(slots=True)
class LLMFeedback:
    event_id: str
    query_id: str
    step: int
    ts: float
    utility: float
    nll_with: float | None = None
    nll_without: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA_FEEDBACK,
            "event_id": self.event_id,
            "query_id": self.query_id,
            "step": self.step,
            "ts": self.ts,
        }
        if self.nll_with is not None and self.nll_without is not None:
            out["nll_with"] = self.nll_with
            out["nll_without"] = self.nll_without
        else:
            out["utility"] = self.utility
        return out


def decode_llm_feedback(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> LLMFeedback:
    obj = loads_object(raw, limits)
    f = _Fields(obj, limits)
    f.schema(SCHEMA_FEEDBACK)
    query_id = f.str_("query_id")
    _check_key(key, query_id)
    nll_with = f.float_("nll_with", 0.0, None, required=False)
    nll_without = f.float_("nll_without", 0.0, None, required=False)
    utility = f.float_("utility", required=False)
    if nll_with is not None and nll_without is not None:
        derived = nll_without - nll_with  # seed 000 §3.3: drop of the answer span's mean NLL
        if utility is not None and abs(utility - derived) > 1e-6 * max(1.0, abs(derived)):
            raise Rejected("inconsistent", "utility disagrees with nll_without - nll_with")
        utility = derived
    elif utility is None:
        missing = "nll_with" if nll_without is not None else "nll_without" if nll_with is not None else "utility"
        raise Rejected("missing_field", f"{missing} (give utility, or both nll_with and nll_without)")
    return LLMFeedback(
        event_id=f.str_("event_id"),
        query_id=query_id,
        step=f.int_("step", 0, 2**31),
        ts=f.float_("ts", 0.0, 1e11),
        utility=utility,
        nll_with=nll_with,
        nll_without=nll_without,
    )


@dataclass(slots=True)
class HumanLabel:
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

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA_LABEL,
            "event_id": self.event_id,
            "query_id": self.query_id,
            "ts": self.ts,
            "labeler": self.labeler,
            "kind": self.kind,
        }
        for name in ("rating", "answer_correct", "sample_id", "correct_memories", "step", "skip_reason"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def decode_human_label(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> HumanLabel:
    obj = loads_object(raw, limits)
    f = _Fields(obj, limits)
    f.schema(SCHEMA_LABEL)
    query_id = f.str_("query_id")
    _check_key(key, query_id)
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
        # A rating may ride along with an answer (the labeling tool asks for both).
        label.rating = f.int_("rating", 0, 5, required=False)
    return label


@dataclass(slots=True)
class ActiveLearningSample:
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
    # Optional additions needed to train on the answer with the §4 rule.
    scores: np.ndarray | None = None
    temperature: float | None = None
    policy: str = "default"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA_AL_SAMPLE,
            "sample_id": self.sample_id,
            "query_id": self.query_id,
            "step": self.step,
            "ts": self.ts,
            "reason": self.reason,
            "utility": self.utility,
            "policy_version": self.policy_version,
            "policy": self.policy,
            "features": self.features.to_dict(),
            "candidates": self.candidates,
            "selected": self.selected,
            "top_slots": self.top_slots,
        }
        if self.query_text is not None:
            out["query_text"] = self.query_text
        if self.memory_texts is not None:
            out["memory_texts"] = {str(k): v for k, v in self.memory_texts.items()}
        if self.scores is not None:
            out["scores"] = self.scores
        if self.temperature is not None:
            out["temperature"] = self.temperature
        return out


def decode_active_learning_sample(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> ActiveLearningSample:
    obj = loads_object(raw, limits)
    f = _Fields(obj, limits)
    f.schema(SCHEMA_AL_SAMPLE)
    query_id = f.str_("query_id")
    _check_key(key, query_id)
    features = f.obj_("features")
    assert features is not None
    candidates = f.slots_("candidates")
    assert candidates is not None
    top_items = f.list_("top_slots")
    assert top_items is not None
    top_slots = []
    for item in top_items:
        if not isinstance(item, dict):
            raise Rejected("wrong_type", "top_slots[] must be objects")
        g = _Fields(item, limits, "top_slots[].")
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
        features=_features(features, limits),
        candidates=candidates,
        selected=f.slots_("selected") or [],
        top_slots=top_slots,
        query_text=f.str_("query_text", required=False, max_len=limits.max_text_len, empty_ok=True),
        memory_texts=f.texts_("memory_texts"),
        scores=scores,
        temperature=f.float_("temperature", 1e-6, 1e6, required=False),
        policy=f.str_("policy", required=False) or "default",
    )


# --------------------------------------------------------------------------- internal values


@dataclass(slots=True)
class Experience:
    """A joined (retrieval event, feedback) pair, or a labelled sample, for the learner.

    ``kind`` is ``"feedback"`` (REINFORCE) or ``"label"`` (last-layer fine-tune toward
    ``correct_memories``). ``id`` is the retrieval event's id (or the label's), so that a
    repeated delivery is applied once.
    """

    id: str
    kind: str
    event: RetrievalEvent
    utility: float
    correct_memories: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        body = self.event.to_dict()
        body.pop("memory_texts", None)  # the learner never needs texts
        body.pop("query_text", None)
        # The embedding travels as base64 float32: ~10× cheaper to decode than 384 JSON floats.
        features = dict(body["features"])
        emb = np.ascontiguousarray(features.pop("query_embedding"), dtype="<f4")
        body["features"] = features
        out: dict[str, Any] = {
            "schema": SCHEMA_EXPERIENCE,
            "id": self.id,
            "kind": self.kind,
            "utility": self.utility,
            "embedding_f32": base64.b64encode(emb.tobytes()).decode("ascii"),
            "event": body,
        }
        if self.correct_memories is not None:
            out["correct_memories"] = self.correct_memories
        return out


def experience_bytes(event: RetrievalEvent, utility: float) -> bytes:
    """Encode a joined feedback experience for the learner (internal ``experiences`` topic)."""
    return encode(Experience(event.event_id, "feedback", event, utility).to_dict())


def decode_experience(raw: bytes, limits: Limits) -> Experience:

    obj = loads_object(raw, limits)
    f = _Fields(obj, limits)
    f.schema(SCHEMA_EXPERIENCE)
    kind = f.str_("kind")
    if kind not in ("feedback", "label"):
        raise Rejected("out_of_range", f"kind {kind!r}")
    event_obj = f._get("event", True)
    if not isinstance(event_obj, dict):
        raise Rejected("wrong_type", "event must be an object")
    embedding = _embedding_from_b64(f._get("embedding_f32", True), limits)
    return Experience(
        id=f.str_("id"),
        kind=kind,
        event=retrieval_event_from_obj(event_obj, limits, embedding=embedding),
        utility=f.float_("utility"),
        correct_memories=f.slots_("correct_memories", required=False),
    )


@dataclass(slots=True)
class Control:
    command: str
    ts: float
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_CONTROL,
            "id": self.id,
            "command": self.command,
            "ts": self.ts,
            "reason": self.reason,
            "details": self.details,
        }


CONTROL_COMMANDS = ("reset", "rollback")


def decode_control(raw: bytes, limits: Limits) -> Control:
    obj = loads_object(raw, limits)
    f = _Fields(obj, limits)
    f.schema(SCHEMA_CONTROL)
    command = f.str_("command")
    if command not in CONTROL_COMMANDS:
        raise Rejected("out_of_range", f"command {command!r}")
    details = obj.get("details") or {}
    if not isinstance(details, dict):
        raise Rejected("wrong_type", "details must be an object")
    return Control(
        command=command,
        ts=f.float_("ts", 0.0, 1e11),
        reason=f.str_("reason", required=False, empty_ok=True) or "",
        details=details,
        id=f.str_("id", required=False, empty_ok=True) or "",
    )


def dead_letter_value(
    raw: bytes | None,
    reason: str,
    detail: str,
    topic: str,
    partition: int,
    offset: int,
    ts: float,
    keep_bytes: int = 64 * 1024,
) -> dict[str, Any]:
    """The dead-letter record: the original value (as text if it is UTF-8) and why."""
    out: dict[str, Any] = {
        "schema": SCHEMA_DEAD_LETTER,
        "reason": reason,
        "detail": detail[:500],
        "source": {"topic": topic, "partition": partition, "offset": offset},
        "ts": ts,
        "original_size": 0 if raw is None else len(raw),
    }
    if raw is not None:
        head = bytes(raw[:keep_bytes])
        out["truncated"] = len(raw) > keep_bytes
        try:
            out["original"] = head.decode("utf-8")
        except UnicodeDecodeError:
            import base64

            out["original_b64"] = base64.b64encode(head).decode("ascii")
    return out


DECODERS: dict[str, Callable[..., Any]] = {
    "retrieval-events": decode_retrieval_event,
    "llm-feedback": decode_llm_feedback,
    "human-labels": decode_human_label,
    "active-learning": decode_active_learning_sample,
}
