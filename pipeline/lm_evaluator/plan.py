"""What the evaluator scores for one retrieval event, and the feedback it makes of the scores (pure).

For an event with its query, the texts of its selected memories and an answer,
:func:`plan` lists the distinct prompts to score the answer after:

- ``with``: the selected memories in draw order (:func:`~pipeline.lm_evaluator.scoring.build_prompt`);
- ``without``: no memories;
- on a deterministic share of events (:func:`attributed`), ``leave-one-out``: the selected
  memories minus one, for each one (contract 1.1, ``nll_without_slot``), or for at most
  ``max_attributed`` of them (:func:`attributed_slots`): an event may select up to the
  contract's 1,024 memories, and without a cap its leave-one-out prompts alone would cost
  over a thousand times an ordinary event's. An event over the cap is attributed on a
  deterministic subset (:attr:`Plan.capped`); its other memories get no per-memory credit,
  which the contract allows.

:func:`feedback` turns the scores into an :class:`~topics.feedback.LLMFeedback` with the
event's ``ts`` (event time, not the wall clock: the join dead-letters inputs far ahead
of its clock) and the id ``fb-<event id>``, so a replayed event yields the same feedback
id, which the join applies once.

>>> from topics.events import RetrievalEvent, Features
>>> import numpy as np
>>> e = RetrievalEvent(event_id="e1", query_id="q1", step=0, ts=5.0, features=Features(np.zeros(2), 0.0, 0.0),
...     candidates=[3, 7], scores=np.zeros(2), selected=[7, 3], temperature=1.0, logprob=-1.0,
...     fallback=False, query_text="Port?", memory_texts={3: "A", 7: "B"}, answer_text="19092")
>>> p = plan(e, attribution_rate=1.0, max_attributed=16)
>>> [pr.replace("\\n", " | ") for pr in p.prompts]
['Context: | - B | - A | Question: Port? | Answer:', 'Question: Port? | Answer:', \
'Context: | - A | Question: Port? | Answer:', 'Context: | - B | Question: Port? | Answer:']
>>> fb = feedback(p, [1.0, 3.0, 2.5, 1.5])
>>> fb.event_id, fb.ts, fb.utility, fb.nll_without_slot
('fb-e1', 5.0, 2.0, {7: 2.5, 3: 1.5})
>>> plan(e, attribution_rate=0.0, max_attributed=16).loo_slots
[]
>>> capped = plan(e, attribution_rate=1.0, max_attributed=1)
>>> len(capped.loo_slots), capped.capped
(1, True)
>>> e.answer_text = " "
>>> plan(e, 1.0, max_attributed=16)
'no_answer'
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.byid import keep_by_id
from pipeline.lm_evaluator.scoring import build_prompt
from topics.events import RetrievalEvent
from topics.feedback import LLMFeedback
from topics.principal import EVALUATOR

# Why an event is not scored (the ``reason`` label of causalmem_evaluator_skipped_total).
SKIP_REASONS = ("no_query_text", "no_answer", "nothing_selected", "no_memory_texts")

MAX_ID_LEN = 256  # topics.fields.Limits.max_id_len: a longer feedback id would be rejected


def attributed(event_id: str, rate: float) -> bool:
    """Whether the event gets leave-one-out scoring: a hash of its id, so replays and evaluators agree.

    >>> attributed("e1", 0.0), attributed("e1", 1.0)
    (False, True)
    >>> sum(attributed(f"e{i}", 0.25) for i in range(4000)) / 4000  # doctest: +ELLIPSIS
    0.2...
    """
    return keep_by_id(event_id, rate)


def attributed_slots(event_id: str, selected: Sequence[int], max_attributed: int) -> list[int]:
    """The selected memories scored leave-one-out: all of them, or ``max_attributed`` chosen by a
    hash of (event id, slot), in draw order (replays and replicas choose the same; which memories
    get credit does not depend on their rank). ``max_attributed`` 0: none.

    >>> attributed_slots("e1", [5, 9, 2], 16)
    [5, 9, 2]
    >>> sub = attributed_slots("e1", list(range(1024)), 16)
    >>> len(sub), sub == sorted(sub), sub == attributed_slots("e1", list(range(1024)), 16)
    (16, True, True)
    >>> attributed_slots("e1", [5, 9, 2], 0)
    []
    """
    if len(selected) <= max_attributed:
        return list(selected)

    def rank(slot: int) -> bytes:
        return hashlib.blake2b(f"{event_id}\x00{slot}".encode(), digest_size=8).digest()

    chosen = set(sorted(selected, key=rank)[: max(0, max_attributed)])
    return [s for s in selected if s in chosen]


def feedback_id(event_id: str) -> str:
    """``fb-<event id>``; a hash when that would exceed the contract's id length.

    >>> feedback_id("e1"), len(feedback_id("x" * 300))
    ('fb-e1', 35)
    """
    fid = f"fb-{event_id}"
    return fid if len(fid) <= MAX_ID_LEN else "fb-" + hashlib.blake2b(event_id.encode(), digest_size=16).hexdigest()


@dataclass
class Plan:
    """The prompts of one event: ``prompts[0]`` with, ``prompts[1]`` without, then one per ``loo_slots``.

    ``index`` maps each of those roles to its row in ``prompts`` after duplicates are merged
    (with one selected memory, its leave-one-out prompt is the ``without`` prompt).
    """

    event: RetrievalEvent
    answer: str
    prompts: list[str]
    loo_slots: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)  # with, without, *loo → row of prompts
    capped: bool = False  # attributed on a subset: more memories selected than max_attributed


def plan(event: RetrievalEvent, attribution_rate: float, *, max_attributed: int) -> Plan | str:
    """The prompts to score for ``event``, or the reason it is skipped (one of :data:`SKIP_REASONS`).

    At most ``2 + max_attributed`` prompts, however many memories the event selected.
    """
    if not (event.query_text or "").strip():
        return "no_query_text"
    answer = (event.answer_text or "").strip()
    if not answer:
        return "no_answer"
    if not event.selected:  # nothing read: with = without, nothing to learn from
        return "nothing_selected"
    texts = event.memory_texts or {}
    if any(s not in texts for s in event.selected):
        return "no_memory_texts"
    query = event.query_text or ""
    memories = [texts[s] for s in event.selected]
    roles = [build_prompt(query, memories), build_prompt(query, [])]
    loo: list[int] = []
    capped = False
    if attributed(event.event_id, attribution_rate):
        loo = attributed_slots(event.event_id, event.selected, max_attributed)
        capped = len(loo) < len(event.selected)
    for slot in loo:
        i = event.selected.index(slot)
        roles.append(build_prompt(query, memories[:i] + memories[i + 1 :]))
    prompts: list[str] = []
    rows: dict[str, int] = {}
    index = []
    for p in roles:
        if p not in rows:
            rows[p] = len(prompts)
            prompts.append(p)
        index.append(rows[p])
    return Plan(event, answer, prompts, loo, index, capped)


def feedback(p: Plan, nlls: Sequence[float]) -> LLMFeedback:
    """The feedback of a scored plan (``nlls[i]`` is the answer's NLL after ``p.prompts[i]``)."""
    by_role = [float(nlls[i]) for i in p.index]
    nll_with, nll_without = by_role[0], by_role[1]
    per_slot = dict(zip(p.loo_slots, by_role[2:], strict=True)) or None
    e = p.event
    return LLMFeedback(
        event_id=feedback_id(e.event_id),
        query_id=e.query_id,
        step=e.step,
        ts=e.ts,
        utility=nll_without - nll_with,
        nll_with=nll_with,
        nll_without=nll_without,
        nll_without_slot=per_slot,
        principal=EVALUATOR,  # contract 1.18: the evaluator's name (counts under the event's principal)
    )
