"""Client side: :class:`PolicySubscriber` follows the model topic and hot-swaps the policy.

Only a checkpoint that passes verification is swapped in (size, sha256, tensor names,
shapes, dtype, finiteness: ``models.policy.weights.verify_and_load``); anything else is
rejected and logged, and the previous policy stays. Manifests of an older writer epoch,
version jumps beyond ``topics.manifest.MAX_VERSION_JUMP`` and chunk counts beyond what
the size allows are rejected before anything is fetched, and with a signing key so are
unsigned or wrongly signed manifests (``pipeline.modeltopic.ModelTopicIndex``). No pickle anywhere: bytes from the
network are parsed by safetensors and orjson only.

Delta checkpoints (contract 1.3, docs/contract.md §7.1) under ``"{policy}/delta"`` are
followed too: a delta based on the policy held is checked and applied; any other, or one
that fails a check, is reached by replaying its chain from its full snapshot
(``pipeline.client.chain``).

    async with PolicySubscriber("127.0.0.1:19092", on_update=retriever.set_policy) as sub:
        await sub.wait_for_policy()

The subscriber reads on a thread of its own (:class:`~pipeline.client.background.Background`):
a caller whose loop is busy (a blocking LLM call inside ``async def``) still gets new
policies, and ``on_update``/``on_canary`` are called on that thread (swapping a reference,
as ``set_policy`` does, is all they should do). ``start`` returns at once, broker or not: an
unreachable broker is retried with backoff (:meth:`PolicySubscriber.health` says since
when), and the caller serves what it has meanwhile. A subscriber that starts on a topic
with history reads it to its end before loading anything, then loads the newest verified
serving version only (and the canary, when one is open), instead of every version in turn.

With ``cache_dir=`` (opt-in) the newest verified serving checkpoint is also kept on local disk
(:class:`~pipeline.client.policy_cache.PolicyCache`: safetensors and the manifest as
received, written atomically), and a subscriber that starts loads it before it reaches the
broker, verified as a checkpoint from the topic is: a service restarted while the broker is
away serves the policy it served before. A cache that fails verification is refused, logged
and counted (:attr:`PolicySubscriber.cache_refused_total`), and the caller serves its wrapped
ranking. Once the topic is read, its newest verified version replaces the cached one.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from models.policy.delta import apply_delta, state_sha256
from models.policy.network import Arch, PolicyNetwork
from models.policy.weights import verify_and_load
from models.serving.params import ServingParams
from pipeline import kafka
from pipeline.client.background import Background, Backoff, keep_trying
from pipeline.client.chain import arch_of, fetch_delta, fetch_state
from pipeline.client.policy_cache import PolicyCache
from pipeline.config import Connection, Settings
from pipeline.modeltopic import KEEP_REJECTIONS, ModelTopicIndex, model_topic, unsigned_warning
from pipeline.service import Service
from topics.delta import DeltaManifest, link_id
from topics.fields import Rejected
from topics.manifest import CheckpointError, Manifest, parse_key, validate_policy_name
from topics.signing import Key
from topics.slotmap import SlotTable, decode_slot_record, parse_slot_key

log = logging.getLogger(__name__)


__all__ = ["LoadedPolicy", "PolicySubscriber", "arch_of", "fetch_checkpoint"]

STATE_CHECK_BYTES = 64 * 1024 * 1024  # states up to this size are re-hashed after every delta
KEEP_DEFERRED = 8  # serving manifests kept while catching up (the newest that verifies is loaded)
CACHE_FLUSH_S = 10.0  # stop waits this long at most for the cache write under way


# Fetch a manifest's chunks, verify and load them (a delta's version rebuilt from its chain's
# full snapshot); raises CheckpointError. The name clients have used since contract 1.0.
fetch_checkpoint = fetch_state


def _probe_base(manifest: Manifest) -> int | None:
    """The certified version a probe's manifest names (contract 1.23), else None."""
    return ServingParams.from_wire(manifest.serving).base if manifest.serving is not None else None


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
        Topic names, limits and SASL/TLS (a :class:`~pipeline.config.Connection`, or
        ``Settings``, whose part is taken); default: the product's defaults.
    on_update
        Called (and awaited when it returns a coroutine) with each newly loaded policy, on
        the subscriber's own thread.
    on_canary
        Contract 1.4: called the same way with the learner's canary when one is loaded,
        and with None when it ends (e.g. ``CausalRetriever.set_canary``). The canary is a
        second copy of the policy in memory while it runs.
    expected_arch
        Rejects a manifest for another architecture; without it, the first loaded
        checkpoint fixes the architecture.
    keep_recent
        How many versions' chunk bytes to keep while waiting for their manifest.
    signing_key
        What the learner's signatures are checked with (``topics.signing``): its Ed25519
        public key, or the shared HMAC secret. Set, unsigned or wrongly signed manifests, and
        manifests signed for another key than the one they arrive under (contract 1.11), are
        rejected. Default: ``Settings.verify_key()`` when ``conn`` is ``Settings``
        (``CAUSALMEM_CHECKPOINT_VERIFY_KEY_FILE``, else the signing key's public half), else none.

    state_check_bytes
        Delta checkpoints (contract 1.3): a state of at most this many bytes is copied,
        updated and re-hashed against the delta's ``state_sha256`` before it is swapped in; a
        larger one is updated in place (the policy object stays the same), relying on the
        chain's checks (the delta blob's sha256, its base's id). A delta whose base is not the
        policy held (a missed link), or that fails a check, makes the subscriber load the
        last full snapshot and replay the chain to it.
    cache_dir
        Keyword-only, opt-in: a local directory where the newest verified serving checkpoint
        is kept (:class:`~pipeline.client.policy_cache.PolicyCache`), and loaded from at
        start, before the broker is reached, after the same verification as from the topic
        (the signature with ``signing_key``, the digest, the tensors). :attr:`cached_version`
        is the version written last, :attr:`from_cache` the version served from the cache
        (None once the topic gave one), :attr:`cache_refused_total` and
        :attr:`cache_refused` count and say why a cache was refused. A write runs on a worker
        thread and is skipped (logged) when the state no longer has the manifest's digest,
        e.g. a large policy updated in place by the next delta meanwhile.

    Rejections are logged, counted in :attr:`rejected_total` and the newest kept in :attr:`rejections`.
    """

    def __init__(
        self,
        bootstrap: str,
        policy: str | None = None,
        conn: Connection | Settings | None = None,
        on_update: UpdateCallback | None = None,
        expected_arch: Arch | None = None,
        keep_recent: int = 2,
        signing_key: Key | None = None,
        state_check_bytes: int = STATE_CHECK_BYTES,
        on_canary: Callable[[LoadedPolicy | None], Any] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.on_canary = on_canary
        self.canary: LoadedPolicy | None = None
        self.state_check_bytes = state_check_bytes
        self.replays = 0  # times a delta was reached by replaying its chain (a missed link, a failed check)
        if signing_key is None and isinstance(conn, Settings):
            signing_key = conn.verify_key()
        self.signing_key = signing_key
        self.conn = Connection.of(conn)
        self.bootstrap = bootstrap
        self.policy = validate_policy_name(policy or self.conn.policy)
        self.topic = model_topic(self.conn)
        self.on_update = on_update
        self.expected_arch = expected_arch
        self.keep_recent = keep_recent
        self.current: LoadedPolicy | None = None
        self.rejections: list[tuple[int, str]] = []  # (offset, reason): the newest ones
        self.rejected_total = 0  # every rejection (``rejections`` keeps the newest KEEP_REJECTIONS to 2x that)
        self.index = ModelTopicIndex(signing_key=signing_key)
        self.slots = SlotTable()  # contract 1.3: "{policy}/slot/{slot}" records, newest per slot
        self._recent: dict[int, dict[int, bytes]] = {}  # version -> {chunk index: bytes}
        self.backoff = Backoff()
        self._bg: Background | None = None
        self._after_reset = False
        # While reading the history there was when the subscriber connected: the serving
        # manifests (offset, manifest) and the last canary record seen, loaded at its end.
        self._catching_up = False
        self._deferred: dict[int, tuple[int, Manifest, bytes | None]] = {}
        self._deferred_canary: tuple[int, Manifest | None] | None = None
        # Contract 1.25: manifests read under the base key, only ever loaded as a probe's base.
        self._deferred_bases: dict[int, tuple[int, Manifest, bytes | None]] = {}
        self._buffer = bytearray()  # delta chunks are assembled here (see _assemble)
        self._digests: dict[int, tuple[int, Any]] = {}  # delta version -> (chunks hashed, running sha256)
        self.cache = (
            PolicyCache(cache_dir, self.policy, signing_key=signing_key, expected_arch=expected_arch)
            if cache_dir is not None
            else None
        )
        self.cached_version: int | None = None  # the version the cache holds, written by this subscriber
        self.from_cache: int | None = None  # the version served from the cache, until the topic gives one
        self.cache_refused_total = 0
        self.cache_refused: str | None = None  # why the cache was refused last
        self._cache_next: tuple[LoadedPolicy, bytes] | None = None  # the newest policy still to write
        self._cache_task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        warning = unsigned_warning("client", self.signing_key, self.bootstrap, self.conn.security.security_protocol)
        if warning:
            log.warning(warning)
        self._bg = Background("causalmem-subscriber")
        if self.cache is not None and self.current is None:
            await self._bg.wait(self._load_cache())  # local disk only: served before the broker is reached
        self._bg.submit(self._follow())

    async def _stop(self) -> None:
        if self._bg is not None:
            if self._cache_task is not None:
                try:
                    await asyncio.wait_for(self._bg.wait(self._cache_written()), CACHE_FLUSH_S)
                except TimeoutError:
                    log.warning("subscriber: the policy cache write did not end within %.0f s", CACHE_FLUSH_S)
            await asyncio.to_thread(self._bg.close)
            self._bg = None

    async def _load_cache(self) -> None:
        """Serve the cached checkpoint, verified; a refused one is logged and counted, and nothing is served."""
        assert self.cache is not None
        try:
            cached = await asyncio.to_thread(self.cache.read)
            if cached is None:
                return
            net = PolicyNetwork.from_tensors(cached.tensors)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # CheckpointError, or whatever a damaged file made the parse raise
            self.cache_refused_total += 1
            self.cache_refused = str(exc)[:300]
            log.warning(
                "subscriber: refused the policy cache in %s (%s); serving the wrapped ranking until the broker answers",
                self.cache.directory,
                self.cache_refused,
            )
            return
        net.eval()
        loaded = LoadedPolicy(manifest=cached.manifest, net=net, slots=self.slots)
        self.current = loaded
        self.from_cache = self.cached_version = loaded.version
        log.info(
            "subscriber: serving %s v%d from the policy cache until the model topic is read",
            self.policy,
            loaded.version,
        )
        if self.on_update is not None:
            result = self.on_update(loaded)
            if asyncio.iscoroutine(result):
                await result

    def _cache_later(self, loaded: LoadedPolicy, raw: bytes | None) -> None:
        """Write ``loaded`` to the cache on a worker thread; while a write runs, only the newest waits."""
        if self.cache is None or raw is None:
            return
        self._cache_next = (loaded, raw)
        if self._cache_task is None or self._cache_task.done():
            self._cache_task = asyncio.get_running_loop().create_task(self._write_cache())

    async def _write_cache(self) -> None:
        assert self.cache is not None
        while self._cache_next is not None:
            loaded, raw = self._cache_next
            self._cache_next = None
            try:
                await asyncio.to_thread(self.cache.write, raw, loaded.manifest, loaded.net.tensors())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("subscriber: v%d not written to the policy cache: %s", loaded.version, exc)
                continue
            self.cached_version = loaded.version

    async def _cache_written(self) -> None:
        """Until the cache write under way (and the one waiting) has ended."""
        while self._cache_task is not None and not self._cache_task.done():
            await asyncio.wait({self._cache_task})

    def health(self) -> str:
        """``"ok"``, or ``"degraded: no broker since …"`` while the model topic cannot be read."""
        return self.backoff.health()

    async def wait_for_policy(self, min_version: int = 1, timeout: float = 60.0) -> LoadedPolicy:
        """Wait until a serving policy of at least ``min_version`` is loaded (``TimeoutError`` after ``timeout`` s)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            current = self.current
            if current is not None and current.version >= min_version:
                return current
            if asyncio.get_running_loop().time() >= deadline:
                raise TimeoutError(f"no policy v{min_version} or later after {timeout} s ({self.health()})")
            await asyncio.sleep(0.02)

    async def _connect(self) -> tuple[Any, TopicPartition]:
        """A consumer at the start of the model topic; retried with backoff while the broker is away."""
        tp = TopicPartition(self.topic, 0)

        async def attempt() -> Any:
            consumer = kafka.consumer(self.bootstrap, self.conn, group_id=None)
            try:
                await consumer.start()
                consumer.assign([tp])
                await self._read_from_start(consumer, tp)
            except BaseException:
                await consumer.stop()
                raise
            return consumer

        def failed(exc: BaseException, delay: float) -> None:
            log.warning("subscriber: cannot read the model topic (%r); retrying in %.1f s", exc, delay)

        return await keep_trying(attempt, self.backoff, failed), tp

    async def _read_from_start(self, consumer: Any, tp: TopicPartition) -> None:
        """Seek to the beginning; what is there is history, caught up with before loading."""
        await consumer.seek_to_beginning(tp)
        self._catching_up = True

    async def _follow(self) -> None:
        consumer, tp = await self._connect()
        try:
            while True:
                try:
                    batch = await consumer.getmany(timeout_ms=500)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    delay = self.backoff.failed()
                    log.warning("subscriber: fetch failed: %r", exc)
                    await asyncio.sleep(delay)
                    continue
                self.backoff.succeeded()
                for msgs in batch.values():
                    for msg in msgs:
                        await self._handle_safely(msg.offset, msg.key, msg.value, msg.headers)
                if self._catching_up:
                    # The high watermark the fetches return (contract §7: end_offsets points into the
                    # last batch on the embedded broker); None until the first fetch answered.
                    hw = consumer.highwater(tp)
                    if hw is not None and await consumer.position(tp) >= hw:
                        await self._caught_up()
                await self._check_reset(consumer, tp)
        finally:
            await consumer.stop()

    async def _caught_up(self) -> None:
        """The history is read: load the newest serving version that verifies, then the open canary."""
        self._catching_up = False
        deferred, self._deferred = self._deferred, {}
        bases, self._deferred_bases = self._deferred_bases, {}
        failed: set[int] = set()
        for version in sorted(deferred, reverse=True):
            if version in failed:
                continue
            base = _probe_base(deferred[version][1])
            if base is not None and not await self._hold_base(base, {**bases, **deferred}, failed):
                continue  # a probe whose version does not load is passed over, as a reader before 1.23 does
            if await self._serve(*deferred[version]) or base is not None:
                break  # the probe serves, or else the version it names does
            failed.add(version)
        canary, self._deferred_canary = self._deferred_canary, None
        if canary is not None:
            await self._canary(*canary)

    async def _hold_base(
        self, base: int, deferred: dict[int, tuple[int, Manifest, bytes | None]], failed: set[int]
    ) -> bool:
        """Contract 1.23: a probe over a certified version is served with that version, which a
        client must hold: load it first from the history, as a client that followed the topic did.
        Whether the client holds it now (``failed`` gets it where it does not load)."""
        if self.current is not None and self.current.version == base:
            return True
        if base in deferred and base not in failed and await self._serve(*deferred[base]):
            return True
        failed.add(base)
        return False

    async def _handle_safely(self, offset: int, key: bytes | None, value: bytes | None, headers: Any = None) -> None:
        """:meth:`handle`, with anything it raises a rejection of that message: the subscriber keeps
        following the topic and loads the next good checkpoint (one hostile message used to end it)."""
        try:
            await self.handle(offset, key, value, headers)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._reject(offset, f"unparseable message: {exc!r}"[:300])

    async def _check_reset(self, consumer: Any, tp: TopicPartition) -> None:
        """A log end below our position means the cluster lost the topic (docs/operations.md)."""
        hw = consumer.highwater(tp)
        if hw is None or hw >= await consumer.position(tp):
            return
        log.error(
            "subscriber: the model topic restarted (log end %d < position %d): the Kafka cluster was reset; "
            "keeping v%s and reading the topic again from the beginning",
            hw,
            await consumer.position(tp),
            self.current.version if self.current else "-",
        )
        self.index = ModelTopicIndex(signing_key=self.signing_key)
        self.slots = SlotTable()  # the loaded policy keeps the old map until the next one loads
        self._recent.clear()
        self._after_reset = True
        await self._read_from_start(consumer, tp)

    async def handle(self, offset: int, key: bytes | None, value: bytes | None, headers: Any = None) -> None:
        """Process one model-topic message (public so tests can feed crafted messages); ``headers``:
        the record's (a signed tombstone's signature, contract 1.7)."""
        kind, manifest = self.index.observe(offset, key, value, headers)
        if key is not None and parse_slot_key(key.decode("utf-8", "replace")) is not None:
            self._slot_record(offset, key, value)
            return
        if kind == "rejected":
            self._reject(offset, self.index.rejected[-1][1])
            return
        if kind in ("chunk", "delta_chunk") and key is not None:
            self._keep_chunk(key, value, delta=kind == "delta_chunk")
            return
        if kind == "canary" and key is not None and parse_key(key.decode("utf-8", "replace"))[1] == self.policy:
            if self._catching_up:
                self._deferred_canary = (offset, manifest)
            else:
                await self._canary(offset, manifest)
            return
        if kind == "base" and self._catching_up and manifest is not None and manifest.policy == self.policy:
            # Contract 1.25: the version a probe names, where compaction removed its serving
            # manifest: loaded only as what a probe is served with, never as the newest version.
            self._deferred_bases[manifest.version] = (offset, manifest, value)
            for old in sorted(self._deferred_bases)[:-KEEP_DEFERRED]:
                del self._deferred_bases[old]
            return
        if kind not in ("serving", "delta") or manifest is None or manifest.policy != self.policy:
            return
        if self._catching_up:
            self._deferred[manifest.version] = (offset, manifest, value)
            kept = sorted(self._deferred)[-KEEP_DEFERRED:]
            bases = {_probe_base(self._deferred[v][1]) for v in kept}  # what a kept probe is served with
            for old in sorted(self._deferred)[:-KEEP_DEFERRED]:
                if old not in bases:
                    del self._deferred[old]
            return
        await self._serve(offset, manifest, value)

    async def _serve(self, offset: int, manifest: Manifest, raw: bytes | None = None) -> bool:
        """Load and swap in a serving manifest; False when it was not loaded (older, or it failed a check).

        ``raw``: the manifest's bytes as received, what the policy cache keeps. A policy served
        from the cache gives way to any version the topic verifies (the topic is the truth: it
        may have been reset, or rolled back, since the cache was written).
        """
        current = self.current
        if current is not None and self.from_cache is not None:
            if (current.version, current.manifest.sha256) == (manifest.version, manifest.sha256):
                self.from_cache = None  # the topic serves what the cache held: nothing to load
                return True
        elif current is not None and manifest.version <= current.version and not self._after_reset:
            if manifest.version < current.version:
                self._reject(offset, f"older version {manifest.version} after {current.version}")
            return False
        try:
            held = self.canary
            if held is not None and (held.version, held.manifest.sha256) == (manifest.version, manifest.sha256):
                loaded = LoadedPolicy(manifest=manifest, net=held.net, slots=self.slots)  # the canary, promoted
            else:
                loaded = await self._load(manifest)
        except CheckpointError as exc:
            self._reject(offset, f"version {manifest.version}: {exc}")
            return False
        self.current = loaded
        self.from_cache = None
        if _probe_base(manifest) is None:
            # A probe (1.23) is served with the version it names: the cache keeps that one, which a
            # client restarted without the broker can serve on its own.
            self._cache_later(loaded, raw)
        if self.canary is not None and self.canary.version <= loaded.version:
            await self._set_canary(None)  # served now, or older than what is served
        self._after_reset = False  # after a cluster reset, the first verified policy is the new base
        for old in [v for v in self._recent if v <= manifest.version]:
            del self._recent[old]
        log.info("subscriber: loaded %s v%d (%s)", self.policy, manifest.version, manifest.reason)
        if self.on_update is not None:
            result = self.on_update(loaded)
            if asyncio.iscoroutine(result):
                await result
        return True

    async def _canary(self, offset: int, manifest: Manifest | None) -> None:
        """Contract 1.4: load the canary named under ``"{policy}/canary"``; a tombstone ends it."""
        if manifest is None:
            if self.canary is not None:
                await self._set_canary(None)
            return
        if self.current is not None and manifest.version <= self.current.version:
            return  # already served, or older than what is
        if self.canary is not None and self.canary.version == manifest.version:
            return
        try:
            loaded = await self._load(manifest)
        except CheckpointError as exc:
            self._reject(offset, f"canary version {manifest.version}: {exc}")
            return
        log.info("subscriber: canary %s v%d loaded", self.policy, manifest.version)
        await self._set_canary(loaded)

    async def _set_canary(self, canary: LoadedPolicy | None) -> None:
        self.canary = canary
        if self.on_canary is not None:
            result = self.on_canary(canary)
            if asyncio.iscoroutine(result):
                await result

    def _slot_record(self, offset: int, key: bytes, value: bytes | None) -> None:
        """A slot-map record (docs/contract.md §9.1): applies to every version it names, loaded or to come."""
        parsed = parse_slot_key(key.decode("utf-8", "replace"))
        if parsed is None or parsed[0] != self.policy or value is None:
            return  # another policy's map, or a compaction tombstone (the learner never deletes a record)
        try:
            self.slots.apply(decode_slot_record(value, key=key, signing_key=self.signing_key))
        except Rejected as exc:
            self._reject(offset, f"slot-map record: {exc.reason}: {exc.detail}")
        except Exception as exc:  # whatever the parse raised: rejected, like a record that does not decode
            self._reject(offset, f"slot-map record: {exc!r}"[:300])

    def _keep_chunk(self, key: bytes, value: bytes | None, delta: bool = False) -> None:
        """Keep the bytes of a recent version's chunk, so that its manifest needs no re-read.

        A delta's chunks are also hashed as they arrive, in order (a chunk out of order
        drops that running hash): its manifest then only has the digest to compare.
        """
        _, policy, version, i = parse_key(key.decode("utf-8", "replace"))
        if policy != self.policy or version is None or i is None:
            return
        if value is None:
            self._recent.get(version, {}).pop(i, None)
            self._digests.pop(version, None)
            return
        held = self.current is not None and version <= self.current.version
        if held and not self._after_reset and self.from_cache is None:
            return
        self._recent.setdefault(version, {})[i] = value
        running = self._digests.pop(version, None)
        if delta and (i == 0 or (running is not None and running[0] == i)):
            hasher = hashlib.sha256() if i == 0 or running is None else running[1]
            hasher.update(value)
            self._digests[version] = (i + 1, hasher)
        for old in sorted(self._recent)[: -self.keep_recent]:
            del self._recent[old]  # bytes dropped; offsets stay in the index for a re-fetch
        self._digests = {v: d for v, d in self._digests.items() if v in self._recent}

    async def _load(self, manifest: Manifest) -> LoadedPolicy:
        arch = arch_of(manifest)
        expected = self.expected_arch or (arch_of(self.current.manifest) if self.current else None)
        if expected is not None and arch != expected:
            raise CheckpointError("arch_mismatch", f"{arch} != {expected}")
        parts = self._recent.get(manifest.version, {})
        have = all(i in parts for i in range(manifest.chunks))
        if isinstance(manifest, DeltaManifest):
            running = self._digests.pop(manifest.version, None)
            digest = running[1].hexdigest() if have and running and running[0] == manifest.chunks else None
            blob = self._assemble(parts, manifest.chunks) if have else None
            return await self._load_delta(manifest, blob, digest)
        joined = b"".join(parts[i] for i in range(manifest.chunks)) if have else None
        if joined is not None:
            tensors = verify_and_load(joined, manifest.sha256, manifest.size, arch)
        else:
            tensors = await fetch_checkpoint(self.bootstrap, self.conn, self.index, manifest, self.topic)
        net = PolicyNetwork.from_tensors(tensors)
        net.eval()
        return LoadedPolicy(manifest=manifest, net=net, slots=self.slots)

    def _assemble(self, parts: dict[int, bytes], chunks: int) -> memoryview:
        """A delta's chunks in one buffer, reused from delta to delta (a fresh one costs page faults each time)."""
        total = sum(len(parts[i]) for i in range(chunks))
        if len(self._buffer) < total:
            self._buffer = bytearray(total)
        view = memoryview(self._buffer)
        pos = 0
        for i in range(chunks):
            view[pos : pos + len(parts[i])] = parts[i]
            pos += len(parts[i])
        return view[:total]

    async def _load_delta(
        self, manifest: DeltaManifest, blob: memoryview | None, digest: str | None = None
    ) -> LoadedPolicy:
        """Apply a delta onto the policy held when it is its base; else replay its chain from the full snapshot."""
        current = self.current
        if current is not None and (current.version, link_id(current.manifest)) == (
            manifest.base_version,
            manifest.base_sha256,
        ):
            try:
                delta = await fetch_delta(self.bootstrap, self.conn, self.index, manifest, self.topic, blob, digest)
                return self._apply(current, manifest, delta)
            except CheckpointError as exc:
                log.warning("subscriber: delta v%d failed (%s); replaying its chain", manifest.version, exc)
        self.replays += 1
        tensors = await fetch_state(self.bootstrap, self.conn, self.index, manifest, self.topic)
        net = PolicyNetwork.from_tensors(tensors)
        net.eval()
        return LoadedPolicy(manifest=manifest, net=net, slots=self.slots)

    def _apply(self, current: LoadedPolicy, manifest: DeltaManifest, delta: Any) -> LoadedPolicy:
        """The held policy with ``delta`` applied: on a checked copy when small, else in place."""
        net = current.net
        a = net.arch
        if 4 * a.slots * (a.hidden + 1) <= self.state_check_bytes:
            net = copy.deepcopy(net)
            tensors = net.state_dict()  # shares the copy's storage
            apply_delta(tensors, delta)
            if state_sha256(tensors) != manifest.state_sha256:
                raise CheckpointError("state_mismatch", f"v{manifest.version}")
        else:
            apply_delta(net.state_dict(), delta)  # shares the parameters' storage
        return LoadedPolicy(manifest=manifest, net=net, slots=self.slots)

    def _reject(self, offset: int, why: str) -> None:
        self.rejected_total += 1
        self.rejections.append((offset, why))
        if len(self.rejections) > 2 * KEEP_REJECTIONS:  # a flood of hostile messages must not grow memory
            del self.rejections[:-KEEP_REJECTIONS]
        current = f"v{self.current.version}" if self.current else "none"
        log.warning("subscriber: rejected checkpoint at offset %d (%s); keeping %s", offset, why, current)
