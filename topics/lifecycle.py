"""The memory lifecycle: add, update and remove records for a memory id (docs/contract.md §9).

A memory store names its memories by id; the policy names them by slot (a row of its output
layer). The ``memory-lifecycle`` topic, keyed by ``memory_id`` and compacted on Apache Kafka,
carries what happens to each memory. The learner, the single writer of the policy, assigns
the slots and publishes the id → slot map with its checkpoints; clients add and remove
memories in their index as the records say.

``add`` and ``update`` carry the memory's text, and optionally its embedding (clients that
embed themselves may leave it out). ``remove`` carries only the id. Memories admitted by the
write gate (seed 004) also carry their ``kind`` (``success`` or ``pitfall``) and ``delta``,
the reward-prediction error that admitted them.

>>> import orjson
>>> from topics.fields import Limits, Rejected
>>> raw = orjson.dumps({"schema": "memory_lifecycle/v1", "op": "add", "memory_id": "doc-7",
...                     "ts": 1.0, "text": "Paris is the capital of France."})
>>> r = decode_memory_record(raw, Limits(), key=b"doc-7")
>>> r.op, r.memory_id, r.embedding is None
('add', 'doc-7', True)
>>> decode_memory_record(MemoryRecord("remove", "doc-7", 2.0).to_bytes(), Limits()).op
'remove'
>>> try:
...     decode_memory_record(orjson.dumps({"schema": "memory_lifecycle/v1", "op": "add",
...                                        "memory_id": "x", "ts": 1.0}), Limits())
... except Rejected as e:
...     print(e.reason)
missing_field
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from topics.fields import NO_KEY_CHECK, Fields, Limits, Rejected, WireValue, check_key, encode, float_array, open_value

SCHEMA_LIFECYCLE = "memory_lifecycle/v1"
OPS = ("add", "update", "remove")
KINDS = ("memory", "success", "pitfall")


@dataclass(slots=True)
class MemoryRecord(WireValue):
    """One lifecycle record; the message key is ``memory_id``."""

    SCHEMA: ClassVar[str] = SCHEMA_LIFECYCLE
    FIELDS: ClassVar[tuple[str, ...]] = ("op", "memory_id", "ts")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("text", "embedding", "kind", "delta", "source")

    op: str
    memory_id: str
    ts: float
    text: str | None = None
    embedding: np.ndarray | None = None  # float32 [D]; optional: clients may embed the text themselves
    kind: str | None = None  # "memory" (default), or "success"/"pitfall" when the write gate admitted it
    delta: float | None = None  # the reward-prediction error that admitted it (seed 004's δ tag)
    source: str | None = None  # who wrote it: a service name, or "write-gate"

    def to_dict(self) -> dict[str, Any]:
        out = WireValue.to_dict(self)
        if self.embedding is not None:
            out["embedding"] = [float(x) for x in np.asarray(self.embedding, dtype=np.float32)]
        return out

    def to_bytes(self) -> bytes:
        return encode(self.to_dict())

    @property
    def key(self) -> bytes:
        return self.memory_id.encode()


def memory_embedding(f: Fields, name: str, limits: Limits) -> np.ndarray | None:
    """The optional embedding field ``name``: float32 [D], or None when absent.

    A list of the wrong size is ``embedding_length`` (the reason a query embedding of the
    wrong size gets); a list far too long is ``oversize`` before it is read.
    """
    items = f.list_(name, required=False, max_len=max(limits.embedding_dim, 1) * 4)
    if items is None:
        return None
    if len(items) != limits.embedding_dim:
        raise Rejected("embedding_length", f"{name}: {len(items)} values, not {limits.embedding_dim}")
    return float_array(items, name, limits.max_abs_value).astype(np.float32)


def decode_memory_record(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> MemoryRecord:
    """A ``memory-lifecycle`` value, validated; the key, when checked, must be its ``memory_id``.

    Arguments and errors follow the decoder contract in :mod:`topics.fields`.
    """
    f = open_value(raw, limits, SCHEMA_LIFECYCLE)
    op = f.str_("op")
    if op not in OPS:
        raise Rejected("out_of_range", f"op {op!r} (expected one of {', '.join(OPS)})")
    memory_id = f.str_("memory_id")
    check_key(key, memory_id, "memory_id")
    text = f.str_("text", required=op != "remove", max_len=limits.max_text_len)
    embedding = memory_embedding(f, "embedding", limits)
    if embedding is not None and op == "remove":
        raise Rejected("inconsistent", "a remove carries no embedding")
    kind = f.str_("kind", required=False)
    if kind is not None and kind not in KINDS:
        raise Rejected("out_of_range", f"kind {kind!r} (expected one of {', '.join(KINDS)})")
    return MemoryRecord(
        op=op,
        memory_id=memory_id,
        ts=f.float_("ts", 0.0, 1e11),
        text=text,
        embedding=embedding,
        kind=kind,
        delta=f.float_("delta", required=False),
        source=f.str_("source", required=False),
    )
