"""The learner's control commands without Kafka: :class:`ControlHandler` with what the loop hands it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from models.policy.trainer import PolicyTrainer
from pipeline.config import Settings
from pipeline.learner.control import ControlHandler, cutover_version
from pipeline.learner.inbox import Inbox
from pipeline.learner.memories import MemoryBank
from pipeline.learner.principals import PrincipalBook
from pipeline.learner.publishing import Progress
from pipeline.learner.replay import Replay
from pipeline.metrics import Metrics
from tests.helpers import experience
from topics.fields import encode
from topics.internal import CUTOVER_COMMAND, SUPPRESS_COMMAND
from topics.lifecycle import MemoryRecord

S = Settings(embedding_dim=8, slots=16, hidden=16)
BASE_TS = 1_767_225_600.0  # tests.helpers.experience's first event time


class Harness:
    """A handler and a record of what it asked of the learner."""

    def __init__(
        self,
        *,
        gated: bool,
        versions: dict[int, dict[str, torch.Tensor]] | None = None,
        principals: PrincipalBook | None = None,
    ) -> None:
        config = S.learner()
        if not gated:
            config = dataclasses.replace(config, gate=None)
        self.trainer = PolicyTrainer(config.trainer)
        self.memories = MemoryBank(config.connection, config.trainer.slots, grace_s=0.0)
        self.replay = Replay(config.replay_window_s)
        self.progress = Progress()
        self.metrics = Metrics()
        self.versions = versions or {}
        self.looked_up: list[int] = []
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.dead: list[tuple[int, str, str]] = []
        self.events: list[str] = []  # the order of applies, loads and publishes
        self.handler = ControlHandler(
            config,
            trainer=self.trainer,
            memories=self.memories,
            replay=self.replay,
            progress=self.progress,
            inbox=Inbox("experiences", "control", config.batch_size, 0.0),
            metrics=self.metrics,
            apply_pending=self.apply_pending,
            find_version=self.find_version,
            local_dir=Path("/nowhere"),
            publish_change=self.publish_change,
            dead_letter=lambda msg, reason, detail: self.dead.append((msg.offset, reason, detail)),
            principals=principals,
        )

    async def apply_pending(self) -> None:
        self.events.append("apply")

    async def find_version(self, version: int) -> dict[str, torch.Tensor] | None:
        self.looked_up.append(version)
        return self.versions.get(version)

    async def publish_change(self, reason: str, extra: dict[str, Any]) -> int:
        self.events.append(f"publish {reason}")
        self.published.append((reason, extra))
        return 40 + len(self.published)

    async def send(self, command: str, offset: int = 0, **fields: Any) -> None:
        value = {"schema": "control/v1", "command": command, "ts": 1.0, **fields}
        await self.handler.handle(SimpleNamespace(value=encode(value), offset=offset))


def weights(bias: float) -> dict[str, torch.Tensor]:
    """Another version's tensors: those of a fresh trainer with every output bias at ``bias``."""
    tensors = PolicyTrainer(S.trainer()).tensors()
    tensors["out.bias"] = torch.full_like(tensors["out.bias"], bias)
    return tensors


def test_a_cutover_serves_the_judged_version_only_under_the_gate() -> None:
    assert cutover_version({"serving_version": 3, "gain": 0.1}, gated=True) == 3
    assert cutover_version({"serving_version": 3}, gated=False) is None  # every checkpoint serves anyway
    assert cutover_version({"serving_version": None}, gated=True) is None
    assert cutover_version({}, gated=True) is None
    assert cutover_version({"serving_version": "3"}, gated=True) is None  # not a version number


async def test_a_message_the_codec_rejects_is_dead_lettered_and_changes_nothing() -> None:
    h = Harness(gated=True)
    before = h.trainer.tensors()
    await h.handler.handle(SimpleNamespace(value=b"{not json", offset=3))
    await h.send("rollback", offset=4, details={"to_version": "x"})
    await h.send("launch", offset=5)
    reasons = [(offset, reason) for offset, reason, _ in h.dead]
    assert reasons == [(3, "bad_json"), (4, "wrong_type"), (5, "out_of_range")]
    assert h.published == [] and h.events == [] and h.looked_up == []
    assert all(torch.equal(before[k], v) for k, v in h.trainer.tensors().items())


