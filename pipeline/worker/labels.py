"""The labels stage: human labels → samples, rating pairs and label experiences.

Reads ``human-labels`` (validated here; a bad label goes to ``dead-letter``), applies each
label event id once and one answer per (sample, labeler) — a second answer from the same
labeler to the same sample, whatever its event id, is counted as a duplicate and ignored —
and by kind:

- ``verdict``: recorded for the query; a wrong answer releases the query's waiting error
  samples, a correct one drops them (the active-learning rule,
  :mod:`pipeline.worker.active_learning`);
- ``memory_choice``: the answer to a sample this worker sent becomes a label experience
  for the learner (an answer to a sample already pruned is counted as expired); a "do not
  use" (sample id ``do-not-use:<slot>``) is a *proposal* only: counted
  (``causalmem_do_not_use_proposals_total``) and logged, and listed by ``causalmem status``,
  which reads it from ``human-labels``. Suppressing a memory is an operator's decision
  (``causalmem suppress``, docs/operations.md "Security"): a labeler could otherwise switch
  off every memory past the promotion gate and force a checkpoint per label;
- a ``rating`` (its own kind, or riding along with an answer) pairs with the query's
  U_query for the drift stage.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from pipeline.metrics import Metrics
from pipeline.worker.active_learning import on_verdict
from pipeline.worker.outcomes import OutcomesStage
from pipeline.worker.records import Rating, SeenLabels, StoredSamples, Verdict
from pipeline.worker.tables import Outputs, Tables
from topics.convert import label_experience
from topics.fields import Limits, Rejected, encode
from topics.internal import dead_letter_value
from topics.labels import DO_NOT_USE_PREFIX, HumanLabel, decode_active_learning_sample, decode_human_label
from topics.names import Topics

log = logging.getLogger(__name__)

MAX_LABELS_PER_QUERY = 1024  # label ids remembered per query for the once-only check


def answer_key(label: HumanLabel) -> str | None:
    """The id of "this labeler's answer to this sample" (None for a label about no sample).

    Remembered next to the label event ids: a labeler answers a sample once, even when a
    second answer comes with another event id (a hand-made label, another tool).

    >>> from topics.labels import HumanLabel
    >>> a = HumanLabel(event_id="e1", query_id="q", ts=1.0, labeler="ann", kind="memory_choice", sample_id="s")
    >>> b = HumanLabel(event_id="e2", query_id="q", ts=2.0, labeler="ann", kind="memory_choice", sample_id="s")
    >>> answer_key(a) == answer_key(b), answer_key(a).startswith("answer:")
    (True, True)
    """
    if not label.sample_id:
        return None
    return "answer:" + hashlib.sha256(f"{label.sample_id}\x00{label.labeler}".encode()).hexdigest()[:32]


class LabelsStage:
    """The ``human-labels`` agent."""

    def __init__(
        self,
        tables: Tables,
        outputs: Outputs,
        metrics: Metrics,
        outcomes: OutcomesStage,
        topics: Topics,
        limits: Limits,
    ) -> None:
        self.tables = tables
        self.outputs = outputs
        self.metrics = metrics
        self.outcomes = outcomes
        self.topics = topics
        self.limits = limits

    async def agent(self, stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            try:
                label = decode_human_label(event.value, self.limits, event.key)
            except Rejected as rej:
                await self._dead_letter(msg, rej.reason, rej.detail)
                continue
            await self.on_label(label)

    async def on_label(self, label: HumanLabel) -> None:
        qid = label.query_id
        qk = qid.encode()
        seen: SeenLabels | None = self.tables.labels_seen.get(qk)
        answer = answer_key(label)
        if seen is not None and (label.event_id in seen.ids or (answer is not None and answer in seen.ids)):
            if label.event_id not in seen.ids:
                log.info("labels: %s answered sample %s again; applied once", label.labeler, label.sample_id)
            self.metrics.duplicates.labels(topic=self.topics.human_labels.name).inc()
            return
        new = [label.event_id] if answer is None else [label.event_id, answer]
        ids = [*(seen.ids if seen is not None else []), *new][-MAX_LABELS_PER_QUERY:]
        self.tables.labels_seen[qk] = SeenLabels(ids=ids, ts=max(label.ts, seen.ts if seen else label.ts))
        self.metrics.labels.labels(kind=label.kind).inc()
        if label.kind == "verdict":
            await self._on_verdict(qid, qk, label)
        elif label.kind == "memory_choice":
            await self._on_answer(qk, label)
        if label.rating is not None:
            rating = Rating(rating=label.rating, ts=label.ts, paired=False)
            self.tables.ratings[qk] = rating
            q = self.tables.query_util.get(qk)
            if q is not None and q.n:
                await self.outcomes.emit_pair(qid, q, rating)

    async def _on_verdict(self, qid: str, qk: bytes, label: HumanLabel) -> None:
        correct = bool(label.answer_correct)
        self.tables.verdicts[qk] = Verdict(correct=correct, ts=label.ts)
        pending = self.tables.al_pending.get(qk)
        if pending is None:
            return
        for step, sample in on_verdict(correct, pending):
            await self.outcomes.emit_sample(qid, step, sample, "error", pending.ts)
        del self.tables.al_pending[qk]

    async def _on_answer(self, qk: bytes, label: HumanLabel) -> None:
        if (label.sample_id or "").startswith(DO_NOT_USE_PREFIX):
            self._propose(label)
            return
        stored: StoredSamples | None = self.tables.al_samples.get(qk)
        sample_text = stored.samples.get(label.sample_id or "") if stored is not None else None
        if sample_text is None:
            self.metrics.labels_expired.labels(kind="memory_choice").inc()
            return
        if not label.correct_memories and not label.harmful_memories:
            return  # a skip: nothing to learn
        try:
            sample = decode_active_learning_sample(sample_text.encode(), self.limits)
        except Rejected as exc:  # written by this worker: only a changed limit gets here
            log.error("labels: stored sample %s no longer valid (%s)", label.sample_id, exc)
            return
        exp = label_experience(label, sample)
        await self.outputs.experiences.send(value=encode(exp.to_dict()), partition=0)

    def _propose(self, label: HumanLabel) -> None:
        """A labeler's "do not use": a proposal for an operator, never a command (nothing is sent)."""
        if not label.harmful_memories:
            return
        self.metrics.do_not_use_proposals.inc()
        log.info(
            "labels: %s proposes 'do not use' for memories %s (an operator decides: causalmem suppress)",
            label.labeler,
            label.harmful_memories[:32],
        )

    async def _dead_letter(self, msg: Any, reason: str, detail: str) -> None:
        self.metrics.rejected.labels(topic=msg.topic, reason=reason).inc()
        self.metrics.dead_letters.inc()
        value = dead_letter_value(msg.value, reason, detail, msg.topic, msg.partition, msg.offset, time.time())
        await self.outputs.dead_letter.send(key=msg.key, value=encode(value), partition=0)
