"""Retrieval events: what the serving side logs for every retrieval (docs/contract.md §3).

The join decodes every event it reads, so decoding has a fast path for the common,
well-formed case; anything unusual falls through to the full validator, which either
accepts the value or says precisely why not.

>>> from topics.fields import Limits, encode
>>> event = RetrievalEvent("e1", "q1", 0, 1.0, Features(np.zeros(2, np.float32), 0.5, 0.1),
...                        candidates=[3, 5], scores=np.array([0.2, 0.1]), selected=[5],
...                        temperature=1.0, logprob=-0.7, fallback=False)
>>> back = decode_retrieval_event(encode(event.to_dict()), Limits(embedding_dim=2, slots=8), key=b"q1")
>>> back.selected, back.features.last_step_loss, back.policy
([5], 0.5, 'default')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from topics.fields import (
    INT_TYPE,
    NO_KEY_CHECK,
    NUMBER_TYPES,
    SCHEMA_RETRIEVAL,
    Fields,
    Limits,
    Rejected,
    WireValue,
    float_array,
    loads_object,
)
from topics.principal import check_principal, valid_principal


@dataclass(slots=True)
class Features(WireValue):
    """What the policy sees: never memory content (seed 000 §2.2)."""

    FIELDS = ("query_embedding", "last_step_loss", "last_step_entropy")

    query_embedding: np.ndarray
    last_step_loss: float
    last_step_entropy: float


def read_features(f: Fields, limits: Limits, embedding: np.ndarray | None = None) -> Features:
    """The ``features`` object of an event or sample; ``embedding`` when it came separately."""
    if embedding is None:
        emb_items = f.list_("query_embedding", max_len=max(limits.embedding_dim, 1) * 4)
        assert emb_items is not None
        if len(emb_items) != limits.embedding_dim:
            raise Rejected("embedding_length", f"{len(emb_items)} values, expected {limits.embedding_dim}")
        embedding = float_array(emb_items, "features.query_embedding", limits.max_abs_value).astype(np.float32)
    return Features(
        query_embedding=embedding,
        last_step_loss=f.float_("last_step_loss"),
        last_step_entropy=f.float_("last_step_entropy"),
    )


@dataclass(slots=True)
class RetrievalEvent(WireValue):
    """One retrieval: the kept candidates, their scores, the drawn ``selected`` slots (in
    draw order) and the log-probability of that draw under the serving policy."""

    SCHEMA = SCHEMA_RETRIEVAL
    FIELDS = (
        "event_id",
        "query_id",
        "step",
        "ts",
        "policy",
        "policy_version",
        "features",
        "candidates",
        "scores",
        "selected",
        "temperature",
        "logprob",
        "fallback",
    )
    OPTIONAL = (
        "mask_max",
        "query_text",
        "answer_text",
        "dropped",
        "candidate_masks",
        "candidate_probs",
        "memory_texts",
        "candidate_ids",
        "canary",
        "canary_arm",
        "canary_version",
        "canary_other",
        "canary_rate",
        "alternative_version",
        "principal",
        "incumbent",
        "base",
    )
    NESTED = ("features", "memory_texts")

    event_id: str
    query_id: str
    step: int
    ts: float
    features: Features
    candidates: list[int]
    scores: np.ndarray
    selected: list[int]
    temperature: float
    logprob: float
    fallback: bool
    policy: str = "default"
    policy_version: int = 0
    mask_max: float | None = None
    query_text: str | None = None
    memory_texts: dict[int, str] | None = None
    # Optional additions (docs/contract.md §1: added optional fields are allowed); written by CausalRetriever.
    dropped: list[int] | None = None  # slots the hard drop removed (intervention rate)
    candidate_masks: np.ndarray | None = None  # m_i of each kept candidate
    candidate_probs: np.ndarray | None = None  # first-draw probabilities over kept candidates
    answer_text: str | None = None  # contract 1.1: the answer given (or a reference), for the evaluator
    # Contract 1.3: the memory id of each candidate (parallel to ``candidates``). When set, the
    # slot numbers of the event are the event's own labels for those memories, and the learner
    # replaces them with the slots its id → slot map gives (docs/contract.md §9.3).
    candidate_ids: list[str] | None = None
    # Contract 1.4: true when the client served the learner's canary (``policy_version`` is
    # then the canary's); the draw's T, logprob and probabilities are the canary's.
    canary: bool | None = None
    # Contract 1.5: a request drawn into a *coupled* canary (docs/contract.md §7.2) says which
    # policy's slate it served — "tie" (both drew the same slate), "canary" or "serving" (their
    # slates differed) — and the canary's version (``policy_version`` is the served one's).
    canary_arm: str | None = None
    canary_version: int | None = None
    # Contract 1.5: where the two slates differed, the other policy's (memories by slot only).
    canary_other: list[int] | None = None
    # Contract 1.9: on a request of a client holding a (not coupled) canary, the share of requests
    # it serves the canary on and the other policy's version (the serving one on a canary request,
    # the canary's on a serving one): the request was drawn from that mixture (docs/contract.md §7.2).
    canary_rate: float | None = None
    alternative_version: int | None = None
    # Contract 1.15: who produced the event (topics/principal.py); None reads as "anonymous".
    principal: str | None = None
    # Contract 1.17: true when the client served its own ranking, the first k candidates as found,
    # because the manifest of ``policy_version`` says ``incumbent`` (a policy not yet certified):
    # no draw chose them (``logprob`` 0, ``selected`` the first k of ``candidates``).
    incumbent: bool | None = None
    # Contract 1.23: true when the client drew this request under the policy of the version that
    # ``serving.base`` of ``policy_version``'s manifest names (a probe over a certified version),
    # not under ``policy_version``'s own weights: ``logprob`` and the probabilities are that draw's.
    base: bool | None = None


CANARY_ARMS = ("tie", "canary", "serving")


def decode_retrieval_event(raw: bytes, limits: Limits, key: Any = NO_KEY_CHECK) -> RetrievalEvent:
    """A ``retrieval-events`` value, validated.

    Arguments and errors follow the decoder contract in :mod:`topics.fields`.
    """
    return retrieval_event_from_obj(loads_object(raw, limits), limits, key)


def _num(x: Any, lo: float, hi: float) -> bool:
    return type(x) in NUMBER_TYPES and lo <= x <= hi


def _slot_list(x: Any, limits: Limits) -> bool:
    return (
        type(x) is list
        and len(x) <= limits.max_candidates
        and (not x or (set(map(type, x)) == INT_TYPE and min(x) >= 0 and max(x) < limits.slots))
        and len(set(x)) == len(x)
    )


def _number_array(x: Any, n: int, lo: float, hi: float) -> np.ndarray | None:
    if type(x) is not list or len(x) != n or (x and not set(map(type, x)) <= NUMBER_TYPES):
        return None
    arr = np.asarray(x, dtype=np.float64)
    if arr.size:
        # NaN fails every comparison, so these also reject non-finite values.
        if lo == -hi:
            if not np.abs(arr).max() <= hi:
                return None
        elif not (arr.min() >= lo and arr.max() <= hi):
            return None
    return arr


def _fast_retrieval_event(
    obj: dict[str, Any], limits: Limits, key: Any, schema: str, embedding: np.ndarray | None
) -> RetrievalEvent | None:
    """The common, well-formed case checked with few calls (the join's hot path).

    Returns None for anything unusual — a missing or null field, an integral float where an
    int is expected, texts, any doubt — and the caller then runs the full validator, which
    either accepts the value or says precisely why not. It never accepts what the full
    validator would reject (tests/unit/topics/test_codec_properties.py checks the two agree).
    """
    big, n_max = limits.max_abs_value, limits.max_id_len
    try:
        if obj.get("schema") != schema or obj.get("memory_texts") is not None or obj.get("answer_text") is not None:
            return None
        if obj.get("candidate_ids") is not None:
            return None  # contract 1.3's ids: checked by the full validator
        canary = obj.get("canary")  # contract 1.4: on a fifth of the traffic by default, so decoded here too
        if canary is not None and type(canary) is not bool:
            return None
        arm, arm_version = obj.get("canary_arm"), obj.get("canary_version")  # contract 1.5, as often as canaries
        if (arm is not None and arm not in CANARY_ARMS) or (arm is None) != (arm_version is None):
            return None
        if arm_version is not None and (type(arm_version) is not int or not 0 <= arm_version <= 2**62):
            return None
        if arm is not None and (arm == "canary") != bool(canary):
            return None
        other = obj.get("canary_other")
        if other is not None and (arm not in ("canary", "serving") or not _slot_list(other, limits) or not other):
            return None
        rate, alternative = obj.get("canary_rate"), obj.get("alternative_version")  # contract 1.9
        if (rate is None) != (alternative is None) or (rate is not None and arm is not None):
            return None
        if rate is not None and (not _num(rate, 0.0, 1.0) or rate in (0, 1) or type(alternative) is not int):
            return None
        if alternative is not None and not 0 <= alternative <= 2**62:
            return None
        principal = obj.get("principal")  # contract 1.15
        if principal is not None and not valid_principal(principal):
            return None
        incumbent = obj.get("incumbent")  # contract 1.17: every request but the explored under a first policy
        if incumbent is not None and (type(incumbent) is not bool or (incumbent and canary)):
            return None
        base = obj.get("base")  # contract 1.23: every request but the explored under a probe over a certified version
        if base is not None and (type(base) is not bool or (base and (canary or incumbent))):
            return None
        qid, eid = obj["query_id"], obj["event_id"]
        if type(qid) is not str or type(eid) is not str or not (0 < len(qid) <= n_max and 0 < len(eid) <= n_max):
            return None
        if key is not NO_KEY_CHECK:
            k = key.decode("utf-8", "replace") if isinstance(key, (bytes, bytearray)) else key
            if k != qid:
                return None
        step, ts, temp, logprob = obj["step"], obj["ts"], obj["temperature"], obj["logprob"]
        if type(step) is not int or not 0 <= step <= 2**31 or not _num(ts, 0.0, 1e11):
            return None
        if not _num(temp, 1e-6, 1e6) or not _num(logprob, -big, 1e-6):
            return None
        fallback = obj["fallback"]
        feats = obj["features"]
        if type(fallback) is not bool or type(feats) is not dict:
            return None
        loss, entropy = feats["last_step_loss"], feats["last_step_entropy"]
        if not _num(loss, -big, big) or not _num(entropy, -big, big):
            return None
        if embedding is None:
            emb = _number_array(feats["query_embedding"], limits.embedding_dim, -big, big)
            if emb is None:
                return None
            embedding = emb.astype(np.float32)
        candidates, selected = obj["candidates"], obj["selected"]
        if not _slot_list(candidates, limits) or not _slot_list(selected, limits):
            return None
        n = len(candidates)
        scores = _number_array(obj["scores"], n, -big, big)
        if scores is None or (not fallback and (not n or not set(selected) <= set(candidates))):
            return None
        if incumbent and (fallback or logprob != 0 or selected != candidates[: len(selected)]):
            return None
        if base and fallback:
            return None
        policy = obj.get("policy")
        version = obj.get("policy_version")
        mask_max = obj.get("mask_max")
        text = obj.get("query_text")
        dropped = obj.get("dropped")
        if policy is not None and (type(policy) is not str or not 0 < len(policy) <= n_max):
            return None
        if version is not None and (type(version) is not int or not 0 <= version <= 2**62):
            return None
        if mask_max is not None and not _num(mask_max, 0.0, big):
            return None
        if text is not None and (type(text) is not str or len(text) > limits.max_text_len):
            return None
        if dropped is not None and not _slot_list(dropped, limits):
            return None
        extras: dict[str, np.ndarray] = {}
        for name in ("candidate_masks", "candidate_probs"):
            if obj.get(name) is not None:
                arr = _number_array(obj[name], n, 0.0, big)
                if arr is None:
                    return None
                extras[name] = arr
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return RetrievalEvent(
        event_id=eid,
        query_id=qid,
        step=step,
        ts=float(ts),
        features=Features(embedding, float(loss), float(entropy)),
        candidates=candidates,
        scores=scores,
        selected=selected,
        temperature=float(temp),
        logprob=float(logprob),
        fallback=fallback,
        policy=policy or "default",
        policy_version=version or 0,
        mask_max=float(mask_max) if mask_max is not None else None,
        query_text=text,
        memory_texts=None,
        dropped=dropped,
        candidate_masks=extras.get("candidate_masks"),
        candidate_probs=extras.get("candidate_probs"),
        canary=True if canary else None,
        canary_arm=arm,
        canary_version=arm_version,
        canary_other=other,
        canary_rate=float(rate) if rate is not None else None,
        alternative_version=alternative,
        principal=principal,
        incumbent=True if incumbent else None,
        base=True if base else None,
    )


def retrieval_event_from_obj(
    obj: dict[str, Any],
    limits: Limits,
    key: Any = NO_KEY_CHECK,
    schema: str = SCHEMA_RETRIEVAL,
    embedding: np.ndarray | None = None,
) -> RetrievalEvent:
    """A retrieval event from an already parsed object (an event nested in another value).

    ``schema`` is the schema the object must name; ``embedding``, when given, replaces
    ``features.query_embedding`` (an experience carries it separately, in binary). Raises
    :class:`~topics.fields.Rejected` as :func:`decode_retrieval_event` does.
    """
    fast = _fast_retrieval_event(obj, limits, key, schema, embedding)
    return fast if fast is not None else _validated_retrieval_event(obj, limits, key, schema, embedding)


def _validated_retrieval_event(
    obj: dict[str, Any], limits: Limits, key: Any, schema: str, embedding: np.ndarray | None
) -> RetrievalEvent:
    """Every rule, field by field, with the precise rejection reason."""
    f = Fields(obj, limits)

    f.schema(schema)
    query_id = f.query_id(key)
    features = f.obj_("features")
    assert features is not None
    fallback = f.bool_("fallback")
    candidates = f.slots_("candidates")
    scores = f.floats_("scores")
    selected = f.slots_("selected")
    assert candidates is not None and scores is not None and selected is not None
    if len(scores) != len(candidates):
        raise Rejected("inconsistent", "scores and candidates differ in length")
    if not fallback:
        if not candidates:
            raise Rejected("inconsistent", "no candidates on a non-fallback event")
        if not set(selected) <= set(candidates):
            raise Rejected("inconsistent", "selected is not a subset of candidates")
    event = RetrievalEvent(
        event_id=f.str_("event_id"),
        query_id=query_id,
        step=f.int_("step", 0, 2**31),
        ts=f.float_("ts", 0.0, 1e11),
        features=read_features(features, limits, embedding),
        candidates=candidates,
        scores=scores,
        selected=selected,
        temperature=f.float_("temperature", 1e-6, 1e6),
        logprob=f.float_("logprob", None, 1e-6),
        fallback=fallback,
        policy=f.str_("policy", required=False) or "default",
        policy_version=f.int_("policy_version", 0, 2**62, required=False) or 0,
        mask_max=f.float_("mask_max", 0.0, None, required=False),
        query_text=f.str_("query_text", required=False, max_len=limits.max_text_len, empty_ok=True),
        memory_texts=f.texts_("memory_texts"),
        dropped=f.slots_("dropped", required=False),
        answer_text=f.str_("answer_text", required=False, max_len=limits.max_text_len, empty_ok=True),
    )
    n = len(candidates)
    event.candidate_ids = read_candidate_ids(f, n)
    event.canary = True if f.bool_("canary", required=False) else None
    read_canary_arm(f, event)
    read_canary_mixture(f, event)
    read_incumbent(f, event)
    read_base(f, event)
    principal = f.get("principal", required=False)
    event.principal = None if principal is None else check_principal(principal)
    for name, lo in (("candidate_masks", 0.0), ("candidate_probs", 0.0)):
        arr = f.floats_(name, required=False, lo=lo)
        if arr is not None:
            if len(arr) != n:
                raise Rejected("inconsistent", f"{name} and candidates differ in length")
            setattr(event, name, arr)
    return event


def read_candidate_ids(f: Fields, n: int) -> list[str] | None:
    """Contract 1.3's optional ``candidate_ids``: ``n`` distinct, non-empty memory ids, or None.

    >>> from topics.fields import Fields, Limits
    >>> read_candidate_ids(Fields({"candidate_ids": ["a", "b"]}, Limits()), 2)
    ['a', 'b']
    >>> try:
    ...     read_candidate_ids(Fields({"candidate_ids": ["a", "a"]}, Limits()), 2)
    ... except Rejected as e:
    ...     print(e.reason)
    inconsistent
    """
    items = f.list_("candidate_ids", required=False, max_len=f.limits.max_candidates)
    if items is None:
        return None
    ids: list[str] = []
    for item in items:
        if type(item) is not str:
            raise Rejected("wrong_type", "candidate_ids[] must be strings")
        if not item:
            raise Rejected("out_of_range", "candidate_ids[] is empty")
        if len(item) > f.limits.max_id_len:
            raise Rejected("oversize", f"candidate_ids[] longer than {f.limits.max_id_len}")
        ids.append(item)
    if len(ids) != n:
        raise Rejected("inconsistent", "candidate_ids and candidates differ in length")
    if len(set(ids)) != n:
        raise Rejected("inconsistent", "candidate_ids repeats a memory id")
    return ids


def read_canary_arm(f: Fields, event: RetrievalEvent) -> None:
    """Contract 1.5's ``canary_arm`` and ``canary_version``: both or neither; the arm agrees with ``canary``.

    >>> e = RetrievalEvent("e", "q", 0, 0.0, Features(np.zeros(1, np.float32), 0.0, 0.0), [1], np.zeros(1), [1],
    ...                    0.05, 0.0, False)
    >>> read_canary_arm(Fields({"canary_arm": "tie", "canary_version": 3}, Limits()), e)
    >>> e.canary_arm, e.canary_version
    ('tie', 3)
    >>> read_canary_arm(Fields({"canary_arm": "canary", "canary_version": 3}, Limits()), e)
    Traceback (most recent call last):
    ...
    topics.fields.Rejected: inconsistent: canary_arm "canary" without canary: true
    """
    arm = f.str_("canary_arm", required=False)
    version = f.int_("canary_version", 0, 2**62, required=False)
    other = f.slots_("canary_other", required=False)
    if other is not None and (arm not in ("canary", "serving") or not other):
        raise Rejected("inconsistent", "canary_other only on a coupled request whose slates differed")
    if arm is None and version is None:
        return
    if arm is None:
        raise Rejected("inconsistent", "canary_version without canary_arm")
    if arm not in CANARY_ARMS:
        raise Rejected("out_of_range", f"canary_arm must be one of {', '.join(CANARY_ARMS)}")
    if version is None:
        raise Rejected("inconsistent", "canary_arm without canary_version")
    if (arm == "canary") != bool(event.canary):
        raise Rejected(
            "inconsistent",
            f'canary_arm "{arm}" without canary: true' if arm == "canary" else f'canary_arm "{arm}" with canary: true',
        )
    event.canary_arm, event.canary_version, event.canary_other = arm, version, other


def read_incumbent(f: Fields, event: RetrievalEvent) -> None:
    """Contract 1.17's ``incumbent``: the client's own first k served, not drawn; not on a fallback
    step or the canary's request, with ``logprob`` 0 and ``selected`` the first k of ``candidates``.

    >>> e = RetrievalEvent("e", "q", 0, 0.0, Features(np.zeros(1, np.float32), 0.0, 0.0), [4, 2, 9], np.zeros(3),
    ...                    [4, 2], 0.001, 0.0, False)
    >>> read_incumbent(Fields({"incumbent": True}, Limits()), e)
    >>> e.incumbent
    True
    >>> e.selected = [2, 4]
    >>> read_incumbent(Fields({"incumbent": True}, Limits()), e)
    Traceback (most recent call last):
    ...
    topics.fields.Rejected: inconsistent: incumbent: selected is not the first 2 candidates
    """
    if not f.bool_("incumbent", required=False):
        return
    if event.fallback:
        raise Rejected("inconsistent", "incumbent on a fallback step")
    if event.canary:
        raise Rejected("inconsistent", "incumbent on the canary's request")
    if event.logprob != 0.0:
        raise Rejected("inconsistent", "incumbent with a logprob other than 0")
    if event.selected != event.candidates[: len(event.selected)]:
        raise Rejected("inconsistent", f"incumbent: selected is not the first {len(event.selected)} candidates")
    event.incumbent = True


def read_base(f: Fields, event: RetrievalEvent) -> None:
    """Contract 1.23's ``base``: drawn under the certified version a probe's manifest names; not
    with ``incumbent``, on a fallback step or on the canary's request.

    >>> e = RetrievalEvent("e", "q", 0, 0.0, Features(np.zeros(1, np.float32), 0.0, 0.0), [4, 2, 9], np.zeros(3),
    ...                    [2, 4], 0.05, -1.5, False)
    >>> read_base(Fields({"base": True}, Limits()), e)
    >>> e.base
    True
    >>> e.canary = True
    >>> read_base(Fields({"base": True}, Limits()), e)
    Traceback (most recent call last):
    ...
    topics.fields.Rejected: inconsistent: base on the canary's request
    """
    if not f.bool_("base", required=False):
        return
    if event.incumbent:  # the client's own first k, or the base's draw: one request is not both
        raise Rejected("inconsistent", "base with incumbent")
    if event.fallback:
        raise Rejected("inconsistent", "base on a fallback step")
    if event.canary:
        raise Rejected("inconsistent", "base on the canary's request")
    event.base = True


def read_canary_mixture(f: Fields, event: RetrievalEvent) -> None:
    """Contract 1.9's ``canary_rate`` and ``alternative_version``: both or neither, not on a coupled
    request, the rate strictly between 0 and 1.

    >>> e = RetrievalEvent("e", "q", 0, 0.0, Features(np.zeros(1, np.float32), 0.0, 0.0), [1], np.zeros(1), [1],
    ...                    0.05, 0.0, False)
    >>> read_canary_mixture(Fields({"canary_rate": 0.2, "alternative_version": 3}, Limits()), e)
    >>> e.canary_rate, e.alternative_version
    (0.2, 3)
    >>> read_canary_mixture(Fields({"canary_rate": 0.2}, Limits()), e)
    Traceback (most recent call last):
    ...
    topics.fields.Rejected: inconsistent: canary_rate without alternative_version
    """
    rate = f.float_("canary_rate", 0.0, 1.0, required=False)
    alternative = f.int_("alternative_version", 0, 2**62, required=False)
    if rate is None and alternative is None:
        return
    if rate is None:
        raise Rejected("inconsistent", "alternative_version without canary_rate")
    if alternative is None:
        raise Rejected("inconsistent", "canary_rate without alternative_version")
    if rate in (0.0, 1.0):
        raise Rejected("out_of_range", "canary_rate must be strictly between 0 and 1")
    if event.canary_arm is not None:
        raise Rejected("inconsistent", "canary_rate on a coupled request (canary_arm says its arm)")
    event.canary_rate, event.alternative_version = rate, alternative