async def test_a_command_delivered_twice_applies_once() -> None:
    h = Harness(gated=True)
    await h.send(SUPPRESS_COMMAND, details={"slots": [2]}, id="mark-1")
    await h.send(SUPPRESS_COMMAND, offset=1, details={"slots": [2]}, id="mark-1")
    await h.send(SUPPRESS_COMMAND, offset=2, details={"slots": [3]})  # no id: no dedupe
    assert [reason for reason, _ in h.published] == [SUPPRESS_COMMAND, SUPPRESS_COMMAND]


async def test_suppress_pins_the_masks_and_publishes_at_once() -> None:
    h = Harness(gated=True)
    await h.send(SUPPRESS_COMMAND, details={"slots": [5, 2]}, reason="do not use")
    await h.send(SUPPRESS_COMMAND, offset=1, details={"slots": [2, 9]})
    assert h.events == ["apply", f"publish {SUPPRESS_COMMAND}"] * 2  # what was read before applies first
    assert h.progress.suppressed == [2, 5, 9]
    reason, extra = h.published[0]
    assert reason == SUPPRESS_COMMAND and extra["suppression"]["slots"] == [2, 5]  # the audit entry rides along
    assert extra["suppression"]["command"] == SUPPRESS_COMMAND and extra["suppression"]["reason"] == "do not use"
    bias = h.trainer.net.out.bias.detach()
    assert all(float(bias[s]) < -20 for s in (2, 5, 9)) and float(bias[0]) > -20


async def test_a_drift_reset_keeps_the_suppressed_memories_and_warms_up_after_the_change() -> None:
    h = Harness(gated=True)
    h.replay.extend([experience(S, i, ts=BASE_TS + i) for i in range(10)])
    await h.send(SUPPRESS_COMMAND, details={"slots": [4]}, reason="do not use")
    await h.send("reset", offset=1, details={"since_ts": BASE_TS + 6}, reason="drift")
    reason, extra = h.published[-1]
    assert reason == "reset" and extra["reset_details"] == {"since_ts": BASE_TS + 6}
    assert extra["warmup_experiences"] == 2 * 4  # the 4 experiences from the change on, over 2 epochs
    assert float(h.trainer.net.out.bias[4].detach()) < -20  # the fresh network does not bring it back
    assert h.progress.resets == 1 and h.metrics.resets._value.get() == 1


async def test_a_drift_reset_warms_up_without_a_quarantined_principal_s_experiences() -> None:
    book = PrincipalBook(cap=0.2, window=100, tolerance=0.1, min_n=10)
    h = Harness(gated=True, principals=book)
    kept = [experience(S, i, ts=BASE_TS + i) for i in range(10)]
    kept = [dataclasses.replace(e, feedback_principal="liar" if i in (7, 8) else f"p{i}") for i, e in enumerate(kept)]
    h.replay.extend(kept)
    h.progress.quarantined = ["liar"]
    await h.send("reset", details={"since_ts": BASE_TS + 6}, reason="drift")
    reason, extra = h.published[-1]
    assert reason == "reset" and extra["warmup_experiences"] == 2 * 2  # 4 from the change on, less the liar's 2


def test_the_warm_up_weights_hold_a_flooding_principal_to_its_bound() -> None:
    book = PrincipalBook(cap=0.2, window=100, tolerance=0.1, min_n=10)
    kept = [dataclasses.replace(experience(S, i), feedback_principal="flood" if i < 20 else f"p{i}") for i in range(25)]
    w = book.warm_up_weights(kept)
    flood = w[:20].sum()
    assert flood == pytest.approx(0.2 * w.sum())  # exactly its bound of the warm-up's weight
    assert (w[20:] == 1.0).all()
    assert sum(book.window.counts.values()) == 0  # the running window is not touched


