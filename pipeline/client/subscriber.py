"""Client side: :class:`PolicySubscriber` follows the model topic and hot-swaps the policy.

Only a checkpoint that passes verification is swapped in (size, sha256, tensor names,
shapes, dtype, finiteness: ``models.weights.verify_and_load``); anything else is
rejected and logged, and the previous policy stays. Manifests of an older writer epoch,
version jumps beyond ``topics.manifest.MAX_VERSION_JUMP`` and chunk counts beyond what
the size allows are rejected before anything is fetched, and with a signing key so are
unsigned or wrongly signed manifests (``pipeline.modeltopic.ModelTopicIndex``). No pickle anywhere: bytes from the
network are parsed by safetensors and orjson only.

    async with PolicySubscriber("127.0.0.1:19092", on_update=retriever.set_policy) as sub:
        await sub.wait_for_policy()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from aiokafka import TopicPartition

from models.policy import Arch, PolicyNetwork
from models.serving import ServingParams
from models.weights import verify_and_load
from pipeline import kafka
from pipeline.component_config import Connection
from pipeline.config import Settings
from pipeline.modeltopic import ModelTopicIndex, fetch_blob, model_topic
from pipeline.service import Service
from topics.fields import Rejected
from topics.manifest import CheckpointError, Manifest, parse_key, validate_policy_name
from topics.slotmap import SlotTable, decode_slot_record, parse_slot_key

log = logging.getLogger(__name__)


def arch_of(manifest: Manifest) -> Arch:
    """The architecture a manifest declares."""
    a = manifest.arch
    return Arch(embedding_dim=int(a["embedding_dim"]), slots=int(a["slots"]), hidden=int(a["hidden"]))


async def fetch_checkpoint(
    bootstrap: str,
    conn: Connection | Settings,
    index: ModelTopicIndex,
    manifest: Manifest,
    topic: str | None = None,
) -> dict[str, torch.Tensor]:
    """Fetch a manifest's chunks, then verify and load them; raises :class:`CheckpointError`."""
    blob = await fetch_blob(bootstrap, conn, index, manifest, topic)
    return verify_and_load(blob, manifest.sha256, manifest.size, arch_of(manifest))


@dataclass
class LoadedPolicy:
    """A verified policy, ready for serving."""

    manifest: Manifest
    net: PolicyNetwork
    slots: SlotTable | None = None  # contract 1.3: the id → slot map the subscriber follows

    @property
    def version(self) -> int:
        return self.manifest.version

    def slot_of(self, memory_id: str) -> int | None:
        """The slot whose row this version holds for ``memory_id``; None when it holds none yet
        (a memory added since: serve it with a neutral mask) or no longer (removed)."""
        return self.slots.slot_of(memory_id, self.version) if self.slots is not None else None

    @property
    def alpha(self) -> float:
        return float(self.net.alpha.detach()[0])

    @property
    def serving(self) -> ServingParams | None:
        """How the learner says to serve it (the manifest's ``serving``); None in older manifests."""
        raw = self.manifest.serving
        return ServingParams.from_wire(raw) if raw is not None else None


UpdateCallback = Callable[[LoadedPolicy], Awaitable[None] | None]


