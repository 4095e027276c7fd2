"""``causalmem ui``: labeling, agreement, memories and health in the browser (docs/ui.md).

app (the Starlette app), auth (labelers, sessions, CSRF), web (shared page plumbing),
pool (the labeling queue's leases), labeling, agreement, memories + memory_pages,
health + health_pages, feeds (the topics, followed); templates/ and static/.
"""
