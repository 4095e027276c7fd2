"""Delta checkpoints on the model topic (contract 1.3, docs/contract.md §7.1): keys and the delta manifest.

A *delta* carries what changed since its base: the output rows written since then and the
small tensors in full (``models.policy.delta``). It is published like a full checkpoint, under
keys of its own that readers of contract 1.2 ignore:

- chunks ``"{policy}/delta/{version}/{i}"``, then the manifest under ``"{policy}/delta"``
  (serving) or ``"{policy}/delta/candidate"`` (awaiting the promotion gate);
- full snapshots stay exactly as before, under ``"{policy}"`` and ``"{policy}/{version}/{i}"``.

Links form a chain by sha256. Every link has an id, :func:`link_id`: a full snapshot's
is its blob's ``sha256``, a delta's is its own blob's ``sha256`` (the blob names its base
in its safetensors metadata, so the id commits to the whole chain). A delta names its base
by ``base_version`` and ``base_sha256`` (the base link's id) and the state it produces by
``state_sha256``: the sha256 a full snapshot of that state would have.

>>> delta_key("default"), delta_candidate_key("default"), delta_chunk_key("default", 8, 0)
('default/delta', 'default/delta/candidate', 'default/delta/8/0')
>>> m = DeltaManifest("p", 2, 0.0, "periodic", {"input_dim": 6, "hidden": 8, "slots": 4, "embedding_dim": 4},
...                   0.5, 0.0, "a" * 64, 100, 1, base_version=1, base_sha256="b" * 64,
...                   state_sha256="c" * 64, rows=1)
>>> decode_delta_manifest(m.to_bytes()) == m
True
>>> link_id(m) == m.sha256
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from topics.fields import Limits, Rejected, open_value
from topics.manifest import DELTA, MAX_VERSION, Manifest, hex64, manifest_fields
from topics.signing import Key, verify_signature

SCHEMA_DELTA = "policy_delta/v1"


def delta_key(policy: str) -> str:
    return f"{policy}/{DELTA}"


def delta_candidate_key(policy: str) -> str:
    return f"{policy}/{DELTA}/candidate"


def delta_chunk_key(policy: str, version: int, index: int) -> str:
    return f"{policy}/{DELTA}/{version}/{index}"


@dataclass
class DeltaManifest(Manifest):
    """A delta checkpoint's manifest: a :class:`Manifest` (``sha256``, ``size`` and ``chunks``
    describe the *delta* blob) plus its base and the state it produces.

    Fields beyond :class:`Manifest`'s: ``base_version`` and ``base_sha256`` (the base link's
    version and id), ``state_sha256`` (the sha256 of the full snapshot of the resulting
    state) and ``rows`` (how many output rows it carries, informational).
    """

    SCHEMA = SCHEMA_DELTA
    FIELDS = (*Manifest.FIELDS, "base_version", "base_sha256", "state_sha256", "rows")

    base_version: int = 0
    base_sha256: str = ""
    state_sha256: str = ""
    rows: int = 0

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_dict())


def link_id(manifest: Manifest) -> str:
    """The chain id of a link: its blob's sha256 (a delta's blob names its base, so it commits to the chain)."""
    return manifest.sha256


def decode_delta_manifest(raw: bytes, limits: Limits | None = None, signing_key: Key | None = None) -> DeltaManifest:
    """A delta manifest, validated like a full one (``topics.manifest.decode_manifest``) plus its chain fields.

    Raises
    ------
    Rejected
        With the reason the manifest must not be followed (among them a base not below
        its version).
    """
    f = open_value(raw, limits or Limits(max_bytes=1024 * 1024), SCHEMA_DELTA)
    if signing_key is not None and not verify_signature(f.obj, signing_key):
        raise Rejected("inconsistent", "signature missing or not the configured key's")
    fields: dict[str, Any] = manifest_fields(f)
    base_version = f.int_("base_version", 0, MAX_VERSION)
    if base_version >= fields["version"]:
        raise Rejected("inconsistent", f"base_version {base_version} is not below version {fields['version']}")
    return DeltaManifest(
        **fields,
        base_version=base_version,
        base_sha256=hex64(f, "base_sha256"),
        state_sha256=hex64(f, "state_sha256"),
        rows=f.int_("rows", 0, int(fields["arch"]["slots"])),
    )
