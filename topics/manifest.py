"""The model topic's wire format (docs/contract.md §7): chunk keys, chunks and the manifest.

A checkpoint is safetensors bytes split into chunks of at most 512 KiB, published as
messages keyed ``"{policy}/{version}/{i}"`` (raw bytes) and followed by one manifest keyed
``"{policy}"`` (the serving checkpoint) or ``"{policy}/candidate"`` (awaiting the
promotion gate). The manifest carries the blob's size and sha256, so a reader checks the
reassembled chunks before it parses them (see ``models.policy.weights.verify_and_load``).

Contract 1.4 adds ``"{policy}/canary"``: a candidate's manifest republished there is the
*canary* that clients serve on a share of their requests (``serving.canary_rate``); a
tombstone (null value) ends it.

Contract 1.2 adds, all optional (docs/contract.md §7): the writer's ``epoch`` on each
manifest and the epoch claim a learner writes under ``"{policy}/epoch"`` when it takes
over (fencing: readers ignore an older epoch), a ``signature`` over the manifest
(``topics.signing``: HMAC-SHA256, or Ed25519 since 1.11), and bounds on ``size``, ``chunks``
and version jumps. Contract 1.11 adds ``role``, signed with the rest: the key a manifest is
published under (``serving``, ``candidate``, ``canary``, ``delta``, ``delta_candidate``), so a
signed candidate replayed under the serving key is refused by a reader that checks signatures.

>>> chunk_key("default", 7, 2)
'default/7/2'
>>> parse_key("default/7/2"), parse_key("default"), parse_key("default/candidate")
(('chunk', 'default', 7, 2), ('serving', 'default', None, None), ('candidate', 'default', None, None))
>>> parse_key("default/epoch"), parse_key("default/canary")
(('epoch', 'default', None, None), ('canary', 'default', None, None))
>>> [len(c) for c in split_chunks(b"x" * 250, 100)]
[100, 100, 50]
>>> sha256_hex(b"")[:12]
'e3b0c44298fc'
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from topics.fields import CHECKPOINT_REASONS, PROBE, SCHEMA_MANIFEST, Fields, Limits, Rejected, WireValue, open_value
from topics.signing import Key, sign, verify_signature

MAX_CHUNK_BYTES = 512 * 1024
MIN_CHUNK_BYTES = 1024  # every chunk but the last holds at least this much (bounds ``chunks``)
HEADER_BYTES = 1024 * 1024  # allowance on top of the tensors' bytes (the safetensors header needs < 1 KiB)
MAX_BLOB_BYTES = 32 * 1024**3  # whatever the arch claims: 32 GiB (S = 10^7 at H = 512 needs 20.5 GB)
MAX_VERSION = 2**53  # versions stay exact in every JSON reader
MAX_VERSION_JUMP = 1_000_000  # a manifest further above the newest accepted one is ignored
MAX_EPOCH_JUMP = 1_000  # an epoch further above the newest one seen is ignored
CANDIDATE_SUFFIX = "/candidate"
EPOCH_SUFFIX = "/epoch"
CANARY_SUFFIX = "/canary"  # contract 1.4
BASE_SUFFIX = "/base"  # contract 1.25: the certified version probes name, kept from compaction
SCHEMA_EPOCH_CLAIM = "writer_epoch/v1"
DELTA = "delta"  # contract 1.3: the key segment of delta checkpoints ("{policy}/delta", ...)
# A key's version or chunk index: ASCII digits only, at most 16 (2^53 has 16). ``str.isdigit``
# also accepts '²' and other Unicode digits that ``int`` refuses, and ``int`` refuses more than
# 4,300 digits: a key that fails this is "unknown", never an exception.
_NUMBER = re.compile(r"[0-9]{1,16}")


def key_number(part: str) -> int | None:
    """A key part as a non-negative integer: ASCII digits only, at most 16; None for anything else.

    >>> key_number("12"), key_number("²"), key_number("٣"), key_number("1" * 17), key_number("-1")
    (12, None, None, None, None)
    """
    return int(part) if _NUMBER.fullmatch(part) else None


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


def canary_key(policy: str) -> str:
    return policy + CANARY_SUFFIX


def base_key(policy: str) -> str:
    return policy + BASE_SUFFIX


def epoch_key(policy: str) -> str:
    return policy + EPOCH_SUFFIX


def parse_key(key: str) -> tuple[str, str, int | None, int | None]:
    """Classify a model-topic key: ``(kind, policy, version, index)``.

    ``kind`` is ``'chunk'``, ``'serving'``, ``'candidate'``, ``'epoch'``, (contract 1.3)
    ``'delta'``, ``'delta_candidate'``, ``'delta_chunk'``, (contract 1.4) ``'canary'``,
    (contract 1.25) ``'base'``, or ``'unknown'``.

    >>> parse_key("default/delta"), parse_key("default/delta/9/0")
    (('delta', 'default', None, None), ('delta_chunk', 'default', 9, 0))
    """
    parts = key.split("/")
    if len(parts) == 1:
        return ("serving", parts[0], None, None)
    if len(parts) == 2 and parts[1] == "candidate":
        return ("candidate", parts[0], None, None)
    if len(parts) == 2 and parts[1] == "epoch":
        return ("epoch", parts[0], None, None)
    if len(parts) == 2 and parts[1] == "canary":
        return ("canary", parts[0], None, None)
    if len(parts) == 2 and parts[1] == "base":
        return ("base", parts[0], None, None)
    numbers = [key_number(p) for p in parts[1:]]
    if len(parts) == 3 and numbers[0] is not None and numbers[1] is not None:
        return ("chunk", parts[0], numbers[0], numbers[1])
    if len(parts) >= 2 and parts[1] == DELTA:  # contract 1.3: delta checkpoints (topics/delta.py)
        if len(parts) == 2:
            return ("delta", parts[0], None, None)
        if len(parts) == 3 and parts[2] == "candidate":
            return ("delta_candidate", parts[0], None, None)
        if len(parts) == 4 and numbers[1] is not None and numbers[2] is not None:
            return ("delta_chunk", parts[0], numbers[1], numbers[2])
    return ("unknown", key, None, None)


def validate_policy_name(name: str) -> str:
    if not name or "/" in name or len(name) > 128:
        raise ValueError(f"policy name {name!r}: non-empty, at most 128 characters, no '/'")
    return name


def sha256_hex(blob: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(blob).hexdigest()


def split_chunks(blob: bytes, chunk_size: int = MAX_CHUNK_BYTES) -> list[bytes]:
    """The chunk messages' values, in order; an empty blob is one empty chunk."""
    if not 0 < chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in (0, {MAX_CHUNK_BYTES}]")
    return [blob[i : i + chunk_size] for i in range(0, len(blob), chunk_size)] or [b""]


