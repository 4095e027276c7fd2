"""Evaluation and rollback: off-policy estimates from the logs, and serving an earlier version."""
