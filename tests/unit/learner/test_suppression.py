"""The operator's suppress / unsuppress rules (pipeline.learner.suppression.decide): the cap on
slots per command, the rate limit on the checkpoints they force, the audit trail and the undo.
Decisions are asserted on given clock values, never on elapsed time."""

from __future__ import annotations

import torch

from models.policy.trainer import PolicyTrainer, TrainerConfig
from pipeline.learner.publishing import Progress
from pipeline.learner.suppression import AUDIT_KEEP, RATE_WINDOW_S, audit_entry, decide, read_audit
from topics.internal import SUPPRESS_COMMAND, UNSUPPRESS_COMMAND

CAPS = {"max_slots": 8, "per_hour": 4}


def test_within_the_cap_suppresses_and_the_undo_restores() -> None:
    on = decide(SUPPRESS_COMMAND, [9, 2, 2], [], [], 1000.0, **CAPS)
    assert (on.verdict, on.suppressed, on.changed) == ("apply", (2, 9), (2, 9))
    off = decide(UNSUPPRESS_COMMAND, [9], on.suppressed, [], 1000.0, **CAPS)
    assert (off.verdict, off.suppressed, off.changed) == ("apply", (2,), (9,))


def test_a_command_over_the_cap_is_refused_and_changes_nothing() -> None:
    d = decide(SUPPRESS_COMMAND, list(range(32)), [1], [], 1000.0, **CAPS)
    assert d.verdict == "refused" and d.reason.startswith("too_many_slots")
    assert d.suppressed == (1,) and d.changed == ()
    assert decide(SUPPRESS_COMMAND, list(range(8)), [], [], 1000.0, **CAPS).verdict == "apply"  # the cap itself is fine


def test_the_rate_limit_holds_within_the_hour_and_frees_after_it() -> None:
    audit: list[dict[str, object]] = []
    suppressed: tuple[int, ...] = ()
    verdicts = []
    for i in range(20):  # twenty commands, a minute apart: only four checkpoints
        now = 1000.0 + 60 * i
        d = decide(SUPPRESS_COMMAND, [i], suppressed, audit, now, **CAPS)
        verdicts.append(d.verdict)
        if d.verdict == "apply":
            suppressed = d.suppressed
            audit.append(audit_entry(SUPPRESS_COMMAND, d.changed, "ops", "", f"c{i}", now))
    assert verdicts == ["apply"] * 4 + ["refused"] * 16
    refused = decide(SUPPRESS_COMMAND, [30], suppressed, audit, 1000.0 + 60 * 20, **CAPS)
    assert refused.reason.startswith("rate_limited") and refused.suppressed == suppressed
    later = decide(SUPPRESS_COMMAND, [30], suppressed, audit, 1000.0 + RATE_WINDOW_S + 1, **CAPS)  # the first aged out
    assert later.verdict == "apply"
    # an undo is a checkpoint too: it counts against the same limit
    assert decide(UNSUPPRESS_COMMAND, [0], suppressed, audit, 1000.0 + 60 * 20, **CAPS).verdict == "refused"


def test_a_command_that_changes_nothing_forces_no_checkpoint() -> None:
    busy = [{"ts": 1000.0}] * 4
    assert decide(SUPPRESS_COMMAND, [3], [3], busy, 1000.0, **CAPS).verdict == "unchanged"
    assert decide(UNSUPPRESS_COMMAND, [5], [3], busy, 1000.0, **CAPS).verdict == "unchanged"


def test_the_audit_trail_survives_a_restore_and_bad_entries_do_not_break_it() -> None:
    entries = [audit_entry(SUPPRESS_COMMAND, [i], "ops", "why", f"c{i}", float(i)) for i in range(AUDIT_KEEP + 5)]
    metrics = {"suppressed": [3], "suppression_audit": [*entries, {"ts": True}, "x", {"command": "reset", "ts": 1.0}]}
    p = Progress.from_metrics(metrics)
    assert p.suppressed == [3] and len(p.suppression_audit) == AUDIT_KEEP
    assert p.suppression_audit[-1] == entries[-1]
    assert Progress.from_metrics({"suppression_audit": {"not": "a list"}}).suppression_audit == []
    assert read_audit([{"command": "suppress", "slots": [1, "x", True], "ts": 2.0}])[0]["slots"] == [1]


def test_unsuppress_gives_the_memory_a_neutral_row_again() -> None:
    t = PolicyTrainer(TrainerConfig(embedding_dim=8, slots=16, hidden=16))
    h = torch.ones(1, 16)
    t.net.suppress([2])
    assert float(t.net.candidate_masks(h, torch.tensor([[2]]))[0, 0].detach()) < 1e-6
    t.unsuppress([2])
    mask = float(t.net.candidate_masks(h, torch.tensor([[2]]))[0, 0].detach())
    assert 0.8 < mask < 1.2


def test_a_restarted_learner_keeps_the_suppressed_memories_and_their_audit() -> None:
    """A restart restores the suppressed set and the audit trail from the checkpoint: otherwise a
    later rollback or reset brings the memories back and the hourly limit starts from zero."""
    from types import SimpleNamespace

    from pipeline.learner.loop import Learner
    from pipeline.learner.publishing import Progress

    entry = audit_entry("suppress", [3, 7], "ops", "misleading", "cmd-1", 1_800_000_000.0)
    checkpoint = Progress.from_metrics({"resets": 1, "suppressed": [3, 7], "suppression_audit": [entry]})
    progress = Progress()
    held = progress  # the control handler holds this very object
    resumed: list[object] = []
    learner = SimpleNamespace(progress=progress, inbox=SimpleNamespace(resume_after=resumed.append))
    restored = SimpleNamespace(source="topic v5", version=5, progress=checkpoint, applied=None)
    Learner._resume(learner, restored)  # type: ignore[arg-type]
    assert held.suppressed == [3, 7] and held.suppression_audit == [entry] and held.resets == 1
    assert learner.version == 5 and resumed == [None]