def max_blob_bytes(arch: dict[str, int]) -> int:
    """The largest blob an architecture can need: its float32 tensors plus a header allowance.

    >>> max_blob_bytes({"embedding_dim": 8, "slots": 32, "hidden": 16}) >= 3420  # the real blob
    True
    """
    d, s, h = int(arch["embedding_dim"]), int(arch["slots"]), int(arch["hidden"])
    params = 2 * d + h * (d + 2) + h + s * h + s + 1
    return min(4 * params + HEADER_BYTES, MAX_BLOB_BYTES)


def max_chunks(size: int) -> int:
    """The most chunks a blob of ``size`` bytes may be split into (all but the last ≥ 1 KiB).

    >>> max_chunks(0), max_chunks(3420), max_chunks(2_897_420)
    (1, 4, 2830)
    """
    return max(1, math.ceil(size / MIN_CHUNK_BYTES))


@dataclass
class EpochClaim:
    """A learner's claim to write a policy from ``epoch`` on (key ``"{policy}/epoch"``).

    Written when a learner takes over, before its first checkpoint; manifests and claims of
    a lower epoch are ignored by readers from then on (docs/architecture.md, "Failure model").

    >>> c = EpochClaim("default", 3, "w1", 1767225600.0)
    >>> decode_epoch_claim(c.to_bytes()) == c
    True
    """

    policy: str
    epoch: int
    writer: str
    ts: float
    signature: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA_EPOCH_CLAIM,
            "policy": self.policy,
            "epoch": self.epoch,
            "writer": self.writer,
            "ts": self.ts,
        }
        if self.signature:
            out["signature"] = self.signature
        return out

    def to_bytes(self, key: Key | None = None) -> bytes:
        obj = self.to_dict()
        if key is not None:
            obj["signature"] = self.signature = sign(obj, key)
        return orjson.dumps(obj)


