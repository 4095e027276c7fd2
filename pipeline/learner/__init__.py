"""The learner: the single writer of the policy (see docs/architecture.md).

``from pipeline.learner.loop import Learner``; the loop composes the other modules:
election (who trains), fence (whether it still owns the policy), restore (from the model
topic on election), inbox (pending and held experiences, positions, reorder, dedupe),
replay (kept experiences: drift warm-up and the gate's window), memories (memory-lifecycle
→ slots, the id → slot map), control (the ``control`` topic's commands, carried out by a
``ControlHandler`` the loop hands what they change), suppression (operators' "do not use"
rules), publishing, deltas, promotion_gate and canary (checkpoints, candidates and
promotion), promotion_decision (what the gate decides, as pure functions), store (the
local copy) and supervise (a failed task ends the process). Inbox, replay, suppression and
promotion_decision are pure: tested without Kafka.
"""
