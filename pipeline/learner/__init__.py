"""The learner: the single writer of the policy (see docs/architecture.md).

``from pipeline.learner.loop import Learner``; the loop composes the other modules:
election (who trains), fence (whether it still owns the policy), restore (from the model
topic on election), inbox (pending and held experiences, positions, reorder, dedupe),
replay (kept experiences: the drift warm-up), memories (memory-lifecycle → slots, the id →
slot map), control (the ``control`` topic's commands, carried out by a ``ControlHandler`` the
loop hands what they change), suppression (operators' "do not use" rules), publishing and
deltas (checkpoints and candidates), promotion (the promotion rule, one state machine),
evidence and logging_policy (what the rule decides on), gate (its async shell), store (the
local copy) and supervise (a failed task ends the process). Inbox, replay, suppression and
promotion are pure: tested without Kafka.
"""
