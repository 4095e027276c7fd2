"""Per-memory statistics (models/memory/stats.py): Welford figures, what the learner exports
(top-N each side, bounded labels) and what `causalmem status` shows of them."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from models.memory.stats import MemoryStats
from models.policy.batch import make_batch
from pipeline.metrics import Metrics
from pipeline.promtext import parse
from pipeline.status.live import learner_view, memory_view
from pipeline.status.render import _memories
from tests.unit.models.policy.test_trainer import event, trainer
from topics.internal import Experience


def test_welford_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    xs = rng.normal(0.3, 0.7, size=200)
    st = MemoryStats(slots=4)
    for x in xs:
        st.update([2], {2: float(x)})
    s = st.get(2)
    half = 1.959963984540054 * xs.std(ddof=1) / np.sqrt(len(xs))
    assert (s.reads, s.effects) == (200, 200)
    assert s.mean == pytest.approx(xs.mean(), rel=1e-12)
    assert (s.low, s.high) == pytest.approx((xs.mean() - half, xs.mean() + half), rel=1e-10)


def test_reads_count_without_effects_and_bad_input_is_ignored() -> None:
    st = MemoryStats(slots=4)
    st.update([0, 1, 9])  # 9 is out of range
    st.update([1], {1: float("nan"), 3: 0.5, -1: 2.0})
    assert st.reads.tolist() == [1, 2, 0, 0]
    assert st.get(1).effects == 0 and np.isnan(st.get(1).mean)
    assert st.get(3).effects == 1 and np.isnan(st.get(3).low)  # one effect: no interval yet
    assert st.measured == 1


def test_trainer_feeds_stats_from_every_applied_experience() -> None:
    t = trainer()
    t.update(
        [
            Experience("a", "feedback", event(0, selected=[7, 3]), 0.3, slot_effects={7: 1.0, 3: -0.5}),
            Experience("b", "feedback", event(1, selected=[7]), 0.3),
        ]
    )
    assert (t.memory_stats.get(7).reads, t.memory_stats.get(7).effects) == (2, 1)
    assert make_batch([Experience("b", "feedback", event(1, selected=[7]), 0.3)]).has_effect.sum() == 0


def test_export_is_bounded_and_status_reads_it_back() -> None:
    st = MemoryStats(slots=64)
    for s in range(30):
        for e in (s - 15.0, s - 14.0):  # slot s has mean s − 14.5
            st.update([s], {s: e})
    m = Metrics(role="learner")
    m.export_memory_stats(st, n=10)
    values = parse(generate_latest(m.registry).decode())
    slots = {k for k in values if k.startswith("causalmem_memory_effect{")}
    assert len(slots) == 20 * 3  # 10 harmful + 10 helpful slots, three bounds each
    view = memory_view(values, n=3)
    assert view is not None and view["measured"] == 30
    assert [r["slot"] for r in view["harmful"]] == [0, 1, 2]
    assert [r["slot"] for r in view["helpful"]] == [29, 28, 27]
    assert view["harmful"][0]["mean"] == pytest.approx(-14.5) and view["harmful"][0]["reads"] == 2
    # A second export replaces the first: no stale slot stays behind.
    st2 = MemoryStats(slots=64)
    st2.update([40, 40], {40: -1.0})
    st2.update([40], {40: -2.0})
    m.export_memory_stats(st2, n=10)
    values = parse(generate_latest(m.registry).decode())
    assert {r["slot"] for r in memory_view(values)["harmful"]} == {40}  # type: ignore[index]
    assert memory_view(values)["helpful"] == []  # type: ignore[index]
    assert learner_view("u", values, {}, "")["memories"]["harmful"][0]["slot"] == 40

    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(_memories(memory_view(values)))  # type: ignore[arg-type]
    text = console.export_text()
    assert "harmful" in text and "40" in text and "-1.500" in text


def test_no_memories_section_without_per_memory_credit() -> None:
    assert memory_view({"causalmem_learner_baseline": 0.1}) is None
