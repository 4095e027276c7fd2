"""The learner's pure parts, without Kafka: inbox (offset order, reorder mode, dedupe, resume
offsets), replay (window, drift warm-up, gate window) and what checkpoints record."""

from __future__ import annotations

import numpy as np
import pytest

from models.policy.trainer import PolicyTrainer, TrainerConfig
from pipeline.config import GateConfig, LearnerConfig, Settings
from pipeline.learner.inbox import Inbox
from pipeline.learner.publishing import Progress, Publishing, applied_through, manifest_metrics
from pipeline.learner.replay import Replay
from pipeline.learner.store import LocalStore
from pipeline.metrics import Metrics
from topics.events import Features, RetrievalEvent
from topics.internal import Experience

EXP, CTL = "experiences", "control"


def exp(ident: str, ts: float = 0.0, policy: str = "default") -> Experience:
    ev = RetrievalEvent(
        ident,
        f"q-{ident}",
        0,
        ts,
        Features(np.zeros(4, np.float32), 0.0, 0.0),
        [0, 1],
        np.array([0.9, 0.8]),
        [0],
        1.0,
        -0.1,
        False,
        policy=policy,
    )
    return Experience(ident, "feedback", ev, utility=0.5)


def ids(batches: list[list[Experience]]) -> list[list[str]]:
    return [[e.id for e in b] for b in batches]


# --------------------------------------------------------------------------- offset order


def test_full_batches_only_unless_forced_and_resume_at_first_unapplied() -> None:
    inbox = Inbox(EXP, CTL, batch_size=2)
    for offset, name in enumerate("abc"):
        assert inbox.accept(offset, exp(name)) is None
    assert ids(list(inbox.batches())) == [["a", "b"]]
    # c is read but not applied: a checkpoint now must make a restored learner read it again.
    assert inbox.input_offsets() == {"experiences:0": 2, "control:0": 0}
    assert inbox.position == 2
    assert ids(list(inbox.batches(force=True))) == [["c"]]
    assert inbox.input_offsets()["experiences:0"] == 3


def test_skipped_messages_hold_their_place_and_trailing_ones_are_passed() -> None:
    inbox = Inbox(EXP, CTL, batch_size=2, policy="default")
    assert inbox.accept(0, None) is None  # dead-lettered
    assert inbox.accept(1, exp("a")) is None
    assert inbox.accept(2, exp("x", policy="other")) == "other_policy"
    # A placeholder before the first unapplied experience: resume there, not after it.
    assert inbox.input_offsets()["experiences:0"] == 0
    assert inbox.accept(3, exp("b")) is None
    assert inbox.accept(4, None) is None
    assert ids(list(inbox.batches())) == [["a", "b"]]
    assert inbox.position == 5  # the trailing placeholder is passed with the batch
    assert inbox.input_offsets()["experiences:0"] == 5


def test_duplicates_are_skipped_and_applied_once() -> None:
    inbox = Inbox(EXP, CTL, batch_size=1)
    assert inbox.accept(0, exp("a")) is None
    assert inbox.accept(1, exp("a")) == "duplicate"
    assert ids(list(inbox.batches(force=True))) == [["a"]]
    assert inbox.position == 2


def test_dedupe_memory_is_bounded_oldest_first() -> None:
    inbox = Inbox(EXP, CTL, batch_size=1, dedupe_ids=2)
    for name in ("a", "b", "c"):
        inbox.mark_seen(name)
    assert not inbox.seen_before("a")
    assert inbox.seen_before("b") and inbox.seen_before("c")


def test_a_batch_that_fails_to_apply_does_not_move_the_position() -> None:
    inbox = Inbox(EXP, CTL, batch_size=2)
    inbox.accept(0, exp("a"))
    inbox.accept(1, exp("b"))
    batches = inbox.batches()
    assert ids([next(batches)]) == [["a", "b"]]
    # The caller has not come back: the batch is not applied yet.
    assert inbox.position == 0
    assert list(batches) == []
    assert inbox.position == 2


def test_rewind_drops_what_was_pending() -> None:
    inbox = Inbox(EXP, CTL, batch_size=5)
    inbox.accept(7, exp("a"))
    inbox.rewind(3, 9)
    assert list(inbox.batches(force=True)) == []
    assert inbox.input_offsets() == {"experiences:0": 3, "control:0": 9}


# --------------------------------------------------------------------------- reorder mode


def test_reorder_applies_in_event_time_order_once_the_watermark_passes() -> None:
    inbox = Inbox(EXP, CTL, batch_size=10, reorder_s=5.0)
    inbox.accept(0, exp("late-ts", ts=3.0))
    inbox.accept(1, exp("early-ts", ts=1.0))
    inbox.accept(2, exp("mid", ts=2.0))
    inbox.release()
    assert inbox.pending_n == 0  # watermark 3 − 5 s slack: nothing is due
    assert inbox.position == 3  # positions follow reads
    # Nothing applied yet: a restore starts again at the oldest unapplied offset.
    assert inbox.input_offsets()["experiences:0"] == 0
    inbox.accept(3, exp("new", ts=7.5))  # horizon 2.5: releases ts 1 and 2
    inbox.release()
    assert ids(list(inbox.batches(force=True))) == [["early-ts", "mid"]]
    assert inbox.applied_key == (2.0, "mid")
    assert inbox.input_offsets()["experiences:0"] == 0  # "late-ts" (offset 0) still held
    inbox.release(force=True)
    assert ids(list(inbox.batches(force=True))) == [["late-ts", "new"]]
    assert inbox.input_offsets()["experiences:0"] == 4


