"""The model topic, without torch: publish checkpoints, index the topic, fetch a checkpoint's bytes.

The wire format (chunk keys, the manifest) is in docs/contract.md and ``topics/manifest.py``.

- :class:`CheckpointPublisher` (learner side): chunks, then the manifest; tombstones for
  versions beyond the last few. It takes the safetensors bytes; the caller serializes.
- :class:`ModelTopicIndex`: what the topic holds (manifests, and the *offsets* of chunks,
  not their bytes, so that scanning a long topic needs little memory). It applies the
  readers' rules of contract 1.2: a manifest or epoch claim of an older epoch than the
  newest seen is ignored, and so are version and epoch jumps beyond
  ``MAX_VERSION_JUMP``/``MAX_EPOCH_JUMP``, chunks of a version whose manifest came
  already (a fenced writer's late chunks) and, with a signing key, anything unsigned.
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

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.component_config import Connection
from pipeline.config import Settings
from topics.fields import Rejected, encode
from topics.manifest import (
    MAX_EPOCH_JUMP,
    MAX_VERSION_JUMP,
    CheckpointError,
    EpochClaim,
    Manifest,
    candidate_key,
    chunk_key,
    decode_epoch_claim,
    decode_manifest,
    epoch_key,
    parse_key,
    serving_key,
    sha256_hex,
    split_chunks,
    validate_policy_name,
)

RANGE_FETCH_BYTES = 1024 * 1024  # read_range's fetch size: above the largest message (a 512 KiB chunk)

# --------------------------------------------------------------------------- publishing


class CheckpointPublisher:
    """Publishes checkpoints of one policy; versions strictly increase.

    ``producer`` is a started aiokafka producer (``kafka.producer``); the publisher never
    starts or stops it. With ``signing_key`` manifests and epoch claims are signed; after
    :meth:`claim` every manifest carries the writer's epoch, and ``before_send`` (when set)
    is awaited immediately before the chunks and again before the manifest: it raises to
    stop a writer that no longer owns the policy (the learner's fence).
    """

    def __init__(
        self,
        producer: Any,
        topic: str,
        policy: str,
        keep_versions: int = 3,
        signing_key: bytes | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.policy = validate_policy_name(policy)
        self.keep_versions = max(1, keep_versions)
        self.signing_key = signing_key
        self.before_send = before_send
        self.live: dict[int, int] = {}  # version -> chunk count, not yet tombstoned
        self.protected: set[int] = set()  # versions that must stay (the serving one)
        self.last_version = 0
        self.epoch: int | None = None  # set by claim()
        self.writer = ""

    async def claim(self, epoch: int, writer: str) -> int:
        """Write an epoch claim (``"{policy}/epoch"``); returns its offset once acknowledged."""
        value = EpochClaim(self.policy, epoch, writer, time.time()).to_bytes(self.signing_key)
        fut = await self.producer.send(self.topic, value, key=epoch_key(self.policy).encode(), partition=0)
        record = await fut
        self.epoch, self.writer = epoch, writer
        return int(record.offset)

    async def _fence(self) -> None:
        if self.before_send is not None:
            await self.before_send()

    def adopt(self, index: ModelTopicIndex) -> None:
        """Continue after what the topic already holds (versions and live chunks)."""
        self.last_version = max(self.last_version, index.max_version(self.policy))
        for (policy, version), chunks in index.chunk_offsets.items():
            if policy == self.policy:
                self.live[version] = max(self.live.get(version, 0), len(chunks))
        serving = index.serving.get(self.policy)
        if serving:
            self.protected = {serving.version}

    def next_version(self) -> int:
        return self.last_version + 1

    async def publish(
        self,
        blob: bytes,
        *,
        alpha: float,
        reason: str,
        arch: dict[str, int],
        baseline: float,
        metrics: dict[str, Any] | None = None,
        input_offsets: dict[str, int] | None = None,
        candidate: bool = False,
        version: int | None = None,
        prepare: Callable[[Manifest], None] | None = None,
        serving: dict[str, Any] | None = None,
    ) -> Manifest:
        """Publish a checkpoint's chunks then its manifest; wait until the broker acknowledged all.

        Parameters
        ----------
        blob
            The policy's safetensors bytes (``models.weights.to_safetensors``).
        alpha, baseline
            The policy's α and the learner's baseline, copied into the manifest.
        reason
            Why this checkpoint exists (one of the contract's checkpoint reasons).
        arch
            ``{"input_dim", "hidden", "slots", "embedding_dim"}`` (``Arch.to_dict()``).
        metrics, input_offsets
            Free-form learner metrics; the input positions this checkpoint has consumed.
        candidate
            Publish under the candidate key (awaiting the promotion gate) instead of serving.
        version
            An explicit version (above every earlier one); default: the next.
        prepare
            Called with the manifest before anything is sent (the learner saves its local
            copy there, so a published version always has its local state).
        serving
            How clients serve it (``ServingParams.to_wire()``), the manifest's optional ``serving``.
        """
        version = version if version is not None else self.next_version()
        if version <= self.last_version:
            raise ValueError(f"version {version} is not above {self.last_version}")
        chunks = split_chunks(blob)
        metrics = dict(metrics or {})
        if self.writer:
            metrics["writer"] = self.writer
        manifest = Manifest(
            policy=self.policy,
            version=version,
            created_ts=time.time(),
            reason=reason,
            arch={k: int(v) for k, v in arch.items()},
            alpha=float(alpha),
            baseline=float(baseline),
            sha256=sha256_hex(blob),
            size=len(blob),
            chunks=len(chunks),
            metrics=metrics,
            input_offsets=input_offsets or {},
            epoch=self.epoch,
            serving=serving,
        ).signed(self.signing_key)
        if prepare is not None:
            prepare(manifest)
        key = candidate_key(self.policy) if candidate else serving_key(self.policy)
        await self._fence()
        futures = [
            await self.producer.send(self.topic, chunk, key=chunk_key(self.policy, version, i).encode(), partition=0)
            for i, chunk in enumerate(chunks)
        ]
        await asyncio.gather(*futures)  # chunks acknowledged before the manifest is decided on
        await self._fence()
        futures.append(await self.producer.send(self.topic, encode(manifest.to_dict()), key=key.encode(), partition=0))
        await asyncio.gather(*futures)
        self.last_version = version
        self.live[version] = len(chunks)
        if not candidate:
            self.protected = {version}
        await self._tombstone_old()
        return manifest

    async def promote(self, manifest: Manifest) -> None:
        """Republish a candidate's manifest under the serving key (its chunks are there)."""
        await self._fence()
        fut = await self.producer.send(
            self.topic, encode(manifest.to_dict()), key=serving_key(self.policy).encode(), partition=0
        )
        await fut
        self.protected = {manifest.version}
        await self._tombstone_old()

    async def _tombstone_old(self) -> None:
        keep = set(sorted(self.live)[-self.keep_versions :]) | self.protected
        futures = []
        for version in sorted(self.live):
            if version in keep:
                continue
            for i in range(self.live.pop(version)):
                key = chunk_key(self.policy, version, i).encode()
                futures.append(await self.producer.send(self.topic, None, key=key, partition=0))
        if futures:
            await asyncio.gather(*futures)


# --------------------------------------------------------------------------- reading


@dataclass
class ModelTopicIndex:
    """Manifests and chunk offsets seen on the model topic (bytes are not kept)."""

    serving: dict[str, Manifest] = field(default_factory=dict)  # newest serving manifest per policy
    candidate: dict[str, Manifest] = field(default_factory=dict)
    manifests: dict[tuple[str, int], Manifest] = field(default_factory=dict)  # every manifest seen
    chunk_offsets: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (offset, reason)
    end_offset: int = 0
    signing_key: bytes | None = None  # set: unsigned or wrongly signed manifests are rejected
    epochs: dict[str, int] = field(default_factory=dict)  # the newest epoch seen per policy
    claims: dict[str, EpochClaim] = field(default_factory=dict)  # the newest epoch claim per policy
    claim_offsets: dict[str, int] = field(default_factory=dict)

    def _reject(self, offset: int, why: str) -> tuple[str, None]:
        self.rejected.append((offset, why))
        return "rejected", None

    def _newest_version(self, policy: str) -> int:
        return max((v for (p, v) in self.manifests if p == policy), default=0)

    def observe(self, offset: int, key: bytes | None, value: bytes | None) -> tuple[str, Manifest | None]:
        """Record one message; returns its kind and, for a valid manifest, the manifest.

        The kind is ``"rejected"`` (with the reason appended to :attr:`rejected`) for a
        manifest or claim that must not be followed.
        """
        self.end_offset = max(self.end_offset, offset + 1)
        if key is None:
            return "unknown", None
        kind, policy, version, index = parse_key(key.decode("utf-8", "replace"))
        if kind == "chunk":
            assert version is not None and index is not None
            if value is None:  # tombstone
                self.chunk_offsets.get((policy, version), {}).pop(index, None)
            elif (policy, version) in self.manifests:
                return "ignored", None  # a manifest's chunks come before it: these are a fenced writer's
            elif version > self._newest_version(policy) + MAX_VERSION_JUMP:
                return "ignored", None
            else:
                self.chunk_offsets.setdefault((policy, version), {})[index] = offset
            return kind, None
        if kind == "epoch" and value is not None:
            return self._observe_claim(offset, policy, value)
        if kind in ("serving", "candidate") and value is not None:
            try:
                manifest = decode_manifest(value, signing_key=self.signing_key)
            except Rejected as exc:
                return self._reject(offset, f"bad manifest: {exc.reason}: {exc.detail}")
            if manifest.policy != policy:
                return self._reject(offset, "manifest policy differs from its key")
            why = self._fenced(manifest)
            if why:
                return self._reject(offset, why)
            newest = self._newest_version(policy)
            if newest and manifest.version > newest + MAX_VERSION_JUMP:
                return self._reject(offset, f"version {manifest.version} jumps beyond {newest} + {MAX_VERSION_JUMP}")
            if manifest.epoch is not None:
                self.epochs[policy] = max(self.epochs.get(policy, 0), manifest.epoch)
            self.manifests[(policy, manifest.version)] = manifest
            target = self.serving if kind == "serving" else self.candidate
            current = target.get(policy)
            # Serving versions only grow; an older manifest after a newer one is ignored.
            if current is None or manifest.version > current.version:
                target[policy] = manifest
            return kind, manifest
        return kind, None

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
        versions = [v for (p, v) in self.manifests if p == policy]
        versions += [v for (p, v) in self.chunk_offsets if p == policy]
        return max(versions, default=0)

    def newest(self, policy: str) -> Manifest | None:
        """The newest manifest of a policy, serving or candidate (what the learner resumes)."""
        options = [m for m in (self.serving.get(policy), self.candidate.get(policy)) if m is not None]
        return max(options, key=lambda m: m.version, default=None)


def model_topic(conn: Connection | Settings | None) -> str:
    """The model topic's name for a connection (or settings)."""
    return Connection.of(conn).topics.policy_checkpoints.name


async def scan_model_topic(
    bootstrap: str, conn: Connection | Settings, topic: str | None = None, signing_key: bytes | None = None
) -> ModelTopicIndex:
    """Read the whole model topic once, from the beginning, into an index.

    The model topic has no retention limit and is read from offset 0 (docs/contract.md).
    """
    conn = Connection.of(conn)
    index = ModelTopicIndex(signing_key=signing_key)
    for msg in await kafka.read_all(bootstrap, conn, topic or model_topic(conn), partitions=[0]):
        index.observe(msg.offset, msg.key, msg.value)
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
    offsets = index.chunk_offsets.get((manifest.policy, manifest.version), {})
    missing = [i for i in range(manifest.chunks) if i not in offsets]
    if missing:
        raise CheckpointError("missing_chunk", f"version {manifest.version} lacks chunks {missing[:5]}")
    wanted = {offsets[i]: i for i in range(manifest.chunks)}
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
