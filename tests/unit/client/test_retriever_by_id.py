"""CausalRetriever with memories named by id: the faiss index follows the lifecycle, masks follow the served version."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from pipeline.client.follower import MemoryFollower
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import Settings
from topics.events import decode_retrieval_event
from topics.fields import Limits, encode
from topics.lifecycle import MemoryRecord
from topics.manifest import Manifest
from topics.slotmap import SlotRecord, SlotTable

D, S = 4, 8
BASE_TS = 1_767_225_600.0


def unit(*xs: float) -> np.ndarray:
    v = np.array(xs, np.float32)
    return v / np.linalg.norm(v)


def policy(version: int, table: SlotTable, suppressed: list[int] | None = None) -> LoadedPolicy:
    torch.manual_seed(0)
    net = PolicyNetwork(D, S, hidden=6)
    if suppressed:
        net.suppress(suppressed)
    manifest = Manifest("default", version, 0.0, "periodic", net.arch.to_dict(), 0.5, 0.0, "0" * 64, 1, 1)
    return LoadedPolicy(manifest, net.eval(), slots=table)


def retriever(**kw: object) -> CausalRetriever:
    r = CausalRetriever.by_id(D, k=2, seed=0, temperature=0.05, **kw)
    r.add_memory("a", unit(1, 0, 0, 0), "alpha memory")
    r.add_memory("b", unit(1, 0.2, 0, 0), "beta memory")
    r.add_memory("c", unit(0, 1, 0, 0), "gamma memory")
    return r


def test_memories_by_id_are_searchable_at_once_and_events_name_them() -> None:
    r = retriever()
    r.set_policy(policy(1, SlotTable()))  # none of the memories has a row yet: neutral masks
    out = r.retrieve(unit(1, 0.1, 0, 0), query_id="q1", ts=BASE_TS)
    assert set(out.ids or []) == {"a", "b"} and out.texts is not None and "alpha memory" in out.texts
    ev = out.event
    assert ev.candidate_ids is not None and set(ev.candidate_ids) == {"a", "b", "c"}
    assert [ev.candidate_ids[ev.candidates.index(s)] for s in ev.selected] == out.ids
    back = decode_retrieval_event(encode(ev.to_dict()), Limits(embedding_dim=D, slots=S), key=b"q1")
    assert back.candidate_ids == ev.candidate_ids
    r.add_memory("d", unit(1, 0.05, 0, 0), "delta memory")  # added while serving: found by the next request
    assert "d" in (r.retrieve(unit(1, 0.05, 0, 0), query_id="q2").event.candidate_ids or [])


def test_a_memory_whose_row_the_served_version_lacks_serves_with_a_neutral_mask() -> None:
    table = SlotTable()
    table.apply(SlotRecord("default", 5, "a", True, version=3, since=3, ts=BASE_TS))
    table.apply(SlotRecord("default", 1, "b", True, version=4, since=4, ts=BASE_TS))  # not in v3
    r = retriever()
    r.set_policy(policy(3, table, suppressed=[5]))  # "a"'s row in v3: pinned near 0
    ev = r.retrieve(unit(1, 0.1, 0, 0), query_id="q1", ts=BASE_TS).event
    assert ev.candidate_ids is not None and ev.dropped is not None
    assert "a" not in ev.candidate_ids and 5 in ev.dropped  # its policy row dropped it, under its own slot
    masks = dict(zip(ev.candidate_ids, ev.candidate_masks, strict=True))  # type: ignore[arg-type]
    assert masks["b"] == 1.0 and masks["c"] == 1.0  # no row in v3: neutral
    r.set_policy(policy(4, table, suppressed=[5]))
    ev4 = r.retrieve(unit(1, 0.1, 0, 0), query_id="q2", ts=BASE_TS).event
    assert dict(zip(ev4.candidate_ids or [], ev4.candidates, strict=True))["b"] == 1  # v4 holds its row
    assert dict(zip(ev4.candidate_ids or [], ev4.candidate_masks, strict=True))["b"] != 1.0  # type: ignore[arg-type]


def test_removed_memories_are_never_returned_and_the_fallback_finds_by_text() -> None:
    r = retriever(drop=0.5)  # a fixed threshold: a suppressed memory is dropped whatever the others' masks
    assert r.remove_memory("a") and not r.remove_memory("a")
    for i in range(5):
        out = r.retrieve(unit(1, 0, 0, 0), query_id=f"q{i}")
        assert "a" not in (out.ids or []) and "a" not in (out.event.candidate_ids or [])
    table = SlotTable()
    for slot, mid in enumerate("bc"):
        table.apply(SlotRecord("default", slot, mid, True, 1, 1, BASE_TS))
    r.set_policy(policy(1, table, suppressed=[0, 1]))  # every candidate dropped: the text fallback serves
    out = r.retrieve(unit(1, 0, 0, 0), query_id="qf", query_text="gamma")
    assert out.event.fallback and out.ids == ["c"] and out.event.candidate_ids == []


def test_the_follower_applies_adds_updates_and_removes_and_embeds_texts_without_embeddings() -> None:
    r = CausalRetriever.by_id(D, k=1, seed=0)
    follower = MemoryFollower("127.0.0.1:1", r, Settings(embedding_dim=D, slots=S), embed=lambda t: unit(0, 0, 1, 0))
    recs = [
        MemoryRecord("add", "x", BASE_TS, text="x text", embedding=unit(1, 0, 0, 0)),
        MemoryRecord("add", "y", BASE_TS, text="embedded by the client"),
        MemoryRecord("update", "x", BASE_TS + 1, text="x, revised", embedding=unit(0, 1, 0, 0)),
        MemoryRecord("remove", "y", BASE_TS + 2),
    ]
    for i, rec in enumerate(recs[:2]):
        follower.handle(i, rec.key, rec.to_bytes())
    assert r.retrieve(unit(0, 0, 1, 0), query_id="q").ids == ["y"]
    follower.handle(2, recs[2].key, recs[2].to_bytes())
    assert r.retrieve(unit(0, 1, 0, 0), query_id="q").texts == ["x, revised"]
    follower.handle(3, recs[3].key, recs[3].to_bytes())
    assert r.memories is not None and "y" not in r.memories and len(r.memories) == 1
    wide = MemoryRecord("add", "z", BASE_TS, text="z", embedding=np.zeros(D + 2, np.float32))
    follower.handle(4, wide.key, wide.to_bytes())
    assert [why.split(":")[0] for _, why in follower.rejections] == ["embedding_length"]
    assert follower.position == 5 and "z" not in r.memories


def test_slot_numbered_retrievers_are_unchanged_and_refuse_ids() -> None:
    r = CausalRetriever(np.eye(D, dtype=np.float32), texts=["m0", "m1", "m2", "m3"], k=1, seed=0)
    out = r.retrieve(unit(1, 0, 0, 0), query_id="q")
    assert out.slots == [0] and out.ids is None and out.event.candidate_ids is None
    with pytest.raises(TypeError):
        r.add_memory("x", unit(1, 0, 0, 0))
    with pytest.raises(TypeError):
        MemoryFollower("127.0.0.1:1", r)


async def test_the_subscriber_keeps_the_map_of_its_policy_and_rejects_bad_records() -> None:
    from pipeline.client.subscriber import PolicySubscriber

    sub = PolicySubscriber("127.0.0.1:1", "default", Settings(embedding_dim=D, slots=S))
    mine = SlotRecord("default", 3, "doc", True, 2, 2, BASE_TS)
    other = SlotRecord("other", 4, "doc", True, 2, 2, BASE_TS)
    await sub.handle(0, mine.key.encode(), mine.to_bytes())
    await sub.handle(1, other.key.encode(), other.to_bytes())
    await sub.handle(2, b"default/slot/5", mine.to_bytes())  # a key that is not the record's
    assert sub.slots.slot_of("doc", 2) == 3 and len(sub.slots) == 1
    assert [off for off, _ in sub.rejections] == [2] and sub.current is None


def test_a_coupled_canary_compares_slates_by_memory_id() -> None:
    """Contract 1.5 with memories by id: the two versions label memories apart (v4 holds a row
    v3 lacks), so a tie is the same memories by id, and no ``canary_other`` is logged."""
    table = SlotTable()
    table.apply(SlotRecord("default", 5, "a", True, version=3, since=3, ts=BASE_TS))
    table.apply(SlotRecord("default", 1, "b", True, version=4, since=4, ts=BASE_TS))
    coupled = ServingParams(
        explore_rate=0.0, canary_rate=1.0, canary_coupled=True, drop="dynamic"
    ).to_wire()  # no revival
    serving, canary = policy(3, table), policy(4, table, suppressed=[5])  # v4 drops "a"
    serving.manifest.serving = canary.manifest.serving = coupled
    r = retriever()
    r.set_policy(serving)
    r.set_canary(canary)
    events = [r.retrieve(unit(1, 0.1, 0, 0), query_id=f"q{i}", ts=BASE_TS).event for i in range(200)]
    assert {e.canary_arm for e in events} <= {"tie", "canary", "serving"} and all(e.canary_version == 4 for e in events)
    assert all(e.canary_other is None for e in events)
    by_id = [[e.candidate_ids[e.candidates.index(s)] for s in e.selected] for e in events if e.candidate_ids]
    differ = [e for e in events if e.canary_arm != "tie"]
    assert differ, "v4 drops a memory v3 serves: their slates differ"
    assert all("a" not in ids for ids, e in zip(by_id, events, strict=True) if e.canary)  # the canary's own slate
    ties = [ids for ids, e in zip(by_id, events, strict=True) if e.canary_arm == "tie"]
    assert all("a" not in ids for ids in ties)  # a tie is a slate both would serve
