"""What the web app reads from the topics, followed in the background and kept bounded in memory.

Every ``refresh_s`` the app reads what is new on each topic (from the beginning at start,
then from where it stopped, like ``causalmem status``) and feeds the views:

- ``retrieval-events`` and ``experiences`` → :class:`~pipeline.ui.memories.MemoryView`
  and :class:`~pipeline.ui.health.Trends`;
- ``human-labels`` and ``active-learning`` → :class:`LabelBook` (agreement and review);
- the model topic → the candidate and serving versions, full snapshots or deltas (the gate's history);
- :class:`~pipeline.status.collect.StatusCollector` → checkpoints, queue depth, dead
  letters and, with ``--worker``/``--learner``, the live health score and gate estimates.

The app reads with the model sizes it is configured with, and takes an embedding of
another length as it comes: it only shows data, it never trains on it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import numpy as np
import orjson

from pipeline import kafka
from pipeline.config import UiConfig
from pipeline.promtext import labelled, scrape
from pipeline.service import Service
from pipeline.status.collect import StatusCollector
from pipeline.ui.health import Trends, principals_of
from pipeline.ui.memories import MemoryView
from topics.delta import decode_delta_manifest
from topics.events import decode_retrieval_event
from topics.fields import Limits, Rejected
from topics.internal import decode_experience
from topics.labels import ActiveLearningSample, HumanLabel, decode_active_learning_sample, decode_human_label
from topics.manifest import decode_manifest, parse_key

log = logging.getLogger(__name__)


def embedding_length(raw: bytes) -> int | None:
    """The length of the embedding a value carries (a JSON list, or base64 float32), if it has one.

    >>> embedding_length(b'{"features": {"query_embedding": [0.0, 1.0]}}')
    2
    >>> embedding_length(b'{"embedding_f32": "AAAAAA=="}')
    1
    """
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("embedding_f32"), str):
        try:
            return len(base64.b64decode(obj["embedding_f32"], validate=True)) // 4
        except (ValueError, binascii.Error):
            return None
    event = obj.get("event")
    for holder in (obj, event if isinstance(event, dict) else {}):
        feats = holder.get("features")
        if isinstance(feats, dict) and isinstance(feats.get("query_embedding"), list):
            return len(feats["query_embedding"])
    return None


def decode_any_size(decode: Callable[[bytes, Limits], Any], raw: bytes, limits: Limits) -> Any:
    """``decode(raw, limits)``, retried once with the value's own embedding length when only that differs."""
    try:
        return decode(raw, limits)
    except Rejected as rej:
        n = embedding_length(raw) if rej.reason == "embedding_length" else None
        if not n:  # no embedding to take the length of, or an empty one
            raise
        return decode(raw, replace(limits, embedding_dim=n))


def footprint(obj: Any, _seen: set[int] | None = None) -> int:
    """Bytes ``obj`` holds, estimated: ``sys.getsizeof`` of it and of everything it refers to
    (containers, dataclass fields, numpy arrays' data), each object counted once.

    A decoded label costs several times its message: a 5 KiB ``memory_choice`` naming 1 024
    slots holds about 32 KiB (a list of ints is 8 bytes a pointer and 28 an int).

    >>> footprint("") < footprint("x" * 1000) and footprint([1000, 2000]) > footprint([])
    True
    """
    size = sys.getsizeof(obj)
    if type(obj) in _SCALARS:
        return size
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return size if obj.base is None else size + obj.nbytes
    if isinstance(obj, dict):
        return size + _items_size(obj.keys(), seen) + _items_size(obj.values(), seen)
    if isinstance(obj, list | tuple | set | frozenset | deque):
        return size + _items_size(obj, seen)
    if hasattr(obj, "__dict__"):
        size += footprint(vars(obj), seen)
    for name in getattr(type(obj), "__slots__", ()):
        size += footprint(getattr(obj, name, None), seen)
    return size


_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})


def _items_size(items: Any, seen: set[int]) -> int:
    """The footprints of a container's items; a run of scalars (a list of slots) summed in C."""
    if set(map(type, items)) <= _SCALARS:
        return sum(map(sys.getsizeof, items))
    return sum(footprint(v, seen) for v in items)


SHED_LOG_EVERY_S = 60.0  # the label store says it is shedding at most this often


