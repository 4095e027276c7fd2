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
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson

from pipeline import kafka
from pipeline.config import UiConfig
from pipeline.promtext import labelled, scrape
from pipeline.service import Service
from pipeline.status.collect import StatusCollector
from pipeline.ui.health import Trends
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


class LabelBook:
    """Labels and the samples they answer, for the agreement and review pages (bounded)."""

    def __init__(self, max_labels: int = 200_000, max_samples: int = 50_000) -> None:
        self.labels: deque[HumanLabel] = deque(maxlen=max_labels)
        self.samples: OrderedDict[str, ActiveLearningSample] = OrderedDict()
        self.max_samples = max_samples

    def add_sample(self, sample: ActiveLearningSample) -> None:
        self.samples[sample.sample_id] = sample
        while len(self.samples) > self.max_samples:
            self.samples.popitem(last=False)


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
        self.book = LabelBook()
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
            self.book.labels.append(decode_human_label(msg.value, self.limits, msg.key))
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
        """The gate's latest estimates and decision counts, from the first learner endpoint that answers."""
        for url in self.config.learner_urls:
            values = await asyncio.to_thread(scrape, url)
            if values:
                return {
                    "estimates": labelled(values, "causalmem_gate_estimate", "policy"),
                    "decisions": labelled(values, "causalmem_gate_decisions_total", "decision"),
                }
        return None
