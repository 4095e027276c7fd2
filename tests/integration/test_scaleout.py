"""Scale-out: two ``causalmem worker`` processes on one broker split the join partitions,
and when one stops (SIGTERM) or dies (SIGKILL) the other takes its partitions over
without losing a join.

Delivery is at-least-once (docs/architecture.md, delivery guarantees): after a takeover a join may be emitted twice, and
consumers downstream dedupe on the retrieval event's id, so the checks compare *sets* of
ids in the ``experiences`` topic.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from causalmem_lab.procs import Child, wait_until

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.promtext import metric
from pipeline.worker.partitions import key_partition
from tests.conftest import settings_env
from tests.helpers import feedback, retrieval_event
from topics.internal import decode_experience

pytestmark = [pytest.mark.broker, pytest.mark.slow]

PARTITIONS = 4
PER_PARTITION = 6  # query ids per partition in each batch


def _query_ids(tag: str) -> list[str]:
    """Query ids spread evenly over every join partition."""
    out: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    i = 0
    while any(len(v) < PER_PARTITION for v in out.values()):
        qid = f"{tag}-{i}"
        p = key_partition(qid, PARTITIONS)
        if len(out[p]) < PER_PARTITION:
            out[p].append(qid)
        i += 1
    return [q for p in range(PARTITIONS) for q in out[p]]


def _owned(child: Child) -> int:
    return int(metric(child.metrics(), "causalmem_partitions_owned", stage="join"))


async def _publish(s, qids: list[str], events: bool = True, feedbacks: bool = True) -> dict[str, str]:
    """Publish retrieval events and/or feedback; returns {query_id: retrieval event_id}."""
    ids: dict[str, str] = {}
    async with EventPublisher(s.bootstrap, s) as pub:
        for qid in qids:
            ev = retrieval_event(s, qid, step=0, event_id=f"ev-{qid}")
            ids[qid] = ev.event_id
            if events:
                await pub.publish(ev)
            if feedbacks:
                await pub.publish(feedback(qid, 0))
        await pub.flush()
    return ids


def _joined_ids(s) -> set[str]:
    msgs = asyncio.run(kafka.read_all(s.bootstrap, s, s.topics().experiences.name, idle_s=0.5))
    return {decode_experience(m.value, s.limits()).id for m in msgs}


def _start_workers(s, tmp_path: Path) -> list[Child]:
    env = settings_env(s)
    return [
        Child("worker", s.bootstrap, env, ["--log-level", "info"], log_path=tmp_path / f"worker{i}.log")
        for i in range(2)
    ]


def _logs(children: list[Child]) -> str:
    return "\n".join(f"--- {c.verb} {i} (rc={c.proc.poll()}):\n{c.log_tail(3000)}" for i, c in enumerate(children))


def _takeover(topics_ready, tmp_path: Path, sig: int, takeover_s: float) -> None:
    s = topics_ready
    assert s.partitions == PARTITIONS
    workers = _start_workers(s, tmp_path)
    try:
        # Both own join partitions, and together all of them.
        try:
            wait_until(
                lambda: all(_owned(w) > 0 for w in workers) and sum(_owned(w) for w in workers) == PARTITIONS,
                60,
                what="the two workers to split the join partitions",
            )
        except TimeoutError:
            pytest.fail("partitions were not split:\n" + _logs(workers))
        split = [_owned(w) for w in workers]
        assert sum(split) == PARTITIONS and min(split) > 0, split

        # Batch 1: complete pairs on every partition, joined by whichever worker owns them.
        first = asyncio.run(_publish(s, _query_ids("a")))
        # Batch 2, first half: retrieval events only; their feedback comes after the stop, so
        # the join state pending on the stopped worker must be rebuilt by the survivor.
        half_open = _query_ids("b")
        second = asyncio.run(_publish(s, half_open, feedbacks=False))
        wait_until(
            lambda: (
                sum(metric(w.metrics(), "causalmem_joins_total") for w in workers) >= len(first)
                and sum(metric(w.metrics(), "causalmem_join_pending") for w in workers) >= len(half_open)
            ),
            30,
            what="batch 1 joined and batch 2's events pending",
        )
        # Let the pending events' offsets be committed (the join commits every second).
        time.sleep(1.5)

        victim, survivor = workers
        t_stop = time.monotonic()
        if sig == signal.SIGKILL:
            victim.kill()
        else:
            victim.stop(timeout=20, sig=sig)
        stopped_in = time.monotonic() - t_stop  # until the process is gone
        # The rest of batch 2: the pending events' feedback, and fresh pairs.
        asyncio.run(_publish(s, half_open, events=False))
        fresh = asyncio.run(_publish(s, _query_ids("c")))

        try:
            wait_until(lambda: _owned(survivor) == PARTITIONS, takeover_s, what="the survivor to own every partition")
        except TimeoutError:
            pytest.fail("no takeover:\n" + _logs(workers))
        took = time.monotonic() - t_stop
        assert survivor.alive()

        expected = set(first.values()) | set(second.values()) | set(fresh.values())
        deadline = time.monotonic() + 30
        joined: set[str] = set()
        while time.monotonic() < deadline:
            joined = _joined_ids(s)
            if expected <= joined:
                break
            time.sleep(0.5)
        missing = expected - joined
        assert not missing, f"{len(missing)} joins lost after takeover in {took:.1f} s:\n{_logs(workers)}"
        assert joined <= expected  # nothing else was joined
        emitted = len(asyncio.run(kafka.read_all(s.bootstrap, s, s.topics().experiences.name, idle_s=0.5)))
        print(
            f"split {split}; {signal.Signals(sig).name}: victim gone in {stopped_in:.1f} s, survivor owned all "
            f"partitions after {took:.1f} s; {len(expected)} joins, {emitted - len(expected)} re-emitted"
        )
        assert _owned(survivor) == PARTITIONS
    finally:
        for w in workers:
            w.stop(timeout=15)


def test_two_workers_split_partitions_and_survive_sigterm(topics_ready, tmp_path: Path) -> None:
    _takeover(topics_ready, tmp_path, signal.SIGTERM, takeover_s=30)


def test_two_workers_survive_sigkill(topics_ready, tmp_path: Path) -> None:
    # A killed worker leaves no group: its partitions move after ~1.5 × the 6 s session.
    _takeover(topics_ready, tmp_path, signal.SIGKILL, takeover_s=40)
