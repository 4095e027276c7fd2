"""``causalmem label`` and the labeling queue, through a real broker (docs/operations.md).

The queue is one consumer group on ``active-learning``: two labelers never get the same
sample, and a sample's offset is committed only after its label is acknowledged, so a
crash between receiving and publishing loses nothing. A crash *after* publishing and
before committing gives the sample again (at least once): the second answer is a new
HumanLabel with a new ``event_id``, so the worker (which dedupes on ``event_id``) turns
both into label experiences and the learner applies each; ``--stats`` counts only the
latest answer per (sample, labeler).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.config import Settings
from pipeline.labeling.agreement import agreement, cohens_kappa
from pipeline.labeling.answers import load_answers, parse_line, parse_rating
from pipeline.labeling.queue import LABELER_GROUP, LabelQueue, SampleMoved
from tests.conftest import settings_env
from tests.helpers import until
from tests.paths import REPO_ROOT
from topics.events import Features
from topics.fields import encode
from topics.labels import ActiveLearningSample, HumanLabel, decode_human_label

REPO = REPO_ROOT
CLI = [sys.executable, "-m", "pipeline.cli"]


# --------------------------------------------------------------------------- helpers


def al_sample(s: Settings, sample_id: str, query_id: str, step: int = 0, candidates: list[int] | None = None):
    cands = candidates if candidates is not None else [0, 1, 2, 3, 4]
    probs = np.linspace(0.4, 0.1, num=min(3, len(cands)))
    return ActiveLearningSample(
        sample_id=sample_id,
        query_id=query_id,
        step=step,
        ts=1_800_000_000.0 + step,
        reason="error",
        utility=-0.8,
        policy_version=3,
        features=Features(np.zeros(s.embedding_dim, dtype=np.float32), 0.5, 1.2),
        candidates=cands,
        selected=cands[:2],
        top_slots=[{"slot": c, "prob": float(p)} for c, p in zip(cands, probs, strict=False)],
        query_text=f"what did the user ask in {query_id}?",
        memory_texts={c: f"memory text of slot {c}" for c in cands},
    )


async def produce(s: Settings, topic: str, items: list[tuple[str, dict[str, Any]]]) -> list[tuple[int, int]]:
    """Send ``(key, value)`` pairs keyed by query id; returns ``(partition, offset)`` of each."""
    p = kafka.producer(s.bootstrap or "", s)
    await p.start()
    try:
        out = []
        for key, value in items:
            md = await p.send_and_wait(topic, encode(value), key=key.encode())
            out.append((md.partition, md.offset))
        return out
    finally:
        await p.stop()


async def queue_samples(s: Settings, samples: list[ActiveLearningSample]) -> dict[str, tuple[int, int]]:
    placed = await produce(s, s.topics().active_learning.name, [(x.query_id, x.to_dict()) for x in samples])
    return {x.sample_id: where for x, where in zip(samples, placed, strict=True)}


async def labels_on_topic(s: Settings) -> list[HumanLabel]:
    msgs = await kafka.read_all(s.bootstrap or "", s, s.topics().human_labels.name)
    return [decode_human_label(m.value, s.limits(), m.key) for m in msgs]


async def uncommitted(s: Settings, placed: dict[str, tuple[int, int]]) -> set[str]:
    """Sample ids at or after the labelers' group's committed offset (still queued).

    The consumer carries the group id only to read committed offsets: it never joins.
    """
    topic = s.topics().active_learning.name
    c = kafka.consumer(s.bootstrap or "", s, group_id=f"{s.topic_prefix}{LABELER_GROUP}")
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(s.partitions)]
        c.assign(tps)
        committed = {tp.partition: (await c.committed(tp)) or 0 for tp in tps}
    finally:
        await c.stop()
    return {sid for sid, (part, off) in placed.items() if off >= committed[part]}


async def run_cli(s: Settings, args: list[str], stdin: bytes = b"", timeout: float = 60.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "label",
        "--bootstrap",
        s.bootstrap or "",
        *args,
        cwd=REPO,
        env=cli_env(s),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(stdin), timeout)
    return proc.returncode or 0, out.decode()


def stable_split(s: Settings, a: LabelQueue, b: LabelQueue) -> bool:
    """Each labeler holds a disjoint, non-empty share of the partitions."""
    pa, pb = a._consumer.assignment(), b._consumer.assignment()
    return bool(pa) and bool(pb) and not (pa & pb) and len(pa | pb) == s.partitions


def cli_env(s: Settings) -> dict[str, str]:
    return {**os.environ, **settings_env(s), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


# --------------------------------------------------------------------------- pure parts


def test_cohens_kappa_against_hand_computed_values() -> None:
    # Two raters, 50 items: yes/yes 20, yes/no 5, no/yes 10, no/no 15.
    # p_o = 35/50 = 0.7; p_e = 0.5·0.6 + 0.5·0.4 = 0.5; κ = (0.7 − 0.5) / (1 − 0.5) = 0.4.
    a = [1] * 20 + [1] * 5 + [0] * 10 + [0] * 15
    b = [1] * 20 + [0] * 5 + [1] * 10 + [0] * 15
    assert cohens_kappa(a, b) == pytest.approx(0.4)
    assert cohens_kappa(["x", "y", "x"], ["x", "y", "x"]) == 1.0
    # Agreement exactly at chance: p_o = p_e = 0.5.
    assert cohens_kappa([1, 1, 0, 0], [1, 0, 1, 0]) == pytest.approx(0.0)
    # Linear weights on 0–5 ratings: a = [4, 2], b = [3, 2]: D_o = (1 + 0)/2 = 0.5;
    # D_e = ¼(|4−3| + |4−2| + |2−3| + |2−2|) = 1; κ_w = 1 − 0.5/1 = 0.5.
    # Unweighted: p_o = 0.5, p_e = P(both 2) = 0.25, κ = 0.25/0.75 = 1/3.
    assert cohens_kappa([4, 2], [3, 2], weights="linear") == pytest.approx(0.5)
    assert cohens_kappa([4, 2], [3, 2]) == pytest.approx(1 / 3)
    # Quadratic: D_o = 0.5, D_e = ¼(1 + 4 + 1) = 1.5: κ = 1 − 1/3.
    assert cohens_kappa([4, 2], [3, 2], weights="quadratic") == pytest.approx(2 / 3)
    assert np.isnan(cohens_kappa([], []))
    assert np.isnan(cohens_kappa([2, 2, 2], [2, 2, 2]))  # no disagreement expected by chance: undefined
    with pytest.raises(ValueError):
        cohens_kappa([1], [1, 0])
    with pytest.raises(ValueError):
        cohens_kappa([1], [1], weights="cubic")


def _label(who: str, sid: str, correct: list[int] | None, rating: int | None = None, skip: str | None = None):
    return HumanLabel(
        event_id=f"{who}-{sid}-{correct}-{rating}",
        query_id=f"q-{sid}",
        ts=1.0,
        labeler=who,
        kind="memory_choice",
        sample_id=sid,
        correct_memories=[] if skip is not None else correct,
        rating=rating,
        skip_reason=skip,
    )


# s1 offers 1–5, s2 6–10, s3 11–15; s4 is no longer on active-learning (candidates unknown).
OFFERED = {"s1": set(range(1, 6)), "s2": set(range(6, 11)), "s3": set(range(11, 16))}
LABELS = [
    _label("alice", "s1", [1, 2], 4),
    _label("bob", "s1", [1], 3),
    _label("carol", "s1", [1, 2], 4),
    _label("alice", "s2", [6], 5),  # superseded: alice answered s2 again (crash before the commit)
    _label("alice", "s2", [7], 2),
    _label("bob", "s2", [7, 8], 2),
    _label("carol", "s2", None, skip="not sure"),
    _label("alice", "s3", [11]),
    _label("bob", "s3", None, skip="off topic"),
    _label("alice", "s4", [20]),
    _label("bob", "s4", [20]),
    HumanLabel("r1", "q-s1", 1.0, "dave", "rating", rating=5),  # not a memory_choice: not counted
]


def check_known_agreement(result: dict[str, Any]) -> None:
    """The hand-computed agreement of LABELS/OFFERED.

    alice/bob overlap on s1, s2, s4 (s3: bob skipped). Slot decisions over s1, s2 (s4 unknown):
    s1 slots 1–5: alice {1,2}, bob {1}; s2 slots 6–10: alice {7}, bob {7,8} →
    yes/yes 2, yes/no 1, no/yes 1, no/no 6: p_o = 0.8, p_e = 0.3·0.3 + 0.7·0.7 = 0.58,
    κ = 0.22/0.42 = 11/21. Ratings (4,3), (2,2): linear κ = 0.5 (see the test above).
    bob/carol on s1: bob {1}, carol {1,2}: p_o = 0.8, p_e = 0.2·0.4 + 0.8·0.6 = 0.56,
    κ = 0.24/0.44 = 6/11; ratings (3,4) on one sample: D_o = D_e = 1, κ = 0.
    alice/carol on s1: identical sets, κ = 1; ratings (4,4) only: undefined.
    """
    pairs = {tuple(p["labelers"]): p for p in result["pairs"]}
    ab = pairs[("alice", "bob")]
    assert (ab["overlap"], ab["slot_decisions"], ab["unknown_samples"], ab["rated_by_both"]) == (3, 10, 1, 2)
    assert ab["kappa_memories"] == pytest.approx(11 / 21, abs=1e-6)
    assert ab["kappa_rating"] == pytest.approx(0.5)
    assert ab["same_set"] == pytest.approx(1 / 3)
    bc = pairs[("bob", "carol")]
    assert (bc["overlap"], bc["slot_decisions"]) == (1, 5)
    assert bc["kappa_memories"] == pytest.approx(6 / 11, abs=1e-6)
    assert bc["kappa_rating"] == pytest.approx(0.0)
    ac = pairs[("alice", "carol")]
    assert ac["kappa_memories"] == 1.0 and ac["kappa_rating"] is None and ac["same_set"] == 1.0
    assert result["labelers"]["alice"] == {"answered": 4, "skipped": 0, "rated": 2, "skip_reasons": {}}
    assert result["labelers"]["bob"] == {"answered": 3, "skipped": 1, "rated": 2, "skip_reasons": {"off topic": 1}}
    assert result["labelers"]["carol"]["skip_reasons"] == {"not sure": 1}
    assert "dave" not in result["labelers"]
    assert (result["samples"], result["samples_with_several_labelers"]) == (4, 4)


def test_agreement_definitions() -> None:
    check_known_agreement(agreement(LABELS, OFFERED))
    assert agreement([_label("alice", "s1", [1])], OFFERED)["pairs"] == []


def test_parse_answers(tmp_path: Path) -> None:
    offered = [3, 5, 17]
    assert parse_line("3 17", offered).slots == (3, 17)
    assert parse_line("17 3 17 r5", offered).slots == (17, 3)
    cmd = parse_line("none r0", offered)
    assert (cmd.action, cmd.slots, cmd.rating) == ("answer", (), 0)
    assert parse_line("r2", offered).action == "rating"
    assert parse_line("s", offered).action == "skip"
    assert parse_line("S off topic ", offered).reason == "off topic"
    assert parse_line("Q", offered).action == "quit"
    for bad in ("", "4", "3 r6", "three", "none 3", "3 -1"):
        with pytest.raises(ValueError):
            parse_line(bad, offered)
    assert parse_rating("R3") == 3
    with pytest.raises(ValueError):
        parse_rating("6")

    f = tmp_path / "a.jsonl"
    f.write_text('{"sample_id": "a", "correct_memories": [1, 2], "rating": 3}\n{"sample_id": "b", "skip": ""}\n')
    answers = load_answers(f)
    assert answers["a"].correct == [1, 2] and answers["a"].rating == 3 and answers["b"].skip == "skipped"
    for bad in (
        '{"sample_id": "a"}',
        '{"sample_id": "a", "correct_memories": [1], "skip": "x"}',
        '{"sample_id": "a", "correct_memories": [1], "rating": 6}',
        '{"sample_id": "a", "correct_memories": [1, 1]}',
        '{"sample_id": "a", "correct_memories": [1]}\n{"sample_id": "a", "skip": "x"}',
        "[1]",
        "{no json",
    ):
        f.write_text(bad + "\n")
        with pytest.raises(ValueError, match=r"a\.jsonl:\d"):
            load_answers(f)


# --------------------------------------------------------------------------- through the broker


@pytest.mark.broker
async def test_two_labelers_never_get_the_same_sample(topics_ready: Settings) -> None:
    s = topics_ready
    alice, bob = LabelQueue(s.bootstrap or "", s, "alice"), LabelQueue(s.bootstrap or "", s, "bob")
    await asyncio.gather(alice.start(), bob.start())
    try:
        await until(lambda: stable_split(s, alice, bob), 30, "a stable two-labeler assignment")
        samples = [al_sample(s, f"two-{i}", f"q{i}", candidates=[i, i + 1, i + 2]) for i in range(16)]
        placed = await queue_samples(s, samples)
        assert len({p for p, _ in placed.values()}) > 1  # spread over partitions by query id
        got: dict[str, list[str]] = {"alice": [], "bob": []}

        async def work(q: LabelQueue) -> None:
            quiet_until = None
            while True:
                total = len(got["alice"]) + len(got["bob"])
                if total >= len(samples):
                    quiet_until = quiet_until or time.monotonic() + 1.0  # then watch for repeats
                if quiet_until and time.monotonic() > quiet_until:
                    return
                item = await q.next(timeout=0.3)
                if item is not None:
                    got[q.labeler].append(item.sample.sample_id)
                    await q.answer(item, [item.sample.candidates[0]], rating=len(got[q.labeler]) % 6)

        await asyncio.wait_for(asyncio.gather(work(alice), work(bob)), 40)
        assert got["alice"] and got["bob"], got
        assert not set(got["alice"]) & set(got["bob"])
        assert sorted(got["alice"] + got["bob"]) == sorted(placed)  # each exactly once
        assert await alice.waiting() == 0 and await bob.waiting() == 0
    finally:
        await asyncio.gather(alice.stop(), bob.stop())
    labels = await labels_on_topic(s)
    assert sorted(x.sample_id or "" for x in labels) == sorted(placed)  # one label per sample
    owner = {sid: who for who, ids in got.items() for sid in ids}
    assert all(x.labeler == owner[x.sample_id or ""] and x.kind == "memory_choice" for x in labels)
    assert await uncommitted(s, placed) == set()


@pytest.mark.broker
async def test_crashes_before_and_after_publishing_lose_nothing(topics_ready: Settings) -> None:
    """(1) alice crashes between receiving and publishing: no label, no commit, and bob
    receives the same sample. (2) bob crashes after the broker acknowledged his label and
    before the commit: the label is on human-labels and carol receives the sample again
    (at least once): two labels for one sample, with different event ids, so the worker's
    dedupe on event_id keeps both and the learner applies each (see the module docstring)."""
    s = topics_ready
    placed = await queue_samples(s, [al_sample(s, "crash-1", "qc1")])
    alice = LabelQueue(s.bootstrap or "", s, "alice")
    await alice.start()
    try:
        item = await alice.next(timeout=15)
        assert item is not None and item.sample.sample_id == "crash-1"
    finally:
        await alice.stop()  # gone before publishing: no label, no commit
    assert await labels_on_topic(s) == []
    assert await uncommitted(s, placed) == {"crash-1"}

    bob = LabelQueue(s.bootstrap or "", s, "bob")
    await bob.start()
    try:
        again = await bob.next(timeout=15)
        assert again is not None and again.sample.sample_id == "crash-1"

        async def crash(*_: Any) -> None:
            raise RuntimeError("crash after the broker's ack, before the commit")

        bob._commit = crash  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="crash"):
            await bob.answer(again, [1], rating=2)
    finally:
        await bob.stop()
    [first] = await labels_on_topic(s)  # acknowledged, so it is there
    assert (first.sample_id, first.labeler, first.correct_memories, first.rating) == ("crash-1", "bob", [1], 2)
    assert await uncommitted(s, placed) == {"crash-1"}

    carol = LabelQueue(s.bootstrap or "", s, "carol")
    await carol.start()
    try:
        third = await carol.next(timeout=15)
        assert third is not None and third.sample.sample_id == "crash-1"  # at least once
        await carol.answer(third, [1, 2])
        assert await carol.next(timeout=1) is None
    finally:
        await carol.stop()
    labels = await labels_on_topic(s)
    assert [(x.sample_id, x.labeler) for x in labels] == [("crash-1", "bob"), ("crash-1", "carol")]
    assert len({x.event_id for x in labels}) == 2
    assert await uncommitted(s, placed) == set()


@pytest.mark.broker
async def test_killed_labeler_process_loses_nothing(topics_ready: Settings) -> None:
    """A real crash: the interactive tool is SIGKILLed while it shows a sample."""
    s = topics_ready
    placed = await queue_samples(s, [al_sample(s, "kill-1", "qk1")])
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "label",
        "--bootstrap",
        s.bootstrap or "",
        "--labeler",
        "alice",
        cwd=REPO,
        env=cli_env(s),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    shown = b""
    try:
        deadline = time.monotonic() + 30
        while b"label> " not in shown and time.monotonic() < deadline:
            chunk = await asyncio.wait_for(proc.stdout.read(4096), max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
            if not chunk:
                break
            shown += chunk
        assert b"label> " in shown and b"kill-1" in shown, shown.decode(errors="replace")
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert await labels_on_topic(s) == []
    bob = LabelQueue(s.bootstrap or "", s, "bob")
    await bob.start()  # waits for the dead member's session to expire
    try:
        again = await bob.next(timeout=20)
        assert again is not None and again.sample.sample_id == "kill-1"
        await bob.answer(again, [0])
    finally:
        await bob.stop()
    assert [x.labeler for x in await labels_on_topic(s)] == ["bob"]
    assert await uncommitted(s, placed) == set()


@pytest.mark.broker
async def test_sample_shown_during_a_rebalance_is_answered_once(topics_ready: Settings) -> None:
    """A labeler joins while another looks at a sample: the sample's partition is revoked
    (and maybe moved), so the old answer is refused before publishing and the partition's
    owner gets the sample again."""
    s = topics_ready
    placed = await queue_samples(s, [al_sample(s, "moved-1", "qm1")])
    alice, bob = LabelQueue(s.bootstrap or "", s, "alice"), LabelQueue(s.bootstrap or "", s, "bob")
    await alice.start()
    try:
        item = await alice.next(timeout=15)
        assert item is not None
        await bob.start()  # the group rebalances under alice's feet
        await until(lambda: stable_split(s, alice, bob), 20, "a stable two-labeler assignment")
        with pytest.raises(SampleMoved) as moved:
            await alice.answer(item, [1])
        assert not moved.value.published
        assert await labels_on_topic(s) == []
        owner = alice if item.tp in alice._consumer.assignment() else bob
        again = await owner.next(timeout=15)
        assert again is not None and again.sample.sample_id == "moved-1"
        await owner.answer(again, [1])
    finally:
        await asyncio.gather(alice.stop(), bob.stop())
    assert [(x.sample_id, x.labeler) for x in await labels_on_topic(s)] == [("moved-1", owner.labeler)]
    assert await uncommitted(s, placed) == set()


@pytest.mark.broker
async def test_file_mode_answers_exactly_the_listed_samples(topics_ready: Settings, tmp_path: Path) -> None:
    s = topics_ready
    listed = [al_sample(s, f"file-{i}", f"qf{i}", candidates=[i, i + 10, i + 20]) for i in range(4)]
    # Not in the file: x-0 on the partition of query "qz", and y-1 behind it (same query id,
    # hence same partition) which *is* in the file but must wait: committing y-1 would
    # commit x-0 as well.
    held = [al_sample(s, "x-0", "qz", 0), al_sample(s, "y-1", "qz", 1)]
    unlisted = [al_sample(s, f"other-{i}", f"qo{i}") for i in range(2)]
    placed = await queue_samples(s, listed + held + unlisted)
    answers = tmp_path / "answers.jsonl"
    lines = [
        {"sample_id": "file-0", "correct_memories": [0, 10], "rating": 4},
        {"sample_id": "file-1", "correct_memories": [11]},
        {"sample_id": "file-2", "skip": "ambiguous query"},
        {"sample_id": "file-3", "correct_memories": [], "rating": 0},
        {"sample_id": "y-1", "correct_memories": [1]},
        {"sample_id": "never-queued", "correct_memories": [1]},
    ]
    answers.write_text("\n".join(orjson.dumps(x).decode() for x in lines) + "\n")
    rc, out = await run_cli(s, ["--labeler", "bob", "--answers", str(answers), "--timeout", "3"])
    assert rc == 0, out
    assert "labelled 3, skipped 1 (labeler bob)" in out, out
    assert "2 answer(s) unused" in out and "y-1" in out and "never-queued" in out, out
    labels = {x.sample_id: x for x in await labels_on_topic(s)}
    assert sorted(labels) == ["file-0", "file-1", "file-2", "file-3"]
    assert all(x.labeler == "bob" and x.kind == "memory_choice" for x in labels.values())
    assert (labels["file-0"].correct_memories, labels["file-0"].rating) == ([0, 10], 4)
    assert (labels["file-1"].correct_memories, labels["file-1"].rating) == ([11], None)
    assert (labels["file-2"].correct_memories, labels["file-2"].skip_reason) == ([], "ambiguous query")
    assert (labels["file-3"].correct_memories, labels["file-3"].rating) == ([], 0)
    # Nothing else was committed: the rest is still queued for other labelers.
    assert await uncommitted(s, placed) == {"x-0", "y-1", "other-0", "other-1"}

    rc, out = await run_cli(s, ["--labeler", "  ", "--answers", str(answers)])
    assert rc == 2 and "labeler identity is required" in out


@pytest.mark.broker
async def test_interactive_mode_driven_through_stdin(topics_ready: Settings) -> None:
    s = topics_ready
    placed = await queue_samples(s, [al_sample(s, f"tty-{i}", f"qi{i}", candidates=[0, 1, 2, 7]) for i in range(3)])
    # First sample: a slot that is no candidate (re-prompted), then 0 and 1 with rating 4;
    # second: skipped with a reason; third: quit (it stays queued).
    rc, out = await run_cli(
        s, ["--labeler", "carol", "--timeout", "20"], stdin=b"9\n0 1\nr4\ns not sure\nq\n", timeout=60
    )
    assert rc == 0, out
    assert "slot 9 is not among this sample's candidates" in out
    assert "memory text of slot 7" in out and "what did the user ask" in out and "waiting: " in out
    labels = await labels_on_topic(s)
    assert all(x.labeler == "carol" and x.kind == "memory_choice" for x in labels)
    answered = [x for x in labels if x.skip_reason is None]
    skipped = [x for x in labels if x.skip_reason is not None]
    assert [(x.correct_memories, x.rating) for x in answered] == [([0, 1], 4)]
    assert [(x.correct_memories, x.skip_reason) for x in skipped] == [([], "not sure")]
    left = await uncommitted(s, placed)
    assert len(left) == 1 and left.isdisjoint({x.sample_id for x in labels})


@pytest.mark.broker
async def test_stats_reports_kappa_for_known_overlap(topics_ready: Settings) -> None:
    s = topics_ready
    cands = {sid: sorted(slots) for sid, slots in OFFERED.items()}
    samples = [al_sample(s, sid, f"q-{sid}", candidates=c) for sid, c in cands.items()]
    await queue_samples(s, samples)
    await produce(s, s.topics().human_labels.name, [(x.query_id, x.to_dict()) for x in LABELS])
    rc, out = await run_cli(s, ["--stats", "--json"])
    assert rc == 0, out
    check_known_agreement(orjson.loads(out[out.index("{") :]))
    rc, out = await run_cli(s, ["--stats"])
    assert rc == 0, out
    row = next(line for line in out.splitlines() if "alice / bob" in line)
    assert "0.524" in row and "0.500" in row and "33%" in row, out
    assert "off topic" in out and "not sure" in out
