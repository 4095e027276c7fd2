"""Values on the pipeline's internal topics (docs/architecture.md): experiences for the
learner, join outcomes and rating pairs for the worker's stages, control commands,
dead letters and the cluster epoch marker.

These are written and read by the pipeline only, but they are validated like input: a
value from an older or broken writer is rejected, never trusted.

>>> import numpy as np
>>> from topics.events import Features, RetrievalEvent
>>> from topics.fields import Limits
>>> event = RetrievalEvent("e1", "q1", 0, 1.0, Features(np.ones(2, np.float32), 0.5, 0.1),
...                        candidates=[1, 2], scores=np.array([0.3, 0.2]), selected=[2],
...                        temperature=1.0, logprob=-0.4, fallback=False)
>>> exp = decode_experience(experience_bytes(event, 0.25), Limits(embedding_dim=2, slots=4))
>>> exp.kind, exp.utility, exp.event.features.query_embedding.tolist()
('feedback', 0.25, [1.0, 1.0])
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from topics.events import RetrievalEvent, retrieval_event_from_obj
from topics.fields import (
    NO_KEY_CHECK,
    SCHEMA_CONTROL,
    SCHEMA_DEAD_LETTER,
    SCHEMA_EPOCH,
    SCHEMA_EXPERIENCE,
    SCHEMA_OUTCOMES,
    SCHEMA_RATING_PAIR,
    Fields,
    Limits,
    Rejected,
    WireValue,
    check_key,
    encode,
    open_value,
)
from topics.principal import EVALUATOR, check_principal, principal_of

# --------------------------------------------------------------------------- experiences


@dataclass(slots=True)
class Experience:
    """A joined (retrieval event, feedback) pair, or a labelled sample, for the learner.

    ``kind`` is ``"feedback"`` (REINFORCE) or ``"label"`` (last-layer fine-tune toward
    ``correct_memories``). ``id`` is the retrieval event's id (or the label's), so that a
    repeated delivery is applied once.
    """

    id: str
    kind: str
    event: RetrievalEvent
    utility: float
    correct_memories: list[int] | None = None
    # Per-memory credit (contract 1.1): slot → nll_without_slot[s] − nll_with, for the selected
    # slots the feedback measured; None when the feedback carried only the step's utility.
    slot_effects: dict[int, float] | None = None
    # Contract 1.2: memories a labeler marked harmful for this sample (kind ``label``).
    harmful_memories: list[int] | None = None
    # Contract 1.15: the principals that produced the event and the feedback (None: an older
    # writer's experience, or a value sent without one; both read as "anonymous").
    event_principal: str | None = None
    feedback_principal: str | None = None

    @property
    def principal(self) -> str:
        """The principal this experience counts under for influence (docs/learning.md): its
        feedback's (the utility is what it teaches), else its event's, else ``"anonymous"``.
        Feedback from the LM evaluator (:data:`~topics.principal.EVALUATOR`) measures the
        event's principal's retrieval, so it counts under the event's.

        >>> from topics.events import Features, RetrievalEvent
        >>> ev = RetrievalEvent("e", "q", 0, 1.0, Features(np.zeros(1, np.float32), 0.0, 0.0), [0], np.zeros(1),
        ...                     [0], 1.0, 0.0, False)
        >>> Experience("e", "feedback", ev, 0.1).principal
        'anonymous'
        >>> Experience("e", "feedback", ev, 0.1, event_principal="a", feedback_principal="b").principal
        'b'
        >>> Experience("e", "feedback", ev, 0.1, event_principal="a", feedback_principal=EVALUATOR).principal
        'a'
        """
        feedback = None if self.feedback_principal == EVALUATOR else self.feedback_principal
        return principal_of(feedback or self.event_principal)

    def to_dict(self) -> dict[str, Any]:
        body = self.event.to_dict()
        # The learner never needs texts; the event's principal travels as ``event_principal``.
        for text in ("memory_texts", "query_text", "answer_text", "principal"):
            body.pop(text, None)
        # The embedding travels as base64 float32: ~10× cheaper to decode than 384 JSON floats.
        features = dict(body["features"])
        emb = np.ascontiguousarray(features.pop("query_embedding"), dtype="<f4")
        body["features"] = features
        out: dict[str, Any] = {
            "schema": SCHEMA_EXPERIENCE,
            "id": self.id,
            "kind": self.kind,
            "utility": self.utility,
            "embedding_f32": base64.b64encode(emb.tobytes()).decode("ascii"),
            "event": body,
        }
        if self.correct_memories is not None:
            out["correct_memories"] = self.correct_memories
        if self.harmful_memories:
            out["harmful_memories"] = self.harmful_memories
        if self.slot_effects:
            out["slot_effects"] = {str(k): v for k, v in self.slot_effects.items()}
        event_principal = self.event_principal if self.event_principal is not None else self.event.principal
        if event_principal is not None:
            out["event_principal"] = event_principal
        if self.feedback_principal is not None:
            out["feedback_principal"] = self.feedback_principal
        return out


def experience_bytes(
    event: RetrievalEvent,
    utility: float,
    slot_effects: dict[int, float] | None = None,
    *,
    feedback_principal: str | None = None,
) -> bytes:
    """Encode a joined feedback experience for the learner (internal ``experiences`` topic).

    The event's own ``principal`` becomes the experience's ``event_principal``; the
    feedback's is ``feedback_principal`` (contract 1.15).
    """
    exp = Experience(
        event.event_id,
        "feedback",
        event,
        utility,
        slot_effects=slot_effects,
        event_principal=event.principal,
        feedback_principal=feedback_principal,
    )
    return encode(exp.to_dict())


def decode_experience(raw: bytes, limits: Limits) -> Experience:
    """An ``experiences`` value, validated like input (its event included).

    Arguments and errors follow the decoder contract in :mod:`topics.fields`.
    """
    f = open_value(raw, limits, SCHEMA_EXPERIENCE)
    kind = f.str_("kind")
    if kind not in ("feedback", "label"):
        raise Rejected("out_of_range", f"kind {kind!r}")
    event_obj = f.get("event")
    if not isinstance(event_obj, dict):
        raise Rejected("wrong_type", "event must be an object")
    embedding = _embedding_from_b64(f.get("embedding_f32"), limits)
    event = retrieval_event_from_obj(event_obj, limits, embedding=embedding)
    # Contract 1.15: an experience without these (an older worker's) reads as anonymous.
    event_principal = f.get("event_principal", required=False)
    feedback_principal = f.get("feedback_principal", required=False)
    if event_principal is not None:
        event.principal = check_principal(event_principal, "event_principal")
    if feedback_principal is not None:
        check_principal(feedback_principal, "feedback_principal")
    return Experience(
        id=f.str_("id"),
        kind=kind,
        event=event,
        utility=f.float_("utility"),
        correct_memories=f.slots_("correct_memories", required=False),
        slot_effects=f.slot_floats_("slot_effects") or None,
        harmful_memories=f.slots_("harmful_memories", required=False) or None,
        event_principal=event.principal,
        feedback_principal=feedback_principal,
    )


def _embedding_from_b64(text: Any, limits: Limits) -> np.ndarray:
    """The internal binary form of an embedding: little-endian float32, base64."""
    if not isinstance(text, str):
        raise Rejected("wrong_type", "embedding_f32 must be a base64 string")
    try:
        arr = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f4")
    except (ValueError, binascii.Error):
        raise Rejected("wrong_type", "embedding_f32 is not base64 of float32 values") from None
    if arr.shape[0] != limits.embedding_dim:
        raise Rejected("embedding_length", f"{arr.shape[0]} values, expected {limits.embedding_dim}")
    if not np.isfinite(arr).all():
        raise Rejected("non_finite", "embedding_f32")
    if arr.size and np.abs(arr).max() > limits.max_abs_value:
        raise Rejected("out_of_range", "embedding_f32")
    return arr.astype(np.float32)  # a writable copy


# --------------------------------------------------------------------------- worker stages

AL_REASONS = ("error", "uncertain")

# An ``outcomes`` message carries (part of) a join batch of one partition, a candidate's
# record with its sample, so the input limit on one message does not bound it; the join
# splits by size (``outcomes_messages``, under ``max_outcomes_bytes``), and a reader
# accepts up to this, well above any message a broker takes.
MAX_OUTCOMES_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Outcome(WireValue):
    """One joined step, as the join tells the worker's outcomes stage about it.

    ``ts`` is the event time of the join (the later of the event's and the feedback's).
    ``al`` marks a candidate for active learning (one of :data:`AL_REASONS`); such a
    record carries its ActiveLearningSample as ``sample``, encoded once by the join (the
    exact bytes the ``active-learning`` topic gets, as text) and validated by whoever
    decodes it, not here: the outcomes stage forwards it as it is.

    >>> o = Outcome("q1", 3, 10.0, -0.5, False, al="error", sample='{"x":1}')
    >>> list(o.to_dict()), Outcome("q1", 4, 11.0, 0.5, False).to_dict()["policy"]
    (['query_id', 'step', 'ts', 'utility', 'fallback', 'policy', 'al', 'sample'], 'default')
    """

    FIELDS = ("query_id", "step", "ts", "utility", "fallback", "policy")
    OPTIONAL = ("al", "sample")

    query_id: str
    step: int
    ts: float
    utility: float
    fallback: bool
    policy: str = "default"
    al: str | None = None
    sample: str | None = None


@dataclass(slots=True)
class Outcomes:
    """One message of the ``outcomes`` topic: a join batch's records for one partition (or a share of them).

    >>> from topics.fields import Limits
    >>> o = Outcome("q1", 2, 5.0, -0.3, False, al="uncertain", sample='{"x":1}')
    >>> decode_outcomes(outcomes_bytes([o]), Limits()).records == [o]
    True
    """

    records: list[Outcome]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_OUTCOMES, "records": [r.to_dict() for r in self.records]}


def outcomes_bytes(records: list[Outcome]) -> bytes:
    """Encode one ``outcomes`` message (what the join sends per batch and partition)."""
    return encode(Outcomes(records).to_dict())


def outcomes_messages(records: list[Outcome], max_bytes: int) -> list[bytes]:
    """Encode ``records`` as ``outcomes`` messages of at most ``max_bytes`` each, in order.

    One message when it fits (the usual case: encoded once); else the records are halved
    until each share fits. A record that alone exceeds ``max_bytes`` travels alone (it
    cannot be split).

    >>> recs = [Outcome(f"q{i}", 0, 1.0, 0.5, False) for i in range(3)]
    >>> outcomes_messages(recs, 1 << 20) == [outcomes_bytes(recs)]
    True
    >>> parts = outcomes_messages(recs, len(outcomes_bytes(recs[:2])))
    >>> [len(decode_outcomes(p, Limits()).records) for p in parts]
    [1, 2]
    """
    body = outcomes_bytes(records)
    if len(body) <= max_bytes or len(records) <= 1:
        return [body]
    mid = len(records) // 2
    return outcomes_messages(records[:mid], max_bytes) + outcomes_messages(records[mid:], max_bytes)


def decode_outcomes(raw: bytes, limits: Limits) -> Outcomes:
    """An ``outcomes`` value, validated record by record (a candidate's sample stays text).

    A record of an older join, which carried the candidate's event and no ``sample``,
    reads as a plain record: its utility counts, it yields no sample.

    >>> from topics.fields import Limits
    >>> old = {"query_id": "q1", "step": 0, "ts": 1.0, "utility": -0.9, "fallback": False,
    ...        "al": "error", "event": {"schema": "retrieval_event/v1"}}
    >>> decode_outcomes(encode({"schema": "outcomes/v1", "records": [old]}), Limits()).records[0].al is None
    True

    Parameters
    ----------
    raw
        The message value (UTF-8 JSON).
    limits
        What validation accepts (ids, numbers); the size of the whole message is bounded
        by :data:`MAX_OUTCOMES_BYTES` instead.

    Raises
    ------
    Rejected
        With the reason the value must not be used.
    """
    f = open_value(raw, replace(limits, max_bytes=max(limits.max_bytes, MAX_OUTCOMES_BYTES)), SCHEMA_OUTCOMES)
    items = f.list_("records", max_len=1 << 20)
    assert items is not None
    records = []
    for item in items:
        if not isinstance(item, dict):
            raise Rejected("wrong_type", "records[] must be objects")
        g = Fields(item, limits, "records[].")
        al = g.str_("al", required=False)
        if al is not None and al not in AL_REASONS:
            raise Rejected("out_of_range", f"records[].al {al!r}")
        sample = g.str_("sample", required=False, max_len=MAX_OUTCOMES_BYTES)
        if sample is not None and al is None:
            raise Rejected("inconsistent", "records[].sample without al")
        records.append(
            Outcome(
                query_id=g.str_("query_id"),
                step=g.int_("step", 0, 2**31),
                ts=g.float_("ts", 0.0, 1e11),
                utility=g.float_("utility"),
                fallback=g.bool_("fallback"),
                policy=g.str_("policy", required=False) or "default",
                al=al if sample is not None else None,  # an older join's candidate: utility only
                sample=sample,
            )
        )
    return Outcomes(records)


@dataclass(frozen=True, slots=True)
class RatingPair(WireValue):
    """A query's mean utility next to its human rating (0–5), for the drift stage.

    ``id`` is the query_id, ``t`` the query's latest event time. The rating travels as a
    number: the drift stage correlates floats.

    >>> from topics.fields import Limits
    >>> decode_rating_pair(encode(RatingPair("q1", 9.0, 0.4, 4.0).to_dict()), Limits(), key=b"q1")
    RatingPair(id='q1', t=9.0, u_query=0.4, rating=4.0)
    """

    SCHEMA = SCHEMA_RATING_PAIR
    FIELDS = ("id", "t", "u_query", "rating")

    id: str
    t: float
    u_query: float
    rating: float


def decode_rating_pair(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> RatingPair:
    """A ``rating-pairs`` value, validated; its key is its ``id`` (the query_id).

    Parameters
    ----------
    raw
        The message value (UTF-8 JSON).
    limits
        What validation accepts (embedding dimension, slots, sizes).
    key
        The message key, which must be the value's ``id``; ``NO_KEY_CHECK`` for a value
        read on its own (a file line, a value about to be sent).

    Raises
    ------
    Rejected
        With the reason the value must not reach the drift detector.
    """
    f = open_value(raw, limits, SCHEMA_RATING_PAIR)
    pair_id = f.str_("id")
    check_key(key, pair_id, "pair_id")
    return RatingPair(
        id=pair_id, t=f.float_("t", 0.0, 1e11), u_query=f.float_("u_query"), rating=f.float_("rating", 0.0, 5.0)
    )


# --------------------------------------------------------------------------- control and upkeep

# ``cutover`` (contract 1.2): shadow mode's cut-over; the learner answers with a checkpoint of that reason.
CUTOVER_COMMAND = "cutover"
# ``suppress`` (contract 1.2): an operator's "do not use" for memories (``causalmem suppress``; a
# labeler's mark is only a proposal since 1.6); the learner turns it into a strong negative (the
# slots' masks pinned near 0, so the hard drop removes them) and publishes a checkpoint of that reason.
SUPPRESS_COMMAND = "suppress"
# ``unsuppress`` (contract 1.6): its undo; the slots get neutral rows again, in a ``suppress`` checkpoint.
UNSUPPRESS_COMMAND = "unsuppress"
# ``quarantine`` / ``unquarantine`` (contract 1.15): an operator's "do not learn from" for a principal
# (``details.principal``); the learner gives its experiences weight 0, or full weight again.
QUARANTINE_COMMAND = "quarantine"
UNQUARANTINE_COMMAND = "unquarantine"
CONTROL_COMMANDS = (
    "reset",
    "rollback",
    CUTOVER_COMMAND,
    SUPPRESS_COMMAND,
    UNSUPPRESS_COMMAND,
    QUARANTINE_COMMAND,
    UNQUARANTINE_COMMAND,
)


@dataclass(slots=True)
class Control(WireValue):
    """A command for the learner (one of :data:`CONTROL_COMMANDS`), with why and its details."""

    SCHEMA = SCHEMA_CONTROL
    FIELDS = ("id", "command", "ts", "reason", "details")

    command: str
    ts: float
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    id: str = ""


def _check_details(command: str, details: Fields) -> None:
    """The ``details`` each command reads, checked here so that a bad one never reaches the learner.

    ``rollback`` needs ``to_version`` (an integer ≥ 1); ``reset`` may carry ``since_ts``
    (a finite time, seconds since the epoch); ``suppress`` and ``unsuppress`` need ``slots`` (a
    non-empty list of slots); ``quarantine`` and ``unquarantine`` need ``principal`` (contract 1.15's
    form, :mod:`topics.principal`). Every command may carry ``by``, a string: who the sender says asked,
    for the audit trail (a claim: nothing on ``control`` proves it). Other keys are informational.
    """
    details.str_("by", required=False, empty_ok=True)
    if command == "rollback":
        details.int_("to_version", 1)
    elif command in (SUPPRESS_COMMAND, UNSUPPRESS_COMMAND):
        if not details.slots_("slots"):
            raise Rejected("inconsistent", f"{command} needs at least one slot")
    elif command == "reset":
        details.float_("since_ts", 0.0, 1e11, required=False)
    elif command in (QUARANTINE_COMMAND, UNQUARANTINE_COMMAND):
        check_principal(details.get("principal"), "details.principal")


def decode_control(raw: bytes, limits: Limits) -> Control:
    """A ``control`` value, validated: a command the learner must carry out.

    Arguments and errors follow the decoder contract in :mod:`topics.fields`; ``details``
    are checked per command (:func:`_check_details`).

    >>> from topics.fields import encode
    >>> bad = encode({"schema": "control/v1", "command": "rollback", "ts": 1.0, "details": {"to_version": "x"}})
    >>> try:
    ...     decode_control(bad, Limits())
    ... except Rejected as rej:
    ...     print(rej.reason)
    wrong_type
    """
    f = open_value(raw, limits, SCHEMA_CONTROL)
    command = f.str_("command")
    if command not in CONTROL_COMMANDS:
        raise Rejected("out_of_range", f"command {command!r}")
    details = f.obj.get("details") or {}
    if not isinstance(details, dict):
        raise Rejected("wrong_type", "details must be an object")
    _check_details(command, Fields(details, limits, "details."))
    return Control(
        command=command,
        ts=f.float_("ts", 0.0, 1e11),
        reason=f.str_("reason", required=False, empty_ok=True) or "",
        details=details,
        id=f.str_("id", required=False, empty_ok=True) or "",
    )


@dataclass(slots=True)
class EpochMarker(WireValue):
    """The one message of the ``epoch`` topic, written when the topics are created."""

    SCHEMA = SCHEMA_EPOCH
    FIELDS = ("created_ts",)

    created_ts: float


def dead_letter_value(
    raw: bytes | None,
    reason: str,
    detail: str,
    topic: str,
    partition: int,
    offset: int,
    ts: float,
    keep_bytes: int = 64 * 1024,
) -> dict[str, Any]:
    """The dead-letter record: the original value (as text if it is UTF-8) and why.

    >>> dead_letter_value(b"{", "bad_json", "eof", "llm-feedback", 0, 7, 1.0)["original"]
    '{'
    """
    out: dict[str, Any] = {
        "schema": SCHEMA_DEAD_LETTER,
        "reason": reason,
        "detail": detail[:500],
        "source": {"topic": topic, "partition": partition, "offset": offset},
        "ts": ts,
        "original_size": 0 if raw is None else len(raw),
    }
    if raw is not None:
        head = bytes(raw[:keep_bytes])
        out["truncated"] = len(raw) > keep_bytes
        try:
            out["original"] = head.decode("utf-8")
        except UnicodeDecodeError:
            out["original_b64"] = base64.b64encode(head).decode("ascii")
    return out
