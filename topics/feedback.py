"""LLM feedback: the utility of one retrieval, as the LLM measured it (docs/contract.md §3).

A producer sends either ``utility`` or both ``nll_with`` and ``nll_without``; the pair
wins and defines the utility as the drop of the answer span's mean NLL. With the pair it may
also send ``nll_without_slot`` (contract 1.1): the NLL with all selected memories but one, per
slot; a memory's effect is ``nll_without_slot[s] − nll_with``.

>>> import orjson
>>> from topics.fields import Limits, Rejected
>>> raw = orjson.dumps({"schema": "llm_feedback/v1", "event_id": "e1", "query_id": "q1",
...                     "step": 0, "ts": 1.0, "nll_with": 1.5, "nll_without": 2.0})
>>> decode_llm_feedback(raw, Limits(), key=b"q1").utility
0.5
>>> fb = decode_llm_feedback(orjson.dumps({"schema": "llm_feedback/v1", "event_id": "e1",
...     "query_id": "q1", "step": 0, "ts": 1.0, "nll_with": 1.5, "nll_without": 2.0,
...     "nll_without_slot": {"3": 1.75, "7": 1.25}}), Limits())
>>> fb.slot_effects([3, 7, 9])
{3: 0.25, 7: -0.25}
>>> try:
...     decode_llm_feedback(b"{not json", Limits())
... except Rejected as e:
...     print(e.reason)
bad_json
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from topics.fields import NO_KEY_CHECK, SCHEMA_FEEDBACK, Limits, Rejected, WireValue, open_value
from topics.principal import check_principal


@dataclass(slots=True)
class LLMFeedback(WireValue):
    """The utility of the retrieval ``event_id``: written as the NLL pair when it came as one."""

    SCHEMA = SCHEMA_FEEDBACK
    FIELDS = ("event_id", "query_id", "step", "ts")
    OPTIONAL = ("principal",)

    event_id: str
    query_id: str
    step: int
    ts: float
    utility: float
    nll_with: float | None = None
    nll_without: float | None = None
    nll_without_slot: dict[int, float] | None = None  # contract 1.1: leave-one-out NLL per slot
    principal: str | None = None  # contract 1.15: who sent it (topics/principal.py); None: "anonymous"

    def slot_effects(self, selected: list[int]) -> dict[int, float] | None:
        """Each selected memory's effect ``nll_without_slot[s] − nll_with`` (slots not selected are ignored)."""
        if self.nll_without_slot is None or self.nll_with is None:
            return None
        out = {s: self.nll_without_slot[s] - self.nll_with for s in selected if s in self.nll_without_slot}
        return out or None

    def to_dict(self) -> dict[str, Any]:
        out = WireValue.to_dict(self)
        if self.nll_with is not None and self.nll_without is not None:
            out["nll_with"] = self.nll_with
            out["nll_without"] = self.nll_without
            if self.nll_without_slot:
                out["nll_without_slot"] = {str(k): v for k, v in self.nll_without_slot.items()}
        else:
            out["utility"] = self.utility
        return out


def decode_llm_feedback(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> LLMFeedback:
    """An ``llm-feedback`` value, validated; ``utility`` derived from the NLL pair if given.

    Arguments and errors follow the decoder contract in :mod:`topics.fields`.
    """
    f = open_value(raw, limits, SCHEMA_FEEDBACK)
    query_id = f.query_id(key)
    nll_with = f.float_("nll_with", 0.0, None, required=False)
    nll_without = f.float_("nll_without", 0.0, None, required=False)
    utility = f.float_("utility", required=False)
    nll_without_slot = f.slot_floats_("nll_without_slot", lo=0.0)
    if nll_without_slot is not None and (nll_with is None or nll_without is None):
        raise Rejected("inconsistent", "nll_without_slot needs nll_with and nll_without")
    if nll_with is not None and nll_without is not None:
        derived = nll_without - nll_with  # seed 000 §3.3: drop of the answer span's mean NLL
        if utility is not None and abs(utility - derived) > 1e-6 * max(1.0, abs(derived)):
            raise Rejected("inconsistent", "utility disagrees with nll_without - nll_with")
        utility = derived
    elif utility is None:
        missing = "nll_with" if nll_without is not None else "nll_without" if nll_with is not None else "utility"
        raise Rejected("missing_field", f"{missing} (give utility, or both nll_with and nll_without)")
    return LLMFeedback(
        event_id=f.str_("event_id"),
        query_id=query_id,
        step=f.int_("step", 0, 2**31),
        ts=f.float_("ts", 0.0, 1e11),
        utility=utility,
        nll_with=nll_with,
        nll_without=nll_without,
        nll_without_slot=nll_without_slot or None,
        principal=None if (p := f.get("principal", required=False)) is None else check_principal(p),
    )
