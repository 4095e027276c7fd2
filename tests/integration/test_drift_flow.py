"""Drift through the real worker: the correlation, one reset for one drop, a restart keeps the window."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from causalmem_lab.procs import Child

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from pipeline.promtext import metric
from tests.conftest import settings_env
from tests.helpers import feedback, label, retrieval_event, until
from topics.internal import decode_control

pytestmark = [pytest.mark.broker, pytest.mark.slow]

DAY = 86400.0


async def _queries(s: Settings, pairs: list[tuple[float, float, int]], tag: str) -> None:
    """One query per (t, utility, rating): a joined step and a rating label."""
    async with EventPublisher(s.bootstrap, s) as pub:
        for i, (t, u, r) in enumerate(pairs):
            qid = f"{tag}{i}"
            await pub.publish(retrieval_event(s, qid, ts=t))
            await pub.publish(feedback(qid, ts=t + 1, utility=u))
            await pub.publish(label(qid, "rating", ts=t + 2, rating=r))


def _pairs(n: int, t0: float, sign: float, seed: int) -> list[tuple[float, float, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = int(rng.integers(0, 6))
        out.append((t0 + i * 600.0, float(sign * (r - 2.5) / 2.5 + 0.3 * rng.normal()), r))
    return out


async def test_worker_drift_stage_correlation_reset_and_restart(settings: Settings, tmp_path: Path) -> None:
    s = settings.replace(topic_prefix=f"d{uuid.uuid4().hex[:6]}.", join_window_s=10 * DAY)
    env = {
        **settings_env(s),
        "CAUSALMEM_DRIFT_MIN_PAIRS": "40",
        "CAUSALMEM_DRIFT_COOLDOWN_S": str(30 * DAY),
        "CAUSALMEM_LABEL_WINDOW_S": str(30 * DAY),
    }
    await kafka.create_topics(s.bootstrap, s)
    worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker-1.log")
    try:
        await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 60, "worker")
        good = _pairs(60, 1_767_225_600.0, +1.0, seed=1)
        await _queries(s, good, "g")
        await until(lambda: metric(worker.metrics(), "causalmem_utility_rating_pairs") == 60, 60, "60 pairs")
        corr = metric(worker.metrics(), "causalmem_utility_rating_correlation")
        u, r = np.array([p[1] for p in good]), np.array([p[2] for p in good])
        assert corr == pytest.approx(np.corrcoef(u, r)[0, 1], abs=1e-9)
    finally:
        worker.stop()
    # A new worker rebuilds the 7-day window from the stored pairs, not from scratch.
    worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker-2.log")
    try:
        await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 60, "worker")
        # The relation flips: exactly one reset, however many bad pairs follow (cool-down).
        bad = _pairs(80, good[-1][0] + 600.0, -1.0, seed=2)
        await _queries(s, bad, "b")
        await until(lambda: metric(worker.metrics(), "causalmem_utility_rating_pairs") == 140, 60, "140 pairs")
        everything = good + bad
        u, r = np.array([p[1] for p in everything]), np.array([p[2] for p in everything])
        corr = metric(worker.metrics(), "causalmem_utility_rating_correlation")
        assert corr == pytest.approx(np.corrcoef(u, r)[0, 1], abs=1e-9)
    finally:
        worker.stop()
    controls = [
        decode_control(m.value, s.limits())
        for m in await kafka.read_all(s.bootstrap, s, s.topics().control.name, partitions=[0])
    ]
    resets = [c for c in controls if c.command == "reset"]
    assert len(resets) == 1, resets
    assert resets[0].details["detector"] == "correlation"
    assert resets[0].ts > good[-1][0]  # not before the drop
