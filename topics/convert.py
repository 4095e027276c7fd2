"""Conversions between wire types: a joined step → an ActiveLearningSample → a label Experience.

Each conversion takes typed values and returns a typed value; nothing here parses or
validates JSON (the decoders in topics/ do that once, at the topic boundary).

>>> import numpy as np
>>> from topics.events import Features
>>> event = RetrievalEvent(
...     event_id="e1", query_id="q1", step=2, ts=10.0,
...     features=Features(np.zeros(2, dtype=np.float32), 0.0, 0.0),
...     candidates=[7, 3], scores=np.array([0.0, 0.0]), selected=[7],
...     temperature=1.0, logprob=-0.7, fallback=False)
>>> sample = make_sample(event, utility=-0.5, reason="error", ts=11.0)
>>> sample.sample_id == sample_id_for("q1", 2), sample.top_slots
(True, [{'slot': 7, 'prob': 0.5}, {'slot': 3, 'prob': 0.5}])
>>> label = HumanLabel(event_id="l1", query_id="q1", ts=12.0, labeler="ann",
...                    kind="memory_choice", sample_id=sample.sample_id, correct_memories=[3])
>>> exp = label_experience(label, sample)
>>> (exp.kind, exp.id, exp.event.event_id == sample.sample_id, exp.correct_memories)
('label', 'l1', True, [3])
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from topics.events import RetrievalEvent
from topics.internal import Experience
from topics.labels import ActiveLearningSample, HumanLabel

TOP_SLOTS = 5


def sample_id_for(query_id: str, step: int) -> str:
    """The sample id of a (query_id, step): deterministic, so a repeated emission is recognisably the same.

    >>> sample_id_for("q1", 0) == sample_id_for("q1", 0) != sample_id_for("q1", 1)
    True
    """
    return hashlib.sha256(f"{query_id}\x00{step}".encode()).hexdigest()[:24]


def _first_draw_probs(z: list[float]) -> list[float]:
    """softmax(z): each candidate's probability of being drawn first (the serving rule's first draw).

    Plain floats: for a handful of candidates this is several times faster than numpy.
    """
    top = max(z)
    e = [math.exp(v - top) for v in z]
    total = sum(e)
    return [v / total for v in e]


def top_slots(event: RetrievalEvent, n: int = TOP_SLOTS) -> list[dict[str, float]]:
    """The serving policy's ``n`` most likely candidates with their first-draw probabilities.

    The logged ``candidate_probs`` when present, else softmax(scores / temperature).
    """
    if event.candidate_probs is not None and len(event.candidate_probs) == len(event.candidates):
        probs = [float(p) for p in event.candidate_probs]
    elif event.candidates:
        probs = _first_draw_probs([float(v) / event.temperature for v in event.scores])
    else:
        return []
    order = sorted(range(len(probs)), key=probs.__getitem__, reverse=True)[:n]  # stable: ties keep their order
    return [{"slot": int(event.candidates[i]), "prob": round(probs[i], 6)} for i in order]


def make_sample(event: RetrievalEvent, utility: float, reason: str, ts: float) -> ActiveLearningSample:
    """The ActiveLearningSample a joined step becomes (``reason``: ``error`` or ``uncertain``)."""
    return ActiveLearningSample(
        sample_id=sample_id_for(event.query_id, event.step),
        query_id=event.query_id,
        step=event.step,
        ts=ts,
        reason=reason,
        utility=utility,
        policy_version=event.policy_version,
        features=event.features,
        candidates=event.candidates,
        selected=event.selected,
        top_slots=top_slots(event),
        query_text=event.query_text,
        memory_texts=event.memory_texts,
        scores=event.scores,
        temperature=event.temperature,
        policy=event.policy,
    )


def label_experience(label: HumanLabel, sample: ActiveLearningSample) -> Experience:
    """A labeler's answer to a sample as a learner input (kind ``label``).

    The event is the sample's step as the serving policy saw it; a sample without scores
    or temperature (an older producer) gets neutral ones, which the label update ignores.
    """
    candidates = list(sample.candidates)
    event = RetrievalEvent(
        event_id=sample.sample_id,
        query_id=sample.query_id,
        step=sample.step,
        ts=sample.ts,
        features=sample.features,
        candidates=candidates,
        scores=sample.scores if sample.scores is not None else np.zeros(len(candidates)),
        selected=[s for s in sample.selected if s in candidates],
        temperature=sample.temperature or 1.0,
        logprob=0.0,
        fallback=False,
        policy=sample.policy,
        policy_version=sample.policy_version,
    )
    return Experience(
        id=label.event_id,
        kind="label",
        event=event,
        utility=0.0,
        correct_memories=label.correct_memories,
        harmful_memories=label.harmful_memories or None,
    )