def decode_epoch_claim(raw: bytes, signing_key: Key | None = None) -> EpochClaim:
    """An epoch claim, validated (and its signature checked when ``signing_key`` is set)."""
    f = open_value(raw, Limits(max_bytes=64 * 1024), SCHEMA_EPOCH_CLAIM)
    if signing_key is not None and not verify_signature(f.obj, signing_key):
        raise Rejected("inconsistent", "epoch claim: signature missing or not the configured key's")
    return EpochClaim(
        policy=f.str_("policy"),
        epoch=f.int_("epoch", 1, MAX_VERSION),
        writer=f.str_("writer", max_len=128),
        ts=f.float_("ts", 0.0, 1e11),
        signature=f.str_("signature", required=False, empty_ok=True) or "",
    )


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
    FIELDS: ClassVar[tuple[str, ...]] = (
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
    OPTIONAL = ("epoch", "signature", "serving", "role")  # contract 1.2; role: 1.11

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
    epoch: int | None = None  # the writer's epoch (fencing); absent before contract 1.2
    signature: str | None = None  # "ed25519:…" or "hmac-sha256:…" when the learner has a signing key
    serving: dict[str, Any] | None = None  # contract 1.2: how clients serve it (models.serving.params)
    role: str | None = None  # contract 1.11: the key it is published under (ROLES), signed with the rest

    def signed(self, key: Key | None, role: str | None = None) -> Manifest:
        """This manifest for the key ``role`` (kept when None), with its signature set (none without a key)."""
        if role is not None:
            if role not in ROLES:
                raise ValueError(f"role {role!r} is not one of {ROLES}")
            self.role = role
        if key is not None:
            self.signature = None
            self.signature = sign(self.to_dict(), key)
        return self


# Contract 1.11: the keys a manifest may be published under, as ``parse_key`` names them.
ROLES = ("serving", "candidate", "canary", "delta", "delta_candidate", "base")


def decode_manifest(raw: bytes, limits: Limits | None = None, signing_key: Key | None = None) -> Manifest:
    """A manifest from the model topic, validated (``limits`` default: 1 MiB values).

    Beyond the fields' types it bounds ``version`` (≤ 2^53), ``size`` (what ``arch``'s
    tensors can need, :func:`max_blob_bytes`) and ``chunks`` (:func:`max_chunks`), so a
    forged manifest cannot make a reader allocate or loop without bound; with
    ``signing_key`` the signature must be that key's.

    Raises
    ------
    Rejected
        With the reason the manifest must not be followed.
    """
    limits = limits or Limits(max_bytes=1024 * 1024)
    f = open_value(raw, limits, SCHEMA_MANIFEST)
    if signing_key is not None and not verify_signature(f.obj, signing_key):
        raise Rejected("inconsistent", "signature missing or not the configured key's")
    return Manifest(**manifest_fields(f))


def manifest_fields(f: Fields) -> dict[str, Any]:
    """A manifest's fields from its opened JSON object, validated (shared with delta manifests, ``topics.delta``)."""
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
    sha = hex64(f, "sha256")
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
    version = f.int_("version", 0, MAX_VERSION)
    check_probe(reason, serving, version)
    size = f.int_("size", 1, max_blob_bytes(arch_d))
    chunks = f.int_("chunks", 1, max_chunks(size))
    if chunks < -(-size // MAX_CHUNK_BYTES):
        raise Rejected("inconsistent", f"{chunks} chunks cannot hold {size} bytes")
    return {
        "policy": f.str_("policy"),
        "version": version,
        "created_ts": f.float_("created_ts", 0.0, 1e11),
        "reason": reason,
        "arch": arch_d,
        "alpha": f.float_("alpha"),
        "baseline": f.float_("baseline"),
        "sha256": sha,
        "size": size,
        "chunks": chunks,
        "metrics": metrics,
        "input_offsets": clean_offsets,
        "epoch": f.int_("epoch", 0, MAX_VERSION, required=False),
        "signature": f.str_("signature", required=False, empty_ok=True),
        "serving": serving,
        "role": _role(f),
    }


def check_probe(reason: str, serving: dict[str, Any] | None, version: int) -> None:
    """A probe is served either as an incumbent (1.19) or over the certified version ``serving.base``
    names (1.23), exactly one of the two; ``base`` only on a probe, and below the probe's own version.

    >>> check_probe("probe", {"base": 4}, 9)
    >>> check_probe("probe", {}, 9)
    Traceback (most recent call last):
    ...
    topics.fields.Rejected: inconsistent: a probe says serving.incumbent: true (1.19) or names serving.base (1.23)
    >>> check_probe("periodic", {"base": 4}, 9)
    Traceback (most recent call last):
    ...
    topics.fields.Rejected: inconsistent: serving.base on a manifest of reason 'periodic' (only a probe has one)
    """
    serving = serving or {}
    base = serving.get("base")
    if reason == PROBE and not serving.get("incumbent") and base is None:
        raise Rejected("inconsistent", "a probe says serving.incumbent: true (1.19) or names serving.base (1.23)")
    if base is None:
        return
    if reason != PROBE:
        raise Rejected("inconsistent", f"serving.base on a manifest of reason {reason!r} (only a probe has one)")
    if base >= version:  # the version served before the probe, as a delta's base_version
        raise Rejected("inconsistent", f"serving.base {base} is not below version {version}")


def _role(f: Fields) -> str | None:
    role = f.str_("role", required=False)
    if role is None:
        return None
    if role not in ROLES:
        raise Rejected("out_of_range", f"role {role!r}")
    return str(role)


def hex64(f: Fields, name: str) -> str:
    """A sha256 field: 64 lowercase hex digits."""
    sha = f.str_(name)
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise Rejected("wrong_type", f"{name} must be 64 lowercase hex digits")
    return sha


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
    >>> decode_serving(Fields({"temperature": 0.05, "base": 4}, Limits()))
    {'temperature': 0.05, 'base': 4}
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
    for name in ("explore_rate", "canary_rate"):  # canary_rate: contract 1.4
        rate = f.float_(name, 0.0, 1.0, required=False)
        if rate is not None:
            out[name] = rate
    drop = f.str_("drop", required=False)
    if drop is not None:
        if drop not in SERVING_DROPS:
            raise Rejected("out_of_range", f"serving.drop {drop!r}")
        out["drop"] = drop
    ratio = f.float_("drop_ratio", 0.0, required=False)
    if ratio is not None:
        out["drop_ratio"] = ratio
    if f.bool_("canary_coupled", required=False):  # contract 1.5
        out["canary_coupled"] = True
    if f.bool_("incumbent", required=False):  # contract 1.17
        out["incumbent"] = True
    base = f.int_("base", 1, MAX_VERSION, required=False)  # contract 1.23: a probe over a certified version
    if base is not None:
        if out.get("incumbent"):  # an incumbent serves the client's own ranking, never a version's
            raise Rejected("inconsistent", "serving.base with serving.incumbent: true")
        out["base"] = base
    return out
