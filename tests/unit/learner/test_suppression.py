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
    # an undo is never refused for the rate: it must be possible to take a mistaken suppression back
    assert decide(UNSUPPRESS_COMMAND, [0], suppressed, audit, 1000.0 + 60 * 20, **CAPS).verdict == "apply"


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


def test_an_undo_is_never_rate_limited_and_does_not_use_up_the_limit() -> None:
    """Four suppressions in the hour used to leave a mistaken one impossible to undo for an hour."""
    now = 1000.0 + 60 * 4
    audit = [audit_entry(SUPPRESS_COMMAND, [i], "ops", "", f"c{i}", 1000.0 + 60 * i) for i in range(4)]
    undo = decide(UNSUPPRESS_COMMAND, [3], (0, 1, 2, 3), audit, now, **CAPS)
    assert (undo.verdict, undo.suppressed, undo.changed) == ("apply", (0, 1, 2), (3,))
    # undos leave the hour's allowance of suppressions alone
    undos = [audit_entry(UNSUPPRESS_COMMAND, [i], "ops", "", f"u{i}", 1000.0 + 60 * i) for i in range(8)]
    assert decide(SUPPRESS_COMMAND, [9], [], undos, now, **CAPS).verdict == "apply"
    # the cap on memories per command still holds for an undo (it is not a rate)
    assert decide(UNSUPPRESS_COMMAND, list(range(9)), list(range(9)), [], now, **CAPS).verdict == "refused"


def test_the_audit_records_that_who_asked_is_the_senders_unverified_claim() -> None:
    """``by`` is free text on ``control``: a forged ``by='ops-bob'`` reached the trail as if proven."""
    entry = audit_entry(SUPPRESS_COMMAND, [4], "ops-bob", "leaks", "c1", 5.0)
    assert entry["by"] == "ops-bob" and entry["by_verified"] is False
    assert read_audit([entry]) == [entry]
    older = {"command": "suppress", "slots": [1], "by": "a", "ts": 1.0}  # a learner before the field
    assert read_audit([older])[0]["by_verified"] is False


def test_rollbacks_resets_and_cutovers_share_an_hourly_cap_counted_from_their_audit() -> None:
    """The reported flood: 10 rollbacks and 3 resets gave 13 checkpoints past the gate in 20 s."""
    from pipeline.learner.suppression import command_entry, decide_command

    recent: list[dict[str, object]] = []
    verdicts = []
    for i, command in enumerate(["rollback"] * 10 + ["reset"] * 3):
        now = 1000.0 + 1.5 * i
        d = decide_command(command, recent, now, per_hour=6)
        verdicts.append(d.verdict)
        if d.verdict == "apply":
            recent.append(command_entry(command, "ops", "", f"c{i}", now))
        else:
            assert d.reason == "rate_limited" and "6" in d.detail
    assert verdicts == ["apply"] * 6 + ["refused"] * 7
    assert decide_command("cutover", recent, 1000.0 + 30, per_hour=6).verdict == "refused"
    assert decide_command("cutover", recent, 1000.0 + RATE_WINDOW_S + 1, per_hour=6).verdict == "apply"  # aged out
    # suppressions have a limit of their own: they neither count here nor are counted here
    suppressions = [audit_entry(SUPPRESS_COMMAND, [i], "ops", "", f"s{i}", 1000.0) for i in range(10)]
    assert decide_command("rollback", suppressions, 1001.0, per_hour=6).verdict == "apply"
    assert decide(SUPPRESS_COMMAND, [1], [], recent, 1001.0, **CAPS).verdict == "apply"