def test_warm_up_weights_must_match_the_experiences() -> None:
    trainer = PolicyTrainer(S.trainer())
    with pytest.raises(ValueError, match="3 sample weights for 2 experiences"):
        trainer.reset([experience(S, 0), experience(S, 1)], sample_weights=[1.0, 1.0, 1.0])


async def test_a_rollback_to_a_version_nowhere_to_be_found_publishes_nothing() -> None:
    h = Harness(gated=True)
    assert await h.handler.rollback(7, "bad") is False
    assert h.looked_up == [7] and h.published == [] and h.events == []


async def test_a_rollback_serves_the_old_weights_and_fresh_rows_for_memories_added_since() -> None:
    h = Harness(gated=True, versions={3: weights(bias=1.5)})
    assert h.memories.apply(MemoryRecord("add", "doc-new", BASE_TS), h.trainer) is None  # not in v3
    slot = h.memories.allocator.live["doc-new"]
    await h.send("rollback", details={"to_version": 3}, reason="regression")
    [(reason, extra)] = h.published
    assert (reason, extra["rolled_back_to"], extra["rollback_reason"]) == ("rollback", 3, "regression")
    bias = h.trainer.net.out.bias.detach()
    assert float(bias[(slot + 1) % S.slots]) == 1.5  # v3's weights
    assert float(bias[slot]) != 1.5  # not the row of the slot's owner in v3
    assert slot in h.memories.pending  # its record goes out again with the rollback's checkpoint


async def test_a_rollback_to_weights_of_another_shape_is_dead_lettered() -> None:
    wrong = weights(bias=1.5)
    wrong["out.bias"] = torch.zeros(S.slots + 1)
    h = Harness(gated=True, versions={3: wrong})
    await h.send("rollback", offset=9, details={"to_version": 3})
    assert h.published == []
    assert [(offset, reason) for offset, reason, _ in h.dead] == [(9, "inconsistent")]


@pytest.mark.parametrize("gated", [True, False])
async def test_a_cutover_loads_the_judged_version_only_under_the_gate(gated: bool) -> None:
    h = Harness(gated=gated, versions={3: weights(bias=1.5)})
    details = {"serving_version": 3, "gain": 0.02}
    await h.send(CUTOVER_COMMAND, details=details, reason="shadow gain")
    [(reason, extra)] = h.published
    assert (reason, extra["cutover_reason"], extra["cutover"]) == (CUTOVER_COMMAND, "shadow gain", details)
    assert extra["control"]["command"] == CUTOVER_COMMAND  # its audit entry rides along
    assert h.looked_up == ([3] if gated else [])
    assert (float(h.trainer.net.out.bias[0].detach()) == 1.5) is gated