def test_reorder_skips_what_arrives_after_its_window_closed() -> None:
    inbox = Inbox(EXP, CTL, batch_size=10, reorder_s=1.0)
    inbox.accept(0, exp("b", ts=5.0))
    inbox.release(force=True)
    assert inbox.accept(1, exp("a", ts=4.0)) == "late"
    assert inbox.accept(2, exp("b", ts=5.0)) == "duplicate"
    assert inbox.position == 3
    assert ids(list(inbox.batches(force=True))) == [["b"]]


def test_reorder_resume_skips_what_the_checkpoint_applied() -> None:
    inbox = Inbox(EXP, CTL, batch_size=10, reorder_s=1.0)
    inbox.resume_after((5.0, "b"))
    # Re-read after a restore: applied before, silently dropped (not "late").
    assert inbox.accept(0, exp("a", ts=4.0)) is None
    assert inbox.accept(1, exp("b", ts=5.0)) is None
    assert inbox.accept(2, exp("c", ts=6.0)) is None
    inbox.release(force=True)
    assert ids(list(inbox.batches(force=True))) == [["c"]]


def test_reorder_order_does_not_depend_on_delivery_order() -> None:
    events = [exp(f"e{i}", ts=float(t)) for i, t in enumerate([5, 1, 4, 1, 3, 9, 2])]
    orders = []
    for perm in ([0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0], [3, 0, 6, 1, 5, 2, 4]):
        inbox = Inbox(EXP, CTL, batch_size=3, reorder_s=100.0)
        for offset, i in enumerate(perm):
            inbox.accept(offset, events[i])
        inbox.release(force=True)
        orders.append([e.id for b in inbox.batches(force=True) for e in b])
    assert orders[0] == orders[1] == orders[2] == ["e1", "e3", "e6", "e4", "e2", "e0", "e5"]


# --------------------------------------------------------------------------- replay


def test_replay_keeps_a_window_of_event_time_and_at_most_max_len() -> None:
    r = Replay(window_s=10.0, max_len=3)
    r.extend([exp("a", 0.0), exp("b", 4.0)])
    r.extend([exp("c", 12.0)])
    assert [e.id for e in r] == ["b", "c"]
    r.extend([exp("d", 13.0), exp("e", 14.0)])
    assert [e.id for e in r] == ["c", "d", "e"]


def test_drift_reset_selects_the_warmup() -> None:
    r = Replay(window_s=100.0)
    r.extend([exp("a", 1.0), exp("b", 5.0), exp("c", 9.0)])
    assert [e.id for e in r.after_drift(since=5.0)] == ["b", "c"]
    # Without an estimate of the change: warm up on everything.
    assert [e.id for e in r.after_drift(since=None)] == ["a", "b", "c"]


# --------------------------------------------------------------------------- checkpoints


def test_manifest_metrics_round_trip_through_a_restore() -> None:
    trainer = PolicyTrainer(TrainerConfig(embedding_dim=4, slots=8, hidden=8, lr=0.5))
    trainer.update([exp("a", 1.0), exp("b", 2.0)])
    progress = Progress(labels_since_checkpoint=2, labels_total=7, resets=1)
    metrics = manifest_metrics(trainer, progress, (2.0, "b"), batch_size=16, extra={"restored_from": "local"})
    assert metrics["updates"] == 1 and metrics["experiences"] == 2
    assert metrics["lr"] == 0.5 and metrics["batch_size"] == 16 and metrics["restored_from"] == "local"
    assert metrics["labels_applied"] == 2
    assert Progress.from_metrics(metrics) == Progress(labels_since_checkpoint=0, labels_total=7, resets=1)
    assert applied_through(metrics) == (2.0, "b")
    assert applied_through(manifest_metrics(trainer, progress, None, 16)) is None


@pytest.mark.parametrize("gate", [True, False])
def test_what_the_gate_judges_and_what_serves_at_once(gate: bool, tmp_path: object) -> None:
    config = Settings(embedding_dim=4, slots=8, hidden=8, device="cpu", gate=gate, gate_epsilon=0.03).learner()
    assert (config.gate is not None) == gate
    store = LocalStore(tmp_path)  # type: ignore[arg-type]
    arch = PolicyTrainer(config.trainer).net.arch
    pub = Publishing(None, config, store, arch, Metrics())
    assert (pub.gate is not None) == gate
    for reason in ("periodic", "label", "shutdown"):
        assert pub.is_candidate(reason) == gate
    for reason in ("init", "rollback", "reset"):
        assert not pub.is_candidate(reason)
    if gate:
        assert pub.gate is not None and pub.gate.config == GateConfig(epsilon=0.03)


def test_settings_build_the_learner_configuration() -> None:
    s = Settings(embedding_dim=16, slots=64, hidden=32, lr=0.01, device="cpu", topic_prefix="t.", policy="p")
    s = s.replace(drift_window_days=2.0, reorder_s=3.0, batch_size=8)
    c = s.learner()
    assert isinstance(c, LearnerConfig)
    assert c.trainer == TrainerConfig(16, 64, 32, lr=0.01, device="cpu")
    assert c.replay_window_s == 2 * 86400 and c.reorder_s == 3.0 and c.batch_size == 8
    assert c.policy == "p" and c.connection.topics.prefix == "t."
    assert c.connection.security is s.security
