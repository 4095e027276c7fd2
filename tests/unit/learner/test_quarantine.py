"""Contract 1.15: an operator's ``quarantine`` / ``unquarantine`` of a principal, carried out by the
learner's :class:`ControlHandler` (no Kafka): the set changes, a checkpoint answers the command with
its audit entry, a repeated change forces nothing, and a malformed command is dead-lettered."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from models.policy.trainer import PolicyTrainer
from pipeline.config import Settings
from pipeline.learner.control import MAX_QUARANTINED, ControlHandler
from pipeline.learner.inbox import Inbox
from pipeline.learner.memories import MemoryBank
from pipeline.learner.publishing import Progress, manifest_metrics
from pipeline.learner.replay import Replay
from pipeline.metrics import Metrics
from topics.fields import encode

S = Settings(embedding_dim=8, slots=16, hidden=16)


class Harness:
    def __init__(self) -> None:
        config = S.learner()
        self.trainer = PolicyTrainer(config.trainer)
        self.progress = Progress()
        self.metrics = Metrics()
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.dead: list[tuple[int, str, str]] = []
        self.applied = 0
        self.handler = ControlHandler(
            config,
            trainer=self.trainer,
            memories=MemoryBank(config.connection, config.trainer.slots, grace_s=0.0),
            replay=Replay(config.replay_window_s),
            progress=self.progress,
            inbox=Inbox("experiences", "control", config.batch_size, 0.0),
            metrics=self.metrics,
            apply_pending=self.apply_pending,
            find_version=self.find_version,
            local_dir=Path("/nowhere"),
            publish_change=self.publish_change,
            dead_letter=lambda msg, reason, detail: self.dead.append((msg.offset, reason, detail)),
            clock=lambda: 100.0,
        )

    async def apply_pending(self) -> None:
        self.applied += 1

    async def find_version(self, version: int) -> None:
        return None

    async def publish_change(self, reason: str, extra: dict[str, Any]) -> int:
        self.published.append((reason, extra))
        return len(self.published)

    async def send(self, command: str, offset: int = 0, **fields: Any) -> None:
        value = {"schema": "control/v1", "command": command, "ts": 1.0, **fields}
        await self.handler.handle(SimpleNamespace(value=encode(value), offset=offset))

    def verdicts(self, command: str, verdict: str) -> float:
        return self.metrics.quarantines.labels(command=command, verdict=verdict)._value.get()


async def test_quarantine_and_unquarantine_change_the_set_and_are_answered_by_a_checkpoint() -> None:
    h = Harness()
    details = {"principal": "bot-9", "by": "ops-ann"}
    await h.send("quarantine", details=details, reason="inverted utilities", id="q-1")
    assert h.progress.quarantined == ["bot-9"] and h.applied == 1  # what was read before applies first
    reason, extra = h.published[-1]
    assert reason == "periodic"
    assert extra["quarantine"] == {
        "command": "quarantine",
        "principal": "bot-9",
        "by": "ops-ann",
        "by_verified": False,
        "ts": 100.0,
        "reason": "inverted utilities",
        "id": "q-1",
    }
    # The set travels in every checkpoint, and a restart takes it back.
    metrics = manifest_metrics(h.trainer, h.progress, None, 16, extra)
    assert metrics["quarantined"] == ["bot-9"] and Progress.from_metrics(metrics).quarantined == ["bot-9"]
    await h.send("quarantine", offset=1, details=details, id="q-2")  # already: nothing to do, no checkpoint
    assert len(h.published) == 1 and h.verdicts("quarantine", "unchanged") == 1
    await h.send("unquarantine", offset=2, details=details, id="q-3")
    assert h.progress.quarantined == [] and h.published[-1][1]["quarantine"]["command"] == "unquarantine"
    assert h.verdicts("quarantine", "apply") == 1 and h.verdicts("unquarantine", "apply") == 1
    assert h.dead == []


@pytest.mark.parametrize(
    ("details", "reason"),
    [({}, "missing_field"), ({"principal": "two words"}, "out_of_range"), ({"principal": 7}, "wrong_type")],
)
async def test_a_malformed_quarantine_is_dead_lettered_and_changes_nothing(
    details: dict[str, Any], reason: str
) -> None:
    h = Harness()
    await h.send("quarantine", offset=5, details=details)
    assert [(offset, r) for offset, r, _ in h.dead] == [(5, reason)]
    assert h.progress.quarantined == [] and h.published == []


async def test_past_the_cap_a_quarantine_is_refused() -> None:
    h = Harness()
    h.progress.quarantined = [f"p{i}" for i in range(MAX_QUARANTINED)]
    await h.send("quarantine", offset=3, details={"principal": "one-more"})
    assert [(offset, r) for offset, r, _ in h.dead] == [(3, "out_of_range")]
    assert len(h.progress.quarantined) == MAX_QUARANTINED and h.published == []
