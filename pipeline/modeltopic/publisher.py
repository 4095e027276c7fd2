"""Publishing on the model topic: :class:`CheckpointPublisher` (the learner's writer; docs/contract.md §7).

Chunks, then the manifest; tombstones for versions beyond the last few; epoch claims
(contract 1.2) and delta checkpoints (contract 1.3, ``topics/delta.py``). It takes the
safetensors bytes; the caller serializes. ``pipeline.modeltopic`` re-exports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from topics.delta import DeltaManifest, delta_candidate_key, delta_chunk_key, delta_key, link_id
from topics.fields import encode
from topics.manifest import (
    EpochClaim,
    Manifest,
    base_key,
    canary_key,
    candidate_key,
    chunk_key,
    epoch_key,
    parse_key,
    serving_key,
    sha256_hex,
    split_chunks,
    validate_policy_name,
)
from topics.signing import TOMBSTONE_HEADER, Key, tombstone_signature

if TYPE_CHECKING:
    from pipeline.modeltopic.reader import ModelTopicIndex

log = logging.getLogger(__name__)


class CheckpointPublisher:
    """Publishes checkpoints of one policy; versions strictly increase.

    ``producer`` is a started aiokafka producer (``kafka.producer``); the publisher never
    starts or stops it. With ``signing_key`` manifests and epoch claims are signed; after
    :meth:`claim` every manifest carries the writer's epoch, and ``before_send`` (when set)
    is awaited immediately before the chunks and again before the manifest: it raises to
    stop a writer that no longer owns the policy (the learner's fence).

    Delta checkpoints (contract 1.3): ``publish(..., delta={...})`` publishes a delta under
    the delta keys; :attr:`head` is the serving link (version, id) that the next delta must
    name as its base. Delta chunks stay until a newer full snapshot serves.
    """

    def __init__(
        self,
        producer: Any,
        topic: str,
        policy: str,
        keep_versions: int = 3,
        signing_key: Key | None = None,
        before_send: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.policy = validate_policy_name(policy)
        self.keep_versions = max(1, keep_versions)
        self.signing_key = signing_key
        self.before_send = before_send
        self.live: dict[int, int] = {}  # version -> chunk count, not yet tombstoned
        self.canary_version: int | None = None  # contract 1.4: the canary's chunks stay while it runs
        self.base_version: int | None = None  # contract 1.25: the version last written under the base key
        self.pinned: set[int] = set()  # candidates the promotion gate is still testing: their chunks stay
        self.protected: set[int] = set()  # versions that must stay (the serving one)
        self.delta_live: dict[int, int] = {}  # delta version -> chunk count, not yet tombstoned
        self.head: tuple[int, str] | None = None  # the serving link (version, id): deltas' base
        self.adoptions = 0  # times adopt() ran (a takeover: the learner's state came from the topic)
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
        self.adoptions += 1
        self.last_version = max(self.last_version, index.max_version(self.policy))
        for (policy, version), chunks in index.chunk_offsets.items():
            if policy == self.policy:
                self.live[version] = max(self.live.get(version, 0), len(chunks))
        for (policy, version), chunks in index.delta_chunk_offsets.items():
            if policy == self.policy:
                self.delta_live[version] = max(self.delta_live.get(version, 0), len(chunks))
        serving = index.serving.get(self.policy)
        if serving:
            self.protected = {serving.version}
        head = index.serving_head(self.policy)
        self.head = (head.version, link_id(head)) if head else None

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
        delta: dict[str, Any] | None = None,
    ) -> Manifest:
        """Publish a checkpoint's chunks then its manifest; wait until the broker acknowledged all.

        Parameters
        ----------
        blob
            The policy's safetensors bytes (``models.policy.weights.to_safetensors``).
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
        delta
            Publish ``blob`` as a delta (``models.policy.delta.encode_delta``): ``base_version``,
            ``base_sha256``, ``state_sha256`` and ``rows`` of the :class:`DeltaManifest`.
        """
        version = version if version is not None else self.next_version()
        if version <= self.last_version:
            raise ValueError(f"version {version} is not above {self.last_version}")
        chunks = split_chunks(blob)
        metrics = dict(metrics or {})
        if self.writer:
            metrics["writer"] = self.writer
        manifest = (DeltaManifest if delta else Manifest)(
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
            **(delta or {}),
        )
        if delta:
            key, part_key = (delta_candidate_key if candidate else delta_key)(self.policy), delta_chunk_key
        else:
            key, part_key = (candidate_key if candidate else serving_key)(self.policy), chunk_key
        # The role is the key it goes under, signed with the rest (contract 1.11).
        manifest.signed(self.signing_key, role=parse_key(key)[0])
        if prepare is not None:
            prepare(manifest)
        await self._fence()
        futures = [
            await self.producer.send(self.topic, chunk, key=part_key(self.policy, version, i).encode(), partition=0)
            for i, chunk in enumerate(chunks)
        ]
        await asyncio.gather(*futures)  # chunks acknowledged before the manifest is decided on
        await self._fence()
        futures.append(await self.producer.send(self.topic, encode(manifest.to_dict()), key=key.encode(), partition=0))
        await asyncio.gather(*futures)
        self.last_version = version
        (self.delta_live if delta else self.live)[version] = len(chunks)
        if not candidate:
            self._serve(manifest)
        await self._tombstone_old()
        return manifest

    def _serve(self, manifest: Manifest) -> None:
        self.head = (manifest.version, link_id(manifest))
        if not isinstance(manifest, DeltaManifest):
            self.protected = {manifest.version}

    async def promote(self, manifest: Manifest) -> None:
        """Republish a candidate's manifest under the serving key (its chunks are there).

        A delta candidate is promoted under the serving delta key, and only while its base is
        still the serving link (a checkpoint served at once in between replaced it: then the
        promotion is skipped, as clients would refuse it).
        """
        delta = isinstance(manifest, DeltaManifest)
        if isinstance(manifest, DeltaManifest) and self.head != (manifest.base_version, manifest.base_sha256):
            log.warning("model topic: delta v%d not promoted: its base is no longer the serving link", manifest.version)
            return
        await self._fence()
        key = (delta_key if delta else serving_key)(self.policy)
        # Signed again for the serving key: the candidate's signature names its own (contract 1.11).
        served = dataclasses.replace(manifest).signed(self.signing_key, role=parse_key(key)[0])
        fut = await self.producer.send(self.topic, encode(served.to_dict()), key=key.encode(), partition=0)
        await fut
        self._serve(manifest)
        await self._tombstone_old()

    async def set_canary(self, manifest: Manifest | None) -> None:
        """Contract 1.4: make a full candidate the canary (republish its manifest under
        ``"{policy}/canary"``; its chunks are kept while it runs), or end it (a tombstone)."""
        if isinstance(manifest, DeltaManifest):
            raise ValueError("a canary is a full snapshot: clients load it beside the serving policy")
        await self._fence()
        key = canary_key(self.policy).encode()
        canary = dataclasses.replace(manifest).signed(self.signing_key, role="canary") if manifest is not None else None
        value = encode(canary.to_dict()) if canary is not None else None
        signed = self._tombstone_headers(key) if value is None else {}
        fut = await self.producer.send(self.topic, value, key=key, partition=0, **signed)
        await fut
        self.canary_version = manifest.version if manifest is not None else None
        await self._tombstone_old()

    async def set_base(self, manifest: Manifest) -> None:
        """Contract 1.25: republish the manifest of the version probes name (``serving.base``)
        under ``"{policy}/base"``, once per version: compaction keeps the newest record of each
        key, so a client that starts while a probe serves finds it after the version's own
        serving manifest was compacted away (its chunks stay while a probe over it serves)."""
        if isinstance(manifest, DeltaManifest):
            raise ValueError("a base is a full snapshot: a client loads it alone")
        if manifest.version == self.base_version:
            return
        await self._fence()
        key = base_key(self.policy)
        # This writer's epoch and name: readers fence off a manifest of an older epoch.
        metrics = {**manifest.metrics, "writer": self.writer} if self.writer else manifest.metrics
        base = dataclasses.replace(manifest, epoch=self.epoch, metrics=metrics).signed(self.signing_key, role="base")
        fut = await self.producer.send(self.topic, encode(base.to_dict()), key=key.encode(), partition=0)
        await fut
        self.base_version = manifest.version

    async def _tombstone_old(self) -> None:
        keep = set(sorted(self.live)[-self.keep_versions :]) | self.protected | self.pinned
        if self.canary_version is not None:
            keep.add(self.canary_version)
        # Deltas are needed from the serving full snapshot on (a client replays them from it).
        chain_start = max(self.protected, default=0)
        doomed = [(v, chunk_key) for v in sorted(self.live) if v not in keep]
        doomed += [(v, delta_chunk_key) for v in sorted(self.delta_live) if v < chain_start and v not in self.pinned]
        futures = []
        for version, part_key in doomed:
            table = self.live if part_key is chunk_key else self.delta_live
            for i in range(table.pop(version, 0)):  # another call may have tombstoned it meanwhile
                key = part_key(self.policy, version, i).encode()
                signed = self._tombstone_headers(key)
                futures.append(await self.producer.send(self.topic, None, key=key, partition=0, **signed))
        if futures:
            await asyncio.gather(*futures)

    def _tombstone_headers(self, key: bytes) -> dict[str, list[tuple[str, bytes]]]:
        """Contract 1.6: a tombstone's signature travels in a record header (its value must stay null);
        the ``send`` keyword arguments that carry it (none when unsigned)."""
        if self.signing_key is None:
            return {}
        return {"headers": [(TOMBSTONE_HEADER, tombstone_signature(key, self.signing_key))]}
