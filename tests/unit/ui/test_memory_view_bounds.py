"""The memory pages' view stays within its byte budget, whatever the events name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from pipeline.config import Settings
from pipeline.ui.feeds import Feeds
from pipeline.ui.memories import MemoryView, recent_size
from topics.events import Features, RetrievalEvent
from topics.fields import encode
from topics.internal import Experience


def event(q: str, selected: list[int], text: str = "", slot_text: str = "") -> RetrievalEvent:
    return RetrievalEvent(
        event_id=f"{q}-0", query_id=q, step=0, ts=1_767_225_600.0,
        features=Features(np.zeros(8, dtype=np.float32), 0.0, 0.0),
        candidates=selected, scores=np.zeros(len(selected)), selected=selected, temperature=1.0, logprob=-1.0,
        fallback=False, dropped=[], query_text=text or None,
        memory_texts={s: slot_text for s in selected} if slot_text else None,
    )  # fmt: skip


def test_many_large_events_naming_many_slots_stay_within_the_byte_budget() -> None:
    """Before: every slot seen was kept with its recent queries, without a bound
    (2,000 events of 8.5 KB made 2,050,000 entries and +3.7 GB)."""
    budget = 2 * 1024 * 1024
    view = MemoryView(recent_per_memory=20, slots=1024, max_bytes=budget)
    for i in range(200):
        ev = event(f"q{i}", list(range(0, 1024, 3)), text="x" * 8000, slot_text="m" * 100)
        view.observe_event(ev)
        view.observe_experience(Experience(id=ev.event_id, kind="feedback", event=ev, utility=0.5))
    assert view.bytes <= budget and view.evicted > 0
    kept = sum(m.size for m in view.memories.values())
    assert view.bytes == kept  # the charge is the sum of what each memory keeps
    assert all(m.size >= len(m.text or "") + sum(recent_size(r) for r in m.recent) for m in view.memories.values())
    assert all(len(m.recent) <= 20 for m in view.memories.values())
    last = view.detail(1023)  # the most recently seen memory is kept
    assert last is not None and last["recent"][0]["query_id"] == "q199"


def test_a_forgotten_memory_starts_over_when_seen_again() -> None:
    view = MemoryView(recent_per_memory=5, slots=16, max_bytes=3000)
    view.observe_event(event("a", [1], text="y" * 1500))
    view.observe_event(event("b", [2], text="y" * 1500))  # over budget: slot 1, least recently seen, goes
    assert 1 not in view.memories and view.evicted == 1 and view.bytes <= 3000
    view.observe_event(event("c", [1]))
    assert view.detail(1)["reads"] == 1  # type: ignore[index]


async def test_the_topic_reader_uses_the_deployments_slot_count_and_passes_over_what_it_cannot_read(
    tmp_path: Path,
) -> None:
    """Before: events were read with 2^31 slots, so any slot number became one more memory kept;
    and an empty embedding raised ValueError out of the refresh, losing the rest of the batch."""
    feeds = Feeds("127.0.0.1:1", Settings(state_dir=str(tmp_path), embedding_dim=8, slots=64).ui())
    empty = event("q3", [7]).to_dict()
    empty["features"]["query_embedding"] = []
    values = [encode(event("q1", [5]).to_dict()), encode(event("q2", [5_000_000]).to_dict()), encode(empty)]
    values.append(encode(event("q4", [6]).to_dict()))
    follower = feeds.followers["events"]

    async def poll(bootstrap: str, conn: Any) -> list[Any]:
        return [SimpleNamespace(value=v, key=None) for v in values]

    async def existing() -> set[str]:
        return {follower.topic}

    async def nothing() -> Any:
        return {}

    follower.poll = poll  # type: ignore[method-assign]
    feeds._existing, feeds._gate_estimates = existing, nothing  # type: ignore[method-assign]
    feeds.status.snapshot = nothing  # type: ignore[method-assign]
    await feeds.refresh()
    assert set(feeds.memories.memories) == {5, 6} and follower.unreadable == 2
