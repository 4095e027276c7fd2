"""Memories as the policy sees them: id → slot allocation, per-memory statistics from credit,
the memory health score, and the write gate that admits proposed memories."""
