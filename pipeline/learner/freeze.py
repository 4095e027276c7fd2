"""How long the serving version has stood, and how many candidates waited meanwhile.

With the promotion gate on, a learner whose candidates the gate can never decide keeps
training and publishing: it looks busy while clients serve the same policy for hours. The
:class:`ServingClock` makes that visible: the learner's metrics
``causalmem_learner_seconds_since_promotion`` and ``causalmem_learner_candidates_waiting``
(the ``CausalmemServingFrozen`` alert watches them), and ``metrics.gate`` in each manifest it
publishes (:func:`ServingClock.record`: the serving version, since when, the candidates
waiting and the gate's last decision and reason), which ``causalmem status`` and the web UI's
health page read from the model topic (:mod:`pipeline.status.freeze`).

"Since the promotion" is since the serving version last changed, whatever changed it (a
promotion, a label fine-tune, a rollback or reset served at once). After a restart the clock
starts from the serving manifest's creation time (a frozen learner that restarts stays
frozen); the count of waiting candidates starts again from 0 (the model topic, which status
reads, still shows them all).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from topics.fields import PROBE
from topics.manifest import Manifest


@dataclass
class ServingClock:
    """The serving version, since when it serves, and the candidates published since then."""

    serving_version: int | None = None
    since: float | None = None
    waiting: int = 0
    clock: Callable[[], float] = field(default=time.time, repr=False)

    def serving(self, manifest: Manifest | None) -> None:
        """The gate's serving manifest now (after each judgement). A new version restarts the clock;
        the first one seen starts it at its creation time."""
        if manifest is None or manifest.version == self.serving_version or manifest.reason == PROBE:
            return  # a probe (contract 1.19) serves the clients' own ranking still: nothing was promoted
        first = self.serving_version is None
        self.serving_version, self.waiting = manifest.version, 0
        self.since = manifest.created_ts if first else self.clock()

    def candidate(self, version: int) -> None:
        """A candidate was published (before the gate judges it)."""
        if self.serving_version is None or version > self.serving_version:
            self.waiting += 1

    def seconds(self) -> float:
        """Seconds since the serving version last changed (0 before one is known)."""
        return 0.0 if self.since is None else max(0.0, self.clock() - self.since)

    def record(self, decisions: Sequence[Any]) -> dict[str, Any]:
        """``metrics.gate`` of the next manifest: what status shows without scraping the learner.

        ``decisions``: the gate's recorded decisions (objects with ``decision``,
        ``candidate_version`` and ``reason``), newest last.

        >>> c = ServingClock(clock=lambda: 100.0)
        >>> c.serving(Manifest("p", 1, 40.0, "init", {}, 0.5, 0.0, "a" * 64, 1, 1)); c.candidate(2)
        >>> class D: decision, candidate_version, reason = "insufficient", 2, "v2: no decisions yet"
        >>> c.record([D()])
        {'serving_version': 1, 'serving_since': 40.0, 'candidates_waiting': 1, 'decision': 'insufficient', \
'candidate_version': 2, 'reason': 'v2: no decisions yet'}
        """
        out: dict[str, Any] = {
            "serving_version": self.serving_version,
            "serving_since": self.since,
            "candidates_waiting": self.waiting,
        }
        if decisions:
            last = decisions[-1]
            out.update(decision=last.decision, candidate_version=last.candidate_version, reason=last.reason)
        return out