class PolicySubscriber(Service):
    """Follows the model topic and hot-swaps verified serving checkpoints of one policy.

    Usage (async)::

        async with PolicySubscriber("127.0.0.1:19092", policy="default") as sub:
            await sub.wait_for_policy()
            mask = sub.current.net(...)

    Parameters
    ----------
    bootstrap
        The Kafka bootstrap address.
    policy
        The policy to follow; default: ``conn.policy``.
    conn
        Topic names, limits and SASL/TLS (a :class:`~pipeline.component_config.Connection`, or
        ``Settings``, whose part is taken); default: the product's defaults.
    on_update
        Called (and awaited when it returns a coroutine) with each newly loaded policy.
    expected_arch
        Rejects a manifest for another architecture; without it, the first loaded
        checkpoint fixes the architecture.
    keep_recent
        How many versions' chunk bytes to keep while waiting for their manifest.
    signing_key
        The HMAC-SHA256 key the learner signs manifests with: set, unsigned or wrongly
        signed manifests are rejected. Default: ``Settings``' key when ``conn`` is one
        (``CAUSALMEM_CHECKPOINT_SIGNING_KEY`` or its file), else none.

    Rejections are logged and kept in :attr:`rejections`.
    """

    def __init__(
        self,
        bootstrap: str,
        policy: str | None = None,
        conn: Connection | Settings | None = None,
        on_update: UpdateCallback | None = None,
        expected_arch: Arch | None = None,
        keep_recent: int = 2,
        signing_key: bytes | None = None,
    ) -> None:
        super().__init__()
        if signing_key is None and isinstance(conn, Settings):
            signing_key = conn.signing_key()
        self.signing_key = signing_key
        self.conn = Connection.of(conn)
        self.bootstrap = bootstrap
        self.policy = validate_policy_name(policy or self.conn.policy)
        self.topic = model_topic(self.conn)
        self.on_update = on_update
        self.expected_arch = expected_arch
        self.keep_recent = keep_recent
        self.current: LoadedPolicy | None = None
        self.rejections: list[tuple[int, str]] = []
        self.index = ModelTopicIndex(signing_key=signing_key)
        self.slots = SlotTable()  # contract 1.3: "{policy}/slot/{slot}" records, newest per slot
        self._recent: dict[int, dict[int, bytes]] = {}  # version -> {chunk index: bytes}
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()
        self._after_reset = False

    async def _start(self) -> None:
        self._consumer = kafka.consumer(self.bootstrap, self.conn, group_id=None)
        await self._consumer.start()
        tp = TopicPartition(self.topic, 0)
        self._consumer.assign([tp])
        await self._consumer.seek_to_beginning(tp)
        self._task = asyncio.create_task(self._run(), name="policy-subscriber")

    async def _stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._consumer:
            await self._consumer.stop()
            self._consumer = None

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
        """A log end below our position means the cluster lost the topic (docs/operations.md)."""
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
        self.index = ModelTopicIndex(signing_key=self.signing_key)
        self.slots = SlotTable()  # the loaded policy keeps the old map until the next one loads
        self._recent.clear()
        self._after_reset = True
        await self._consumer.seek_to_beginning(tp)

    async def handle(self, offset: int, key: bytes | None, value: bytes | None) -> None:
        """Process one model-topic message (public so tests can feed crafted messages)."""
        kind, manifest = self.index.observe(offset, key, value)
        if key is not None and parse_slot_key(key.decode("utf-8", "replace")) is not None:
            self._slot_record(offset, key, value)
            return
        if kind == "rejected":
            self._reject(offset, self.index.rejected[-1][1])
            return
        if kind == "chunk" and key is not None:
            self._keep_chunk(key, value)
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

    def _slot_record(self, offset: int, key: bytes, value: bytes | None) -> None:
        """A slot-map record (docs/contract.md §9.1): applies to every version it names, loaded or to come."""
        parsed = parse_slot_key(key.decode("utf-8", "replace"))
        if parsed is None or parsed[0] != self.policy or value is None:
            return  # another policy's map, or a compaction tombstone (the learner never deletes a record)
        try:
            self.slots.apply(decode_slot_record(value, key=key))
        except Rejected as exc:
            self._reject(offset, f"slot-map record: {exc.reason}: {exc.detail}")

    def _keep_chunk(self, key: bytes, value: bytes | None) -> None:
        """Keep the bytes of a recent version's chunk, so that its manifest needs no re-read."""
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

    async def _load(self, manifest: Manifest) -> LoadedPolicy:
        arch = arch_of(manifest)
        expected = self.expected_arch or (arch_of(self.current.manifest) if self.current else None)
        if expected is not None and arch != expected:
            raise CheckpointError("arch_mismatch", f"{arch} != {expected}")
        parts = self._recent.get(manifest.version, {})
        if all(i in parts for i in range(manifest.chunks)):
            blob = b"".join(parts[i] for i in range(manifest.chunks))
            tensors = verify_and_load(blob, manifest.sha256, manifest.size, arch)
        else:
            tensors = await fetch_checkpoint(self.bootstrap, self.conn, self.index, manifest, self.topic)
        net = PolicyNetwork.from_tensors(tensors)
        net.eval()
        return LoadedPolicy(manifest=manifest, net=net, slots=self.slots)

    def _reject(self, offset: int, why: str) -> None:
        self.rejections.append((offset, why))
        current = f"v{self.current.version}" if self.current else "none"
        log.warning("subscriber: rejected checkpoint at offset %d (%s); keeping %s", offset, why, current)
