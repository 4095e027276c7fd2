"""Memory ids → slots: the allocator, the learner's bank (rows, dead letters, events by id) and the published map."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.memory.slots import SlotAllocator, SlotChange, SlotsFull, UnknownMemory
from models.policy.cold_start import knn_rows
from models.policy.network import NEUTRAL_BIAS
from models.policy.trainer import PolicyTrainer, TrainerConfig
from pipeline.config import Connection, Settings
from pipeline.learner.memories import MemoryBank
from pipeline.modeltopic import ModelTopicIndex
from topics.events import decode_retrieval_event
from topics.fields import Limits, Rejected, encode
from topics.internal import Experience, decode_experience, experience_bytes
from topics.lifecycle import MemoryRecord
from topics.slotmap import SlotRecord, SlotTable, decode_slot_record

BASE_TS = 1_767_225_600.0
S, D, H = 8, 4, 6


# --------------------------------------------------------------------------- the allocator


def test_assign_gives_fresh_slots_in_order_and_an_add_of_a_live_id_keeps_its_slot() -> None:
    a = SlotAllocator(S, grace_s=10)
    assert [a.add(f"m{i}", BASE_TS + i).slot for i in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    assert a.add("m1", BASE_TS + 5) is None
    assert a.slot_of("m1") == 1 and a.slot_of("nope") is None


def test_remove_tombstones_the_slot_and_unknown_ids_are_refused() -> None:
    a = SlotAllocator(S, grace_s=10)
    a.add("m0", BASE_TS)
    change = a.remove("m0", BASE_TS + 1)
    assert change == SlotChange("m0", 0, False, BASE_TS + 1)
    assert a.tombstones == {0: ("m0", BASE_TS + 1)} and a.slot_of("m0") is None
    with pytest.raises(UnknownMemory):
        a.remove("m0", BASE_TS + 2)  # removed already
    with pytest.raises(UnknownMemory):
        a.check_live("never-added")


def test_a_tombstoned_slot_is_reused_only_after_the_grace_period_of_event_time() -> None:
    a = SlotAllocator(2, grace_s=100)
    a.add("a", BASE_TS)
    a.add("b", BASE_TS)
    a.remove("a", BASE_TS + 10)
    with pytest.raises(SlotsFull):
        a.add("c", BASE_TS + 109)  # 99 s after the removal
    assert a.slot_of("c") is None
    reuse = a.add("c", BASE_TS + 110)
    assert reuse == SlotChange("c", 0, True, BASE_TS + 110, reused=True)
    assert a.tombstones == {}


def test_fresh_slots_go_before_tombstones_and_the_oldest_removal_is_reused_first() -> None:
    a = SlotAllocator(4, grace_s=0)
    for i in range(3):
        a.add(f"m{i}", BASE_TS)
    a.remove("m2", BASE_TS + 1)
    a.remove("m0", BASE_TS + 2)
    assert a.add("n0", BASE_TS + 3).slot == 3  # type: ignore[union-attr]  # never used
    assert a.add("n1", BASE_TS + 3).slot == 2  # type: ignore[union-attr]  # removed first
    assert a.add("n2", BASE_TS + 3).slot == 0  # type: ignore[union-attr]


ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 9), st.floats(0, 50, allow_nan=False)),
    max_size=60,
)


def _run(allocator: SlotAllocator, script: list[tuple[str, int, float]]) -> list[Any]:
    out: list[Any] = []
    for op, i, dt in script:
        try:
            out.append(allocator.add(f"m{i}", BASE_TS + dt) if op == "add" else allocator.remove(f"m{i}", BASE_TS + dt))
        except (SlotsFull, UnknownMemory) as exc:
            out.append(type(exc).__name__)
    return out


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(0, 60))
def test_allocation_is_deterministic_and_a_restart_from_the_published_map_continues_identically(
    script: list[tuple[str, int, float]], cut: int
) -> None:
    first, second = SlotAllocator(4, grace_s=5), SlotAllocator(4, grace_s=5)
    assert _run(first, script) == _run(second, script)
    # Restart at ``cut``: the newest change of each slot (the compacted map) restores the state.
    head, tail = script[:cut], script[cut:]
    before = SlotAllocator(4, grace_s=5)
    newest: dict[int, SlotChange] = {}
    for change in _run(before, head):
        if isinstance(change, SlotChange):
            newest[change.slot] = change
    restored = SlotAllocator(4, grace_s=5)
    restored.restore(newest.values())
    assert restored.live == before.live
    assert _run(restored, tail) == _run(before, tail)


# --------------------------------------------------------------------------- the learner's bank


def conn() -> Connection:
    return Settings(embedding_dim=D, slots=S, hidden=H).connection()


def trainer() -> PolicyTrainer:
    return PolicyTrainer(TrainerConfig(embedding_dim=D, slots=S, hidden=H, lr=0.05))


def add(memory_id: str, ts: float = BASE_TS, **kw: Any) -> MemoryRecord:
    return MemoryRecord("add", memory_id, ts, text=f"text of {memory_id}", **kw)


def feed(bank: MemoryBank, t: PolicyTrainer, *records: MemoryRecord) -> list[Rejected | None]:
    return [bank.handle(i, r.key, r.to_bytes(), t) for i, r in enumerate(records, start=bank.position)]


def test_an_add_reinitialises_its_row_and_clears_its_adam_moments() -> None:
    t, bank = trainer(), MemoryBank(conn(), S, grace_s=0)
    out = t.net.out
    with torch.no_grad():
        out.weight.fill_(3.0)
        out.bias.fill_(2.0)
    rows = t.optimizer.rows  # the output layer's lazy Adam: moments as training leaves them
    for moment in (rows.exp_avg, rows.exp_avg_sq):
        moment.fill_(1.0)
    rows.step_count.fill_(1)
    assert feed(bank, t, add("doc-a")) == [None]
    assert float(out.bias.detach()[0]) == pytest.approx(NEUTRAL_BIAS)
    assert float(out.weight.detach()[0].abs().max()) < 0.01
    assert float(rows.exp_avg[0].abs().sum()) == 0.0 and int(rows.step_count[0]) == 0
    assert float(out.bias.detach()[1]) == 2.0 and float(rows.exp_avg[1].sum()) == H  # untouched


def test_a_reused_slot_gets_a_fresh_row_not_the_removed_memorys() -> None:
    t, bank = trainer(), MemoryBank(conn(), 1, grace_s=60)
    feed(bank, t, add("old"))
    with torch.no_grad():
        t.net.out.bias[0] = 5.0  # what learning gave the old memory
    feed(bank, t, MemoryRecord("remove", "old", BASE_TS + 1))
    assert float(t.net.out.bias.detach()[0]) == 5.0  # tombstoned, not yet reused
    assert [r.reason for r in feed(bank, t, add("new", BASE_TS + 30)) if r] == ["slots_full"]
    assert feed(bank, t, add("new", BASE_TS + 61)) == [None]
    assert bank.allocator.slot_of("new") == 0
    assert float(t.net.out.bias.detach()[0]) == pytest.approx(NEUTRAL_BIAS)


def test_a_new_memory_starts_from_its_nearest_live_memories_and_not_from_removed_or_updated_away_ones() -> None:
    """The bank's kNN cold start equals knn_rows over every live embedding (as it did before it kept a matrix)."""
    t, bank = trainer(), MemoryBank(conn(), S, grace_s=0)
    rng = np.random.default_rng(0)
    embs = {f"m{i}": rng.normal(size=D).astype(np.float32) for i in range(7)}
    feed(bank, t, *(add(m, embedding=e) for m, e in embs.items()))
    with torch.no_grad():  # what learning gave the live memories
        t.net.out.weight.copy_(torch.randn(S, H))
        t.net.out.bias.copy_(torch.randn(S))
    moved = rng.normal(size=D).astype(np.float32)
    assert feed(
        bank,
        t,
        MemoryRecord("remove", "m3", BASE_TS + 1),  # gone: no neighbour any more
        MemoryRecord("update", "m5", BASE_TS + 1, text="moved", embedding=moved),
    ) == [None, None]
    embs["m5"] = moved
    del embs["m3"]
    live = {m: bank.allocator.slot_of(m) for m in embs}
    w0, b0 = t.net.out.weight.detach().clone(), t.net.out.bias.detach().clone()
    new = embs["m1"] + 0.1 * rng.normal(size=D).astype(np.float32)
    assert feed(bank, t, add("new", BASE_TS + 2, embedding=new)) == [None]
    slot = bank.allocator.slot_of("new")
    want_w, want_b = knn_rows(w0, b0, np.stack(list(embs.values())), np.array(list(live.values())), new[None], k=5)
    assert torch.allclose(t.net.out.weight.detach()[slot], want_w[0], atol=1e-6)
    assert float(t.net.out.bias.detach()[slot]) == pytest.approx(float(want_b[0]), abs=1e-6)
    assert len(bank.embeddings) == len(embs) + 1


