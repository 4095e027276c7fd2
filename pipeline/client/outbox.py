"""What the adapters send after serving: held events, answers for the evaluator, the user's feedback.

:class:`Outbox` is the publishing half of :class:`~pipeline.client.adapter.CausalServing`.
Events go out at retrieval (``publish_on="retrieve"``) or are held until the answer is
known (``"answer"``), so that ``causalmem evaluator`` gets the event with its
``answer_text`` (docs/contract.md, contract 1.1) and scores it. Feedback the service
measures itself goes out as LLMFeedback for the same event, and also updates the running
per-memory utility estimates (:class:`SlotUtility`) behind the ``memory_conflict`` flag.
The publisher is an ``EventPublisher`` (async methods only), a ``SyncEventPublisher``, or
anything with a ``publish(value)`` method.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from topics.events import RetrievalEvent
from topics.feedback import LLMFeedback

log = logging.getLogger(__name__)


@dataclass
class SlotUtility:
    """Running estimate of each memory's effect on utility (exponentially weighted, ``fading`` per update).

    >>> u = SlotUtility(fading=0.5)
    >>> u.update([3, 4], utility=-1.0)  # no per-slot effects: the utility is split evenly
    >>> u.update([3], utility=0.0, effects={3: -0.6})
    >>> u.expected([3, 4]), u.expected([9])
    (-1.05, None)
    """

    fading: float = 0.1
    values: dict[int, float] = field(default_factory=dict)

    def update(self, selected: Sequence[int], utility: float, effects: dict[int, float] | None = None) -> None:
        if not selected:
            return
        per = effects if effects else {s: utility / len(selected) for s in selected}
        for s, x in per.items():
            old = self.values.get(s)
            self.values[s] = x if old is None else old + self.fading * (x - old)

    def expected(self, selected: Sequence[int]) -> float | None:
        """The step's expected utility: the sum of the known estimates (None when none is known)."""
        known = [self.values[s] for s in selected if s in self.values]
        return float(sum(known)) if known else None


Sent = tuple[str, np.ndarray]  # a published event: its id and the slots it served


def _sent(event: RetrievalEvent) -> Sent:
    # Not a tuple of ints inside the tuple: the collector often leaves such a pair tracked.
    return event.event_id, np.asarray(event.selected, dtype=np.int64)