def test_the_learner_package_imports_without_a_circle() -> None:
    """The loop imports the control commands, never the other way (nor any other circle in the package)."""
    root = Path(__file__).resolve().parents[3]
    package = root / "pipeline" / "learner"
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        graph[path.stem] = {n.split(".")[2] for n in names if n.startswith("pipeline.learner.")} - {path.stem}
    assert "control" in graph["loop"] and "loop" not in graph["control"]

    def circle_from(start: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in sorted(graph.get(start, ())):
            if nxt in seen:
                return (*seen, nxt)
            found = circle_from(nxt, (*seen, nxt))
            if found:
                return found
        return None

    assert [c for m in sorted(graph) if (c := circle_from(m, (m,)))] == []


async def test_a_removed_memory_leaves_the_suppressed_set_so_its_slot_is_not_suppressed_for_another() -> None:
    h = Harness(gated=True)
    assert h.memories.apply(MemoryRecord("add", "doc-bad", BASE_TS), h.trainer) is None
    slot = h.memories.allocator.live["doc-bad"]
    await h.send(SUPPRESS_COMMAND, details={"slots": [slot]}, reason="do not use")
    assert h.progress.suppressed == [slot]
    assert h.memories.apply(MemoryRecord("remove", "doc-bad", BASE_TS + 1), h.trainer) is None
    h.handler.forget_removed()
    assert h.progress.suppressed == []
    await h.send("reset", offset=1, details={}, reason="drift")  # fresh weights: nothing suppressed again
    assert float(h.trainer.net.out.bias[slot].detach()) > -20


async def test_rollbacks_and_resets_beyond_the_hourly_cap_are_refused_and_dead_lettered() -> None:
    """The reported flood: 10 rollbacks and 3 resets forced 13 checkpoints past the gate in 20 s."""
    h = Harness(gated=True, versions={3: weights(bias=1.5)})
    for i in range(10):
        await h.send("rollback", offset=i, details={"to_version": 3}, id=f"rb-{i}")
    for i in range(3):
        await h.send("reset", offset=10 + i, details={}, reason="drift", id=f"rs-{i}")
    refused = [(offset, reason) for offset, reason, _ in h.dead]
    assert refused, f"{len(h.published)} checkpoints past the gate, none refused"
    cap = S.control_checkpoints_per_hour
    assert len(h.published) == cap and 0 < cap < 13
    assert refused == [(offset, "rate_limited") for offset in range(cap, 13)]
    version = h.trainer.tensors()
    await h.send(CUTOVER_COMMAND, offset=13, details={"serving_version": 3}, id="cut-1")  # the same allowance
    assert h.dead[-1][:2] == (13, "rate_limited") and len(h.published) == cap
    assert all(torch.equal(version[k], v) for k, v in h.trainer.tensors().items())  # a refusal changes nothing


async def test_the_control_rate_limit_holds_across_a_restart() -> None:
    """A restarted learner counts the commands its checkpoints on the model topic carry."""
    import time

    h = Harness(gated=True, versions={3: weights(bias=1.5)})
    for i in range(S.control_checkpoints_per_hour):
        await h.send("rollback", offset=i, details={"to_version": 3}, id=f"rb-{i}")
    restarted = Harness(gated=True, versions={3: weights(bias=1.5)})
    restarted.handler.recall([{"updates": 1}, "junk", *(extra for _, extra in h.published)], now=time.time())
    await restarted.send("rollback", offset=99, details={"to_version": 3}, id="rb-next")
    assert restarted.published == [] and [r for _, r, _ in restarted.dead] == ["rate_limited"]


async def test_a_rollback_to_a_version_the_learner_does_not_keep_is_dead_lettered_with_why() -> None:
    """``causalmem rollback --to 5`` of a version no longer kept: the learner only logged why."""
    h = Harness(gated=True, versions={3: weights(bias=1.5)})
    await h.send("rollback", offset=4, details={"to_version": 5}, id="rb-1")
    assert h.published == [] and h.looked_up == [5]
    [(offset, reason, detail)] = h.dead
    assert (offset, reason) == (4, "out_of_range") and "v5" in detail
    assert len(h.handler.recent) == 0  # a refused command uses up nothing of the hourly allowance


async def test_a_rollback_is_audited_with_who_claims_to_ask_and_the_command_id() -> None:
    h = Harness(gated=True, versions={3: weights(bias=1.5)})
    await h.send("rollback", details={"to_version": 3, "by": "ops-bob"}, reason="regression", id="rb-7")
    [(reason, extra)] = h.published
    entry = extra["control"]
    assert reason == "rollback" and extra["rolled_back_to"] == 3
    assert (entry["command"], entry["by"], entry["by_verified"], entry["id"]) == ("rollback", "ops-bob", False, "rb-7")
    await h.send(SUPPRESS_COMMAND, offset=1, details={"slots": [2], "by": "ops-bob"}, id="s-1")
    assert h.published[-1][1]["suppression"]["by_verified"] is False  # a claim, not a proven principal
    await h.send("reset", offset=2, details={"by": 7})  # who asked is text, on every command
    assert [(offset, reason) for offset, reason, _ in h.dead] == [(2, "wrong_type")]