def test_bad_lifecycle_records_are_dead_lettered_with_a_reason_and_change_nothing() -> None:
    t, bank = trainer(), MemoryBank(conn(), S)
    before = {k: v.clone() for k, v in t.tensors().items()}
    rejected = feed(
        bank,
        t,
        MemoryRecord("remove", "ghost", BASE_TS),  # an id that does not exist
        MemoryRecord("update", "ghost", BASE_TS, text="x"),
        add("wide", embedding=np.zeros(D + 1, np.float32)),  # an embedding of the wrong size
        add("narrow", embedding=np.zeros(D - 1, np.float32)),
    )
    assert [r.reason if r else None for r in rejected] == ["unknown_memory"] * 2 + ["embedding_length"] * 2
    raw = orjson.dumps({"schema": "memory_lifecycle/v1", "op": "add", "memory_id": "k", "ts": 1.0, "text": "t"})
    assert bank.handle(10, b"other-key", raw, t).reason == "key_mismatch"  # type: ignore[union-attr]
    assert bank.handle(11, b"\xff\xfe", raw, t).reason == "key_mismatch"  # type: ignore[union-attr]  # not UTF-8
    assert bank.pending == {} and bank.allocator.live == {} and bank.position == 12
    assert all(torch.equal(before[k], v) for k, v in t.tensors().items())


