"""The learner: the single writer of the policy (see docs/architecture.md)."""