class Outbox:
    """Held and recent events, and the publishing of events, answers and feedback.

    Parameters
    ----------
    publisher
        ``publish(value)``, sync or async; None: nothing is sent.
    publish_on
        ``"retrieve"`` or ``"answer"`` (hold each event until :meth:`answer` or :meth:`feedback`).
    max_pending
        Recent events kept; beyond it, the oldest held event goes out without its answer.
    text_limit
        Characters kept of an answer (``Limits.max_text_len``).

    A published event is remembered only by what its feedback needs, its id and the slots it
    served, in a pair Python's collector stops tracking (a string and an array): thousands of
    recent events as objects would each survive into the oldest generation and bring on full
    collections of the whole process (~0.1 s with torch loaded) in the middle of requests.
    """

    def __init__(self, publisher: Any, publish_on: str, max_pending: int, text_limit: int) -> None:
        if publish_on not in ("retrieve", "answer"):
            raise ValueError("publish_on must be 'retrieve' or 'answer'")
        self.publisher = publisher
        self.publish_on = publish_on
        self.max_pending = max_pending
        self.text_limit = text_limit
        self.utility = SlotUtility()
        self.publish_failures = 0  # events and feedback the publisher raised on (served all the same)
        self._failure_logged = 0.0
        # A held event (publish_on="answer"), or a published one's (event id, slots served).
        self._recent: OrderedDict[tuple[str, int], RetrievalEvent | Sent] = OrderedDict()

    def _remember(self, event: RetrievalEvent) -> list[RetrievalEvent]:
        """Keep ``event``; returns what must go out now: ``event`` itself when published at retrieval,
        and the oldest held events, without their answer, beyond ``max_pending``."""
        key = (event.query_id, event.step)
        now = self.publish_on == "retrieve"
        self._recent[key] = _sent(event) if now else event
        self._recent.move_to_end(key)
        out = [event] if now else []
        while len(self._recent) > self.max_pending:
            _, old = self._recent.popitem(last=False)
            if isinstance(old, RetrievalEvent):
                out.insert(0, old)
        return out

    def event(self, query_id: str, step: int = 0) -> RetrievalEvent:
        """A held event (``publish_on="answer"``); KeyError when it is not among the last
        ``max_pending``, or was published (only its id and slots are kept then)."""
        held = self._recent[(query_id, step)]
        if not isinstance(held, RetrievalEvent):
            raise KeyError((query_id, step))
        return held

    def _publish_sync(self, value: RetrievalEvent | LLMFeedback) -> None:
        if self.publisher is None:
            return
        try:
            result = self.publisher.publish(value)
        except Exception as exc:
            self._failed(exc)
            return
        if inspect.isawaitable(result):
            close = getattr(result, "close", None)
            if close is not None:
                close()
            raise TypeError("an async EventPublisher needs the async methods (ainvoke / aretrieve, aanswer, afeedback)")

    async def _publish_async(self, value: RetrievalEvent | LLMFeedback) -> None:
        if self.publisher is None:
            return
        try:
            result = self.publisher.publish(value)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """A publisher that raised (one of the user's own, or a value it rejected): the request is
        served all the same; the failure is counted and logged at most every ten seconds."""
        self.publish_failures += 1
        now = time.monotonic()
        if now - self._failure_logged >= 10.0:
            self._failure_logged = now
            log.warning("not published (%d so far): %r", self.publish_failures, exc)

    def _answered(self, query_id: str, step: int, answer_text: str | None) -> RetrievalEvent | None:
        """The event to publish now (None when it was published already)."""
        event = self._recent[(query_id, step)]
        if not isinstance(event, RetrievalEvent):
            if answer_text is not None:
                raise ValueError("this event was published at retrieval: use publish_on='answer' to attach answers")
            return None
        if answer_text is not None:
            event.answer_text = answer_text[: self.text_limit]
        self._recent[(query_id, step)] = _sent(event)
        return event

    def answer(self, query_id: str, answer_text: str, step: int = 0) -> RetrievalEvent:
        """Publish the held event with the answer given, for ``causalmem evaluator`` to score."""
        event = self._answered(query_id, step, answer_text)
        assert event is not None
        self._publish_sync(event)
        return event

    async def aanswer(self, query_id: str, answer_text: str, step: int = 0) -> RetrievalEvent:
        """:meth:`answer` with an async publisher."""
        event = self._answered(query_id, step, answer_text)
        assert event is not None
        await self._publish_async(event)
        return event

    def _feedback(self, query_id: str, step: int, utility: float | None, nll: dict[str, Any]) -> LLMFeedback:
        recent = self._recent[(query_id, step)]
        if isinstance(recent, RetrievalEvent):
            event_id, selected = recent.event_id, list(recent.selected)
        else:
            event_id, selected = recent[0], recent[1].tolist()
        with_, without = nll.get("nll_with"), nll.get("nll_without")
        if utility is None and (with_ is None or without is None):
            raise ValueError("feedback needs a utility, or nll_with and nll_without")
        fb = LLMFeedback(
            event_id=event_id,
            query_id=query_id,
            step=step,
            ts=time.time(),
            utility=float(without - with_) if with_ is not None and without is not None else float(utility or 0.0),
            nll_with=with_,
            nll_without=without,
            nll_without_slot=nll.get("nll_without_slot"),
        )
        self.utility.update(selected, fb.utility, fb.slot_effects(selected))
        return fb

    def feedback(
        self,
        query_id: str,
        step: int = 0,
        utility: float | None = None,
        nll_with: float | None = None,
        nll_without: float | None = None,
        nll_without_slot: dict[int, float] | None = None,
    ) -> LLMFeedback:
        """Send the user's own measure of the retrieval's utility (publishes a held event first)."""
        nll = {"nll_with": nll_with, "nll_without": nll_without, "nll_without_slot": nll_without_slot}
        fb = self._feedback(query_id, step, utility, nll)
        held = self._answered(query_id, step, None)
        if held is not None:
            self._publish_sync(held)
        self._publish_sync(fb)
        return fb

    async def afeedback(
        self,
        query_id: str,
        step: int = 0,
        utility: float | None = None,
        nll_with: float | None = None,
        nll_without: float | None = None,
        nll_without_slot: dict[int, float] | None = None,
    ) -> LLMFeedback:
        """:meth:`feedback` with an async publisher."""
        nll = {"nll_with": nll_with, "nll_without": nll_without, "nll_without_slot": nll_without_slot}
        fb = self._feedback(query_id, step, utility, nll)
        held = self._answered(query_id, step, None)
        if held is not None:
            await self._publish_async(held)
        await self._publish_async(fb)
        return fb