def test_events_by_id_are_translated_to_the_learners_slots_and_unknown_ids_rejected() -> None:
    t, bank = trainer(), MemoryBank(conn(), S)
    feed(bank, t, add("x"), add("y"), add("z"))  # slots 0, 1, 2
    limits = Limits(embedding_dim=D, slots=S)
    ev = decode_retrieval_event(
        encode(
            {
                "schema": "retrieval_event/v1",
                "event_id": "e1",
                "query_id": "q1",
                "step": 0,
                "ts": BASE_TS,
                "features": {"query_embedding": [0.1] * D, "last_step_loss": 0.0, "last_step_entropy": 0.0},
                "candidates": [0, 1],
                "scores": [0.5, 0.4],
                "selected": [1],
                "temperature": 0.5,
                "logprob": -0.3,
                "fallback": False,
                "candidate_ids": ["z", "x"],
            }
        ),
        limits,
    )
    exp = decode_experience(experience_bytes(ev, 0.5, {1: 0.2}), limits)
    back = bank.translate(exp)
    assert back.event.candidates == [2, 0] and back.event.selected == [0]
    assert back.slot_effects == {0: 0.2}  # nll_without_slot keys are the event's slot numbers, mapped too
    bank.apply(MemoryRecord("remove", "z", BASE_TS + 1), t)
    with pytest.raises(Rejected) as err:
        bank.translate(exp)
    assert err.value.reason == "unknown_memory"
    plain = Experience("e2", "feedback", dataclasses.replace(ev, candidate_ids=None), 0.5)
    assert bank.translate(plain) is plain  # slot-numbered events pass unchanged
    assert bank.known([exp, plain]) == [plain]  # a restore's warm-up material: only what maps


