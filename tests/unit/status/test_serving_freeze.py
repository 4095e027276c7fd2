"""Why serving has not moved (pipeline/learner/freeze.py, pipeline/status/freeze.py): a learner
whose candidates all wait shows it in its metrics, in ``causalmem status`` and in the manifests
status reads, instead of looking busy."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from rich.console import Console

from models.policy.trainer import PolicyTrainer
from pipeline.config import Settings
from pipeline.learner.freeze import ServingClock
from pipeline.learner.publishing import Publishing
from pipeline.learner.store import LocalStore
from pipeline.metrics import Metrics
from pipeline.modeltopic import ModelTopicIndex
from pipeline.promtext import parse
from pipeline.status.collect import checkpoint_view
from pipeline.status.freeze import FROZEN_AFTER_S, freeze_view, short_age
from pipeline.status.live import learner_view
from pipeline.status.render import freeze_text, render
from topics.manifest import Manifest


class RecordingProducer:
    def __init__(self) -> None:
        self.log: list[tuple[int, bytes | None, bytes | None]] = []

    async def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int = 0) -> Any:
        self.log.append((len(self.log), key, value))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def index_of(producer: RecordingProducer) -> ModelTopicIndex:
    index = ModelTopicIndex()
    for offset, key, value in producer.log:
        index.observe(offset, key, value)
    return index


def manifest(version: int, ts: float = 0.0) -> Manifest:
    return Manifest("default", version, ts, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1)


def test_the_serving_clock_restarts_when_serving_moves_and_counts_the_candidates_since() -> None:
    now = [1000.0]
    clock = ServingClock(clock=lambda: now[0])
    assert clock.seconds() == 0.0  # nothing serves yet
    clock.serving(manifest(1, ts=400.0))  # first seen (a restart): since its creation
    assert clock.since == 400.0 and clock.seconds() == 600.0
    for v in (2, 3, 4):
        clock.candidate(v)
    clock.serving(manifest(1, ts=400.0))  # the same version again: nothing changes
    assert clock.waiting == 3 and clock.since == 400.0
    now[0] = 1300.0
    clock.serving(manifest(3, ts=900.0))  # promoted now, whenever it was created
    assert (clock.serving_version, clock.since, clock.waiting, clock.seconds()) == (3, 1300.0, 0, 0.0)
    clock.candidate(2)  # older than serving (a late judgement): not waiting
    assert clock.waiting == 0


async def test_a_learner_whose_candidates_all_wait_says_so_in_metrics_and_status(tmp_path: Path) -> None:
    """The reproduction: every candidate waits (the gate never has the data), and the learner
    publishes as if all were well. Status read only the checkpoints' ages and versions."""
    config = Settings(embedding_dim=4, slots=8, hidden=8, device="cpu").learner()  # no decision comes
    trainer = PolicyTrainer(config.trainer)
    producer = RecordingProducer()
    metrics = Metrics(role="learner")
    pub = Publishing(producer, config, LocalStore(tmp_path), trainer.net.arch, metrics)
    assert pub.gate is not None
    for reason in ("init", *["periodic"] * 20):
        published = await pub.publish(trainer, reason=reason, metrics={}, input_offsets={}, changed_rows=rows(trainer))
        await pub.settle(published)
    # The first candidate came as a probe too (contract 1.19), v2: clients serve their own ranking still,
    # so the clock counts from v1. The others took the place of a trial that saw no decision: no probe.
    assert pub.gate.serving_manifest is not None and pub.gate.serving_manifest.version == 2
    assert pub.gate.serving_manifest.reason == "probe"
    since = pub.clock.since
    assert since is not None
    pub.clock.clock = lambda: since + 720.0
    value = metrics.registry.get_sample_value
    assert value("causalmem_learner_seconds_since_promotion") == 720.0
    assert value("causalmem_learner_candidates_waiting") == 20.0
    live = learner_view("u", parse(generate_latest(metrics.registry).decode()), {}, "")  # status --learner URL
    assert live["seconds_since_promotion"] == 720.0 and live["candidates_waiting"] == 20
    # The newest manifest records the gate's last word for status.
    index = index_of(producer)
    newest = index.newest("default")
    assert newest is not None and newest.version == 22
    record = newest.metrics["gate"]
    assert record["serving_version"] == 1 and record["candidates_waiting"] == 19  # v22 itself not yet published
    assert record["decision"] == "insufficient" and record["candidate_version"] == 21
    view = checkpoint_view(index, "default", since + 720.0)["freeze"]
    assert view["line"] == "serving v2 for 12m while 20 candidates waited: v21 waits: v21: no decisions yet"
    assert not view["frozen"]
    assert checkpoint_view(index, "default", since + FROZEN_AFTER_S)["freeze"]["frozen"]
    text = render_text({"checkpoints": checkpoint_view(index, "default", since + 720.0)})
    assert "serving v2 for 12m while 20 candidates waited: v21 waits: v21: no decisions yet" in text


def rows(trainer: PolicyTrainer) -> Any:
    return trainer.take_changed_rows()


def render_text(checkpoints: dict[str, Any]) -> str:
    snapshot = {"bootstrap": "b", "prefix": "", "policy": "default", "ts": 0.0, **checkpoints}
    console = Console(width=200, record=True)
    console.print(render(snapshot))
    return console.export_text()


def test_the_freeze_view_without_a_learner_record_and_with_one_of_another_version() -> None:
    index = ModelTopicIndex()
    assert freeze_view(index, "default", 0.0)["line"] is None  # nothing serves yet
    index.serving["default"] = index.manifests[("default", 1)] = manifest(1, ts=100.0)
    assert freeze_view(index, "default", 5000.0)["line"] is None  # nothing waits: no line
    # A learner from before metrics.gate: the serving manifest's creation time stands in, no reason.
    index.candidate["default"] = index.manifests[("default", 2)] = manifest(2, ts=150.0)
    view = freeze_view(index, "default", 160.0)
    assert view["line"] == "serving v1 for 1m while 1 candidate waited" and view["reason"] is None
    # A record whose serving version is not the one on the topic.
    record = {"serving_version": 7, "serving_since": 150.0, "decision": "refused", "candidate_version": 2}
    record.update(reason="gain over serving -0.0500, upper bound -0.0300 < −ε")
    index.candidate["default"] = index.manifests[("default", 3)] = Manifest(
        "default", 3, 170.0, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1, metrics={"gate": record}
    )
    view = freeze_view(index, "default", 100.0 + FROZEN_AFTER_S)
    assert view["candidates_waiting"] == 2 and view["frozen"]
    assert view["line"].endswith("2 candidates waited: v2 refused: gain over serving -0.0500, upper bound -0.0300 < −ε")
    assert view["line"].startswith("serving v1 for 30m")  # since v1's creation: the record is of another version
    texts = [t.plain for t in freeze_text(view)]
    assert texts == [f"FROZEN: {view['line']}"]
    assert short_age(59.0) == "59s" and short_age(3600.0) == "1h 00m"
