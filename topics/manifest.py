"""The model topic's wire format (docs/contract.md §7): chunk keys, chunks and the manifest.

A checkpoint is safetensors bytes split into chunks of at most 512 KiB, published as
messages keyed ``"{policy}/{version}/{i}"`` (raw bytes) and followed by one manifest keyed
``"{policy}"`` (the serving checkpoint) or ``"{policy}/candidate"`` (awaiting the
promotion gate). The manifest carries the blob's size and sha256, so a reader checks the
reassembled chunks before it parses them (see ``models.weights.verify_and_load``).

>>> chunk_key("default", 7, 2)
'default/7/2'
>>> parse_key("default/7/2"), parse_key("default"), parse_key("default/candidate")
(('chunk', 'default', 7, 2), ('serving', 'default', None, None), ('candidate', 'default', None, None))
>>> [len(c) for c in split_chunks(b"x" * 250, 100)]
[100, 100, 50]
>>> sha256_hex(b"")[:12]
'e3b0c44298fc'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from topics.fields import CHECKPOINT_REASONS, SCHEMA_MANIFEST, Fields, Limits, Rejected, WireValue, open_value

MAX_CHUNK_BYTES = 512 * 1024
CANDIDATE_SUFFIX = "/candidate"


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; ``reason`` is machine-readable."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


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


def sha256_hex(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def split_chunks(blob: bytes, chunk_size: int = MAX_CHUNK_BYTES) -> list[bytes]:
    """The chunk messages' values, in order; an empty blob is one empty chunk."""
    if not 0 < chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in (0, {MAX_CHUNK_BYTES}]")
    return [blob[i : i + chunk_size] for i in range(0, len(blob), chunk_size)] or [b""]


@dataclass
class Manifest(WireValue):
    """A published checkpoint: what it is (policy, version, architecture, serving-rule
    alpha, baseline), how to check it (sha256, size, chunks) and what it has learnt from
    (``input_offsets``: the experiences applied). ``serving`` (optional, contract 1.2): the
    temperature, exploration and hard drop clients serve it with; absent in older manifests.

    >>> m = Manifest("p", 1, 0.0, "init", {}, 0.5, 0.0, "0" * 64, 1, 1)
    >>> "serving" in m.to_dict(), Manifest(**{**m.__dict__, "serving": {"temperature": 0.1}}).to_dict()["serving"]
    (False, {'temperature': 0.1})
    """

    SCHEMA = SCHEMA_MANIFEST
    FIELDS = (
        "policy",
        "version",
        "created_ts",
        "reason",
        "arch",
        "alpha",
        "baseline",
        "sha256",
        "size",
        "chunks",
        "metrics",
        "input_offsets",
    )
    OPTIONAL = ("serving",)

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
    serving: dict[str, Any] | None = None  # contract 1.2: how clients serve it (models.serving)


def decode_manifest(raw: bytes, limits: Limits | None = None) -> Manifest:
    """A manifest from the model topic, validated (``limits`` default: 1 MiB values).

    Raises
    ------
    Rejected
        With the reason the manifest must not be followed.
    """
    limits = limits or Limits(max_bytes=1024 * 1024)
    f = open_value(raw, limits, SCHEMA_MANIFEST)
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
    metrics = f.obj.get("metrics") or {}
    offsets = f.obj.get("input_offsets") or {}
    if not isinstance(metrics, dict) or not isinstance(offsets, dict):
        raise Rejected("wrong_type", "metrics and input_offsets must be objects")
    clean_offsets: dict[str, int] = {}
    for k, v in offsets.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise Rejected("wrong_type", f"input_offsets[{k}] must be a non-negative integer")
        clean_offsets[str(k)] = v
    serving = decode_serving(f.obj_("serving", required=False))
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
        serving=serving,
    )


SERVING_DROPS = ("dynamic", "fixed", "none")


def decode_serving(f: Fields | None) -> dict[str, Any] | None:
    """The manifest's optional ``serving`` object, validated (None when absent).

    >>> from topics.fields import Fields
    >>> decode_serving(Fields({"temperature": 0.05, "explore_rate": 0.1, "drop": "dynamic"}, Limits()))
    {'temperature': 0.05, 'explore_rate': 0.1, 'drop': 'dynamic'}
    >>> decode_serving(Fields({"temperature": 0.0}, Limits()))
    Traceback (most recent call last):
    ...
    topics.fields.Rejected: out_of_range: serving.temperature must be > 0
    """
    if f is None:
        return None
    out: dict[str, Any] = {}
    for name in ("temperature", "explore_temperature"):
        v = f.float_(name, 0.0, required=False)
        if v is not None:
            if v <= 0:
                raise Rejected("out_of_range", f"serving.{name} must be > 0")
            out[name] = v
    rate = f.float_("explore_rate", 0.0, 1.0, required=False)
    if rate is not None:
        out["explore_rate"] = rate
    drop = f.str_("drop", required=False)
    if drop is not None:
        if drop not in SERVING_DROPS:
            raise Rejected("out_of_range", f"serving.drop {drop!r}")
        out["drop"] = drop
    ratio = f.float_("drop_ratio", 0.0, required=False)
    if ratio is not None:
        out["drop_ratio"] = ratio
    return out