def test_the_map_goes_out_as_records_of_the_next_version_and_a_restart_restores_it() -> None:
    t, bank = trainer(), MemoryBank(conn(), S, grace_s=0)
    feed(bank, t, add("a"), add("b"))
    first = bank.records(version=3)
    assert [(r.slot, r.memory_id, r.live, r.version, r.since) for r in first] == [
        (0, "a", True, 3, 3),
        (1, "b", True, 3, 3),
    ]
    bank.pending.clear()
    bank.since = {0: 3, 1: 3}
    feed(bank, t, MemoryRecord("remove", "a", BASE_TS + 5))
    (tomb,) = bank.records(version=4)
    assert (tomb.slot, tomb.memory_id, tomb.live, tomb.version, tomb.since) == (0, "a", False, 4, 3)
    # A restart from checkpoint 3: the record of v4 is ahead of it; its row is re-initialised.
    t2 = trainer()
    with torch.no_grad():
        t2.net.out.bias.fill_(7.0)
    bank2 = MemoryBank(conn(), S, grace_s=0)
    bank2.load([first[1], tomb], version=3, trainer=t2)
    assert bank2.allocator.live == {"b": 1} and 0 in bank2.allocator.tombstones
    assert (
        float(t2.net.out.bias.detach()[0]) == pytest.approx(NEUTRAL_BIAS) and float(t2.net.out.bias.detach()[1]) == 7.0
    )
    assert list(bank2.pending) == [0]  # published again with the next checkpoint
    assert bank2.allocator.add("c", BASE_TS + 6).slot == 2  # type: ignore[union-attr]


def test_after_a_rollback_memories_given_a_slot_later_get_fresh_rows_and_are_published_again() -> None:
    t, bank = trainer(), MemoryBank(conn(), S, grace_s=0)
    feed(bank, t, add("old"))
    bank.since, bank.pending = {0: 2}, {}  # "old" shipped with v2
    feed(bank, t, add("new"))
    bank.since[1], bank.pending = 5, {}  # "new" shipped with v5
    feed(bank, t, add("newest"))  # not yet shipped
    with torch.no_grad():
        t.net.out.bias.fill_(4.0)  # the weights of v3, as a rollback loads them
    assert bank.rows_from(3, t) == [1, 2]
    bias = t.net.out.bias.detach()
    assert float(bias[0]) == 4.0 and float(bias[1]) == pytest.approx(NEUTRAL_BIAS) == float(bias[2])
    assert [(r.slot, r.memory_id, r.live, r.since) for r in bank.records(9)] == [
        (1, "new", True, 9),
        (2, "newest", True, 9),
    ]


def test_the_slots_given_between_two_versions_are_those_whose_owner_arrived_in_between() -> None:
    # What a conservative step between the serving version and a candidate must not blend
    # (pipeline/learner/conservative.py): the earlier owner's row with the new one's.
    t, bank = trainer(), MemoryBank(conn(), S, grace_s=0)
    feed(bank, t, add("a"), add("b"), add("c"))
    bank.since, bank.pending = {0: 2, 1: 5, 2: 7}, {}
    assert bank.given_between(2, 7) == [1, 2]
    assert bank.given_between(5, 6) == [] and bank.given_between(1, 2) == [0]


# --------------------------------------------------------------------------- the map as clients read it


def test_slot_of_follows_the_version_a_client_serves() -> None:
    table = SlotTable()
    table.apply(SlotRecord("p", 0, "a", True, version=3, since=3, ts=BASE_TS))
    table.apply(SlotRecord("p", 1, "b", True, version=5, since=5, ts=BASE_TS))
    assert [table.slot_of("a", 3), table.slot_of("b", 4), table.slot_of("b", 5)] == [0, None, 1]
    table.apply(SlotRecord("p", 0, "a", False, version=8, since=3, ts=BASE_TS + 1))  # removed in v8
    assert [table.slot_of("a", 2), table.slot_of("a", 7), table.slot_of("a", 8)] == [None, 0, None]
    table.apply(SlotRecord("p", 0, "c", True, version=20, since=20, ts=BASE_TS + 99))  # reused
    assert table.slot_of("a", 7) is None and table.slot_of("c", 20) == 0 and table.latest_slot("c") == 0
    assert len(table) == 2


