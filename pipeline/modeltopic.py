"""Checkpoints through the model topic (DESIGN §5): publish, scan, fetch, follow.

- :class:`CheckpointPublisher` (learner side): chunks, then the manifest; tombstones for
  versions beyond the last few.
- :class:`ModelTopicIndex`: what the topic holds (manifests, and the *offsets* of chunks,
  not their bytes, so that scanning a long topic needs little memory).
- :func:`fetch_checkpoint`: seek to a version's chunks, assemble, verify, load.
- :class:`PolicySubscriber` (client side): follows the topic and hot-swaps a verified
  serving policy; anything that fails verification is rejected and logged, and the
  previous policy stays.

No pickle anywhere: bytes from the network are parsed by safetensors and orjson only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from aiokafka import TopicPartition

from models.checkpoint import CheckpointError, sha256_hex, split_chunks, to_safetensors, verify_and_load
from models.policy import Arch, PolicyNetwork
from pipeline import kafka
from pipeline.config import Connection, Settings
from topics.checkpoint import (
    Manifest,
    candidate_key,
    chunk_key,
    decode_manifest,
    parse_key,
    serving_key,
    validate_policy_name,
)
from topics.codec import Rejected, encode

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- publishing


class CheckpointPublisher:
    """Publishes checkpoints of one policy; versions strictly increase."""

    def __init__(self, producer: Any, topic: str, policy: str, keep_versions: int = 3) -> None:
        self.producer = producer
        self.topic = topic
        self.policy = validate_policy_name(policy)
        self.keep_versions = max(1, keep_versions)
        self.live: dict[int, int] = {}  # version -> chunk count, not yet tombstoned
        self.protected: set[int] = set()  # versions that must stay (the serving one)
        self.last_version = 0

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
        blob: bytes | dict[str, torch.Tensor],
        *,
        reason: str,
        arch: dict[str, int] | Arch,
        baseline: float,
        alpha: float | None = None,
        metrics: dict[str, Any] | None = None,
        input_offsets: dict[str, int] | None = None,
        candidate: bool = False,
        version: int | None = None,
    ) -> Manifest:
        """Publish chunks then the manifest; wait until the broker has acknowledged all.

        ``blob`` is the serialized checkpoint (``models.checkpoint.to_safetensors``) with
        its ``alpha``; tensors are still accepted and serialized here.
        """
        if isinstance(blob, dict):
            alpha = float(blob["alpha"].reshape(-1)[0]) if alpha is None else alpha
            blob = to_safetensors(blob)
        if alpha is None:
            raise TypeError("publish(blob) needs alpha=")
        arch_dict = arch.to_dict() if isinstance(arch, Arch) else dict(arch)
        version = version if version is not None else self.next_version()
        if version <= self.last_version:
            raise ValueError(f"version {version} is not above {self.last_version}")
        chunks = split_chunks(blob)
        futures = [
            await self.producer.send(self.topic, chunk, key=chunk_key(self.policy, version, i).encode(), partition=0)
            for i, chunk in enumerate(chunks)
        ]
        manifest = Manifest(
            policy=self.policy,
            version=version,
            created_ts=time.time(),
            reason=reason,
            arch=arch_dict,
            alpha=float(alpha),
            baseline=float(baseline),
            sha256=sha256_hex(blob),
            size=len(blob),
            chunks=len(chunks),
            metrics=metrics or {},
            input_offsets=input_offsets or {},
        )
        key = candidate_key(self.policy) if candidate else serving_key(self.policy)
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

    def observe(self, offset: int, key: bytes | None, value: bytes | None) -> tuple[str, Manifest | None]:
        """Record one message; returns its kind and, for a valid manifest, the manifest."""
        self.end_offset = max(self.end_offset, offset + 1)
        if key is None:
            return "unknown", None
        kind, policy, version, index = parse_key(key.decode("utf-8", "replace"))
        if kind == "chunk":
            assert version is not None and index is not None
            if value is None:  # tombstone
                self.chunk_offsets.get((policy, version), {}).pop(index, None)
            else:
                self.chunk_offsets.setdefault((policy, version), {})[index] = offset
            return kind, None
        if kind in ("serving", "candidate") and value is not None:
            try:
                manifest = decode_manifest(value)
            except Rejected as exc:
                self.rejected.append((offset, f"bad manifest: {exc.reason}"))
                return "rejected", None
            if manifest.policy != policy:
                self.rejected.append((offset, "manifest policy differs from its key"))
                return "rejected", None
            self.manifests[(policy, manifest.version)] = manifest
            target = self.serving if kind == "serving" else self.candidate
            current = target.get(policy)
            # Serving versions only grow; an older manifest after a newer one is ignored.
            if current is None or manifest.version > current.version:
                target[policy] = manifest
            return kind, manifest
        return kind, None

    def max_version(self, policy: str) -> int:
        versions = [v for (p, v) in self.manifests if p == policy]
        versions += [v for (p, v) in self.chunk_offsets if p == policy]
        return max(versions, default=0)

    def newest(self, policy: str) -> Manifest | None:
        """The newest manifest of a policy, serving or candidate (what the learner resumes)."""
        options = [m for m in (self.serving.get(policy), self.candidate.get(policy)) if m is not None]
        return max(options, key=lambda m: m.version, default=None)


def _model_topic(settings: Connection | Settings) -> str:
    topics = settings.topics if isinstance(settings, Connection) else settings.topics()
    return topics.policy_checkpoints.name


async def scan_model_topic(
    bootstrap: str, settings: Connection | Settings, topic: str | None = None
) -> ModelTopicIndex:
    """Read the whole model topic once (from the beginning, DESIGN §8) into an index."""
    topic = topic or _model_topic(settings)
    index = ModelTopicIndex()
    for msg in await kafka.read_all(bootstrap, settings, topic, partitions=[0]):
        index.observe(msg.offset, msg.key, msg.value)
    return index


async def fetch_checkpoint(
    bootstrap: str,
    settings: Connection | Settings,
    index: ModelTopicIndex,
    manifest: Manifest,
    topic: str | None = None,
) -> dict[str, torch.Tensor]:
    """Fetch a manifest's chunks by offset, then verify and load; raises CheckpointError."""
    topic = topic or _model_topic(settings)
    offsets = index.chunk_offsets.get((manifest.policy, manifest.version), {})
    missing = [i for i in range(manifest.chunks) if i not in offsets]
    if missing:
        raise CheckpointError("missing_chunk", f"version {manifest.version} lacks chunks {missing[:5]}")
    wanted = {offsets[i]: i for i in range(manifest.chunks)}
    parts: dict[int, bytes] = {}
    start = min(wanted)
    msgs = await kafka.read_all(bootstrap, settings, topic, partitions=[0], start={0: start})
    for msg in msgs:
        if msg.offset in wanted and msg.value is not None:
            parts[wanted[msg.offset]] = msg.value
        if len(parts) == manifest.chunks:
            break
    if len(parts) != manifest.chunks:
        raise CheckpointError("missing_chunk", f"version {manifest.version}: read {len(parts)}/{manifest.chunks}")
    blob = b"".join(parts[i] for i in range(manifest.chunks))
    return verify_and_load(blob, manifest.sha256, manifest.size, arch_of(manifest))


