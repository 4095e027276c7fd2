"""The learner: the single writer of the policy (see docs/architecture.md).

``from pipeline.learner.loop import Learner``; the loop composes the other modules:
election (who trains), restore (from the model topic on election), inbox (pending and
held experiences, positions, reorder, dedupe), replay (kept experiences: drift warm-up and
the gate's window), publishing and promotion_gate (checkpoints, candidates, promotion),
promotion_decision (what the gate decides, as pure functions) and store (the local copy).
Inbox, replay and promotion_decision are pure: tested without Kafka.
"""
