"""The model topic's wire format (DESIGN §5): chunk keys and the manifest.

A checkpoint is safetensors bytes split into chunks of at most 512 KiB, published as
messages keyed ``"{policy}/{version}/{i}"`` (raw bytes) and followed by one manifest keyed
``"{policy}"`` (the serving checkpoint) or ``"{policy}/candidate"`` (awaiting the
promotion gate).

>>> chunk_key("default", 7, 2)
'default/7/2'
>>> parse_key("default/7/2"), parse_key("default"), parse_key("default/candidate")
(('chunk', 'default', 7, 2), ('serving', 'default', None, None), ('candidate', 'default', None, None))
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from topics.codec import CHECKPOINT_REASONS, SCHEMA_MANIFEST, Limits, Rejected, _Fields, loads_object

MAX_CHUNK_BYTES = 512 * 1024
CANDIDATE_SUFFIX = "/candidate"


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; ``reason`` is machine-readable."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def sha256_hex(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def split_chunks(blob: bytes, chunk_size: int = MAX_CHUNK_BYTES) -> list[bytes]:
    """Cut a blob into the model topic's chunks (an empty blob is one empty chunk).

    >>> [len(c) for c in split_chunks(b"x" * 250, 100)]
    [100, 100, 50]
    """
    if not 0 < chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in (0, {MAX_CHUNK_BYTES}]")
    return [blob[i : i + chunk_size] for i in range(0, len(blob), chunk_size)] or [b""]


def chunk_key(policy: str, version: int, index: int) -> str:
    return f"{policy}/{version}/{index}"


def serving_key(policy: str) -> str:
    return policy


def candidate_key(policy: str) -> str:
    return policy + CANDIDATE_SUFFIX


def parse_key(key: str) -> tuple[str, str, int | None, int | None]:
    """Classify a model-topic key: ``('chunk'|'serving'|'candidate'|'unknown', policy, version, index)``."""
    parts = key.split("/")
    if len(parts) == 1:
        return ("serving", parts[0], None, None)
    if len(parts) == 2 and parts[1] == "candidate":
        return ("candidate", parts[0], None, None)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return ("chunk", parts[0], int(parts[1]), int(parts[2]))
    return ("unknown", key, None, None)


def validate_policy_name(name: str) -> str:
    if not name or "/" in name or len(name) > 128:
        raise ValueError(f"policy name {name!r}: non-empty, at most 128 characters, no '/'")
    return name


@dataclass
class Manifest:
    policy: str
    version: int
    created_ts: float
    reason: str
    arch: dict[str, int]
    alpha: float
    baseline: float
    sha256: str
    size: int
    chunks: int
    metrics: dict[str, Any] = field(default_factory=dict)
    input_offsets: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_MANIFEST,
            "policy": self.policy,
            "version": self.version,
            "created_ts": self.created_ts,
            "reason": self.reason,
            "arch": self.arch,
            "alpha": self.alpha,
            "baseline": self.baseline,
            "sha256": self.sha256,
            "size": self.size,
            "chunks": self.chunks,
            "metrics": self.metrics,
            "input_offsets": self.input_offsets,
        }


def decode_manifest(raw: bytes, limits: Limits | None = None) -> Manifest:
    limits = limits or Limits(max_bytes=1024 * 1024)
    obj = loads_object(raw, limits)
    f = _Fields(obj, limits)
    f.schema(SCHEMA_MANIFEST)
    reason = f.str_("reason")
    if reason not in CHECKPOINT_REASONS:
        raise Rejected("out_of_range", f"reason {reason!r}")
    arch = f.obj_("arch")
    assert arch is not None
    arch_d = {
        "input_dim": arch.int_("input_dim", 3),
        "hidden": arch.int_("hidden", 1),
        "slots": arch.int_("slots", 1),
        "embedding_dim": arch.int_("embedding_dim", 1),
    }
    if arch_d["input_dim"] != arch_d["embedding_dim"] + 2:
        raise Rejected("inconsistent", "arch.input_dim != embedding_dim + 2")
    sha = f.str_("sha256")
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise Rejected("wrong_type", "sha256 must be 64 lowercase hex digits")
    metrics = obj.get("metrics") or {}
    offsets = obj.get("input_offsets") or {}
    if not isinstance(metrics, dict) or not isinstance(offsets, dict):
        raise Rejected("wrong_type", "metrics and input_offsets must be objects")
    clean_offsets: dict[str, int] = {}
    for k, v in offsets.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise Rejected("wrong_type", f"input_offsets[{k}] must be a non-negative integer")
        clean_offsets[str(k)] = v
    size = f.int_("size", 1)
    chunks = f.int_("chunks", 1)
    if chunks < -(-size // MAX_CHUNK_BYTES):
        raise Rejected("inconsistent", f"{chunks} chunks cannot hold {size} bytes")
    return Manifest(
        policy=f.str_("policy"),
        version=f.int_("version", 0),
        created_ts=f.float_("created_ts", 0.0, 1e11),
        reason=reason,
        arch=arch_d,
        alpha=f.float_("alpha"),
        baseline=f.float_("baseline"),
        sha256=sha,
        size=size,
        chunks=chunks,
        metrics=metrics,
        input_offsets=clean_offsets,
    )
