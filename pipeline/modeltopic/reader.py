"""Reading the model topic, without torch: index the topic, fetch a checkpoint's bytes.

The wire format (chunk keys, the manifest) is in docs/contract.md and ``topics/manifest.py``.

- :class:`ModelTopicIndex`: what the topic holds (manifests, and the *offsets* of chunks,
  not their bytes, so that scanning a long topic needs little memory). It applies the
  readers' rules of contract 1.2: a manifest or epoch claim of an older epoch than the
  newest seen is ignored, and so are version and epoch jumps beyond
  ``MAX_VERSION_JUMP``/``MAX_EPOCH_JUMP``, chunks of a version whose manifest came
  already (a fenced writer's late chunks) and, with a signing key, anything unsigned.
  Delta manifests and their chunks (contract 1.3, ``topics/delta.py``) are indexed apart,
  under the same rules; :meth:`ModelTopicIndex.serving_head` is the newest serving link,
  :meth:`~ModelTopicIndex.candidate_head` the newest candidate, and
  :meth:`~ModelTopicIndex.chain_to` / :meth:`~ModelTopicIndex.rebuildable` walk a delta's
  chain back to its full snapshot (every reader finds versions through these).
- :func:`scan_model_topic` reads the topic once into an index; :func:`fetch_blob` seeks to
  a version's chunks and assembles them, checked against the manifest's size and sha256.

Turning bytes into tensors (and checking names, shapes, dtypes) is
``pipeline.client.subscriber``'s job: this module imports no torch, so the status and
rollback commands can read the topic cheaply.

>>> index = ModelTopicIndex()
>>> index.observe(0, b"default/1/0", b"chunk bytes")
('chunk', None)
>>> index.chunk_offsets, index.max_version("default"), index.end_offset
({('default', 1): {0: 0}}, 1, 1)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.config import Connection, Settings
from topics.delta import DeltaManifest, decode_delta_manifest, link_id
from topics.fields import Rejected
from topics.manifest import (
    MAX_EPOCH_JUMP,
    MAX_VERSION_JUMP,
    CheckpointError,
    EpochClaim,
    Manifest,
    decode_epoch_claim,
    decode_manifest,
    parse_key,
    sha256_hex,
)
from topics.signing import Key, verify_tombstone

__all__ = [
    "ModelTopicIndex",
    "check_blob",
    "chunk_plan",
    "fetch_blob",
    "read_range",
    "scan_model_topic",
    "unsigned_warning",
]

log = logging.getLogger(__name__)

KEEP_REJECTIONS = 1000  # the newest rejections kept with their reasons (more are only counted)
MAX_CHAIN = 100_000  # links walked at most (a chain is as long as the versions between full snapshots)
RANGE_FETCH_BYTES = 1024 * 1024  # read_range's fetch size: above the largest message (a 512 KiB chunk)

# --------------------------------------------------------------------------- reading


@dataclass
class ModelTopicIndex:
    """Manifests and chunk offsets seen on the model topic (bytes are not kept)."""

    serving: dict[str, Manifest] = field(default_factory=dict)  # newest serving manifest per policy
    candidate: dict[str, Manifest] = field(default_factory=dict)
    manifests: dict[tuple[str, int], Manifest] = field(default_factory=dict)  # every manifest seen
    chunk_offsets: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (offset, reason): the newest ones
    rejected_total: int = 0  # every rejection since the index was made (``rejected`` keeps the newest)
    end_offset: int = 0
    signing_key: Key | None = None  # set: unsigned or wrongly signed manifests are rejected
    epochs: dict[str, int] = field(default_factory=dict)  # the newest epoch seen per policy
    claims: dict[str, EpochClaim] = field(default_factory=dict)  # the newest epoch claim per policy
    claim_offsets: dict[str, int] = field(default_factory=dict)
    # contract 1.3, delta checkpoints (topics/delta.py): every accepted delta manifest, the
    # newest serving and candidate one per policy, the versions published or promoted under
    # the serving delta key (the chain clients follow), and their chunks' offsets
    deltas: dict[tuple[str, int], DeltaManifest] = field(default_factory=dict)
    delta_serving: dict[str, DeltaManifest] = field(default_factory=dict)
    delta_candidate: dict[str, DeltaManifest] = field(default_factory=dict)
    served_deltas: set[tuple[str, int]] = field(default_factory=set)
    delta_chunk_offsets: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    # contract 1.4: the canary per policy (a full candidate's manifest; None once a tombstone ended it)
    canary: dict[str, Manifest | None] = field(default_factory=dict)
    # contract 1.25: the newest manifest under the base key per policy (the version probes name)
    base: dict[str, Manifest] = field(default_factory=dict)

    def _reject(self, offset: int, why: str) -> tuple[str, None]:
        self.rejected_total += 1
        self.rejected.append((offset, why))
        if len(self.rejected) > 2 * KEEP_REJECTIONS:  # a flood of hostile messages must not grow memory
            del self.rejected[:-KEEP_REJECTIONS]
        return "rejected", None

    def _newest_version(self, policy: str) -> int:
        return max((v for (p, v) in [*self.manifests, *self.deltas] if p == policy), default=0)

    def offsets_of(self, manifest: Manifest) -> dict[int, int]:
        """The chunk offsets of a manifest's version (a delta's chunks have keys of their own)."""
        table = self.delta_chunk_offsets if isinstance(manifest, DeltaManifest) else self.chunk_offsets
        return table.get((manifest.policy, manifest.version), {})

    def observe(
        self, offset: int, key: bytes | None, value: bytes | None, headers: Any = None
    ) -> tuple[str, Manifest | None]:
        """Record one message; returns its kind and, for a valid manifest, the manifest.

        The kind is ``"rejected"`` (with the reason appended to :attr:`rejected`) for a
        manifest or claim that must not be followed, and for a message that raised anything
        while it was parsed: one hostile message is skipped, never a reason for a reader
        (client, learner, ``status``, ``rollback``) to stop.

        >>> ModelTopicIndex().observe(0, "default/²/0".encode(), b"x")
        ('unknown', None)

        ``headers`` (the record's): with a signing key, a tombstone of a chunk or of the canary
        counts only with the learner's signature in its ``causalmem-signature`` header
        (contract 1.7); an unsigned one is rejected, so it cannot empty a version's chunk
        index or end a canary.
        """
        self.end_offset = max(self.end_offset, offset + 1)
        try:
            if value is None and key is not None and self.signing_key is not None:
                kind = parse_key(key.decode("utf-8", "replace"))[0]
                if kind in ("chunk", "delta_chunk", "canary") and not verify_tombstone(key, headers, self.signing_key):
                    return self._reject(offset, f"{kind} tombstone: signature missing or not the configured key's")
            return self._observe(offset, key, value)
        except Exception as exc:  # whatever the parse raised: this message is rejected, the reader goes on
            return self._reject(offset, f"unparseable message: {exc!r}"[:300])

    def _observe(self, offset: int, key: bytes | None, value: bytes | None) -> tuple[str, Manifest | None]:
        if key is None:
            return "unknown", None
        kind, policy, version, index = parse_key(key.decode("utf-8", "replace"))
        if kind in ("chunk", "delta_chunk"):
            assert version is not None and index is not None
            table, seen = (
                (self.chunk_offsets, self.manifests) if kind == "chunk" else (self.delta_chunk_offsets, self.deltas)
            )
            if value is None:  # tombstone
                table.get((policy, version), {}).pop(index, None)
            elif (policy, version) in seen:
                return "ignored", None  # a manifest's chunks come before it: these are a fenced writer's
            elif version > self._newest_version(policy) + MAX_VERSION_JUMP:
                return "ignored", None
            else:
                table.setdefault((policy, version), {})[index] = offset
            return kind, None
        if kind == "epoch" and value is not None:
            return self._observe_claim(offset, policy, value)
        if kind == "canary":
            return self._observe_canary(offset, policy, value)
        if kind == "base" and value is not None:  # contract 1.25: a version probes name, kept from compaction
            manifest = self._followable(policy, value, delta=False, what="base manifest", role="base")
            if isinstance(manifest, str):
                return self._reject(offset, manifest)
            self.manifests.setdefault((policy, manifest.version), manifest)
            self.base[policy] = manifest
            return kind, manifest
        if kind in ("serving", "candidate", "delta", "delta_candidate") and value is not None:
            manifest = self._followable(policy, value, delta=kind.startswith("delta"), role=kind)
            if isinstance(manifest, str):
                return self._reject(offset, manifest)
            if manifest.epoch is not None:
                self.epochs[policy] = max(self.epochs.get(policy, 0), manifest.epoch)
            if isinstance(manifest, DeltaManifest):
                self.deltas[(policy, manifest.version)] = manifest
                if kind == "delta":
                    self.served_deltas.add((policy, manifest.version))
            else:
                self.manifests[(policy, manifest.version)] = manifest
            tables: dict[str, dict[str, Any]] = {
                "serving": self.serving,
                "candidate": self.candidate,
                "delta": self.delta_serving,
                "delta_candidate": self.delta_candidate,
            }
            target = tables[kind]
            current = target.get(policy)
            # Serving versions only grow; an older manifest after a newer one is ignored.
            if current is None or manifest.version > current.version:
                target[policy] = manifest
            return kind, manifest
        return kind, None

    def _observe_canary(self, offset: int, policy: str, value: bytes | None) -> tuple[str, Manifest | None]:
        """Contract 1.4: a full candidate's manifest under ``"{policy}/canary"``, or a tombstone ending it."""
        if value is None:
            self.canary[policy] = None
            return "canary", None
        manifest = self._followable(policy, value, delta=False, what="canary manifest", role="canary")
        if isinstance(manifest, str):
            return self._reject(offset, manifest)
        self.canary[policy] = manifest
        return "canary", manifest

    def _followable(self, policy: str, value: bytes, delta: bool, role: str, what: str = "manifest") -> Manifest | str:
        """The manifest under a ``policy`` key of kind ``role``, or why it must not be followed:
        it does not decode (or verify), names another policy, was signed for another key
        (contract 1.11: a signed candidate replayed as serving), comes from a fenced writer, or
        jumps beyond the newest version seen by more than :data:`MAX_VERSION_JUMP`."""
        try:
            decode = decode_delta_manifest if delta else decode_manifest
            manifest: Manifest = decode(value, signing_key=self.signing_key)
        except Rejected as exc:
            return f"bad {what}: {exc.reason}: {exc.detail}"
        if manifest.policy != policy:
            return "manifest policy differs from its key"
        if self.signing_key is not None and manifest.role != role:
            return f"{what} signed for the {manifest.role or 'unnamed'} key, found under the {role} key"
        why = self._fenced(manifest)
        if why:
            return why
        newest = self._newest_version(policy)
        if newest and manifest.version > newest + MAX_VERSION_JUMP:
            return f"version {manifest.version} jumps beyond {newest} + {MAX_VERSION_JUMP}"
        return manifest

    def _fenced(self, manifest: Manifest) -> str:
        """Why a manifest's writer is fenced off (an older epoch, or not the epoch's claimant); "" if not."""
        epoch = manifest.epoch or 0
        newest = self.epochs.get(manifest.policy, 0)
        if epoch < newest:
            return f"stale epoch {epoch} < {newest}"
        if newest and epoch > newest + MAX_EPOCH_JUMP:
            return f"epoch {epoch} jumps beyond {newest} + {MAX_EPOCH_JUMP}"
        claim = self.claims.get(manifest.policy)
        writer = manifest.metrics.get("writer")
        if claim is not None and claim.epoch == epoch and writer is not None and writer != claim.writer:
            return f"writer {writer!r} does not hold epoch {epoch}"
        return ""

    def _observe_claim(self, offset: int, policy: str, value: bytes) -> tuple[str, None]:
        try:
            claim = decode_epoch_claim(value, self.signing_key)
        except Rejected as exc:
            return self._reject(offset, f"bad epoch claim: {exc.reason}: {exc.detail}")
        newest = self.epochs.get(policy, 0)
        if claim.policy != policy:
            return self._reject(offset, "epoch claim policy differs from its key")
        if claim.epoch <= newest:
            return self._reject(offset, f"epoch {claim.epoch} claimed after {newest}")
        if newest and claim.epoch > newest + MAX_EPOCH_JUMP:
            return self._reject(offset, f"epoch {claim.epoch} jumps beyond {newest} + {MAX_EPOCH_JUMP}")
        self.epochs[policy] = claim.epoch
        self.claims[policy] = claim
        self.claim_offsets[policy] = offset
        return "epoch", None

    def owner(self, policy: str) -> EpochClaim | None:
        """The newest accepted epoch claim of a policy (the writer that owns it now)."""
        return self.claims.get(policy)

    def max_version(self, policy: str) -> int:
        keys = [*self.manifests, *self.chunk_offsets, *self.deltas, *self.delta_chunk_offsets]
        return max((v for (p, v) in keys if p == policy), default=0)

    def newest(self, policy: str) -> Manifest | None:
        """The newest manifest of a policy, serving or candidate, full or delta (what the learner resumes)."""
        tables = (self.serving, self.candidate, self.delta_serving, self.delta_candidate)
        options = [m for m in (t.get(policy) for t in tables) if m is not None]
        return max(options, key=lambda m: m.version, default=None)

    def serving_head(self, policy: str) -> Manifest | None:
        """The newest serving link of a policy, a full snapshot or a delta (what clients hold)."""
        options = [m for m in (self.serving.get(policy), self.delta_serving.get(policy)) if m is not None]
        return max(options, key=lambda m: m.version, default=None)

    # Every reader finds versions through these, full or delta (contract 1.3): clients,
    # ``causalmem evaluate``, ``evaluate --shadow``, ``rollback``, ``status`` and the web UI.

    def candidate_head(self, policy: str) -> Manifest | None:
        """The newest candidate of a policy (awaiting the promotion gate), a full snapshot or a delta."""
        options = [m for m in (self.candidate.get(policy), self.delta_candidate.get(policy)) if m is not None]
        return max(options, key=lambda m: m.version, default=None)

    def version(self, policy: str, version: int) -> Manifest | None:
        """A version's accepted manifest, full or delta."""
        return self.manifests.get((policy, version)) or self.deltas.get((policy, version))

    def links(self, policy: str) -> list[Manifest]:
        """Every accepted manifest of a policy, full and delta, oldest first."""
        found = [m for (p, _), m in [*self.manifests.items(), *self.deltas.items()] if p == policy]
        return sorted(found, key=lambda m: m.version)

    def chain_to(self, manifest: DeltaManifest) -> tuple[Manifest, list[DeltaManifest]]:
        """The full snapshot ``manifest``'s chain starts from, and the deltas from it to ``manifest`` (in order).

        Every base must be a full snapshot or a delta published under the serving delta key,
        with the id the next link names. Raises :class:`CheckpointError` (``missing_link``).
        """
        links = [manifest]
        link = manifest
        for _ in range(MAX_CHAIN):
            where = (link.policy, link.base_version)
            full = self.manifests.get(where)
            if full is not None and link_id(full) == link.base_sha256 and full.arch == manifest.arch:
                return full, links[::-1]
            base = self.deltas.get(where)
            if base is None or where not in self.served_deltas or link_id(base) != link.base_sha256:
                why = f"v{link.version}'s base v{link.base_version} is not on the topic"
                raise CheckpointError("missing_link", why)
            links.append(base)
            link = base
        raise CheckpointError("missing_link", f"v{manifest.version}: chain longer than {MAX_CHAIN}")

    def rebuildable(self, manifest: Manifest) -> bool:
        """Whether the topic still holds every chunk that rebuilding ``manifest``'s state needs (its chain's too)."""
        links: list[Manifest] = [manifest]
        if isinstance(manifest, DeltaManifest):
            try:
                full, deltas = self.chain_to(manifest)
            except CheckpointError:
                return False
            links = [full, *deltas]
        return all(all(i in self.offsets_of(m) for i in range(m.chunks)) for m in links)


_LOOPBACK_HOSTS = ("localhost", "127.", "[::1]", "::1")


def unsigned_warning(role: str, signing_key: Key | None, bootstrap: str | None, security_protocol: str) -> str | None:
    """What an unsigned ``role`` ("learner", "client") logs at start as a WARNING; None when it signs
    or runs on the embedded broker.

    The embedded broker (``bootstrap`` None: the verbs start or reuse it) listens on loopback
    only, without SASL or TLS; any other broker (another address, or SASL/TLS) is a
    deployment, where an unsigned model topic serves whatever any producer on it writes.

    >>> unsigned_warning("client", None, "127.0.0.1:19092", "PLAINTEXT") is None
    True
    >>> unsigned_warning("client", b"k", "kafka:9092", "SASL_SSL") is None
    True
    >>> print(unsigned_warning("learner", None, "kafka:9092", "PLAINTEXT"))  # doctest: +ELLIPSIS
    learner: checkpoints are NOT signed ... CAUSALMEM_CHECKPOINT_SIGNING_KEY_FILE ...
    """
    if signing_key is not None:
        return None
    hosts = [part.strip().rsplit(":", 1)[0] for part in (bootstrap or "").split(",") if part.strip()]
    local = all(h.startswith(_LOOPBACK_HOSTS) for h in hosts)
    if local and security_protocol.upper() == "PLAINTEXT":
        return None  # the embedded broker (or a broker only this machine reaches): a trial
    what = "publishes checkpoints no client can tell from a forgery" if role == "learner" else "serves any manifest"
    return (
        f"{role}: checkpoints are NOT signed on broker {bootstrap}: this {role} {what}, so any producer "
        "on the model topic can serve its own weights and lock the learner out; run causalmem keygen and set "
        "CAUSALMEM_CHECKPOINT_SIGNING_KEY_FILE on the learner and CAUSALMEM_CHECKPOINT_VERIFY_KEY_FILE on every "
        "client (docs/operations.md, 'Signed checkpoints')"
    )


def model_topic(conn: Connection | Settings | None) -> str:
    """The model topic's name for a connection (or settings)."""
    return Connection.of(conn).topics.policy_checkpoints.name


async def scan_model_topic(
    bootstrap: str, conn: Connection | Settings, topic: str | None = None, signing_key: Key | None = None
) -> ModelTopicIndex:
    """Read the whole model topic once, from the beginning, into an index.

    The model topic has no retention limit and is read from offset 0 (docs/contract.md).
    """
    conn = Connection.of(conn)
    index = ModelTopicIndex(signing_key=signing_key)
    for msg in await kafka.read_all(bootstrap, conn, topic or model_topic(conn), partitions=[0]):
        index.observe(msg.offset, msg.key, msg.value, msg.headers)
    if index.rejected:
        offset, why = index.rejected[-1]
        log.warning(
            "model topic: %d messages rejected (skipped); the last at offset %d: %s", index.rejected_total, offset, why
        )
    return index


def check_blob(blob: bytes, manifest: Manifest) -> bytes:
    """``blob`` when its size and sha256 are the manifest's; raises :class:`CheckpointError`.

    >>> m = Manifest("p", 1, 0.0, "init", {}, 0.0, 0.0, sha256_hex(b"abc"), 3, 1)
    >>> check_blob(b"abc", m)
    b'abc'
    >>> try:
    ...     check_blob(b"abd", m)
    ... except CheckpointError as exc:
    ...     print(exc.reason)
    sha256_mismatch
    """
    if len(blob) != manifest.size:
        raise CheckpointError("size_mismatch", f"{len(blob)} bytes, manifest says {manifest.size}")
    if sha256_hex(blob) != manifest.sha256:
        raise CheckpointError("sha256_mismatch")
    return blob


def chunk_plan(manifest: Manifest, offsets: dict[int, int]) -> dict[int, int]:
    """Where to read a manifest's chunks: ``{offset: chunk index}``; raises :class:`CheckpointError`
    (``missing_chunk``) when the topic does not hold them all.

    What this builds is bounded by the chunks the topic holds, never by what the manifest
    claims: a forged manifest claiming 4 GiB in four million chunks, with none on the topic,
    costs a few entries, not a four-million-entry list (the bytes themselves are joined only
    once every chunk has been read).

    >>> m = Manifest("p", 1, 0.0, "init", {}, 0.0, 0.0, "0" * 64, 4 * 1024**3, 4 * 1024**2)
    >>> try:
    ...     chunk_plan(m, {0: 10})
    ... except CheckpointError as exc:
    ...     print(exc)
    missing_chunk: version 1 lacks chunks [1, 2, 3, 4, 5] (holds 1 of 4194304)
    """
    # Lazily, and at most five: len(offsets) + 5 steps whatever ``manifest.chunks`` claims.
    missing = list(islice((i for i in range(manifest.chunks) if i not in offsets), 5))
    if missing:
        why = f"version {manifest.version} lacks chunks {missing} (holds {len(offsets)} of {manifest.chunks})"
        raise CheckpointError("missing_chunk", why)
    return {offsets[i]: i for i in range(manifest.chunks)}


async def fetch_blob(
    bootstrap: str,
    conn: Connection | Settings,
    index: ModelTopicIndex,
    manifest: Manifest,
    topic: str | None = None,
) -> bytes:
    """Fetch a manifest's chunks by their offsets in ``index`` and assemble them.

    The bytes are checked against the manifest's size and sha256 (:func:`check_blob`);
    raises :class:`CheckpointError` (``missing_chunk``, ``size_mismatch``,
    ``sha256_mismatch``). Turning them into tensors is ``verify_and_load``'s job.
    """
    conn = Connection.of(conn)
    topic = topic or model_topic(conn)
    wanted = chunk_plan(manifest, index.offsets_of(manifest))
    parts: dict[int, bytes] = {}
    async for msg in read_range(bootstrap, conn, topic, min(wanted), max(wanted) + 1):
        if msg.offset in wanted and msg.value is not None:
            parts[wanted[msg.offset]] = msg.value
    if len(parts) != manifest.chunks:
        raise CheckpointError("missing_chunk", f"version {manifest.version}: read {len(parts)}/{manifest.chunks}")
    return check_blob(b"".join(parts[i] for i in range(manifest.chunks)), manifest)


async def read_range(
    bootstrap: str, conn: Connection | Settings, topic: str, start: int, end: int, partition: int = 0
) -> AsyncIterator[Any]:
    """The records of one partition with ``start <= offset < end``, streamed (bounded memory).

    Stops at ``end`` or at the partition's high watermark, whichever comes first: unlike
    ``kafka.read_all`` it never reads what was appended after the range, so a restore's
    cost does not grow with the backlog behind it.
    """
    if end <= start:
        return
    conn = Connection.of(conn)
    tp = TopicPartition(topic, partition)
    # Small fetches: what is fetched beyond ``end`` (at most one fetch) is the memory bound.
    c = kafka.consumer(
        bootstrap,
        conn,
        group_id=None,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=RANGE_FETCH_BYTES,
        fetch_max_bytes=RANGE_FETCH_BYTES,
    )
    await c.start()
    try:
        c.assign([tp])
        c.seek(tp, start)
        idle = 0
        while True:
            batch = await c.getmany(tp, timeout_ms=200, max_records=500)
            msgs = batch.get(tp, [])
            for msg in msgs:
                if msg.offset >= end:
                    return
                if msg.offset >= start:
                    yield msg
            idle = 0 if msgs else idle + 1
            hw = c.highwater(tp)
            if await c.position(tp) >= end or (hw is not None and await c.position(tp) >= hw) or idle > 25:
                return
    finally:
        await c.stop()