def test_a_reader_of_contract_1_2_ignores_the_slot_map_keys() -> None:
    index = ModelTopicIndex()
    record = SlotRecord("default", 4, "doc", True, 2, 2, BASE_TS)
    assert index.observe(0, record.key.encode(), record.to_bytes()) == ("unknown", None)
    assert index.rejected == [] and index.manifests == {} and index.chunk_offsets == {}


def test_slot_records_are_checked() -> None:
    good = SlotRecord("default", 4, "doc", False, 9, 2, BASE_TS)
    assert decode_slot_record(good.to_bytes(), key=good.key) == good
    with pytest.raises(Rejected) as err:
        decode_slot_record(good.to_bytes(), key="default/slot/5")
    assert err.value.reason == "key_mismatch"
    bad = dict(good.to_dict(), since=10)
    with pytest.raises(Rejected):
        decode_slot_record(encode(bad))


# --------------------------------------------------------------------------- events naming memories by id

EVENT = {
    "schema": "retrieval_event/v1", "event_id": "e1", "query_id": "q1", "step": 0, "ts": BASE_TS,
    "features": {"query_embedding": [0.1] * D, "last_step_loss": 0.0, "last_step_entropy": 0.0},
    "candidates": [0, 3], "scores": [0.5, 0.4], "selected": [3], "temperature": 0.5, "logprob": -0.3,
    "fallback": False,
}  # fmt: skip


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.none(), st.lists(st.one_of(st.text(max_size=4), st.integers(-9, 9), st.none()), max_size=3)))
def test_candidate_ids_are_optional_and_checked(ids: Any) -> None:
    limits = Limits(embedding_dim=D, slots=S)
    obj = dict(EVENT) if ids is None else {**EVENT, "candidate_ids": ids}
    plain = decode_retrieval_event(encode(EVENT), limits)
    valid = ids is None or (len(ids) == 2 and all(isinstance(i, str) and i for i in ids) and len(set(ids)) == 2)
    if valid:
        ev = decode_retrieval_event(encode(obj), limits)
        assert ev.candidate_ids == ids
        assert encode(dataclasses.replace(ev, candidate_ids=None).to_dict()) == encode(plain.to_dict())
        assert decode_retrieval_event(encode(ev.to_dict()), limits).candidate_ids == ids  # round trip
    else:
        with pytest.raises(Rejected):
            decode_retrieval_event(encode(obj), limits)


class FakeConsumer:
    def __init__(self) -> None:
        self.hw: int | None = None
        self._paused: set[Any] = set()

    def highwater(self, tp: Any) -> int | None:
        return self.hw

    def paused(self) -> set[Any]:
        return set(self._paused)

    def pause(self, *tps: Any) -> None:
        self._paused |= set(tps)

    def resume(self, *tps: Any) -> None:
        self._paused -= set(tps)


def test_experiences_wait_until_the_lifecycle_is_read_so_an_event_never_names_a_memory_not_yet_added() -> None:
    t, bank, consumer = trainer(), MemoryBank(conn(), S), FakeConsumer()
    assert bank.hold_experiences(consumer, "exp") and consumer.paused() == {"exp"}  # high watermark not known yet
    consumer.hw = 2
    assert bank.hold_experiences(consumer, "exp")  # two lifecycle records to read first
    feed(bank, t, add("a"), add("b"))
    assert not bank.hold_experiences(consumer, "exp") and consumer.paused() == set()
    bank._unknown_since, consumer.hw = -1e9, None  # the lifecycle's watermark never came: do not wait forever
    assert not bank.hold_experiences(consumer, "exp")