def arch_of(manifest: Manifest) -> Arch:
    a = manifest.arch
    return Arch(embedding_dim=int(a["embedding_dim"]), slots=int(a["slots"]), hidden=int(a["hidden"]))


# --------------------------------------------------------------------------- following


@dataclass
class LoadedPolicy:
    """A verified policy, ready for serving."""

    manifest: Manifest
    net: PolicyNetwork

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def alpha(self) -> float:
        return float(self.net.alpha.detach()[0])


UpdateCallback = Callable[[LoadedPolicy], Awaitable[None] | None]


class PolicySubscriber:
    """Follows the model topic and hot-swaps verified serving checkpoints of one policy.

    Usage (async)::

        async with PolicySubscriber("127.0.0.1:19092", policy="default") as sub:
            await sub.wait_for_policy()
            mask = sub.current.net(...)

    ``expected_arch`` (optional) rejects a manifest for another architecture; otherwise the
    first loaded checkpoint fixes it. Rejections are logged and kept in :attr:`rejections`.
    """

    def __init__(
        self,
        bootstrap: str,
        policy: str = "default",
        settings: Settings | None = None,
        on_update: UpdateCallback | None = None,
        expected_arch: Arch | None = None,
        keep_recent: int = 2,
    ) -> None:
        self.settings = settings or Settings()
        self.bootstrap = bootstrap
        self.policy = validate_policy_name(policy)
        self.topic = self.settings.topics().policy_checkpoints.name
        self.on_update = on_update
        self.expected_arch = expected_arch
        self.keep_recent = keep_recent
        self.current: LoadedPolicy | None = None
        self.rejections: list[tuple[int, str]] = []
        self.index = ModelTopicIndex()
        self._recent: dict[int, dict[int, bytes]] = {}  # version -> {chunk index: bytes}
        self._consumer: Any = None
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Condition()
        self._after_reset = False

    async def start(self) -> None:
        self._consumer = kafka.consumer(self.bootstrap, self.settings, group_id=None)
        await self._consumer.start()
        tp = TopicPartition(self.topic, 0)
        self._consumer.assign([tp])
        await self._consumer.seek_to_beginning(tp)
        self._task = asyncio.create_task(self._run(), name="policy-subscriber")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._consumer:
            await self._consumer.stop()
            self._consumer = None

    async def __aenter__(self) -> PolicySubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_for_policy(self, min_version: int = 1, timeout: float = 60.0) -> LoadedPolicy:
        """Wait until a serving policy of at least ``min_version`` is loaded."""

        async def ready() -> LoadedPolicy:
            async with self._changed:
                await self._changed.wait_for(lambda: self.current is not None and self.current.version >= min_version)
                assert self.current is not None
                return self.current

        return await asyncio.wait_for(ready(), timeout)

    async def _run(self) -> None:
        while True:
            try:
                batch = await self._consumer.getmany(timeout_ms=500)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("subscriber: fetch failed: %r", exc)
                await asyncio.sleep(1.0)
                continue
            for msgs in batch.values():
                for msg in msgs:
                    await self.handle(msg.offset, msg.key, msg.value)
            await self._check_reset()

    async def _check_reset(self) -> None:
        """A log end below our position means the cluster lost the topic (DESIGN §8)."""
        tp = TopicPartition(self.topic, 0)
        hw = self._consumer.highwater(tp)
        if hw is None or hw >= await self._consumer.position(tp):
            return
        log.error(
            "subscriber: the model topic restarted (log end %d < position %d): the Kafka cluster was reset; "
            "keeping v%s and reading the topic again from the beginning",
            hw,
            await self._consumer.position(tp),
            self.current.version if self.current else "-",
        )
        self.index = ModelTopicIndex()
        self._recent.clear()
        self._after_reset = True
        await self._consumer.seek_to_beginning(tp)

    async def handle(self, offset: int, key: bytes | None, value: bytes | None) -> None:
        """Process one model-topic message (public so tests can feed crafted messages)."""
        kind, manifest = self.index.observe(offset, key, value)
        if kind == "rejected":
            self._reject(offset, self.index.rejected[-1][1])
            return
        if kind == "chunk" and key is not None:
            _, policy, version, i = parse_key(key.decode("utf-8", "replace"))
            if policy != self.policy or version is None or i is None:
                return
            if value is None:
                self._recent.get(version, {}).pop(i, None)
                return
            if self.current is not None and version <= self.current.version and not self._after_reset:
                return
            self._recent.setdefault(version, {})[i] = value
            for old in sorted(self._recent)[: -self.keep_recent]:
                del self._recent[old]  # bytes dropped; offsets stay in the index for a re-fetch
            return
        if kind != "serving" or manifest is None or manifest.policy != self.policy:
            return
        if self.current is not None and manifest.version <= self.current.version and not self._after_reset:
            if manifest.version < self.current.version:
                self._reject(offset, f"older version {manifest.version} after {self.current.version}")
            return
        try:
            loaded = await self._load(manifest)
        except CheckpointError as exc:
            self._reject(offset, f"version {manifest.version}: {exc}")
            return
        self.current = loaded
        self._after_reset = False  # after a cluster reset, the first verified policy is the new base
        for old in [v for v in self._recent if v <= manifest.version]:
            del self._recent[old]
        log.info("subscriber: loaded %s v%d (%s)", self.policy, manifest.version, manifest.reason)
        if self.on_update is not None:
            result = self.on_update(loaded)
            if asyncio.iscoroutine(result):
                await result
        async with self._changed:
            self._changed.notify_all()

    async def _load(self, manifest: Manifest) -> LoadedPolicy:
        arch = arch_of(manifest)
        expected = self.expected_arch or (arch_of(self.current.manifest) if self.current else None)
        if expected is not None and arch != expected:
            raise CheckpointError("arch_mismatch", f"{arch} != {expected}")
        parts = self._recent.get(manifest.version, {})
        if len(parts) >= manifest.chunks and all(i in parts for i in range(manifest.chunks)):
            blob = b"".join(parts[i] for i in range(manifest.chunks))
            tensors = verify_and_load(blob, manifest.sha256, manifest.size, arch)
        else:
            tensors = await fetch_checkpoint(self.bootstrap, self.settings, self.index, manifest, self.topic)
        net = PolicyNetwork.from_tensors(tensors)
        net.eval()
        return LoadedPolicy(manifest=manifest, net=net)

    def _reject(self, offset: int, why: str) -> None:
        self.rejections.append((offset, why))
        current = f"v{self.current.version}" if self.current else "none"
        log.warning("subscriber: rejected checkpoint at offset %d (%s); keeping %s", offset, why, current)
