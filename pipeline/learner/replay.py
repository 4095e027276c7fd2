"""The experiences the learner keeps: warm-up material for a drift reset.

Pure, no Kafka. The learner keeps the applied experiences of the last ``window_s`` of
event time (the drift detector's window, 7 days by default; at most ``max_len``). A drift
reset warms the new last layer up on those from the detected change on (docs/learning.md).

>>> from topics.events import Features, RetrievalEvent
>>> from topics.internal import Experience
>>> import numpy as np
>>> def exp(i: int, ts: float) -> Experience:
...     ev = RetrievalEvent(f"e{i}", f"q{i}", 0, ts, Features(np.zeros(2, np.float32), 0.0, 0.0),
...                         [0], np.array([1.0]), [0], 1.0, 0.0, False)
...     return Experience(f"e{i}", "feedback", ev, utility=0.0)
>>> r = Replay(window_s=10.0)
>>> r.extend([exp(0, 0.0), exp(1, 5.0), exp(2, 12.0)])
>>> [e.id for e in r]  # e0 is more than 10 s older than the newest
['e1', 'e2']
>>> [e.id for e in r.after_drift(since=6.0)]
['e2']
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from topics.internal import Experience


class Replay:
    """Applied experiences in application order, trimmed to a window of event time."""

    def __init__(self, window_s: float, max_len: int | None = None) -> None:
        self.window_s = window_s
        self.items: deque[Experience] = deque(maxlen=max_len)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Experience]:
        return iter(self.items)

    def extend(self, experiences: Iterable[Experience]) -> None:
        self.items.extend(experiences)
        self.trim()

    def trim(self) -> None:
        """Drop what is older than ``window_s`` before the newest experience kept."""
        if not self.items:
            return
        horizon = self.items[-1].event.ts - self.window_s
        while self.items and self.items[0].event.ts < horizon:
            self.items.popleft()

    def after_drift(self, since: float | None) -> list[Experience]:
        """A drift reset: the experiences to warm up on.

        ``since`` is the detector's estimate of when the drift began: what came before
        teaches the world that changed. Without it, the warm-up takes everything kept.
        """
        return [e for e in self.items if since is None or e.event.ts >= since]
