"""The active-learning rule, in one place and without Kafka.

A joined step is a *candidate* when

- its utility is below ``threshold`` (an **error** candidate), or
- the serving policy hesitated: the top-2 margin of its first-draw probabilities is
  below ``uncertainty_margin``, within a budget of ``uncertainty_budget`` × joined steps
  (an **uncertain** candidate).

Fallback steps are never candidates. An uncertain candidate becomes a sample at once; an
error candidate only once its query gets a verdict ``answer_correct = false``, in either
arrival order (the candidate waits for the verdict, or the verdict is already there). A
correct verdict drops the waiting candidates. Each (query_id, step) becomes at most one
sample, whose id is :func:`topics.convert.sample_id_for` of it.

The join applies :class:`CandidateRule` to each joined step; the outcomes and labels
stages apply :func:`on_candidate`, :func:`on_verdict` and :func:`first_send` to the
query's table records.

>>> rule = CandidateRule(ActiveLearningConfig(threshold=-0.3))
>>> rule.reason(utility=-0.5, fallback=False, margin=None), rule.reason(0.2, False, None)
('error', None)
>>> on_candidate("error", verdict=None), on_candidate("error", verdict=False), on_candidate("error", True)
('hold', 'emit', 'drop')
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from pipeline.config import ActiveLearningConfig
from pipeline.worker.records import MAX_STEPS_PER_QUERY, PendingSamples, SentSteps
from topics.events import RetrievalEvent

Action = Literal["emit", "hold", "drop"]


def uncertainty_margin(event: RetrievalEvent) -> float | None:
    """Top-2 margin of the serving policy's first-draw probabilities, when they were logged.

    >>> import types
    >>> uncertainty_margin(types.SimpleNamespace(candidate_probs=[0.25, 0.5, 0.25]))
    0.25
    """
    probs = event.candidate_probs
    if probs is None or len(probs) < 2:
        return None
    top = np.sort(np.asarray(probs, dtype=np.float64))[::-1]
    return float(top[0] - top[1])


class CandidateRule:
    """Which joined steps are candidates; keeps the count the uncertainty budget is a fraction of."""

    def __init__(self, config: ActiveLearningConfig) -> None:
        self.config = config
        self.steps = 0  # joined steps seen
        self.uncertain = 0  # ... of which marked uncertain

    def reason(self, utility: float, fallback: bool, margin: float | None) -> str | None:
        """``"error"``, ``"uncertain"`` or None for one joined step (call once per joined step)."""
        c = self.config
        self.steps += 1
        if fallback:  # fallback steps feed metrics and U_query, never a sample
            return None
        if utility < c.threshold:
            return "error"
        if (
            c.uncertainty_budget > 0
            and margin is not None
            and margin < c.uncertainty_margin
            and self.uncertain < c.uncertainty_budget * self.steps
        ):
            self.uncertain += 1
            return "uncertain"
        return None

    def classify(self, event: RetrievalEvent, utility: float) -> str | None:
        """:meth:`reason` for a joined event (its margin is computed only when it can matter)."""
        c = self.config
        margin = None
        if not event.fallback and utility >= c.threshold and c.uncertainty_budget > 0:
            margin = uncertainty_margin(event)
        return self.reason(utility, event.fallback, margin)


def on_candidate(reason: str, verdict: bool | None) -> Action:
    """What a candidate does given its query's verdict so far (None: no verdict yet)."""
    if reason == "uncertain" or verdict is False:
        return "emit"
    return "hold" if verdict is None else "drop"


def hold(pending: PendingSamples | None, step: int, sample: str, ts: float) -> PendingSamples:
    """The query's waiting error samples with one more."""
    if pending is None:
        return PendingSamples(samples={str(step): sample}, ts=ts)
    samples = dict(pending.samples)
    samples[str(step)] = sample
    return PendingSamples(samples=samples, ts=max(pending.ts, ts))


def on_verdict(correct: bool, pending: PendingSamples | None) -> list[tuple[int, str]]:
    """The waiting samples a verdict releases, in step order (none when the answer was correct).

    Either way the caller then forgets the waiting samples.
    """
    if correct or pending is None:
        return []
    return sorted((int(step), sample) for step, sample in pending.samples.items())


def first_send(sent: SentSteps | None, step: int, ts: float) -> SentSteps | None:
    """The query's sent steps with ``step`` added, or None when its sample already went out."""
    if sent is None:
        return SentSteps(steps=[step], ts=ts)
    if step in sent.steps:
        return None
    return SentSteps(steps=[*sent.steps, step][-MAX_STEPS_PER_QUERY:], ts=max(sent.ts, ts))