class LabelBook:
    """Labels and the samples they answer, for the agreement and review pages, bounded in bytes.

    Each label and sample is charged its :func:`footprint` when it is read; past ``max_bytes``
    (``label_book_bytes``) the oldest entries read, labels or samples, are forgotten first,
    counted in :attr:`shed` (exported as ``causalmem_ui_label_book_shed_total``) and logged.
    The counts ``max_labels`` and ``max_samples`` still apply.
    """

    def __init__(
        self,
        max_labels: int = 200_000,
        max_samples: int = 50_000,
        max_bytes: int = UiConfig.label_book_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_labels = max_labels
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self.clock = clock
        self.bytes = 0  # estimated bytes of what is kept (footprints summed)
        self.shed = {"label": 0, "sample": 0}  # entries forgotten, by kind
        self._seq = 0  # the order entries were read in, across both kinds
        self._labels: deque[tuple[int, int, HumanLabel]] = deque()  # (seq, bytes, label), oldest first
        self._samples: dict[str, ActiveLearningSample] = {}  # oldest read first
        self._sample_sizes: OrderedDict[str, tuple[int, int]] = OrderedDict()  # id → (seq, bytes), same order
        self._logged_at: float | None = None

    @property
    def labels(self) -> tuple[HumanLabel, ...]:
        """The labels kept, oldest first."""
        return tuple(label for _, _, label in self._labels)

    @property
    def samples(self) -> Mapping[str, ActiveLearningSample]:
        """The samples kept by id, oldest first (read-only)."""
        return MappingProxyType(self._samples)

    def add_label(self, label: HumanLabel) -> None:
        size = footprint(label)
        self._labels.append((self._next(), size, label))
        self.bytes += size
        self._shrink()

    def add_sample(self, sample: ActiveLearningSample) -> None:
        sid = sample.sample_id
        if sid in self._samples:  # read again: charged once, now the newest
            del self._samples[sid]
            self.bytes -= self._sample_sizes.pop(sid)[1]
        size = footprint(sample)
        self._samples[sid] = sample
        self._sample_sizes[sid] = (self._next(), size)
        self.bytes += size
        self._shrink()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _shrink(self) -> None:
        """Forget the oldest entries until within every bound."""
        shed = 0
        while len(self._labels) > self.max_labels:
            shed += self._drop("label")
        while len(self._samples) > self.max_samples:
            shed += self._drop("sample")
        while self.bytes > self.max_bytes and (self._labels or self._samples):
            label_seq = self._labels[0][0] if self._labels else None
            sample_seq = next(iter(self._sample_sizes.values()))[0] if self._sample_sizes else None
            older = "label" if sample_seq is None or (label_seq is not None and label_seq < sample_seq) else "sample"
            shed += self._drop(older)
        now = self.clock()
        if shed and (self._logged_at is None or now - self._logged_at >= SHED_LOG_EVERY_S):
            self._logged_at = now
            log.warning(
                "ui: the label store is full (label_book_bytes=%d): forgetting the oldest; "
                "%d labels and %d samples forgotten so far, %d labels and %d samples kept",
                self.max_bytes,
                self.shed["label"],
                self.shed["sample"],
                len(self._labels),
                len(self._samples),
            )

    def _drop(self, kind: str) -> int:
        if kind == "label":
            _, size, _ = self._labels.popleft()
        else:
            sid, (_, size) = self._sample_sizes.popitem(last=False)
            del self._samples[sid]
        self.bytes -= size
        self.shed[kind] += 1
        return 1


class TopicFollower:
    """One topic read incrementally: all of it the first time, then what is new."""

    def __init__(self, topic: str, partitions: list[int] | None = None) -> None:
        self.topic = topic
        self.partitions = partitions
        self.next: dict[int, int] = {}
        self.unreadable = 0

    async def poll(self, bootstrap: str, conn: Any) -> list[Any]:
        msgs = await kafka.read_all(
            bootstrap, conn, self.topic, partitions=self.partitions, start=dict(self.next) or None, idle_s=0.3
        )
        fresh = [m for m in msgs if m.offset >= self.next.get(m.partition, 0)]
        for m in fresh:
            self.next[m.partition] = m.offset + 1
        return fresh


class Feeds(Service):
    """The app's background reader (``start``/``stop``); ``refresh()`` reads once (tests call it)."""

    def __init__(self, bootstrap: str, config: UiConfig) -> None:
        super().__init__()
        self.bootstrap = bootstrap
        self.config = config
        self.conn = config.connection
        # The deployment's slot count: a slot number beyond it is a rejected event, not one more memory to keep.
        self.limits = self.conn.limits
        t = self.conn.topics
        self.memories = MemoryView(
            config.max_events, config.recent_per_memory, self.limits.slots, max_bytes=config.memory_view_bytes
        )
        self.trends = Trends()
        self.book = LabelBook(max_bytes=config.label_book_bytes)
        self.manifests: dict[int, dict[str, Any]] = {}
        self.snapshot: dict[str, Any] | None = None
        # Shadow mode's estimate re-reads and re-judges a window of steps: not at every refresh.
        self._shadow_last: tuple[float, dict[str, Any] | None] | None = None
        self.followers = {
            "events": TopicFollower(t.retrieval_events.name),
            "experiences": TopicFollower(t.experiences.name, [0]),
            "labels": TopicFollower(t.human_labels.name),
            "samples": TopicFollower(t.active_learning.name),
            "model": TopicFollower(t.policy_checkpoints.name, [0]),
        }
        self.status = StatusCollector(bootstrap, self.conn, list(config.worker_urls), list(config.learner_urls))
        self.refreshed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a broker hiccup: the pages show the last view
                log.warning("ui: refresh failed: %r", exc)
            await asyncio.sleep(self.config.refresh_s)

    async def _existing(self) -> set[str]:
        admin = kafka.admin(self.bootstrap, self.conn)
        await admin.start()
        try:
            return set(await admin.list_topics())
        finally:
            await admin.close()

    async def refresh(self) -> None:
        """Read what is new on every topic (only topics that exist: reading must not create them)."""
        existing = await self._existing()
        for name, follower in self.followers.items():
            if follower.topic not in existing:
                continue
            for msg in await follower.poll(self.bootstrap, self.conn):
                try:
                    self._apply(name, msg)
                except Exception:  # whatever a parse raised: counted and passed over, never the rest of a batch
                    follower.unreadable += 1
        snapshot = await self.status.snapshot()
        snapshot["gate_estimates"] = await self._gate_estimates()
        if self.config.shadow_window > 0:
            now = time.monotonic()
            if self._shadow_last is None or now - self._shadow_last[0] >= self.config.shadow_every_s:
                self._shadow_last = (now, await self._shadow())
            snapshot["shadow"] = self._shadow_last[1]
        self.snapshot = snapshot
        self.refreshed.set()

    async def _shadow(self) -> dict[str, Any] | None:
        """Shadow mode's mode and gain estimate, as `causalmem status --shadow` shows them."""
        from pipeline.policy_evaluation.shadow import format_report, shadow_report

        try:
            report = await shadow_report(self.bootstrap, self.conn, self.config.shadow_window)
        except Exception as exc:  # the rest of the page stands without it
            log.warning("ui: shadow estimate failed: %r", exc)
            return None
        return {**report, "line": format_report(report)}

    def _apply(self, name: str, msg: Any) -> None:
        if name == "events":
            ev = decode_any_size(decode_retrieval_event, msg.value, self.limits)
            self.memories.observe_event(ev)
            self.trends.observe_event(ev)
        elif name == "experiences":
            exp = decode_any_size(decode_experience, msg.value, self.limits)
            self.memories.observe_experience(exp)
            self.trends.observe_experience(exp)
        elif name == "labels":
            self.book.add_label(decode_human_label(msg.value, self.limits, msg.key))
        elif name == "samples":
            self.book.add_sample(decode_active_learning_sample(msg.value, self.limits, msg.key, any_shape=True))
        elif name == "model" and msg.key is not None and msg.value is not None:
            kind, policy, _, _ = parse_key(msg.key.decode("utf-8", "replace"))
            if kind not in ("serving", "candidate", "delta", "delta_candidate") or policy != self.conn.policy:
                return
            # Delta checkpoints (contract 1.3) are versions like full snapshots: candidates and promotions alike.
            m = decode_manifest(msg.value) if kind in ("serving", "candidate") else decode_delta_manifest(msg.value)
            row = self.manifests.setdefault(
                m.version,
                {
                    "version": m.version,
                    "reason": m.reason,
                    "created_ts": m.created_ts,
                    "candidate": False,
                    "served": False,
                },
            )
            row["candidate" if kind in ("candidate", "delta_candidate") else "served"] = True

    async def _gate_estimates(self) -> dict[str, Any] | None:
        """The gate's latest estimates and decision counts, and the principals (their shares, weights
        and flags), from the first learner endpoint that answers."""
        for url in self.config.learner_urls:
            values = await asyncio.to_thread(scrape, url)
            if values:
                return {
                    "estimates": labelled(values, "causalmem_gate_estimate", "policy"),
                    "decisions": labelled(values, "causalmem_gate_decisions_total", "decision"),
                    "principals": principals_of(values),
                }
        return None
