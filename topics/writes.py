"""Proposed memories and the write gate's kept rejections (docs/contract.md §9.2).

An agent (or any producer) proposes a memory on ``memory-writes``, keyed by ``write_id``,
with the reward context of the step that produced it: the ``reward`` the step earned and,
when the producer has one, the ``expected_reward`` it predicted (seed 004's D-MEM). The
write gate (``causalmem writes``) admits a proposal when its reward-prediction error
``reward − expected_reward`` is large enough and writes it to ``memory-lifecycle``; the
proposals it rejects go to ``memory-writes-rejected`` (keyed by ``write_id``, kept for a
configurable period) so that an operator can review them.

>>> import orjson
>>> from topics.fields import Limits, Rejected
>>> raw = orjson.dumps({"schema": "memory_write/v1", "write_id": "w1", "ts": 1.0,
...                     "text": "Retry the export with a smaller page size.",
...                     "query_id": "q1", "step": 2, "reward": 0.9})
>>> w = decode_memory_write(raw, Limits(), key=b"w1")
>>> w.write_id, w.reward, w.expected_reward is None
('w1', 0.9, True)
>>> try:
...     decode_memory_write(orjson.dumps({"schema": "memory_write/v1", "write_id": "w2", "ts": 1.0,
...                                       "text": "x", "query_id": "q1", "step": 0}), Limits())
... except Rejected as e:
...     print(e.reason, e.detail)
missing_field reward
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from topics.fields import NO_KEY_CHECK, Fields, Limits, Rejected, WireValue, check_key, encode, open_value
from topics.lifecycle import memory_embedding

SCHEMA_WRITE = "memory_write/v1"
SCHEMA_WRITE_REJECTED = "memory_write_rejected/v1"
ESTIMATES = ("producer", "cluster", "global", "prior")  # where a decision's expected reward came from


@dataclass(slots=True)
class MemoryWrite(WireValue):
    """One proposed memory with its step's reward context; the message key is ``write_id``."""

    SCHEMA: ClassVar[str] = SCHEMA_WRITE
    FIELDS: ClassVar[tuple[str, ...]] = ("write_id", "ts", "text", "query_id", "step", "reward")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("expected_reward", "embedding", "query_embedding", "policy", "source")

    write_id: str
    ts: float
    text: str
    query_id: str
    step: int
    reward: float  # what the step earned (the producer's reward, e.g. the evaluator's utility)
    expected_reward: float | None = None  # the producer's own prediction; None: the gate estimates it
    embedding: np.ndarray | None = None  # float32 [D]: the memory's embedding, passed on to the lifecycle
    query_embedding: np.ndarray | None = None  # float32 [D]: the query's, the context of the gate's estimate
    policy: str | None = None
    source: str | None = None  # who proposed it (an agent's name)

    def to_dict(self) -> dict[str, Any]:
        out = WireValue.to_dict(self)
        for name in ("embedding", "query_embedding"):
            if out.get(name) is not None:
                out[name] = [float(x) for x in np.asarray(out[name], dtype=np.float32)]
        return out

    def to_bytes(self) -> bytes:
        return encode(self.to_dict())

    @property
    def key(self) -> bytes:
        return self.write_id.encode()


@dataclass(slots=True)
class RejectedWrite(WireValue):
    """A proposal the gate did not admit, with the numbers it judged by (key ``write_id``)."""

    SCHEMA: ClassVar[str] = SCHEMA_WRITE_REJECTED
    FIELDS: ClassVar[tuple[str, ...]] = ("write_id", "ts", "rpe", "expected_reward", "estimate", "theta", "write")
    NESTED: ClassVar[tuple[str, ...]] = ("write",)

    write_id: str
    ts: float  # when the gate decided (wall time)
    rpe: float
    expected_reward: float
    estimate: str  # one of ESTIMATES
    theta: float
    write: MemoryWrite

    def to_bytes(self) -> bytes:
        return encode(self.to_dict())

    @property
    def key(self) -> bytes:
        return self.write_id.encode()


def write_from_fields(f: Fields, limits: Limits, key: Any = NO_KEY_CHECK) -> MemoryWrite:
    """A :class:`MemoryWrite` from an opened object (also the ``write`` inside a kept rejection)."""
    write_id = f.str_("write_id")
    check_key(key, write_id, "write_id")
    return MemoryWrite(
        write_id=write_id,
        ts=f.float_("ts", 0.0, 1e11),
        text=f.str_("text", max_len=limits.max_text_len),
        query_id=f.str_("query_id"),
        step=f.int_("step", 0),
        reward=f.float_("reward"),
        expected_reward=f.float_("expected_reward", required=False),
        embedding=memory_embedding(f, "embedding", limits),
        query_embedding=memory_embedding(f, "query_embedding", limits),
        policy=f.str_("policy", required=False),
        source=f.str_("source", required=False),
    )


def decode_memory_write(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> MemoryWrite:
    """A ``memory-writes`` value, validated; the key, when checked, must be its ``write_id``.

    A proposal without a ``reward`` is rejected (``missing_field``), and an embedding of
    the wrong size too (``embedding_length``). Arguments and errors follow the decoder
    contract in :mod:`topics.fields`.
    """
    return write_from_fields(open_value(raw, limits, SCHEMA_WRITE), limits, key)


def decode_rejected_write(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> RejectedWrite:
    """A ``memory-writes-rejected`` value (what ``causalmem status`` or a review tool reads).

    >>> w = MemoryWrite("w1", 1.0, "t", "q1", 0, 0.1)
    >>> r = RejectedWrite("w1", 2.0, 0.05, 0.05, "global", 0.3, w)
    >>> back = decode_rejected_write(r.to_bytes(), Limits(), key=b"w1")
    >>> back.write.reward, back.estimate
    (0.1, 'global')
    """
    f = open_value(raw, limits, SCHEMA_WRITE_REJECTED)
    write_id = f.str_("write_id")
    check_key(key, write_id, "write_id")
    estimate = f.str_("estimate")
    if estimate not in ESTIMATES:
        raise Rejected("out_of_range", f"estimate {estimate!r} (expected one of {', '.join(ESTIMATES)})")
    inner = f.obj_("write")
    assert inner is not None
    write = write_from_fields(inner, limits)
    if write.write_id != write_id:
        raise Rejected("inconsistent", "write.write_id differs from write_id")
    return RejectedWrite(
        write_id=write_id,
        ts=f.float_("ts", 0.0, 1e11),
        rpe=f.float_("rpe"),
        expected_reward=f.float_("expected_reward"),
        estimate=estimate,
        theta=f.float_("theta", 0.0),
        write=write,
    )
