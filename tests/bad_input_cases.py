"""Seeded good and bad wire messages for the bad-input tests (docs/contract.md).

The message record, JSON helpers that splice raw (non-JSON) text into a message, the seeded
generator :class:`Gen` of good events, feedback and labels (with RTL, zero-width and other
valid unicode, unknown extra fields, edge-of-range values), and :func:`codec_reason`, what
the codec says about a message as the worker reads it. The catalogue of bad messages is in
tests/bad_input_catalogue.py. Shared by tests/unit/topics/test_bad_input_codec.py,
tests/integration/test_bad_input_scale.py and tests/integration/test_bad_input_join_stage.py.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from pipeline.config import Settings
from topics.fields import SCHEMA_FEEDBACK, SCHEMA_LABEL, SCHEMA_RETRIEVAL, Limits, Rejected
from topics.names import DECODERS

R, F, L = "retrieval-events", "llm-feedback", "human-labels"
RAW = "\x00RAW\x00"  # placeholder replaced by raw (non-orjson) JSON text
BASE_TS = 1_767_225_600.0

# Valid unicode that must be accepted in ids (docs/contract.md: only *malformed* input is bad).
ODD_UNICODE = [
    "\u202e",  # right-to-left override
    "\u200f",  # right-to-left mark
    "\u200b",  # zero-width space
    "\u200d",  # zero-width joiner
    "\ufeff",  # zero-width no-break space (BOM character inside a string)
    "\u2028",  # line separator
    "\u0000",  # NUL
    "שאלה",
    "سؤال",
    "問題",
    "🔥",
    "\U0001f469\u200d\U0001f52c",  # ZWJ emoji sequence
    "e\u0301",  # combining accent
    "\U0010fffd",  # plane-16 private use
]


@dataclass(frozen=True)
class Msg:
    topic: str  # short topic name
    key: str | None
    value: bytes | None
    category: str
    reason: str | None  # intended dead-letter reason; None for good input


# --------------------------------------------------------------------------- encoding helpers


def dumps(obj: Any, raw: str | bytes | None = None) -> bytes:
    """orjson JSON; the one ``RAW`` string value is replaced by ``raw`` verbatim (non-JSON text or bytes)."""
    out = orjson.dumps(obj)
    if raw is not None:
        marker = orjson.dumps(RAW)
        assert out.count(marker) == 1, "exactly one RAW placeholder"
        out = out.replace(marker, raw.encode() if isinstance(raw, str) else raw)
    return out


def set_path(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set (or, for the ``DELETE`` sentinel, remove) a dotted path in a JSON object copy."""
    obj = json.loads(json.dumps(obj))  # deep copy of plain JSON
    *parents, last = path.split(".")
    target = obj
    for p in parents:
        target = target[p]
    if value is DELETE:
        target.pop(last, None)
    else:
        target[last] = value
    return obj


DELETE = object()


# --------------------------------------------------------------------------- good input


class Gen:
    """Seeded generators of good and bad messages for D-dimensional, S-slot settings."""

    def __init__(self, seed: int, d: int, s: int) -> None:
        self.rng = random.Random(seed)
        self.d = d
        self.s = s
        self.limits = Limits(embedding_dim=d, slots=s)

    # ---- good values
    def good_event(self, qid: str, eid: str, step: int = 0, ts: float = BASE_TS, variant: str = "plain") -> dict:
        rng, d, s = self.rng, self.d, self.s
        cands = rng.sample(range(s), k=rng.randint(1, min(8, s)))
        sel = rng.sample(cands, k=rng.randint(0, len(cands)))
        ev: dict[str, Any] = {
            "event_id": eid,
            "schema": SCHEMA_RETRIEVAL,
            "query_id": qid,
            "step": step,
            "ts": ts,
            "policy": "default",
            "policy_version": rng.randint(0, 50),
            "features": {
                "query_embedding": [rng.gauss(0.0, 1.0) for _ in range(d)],
                "last_step_loss": rng.uniform(0.0, 4.0),
                "last_step_entropy": rng.uniform(0.0, 4.0),
            },
            "candidates": cands,
            "scores": [rng.uniform(-1.0, 1.0) for _ in cands],
            "selected": sel,
            "temperature": rng.uniform(0.05, 2.0),
            "logprob": -rng.uniform(0.0, 12.0),
            "fallback": False,
        }
        if variant == "extras":  # unknown extra fields are ignored (docs/contract.md)
            nested: Any = 1
            for _ in range(rng.randint(2, 200)):
                nested = [nested] if rng.random() < 0.5 else {"n": nested}
            ev["x_future_field"] = nested
            ev["x_blob"] = "z" * rng.randint(0, 20_000)
            ev["features"]["x_extra_feature"] = [1, "two", None]
        elif variant == "optional":
            ev["mask_max"] = rng.uniform(0.0, 10.0)
            ev["query_text"] = "".join(rng.choice(ODD_UNICODE) for _ in range(rng.randint(0, 40)))
            ev["memory_texts"] = {str(c): f"mem {c} {rng.choice(ODD_UNICODE)}" for c in cands}
            ev["dropped"] = [x for x in range(s) if x not in cands][: rng.randint(0, 4)]
            probs = [rng.random() for _ in cands]
            ev["candidate_probs"] = [p / sum(probs) for p in probs]
            ev["candidate_masks"] = [rng.uniform(0.0, 3.0) for _ in cands]
        elif variant == "ints":  # integers where floats are expected, an integral float step
            ev["features"]["query_embedding"] = [rng.randint(-3, 3) for _ in range(d)]
            ev["features"]["last_step_loss"] = 1
            ev["ts"] = int(ts)
            ev["temperature"] = 1
            ev["step"] = float(step)
        elif variant == "edge":  # values at the limits, still valid
            m = 1e6
            ev["features"]["query_embedding"] = [rng.choice([m, -m, 0.0, 5e-324]) for _ in range(d)]
            ev["features"]["last_step_loss"] = m
            ev["features"]["last_step_entropy"] = -m
            ev["scores"] = [rng.choice([m, -m, 0.0]) for _ in cands]
            ev["temperature"] = rng.choice([1e-6, 1e6])
            ev["logprob"] = rng.choice([-m, 1e-6, 0.0])
            ev["policy_version"] = 2**62
        return ev

    def good_feedback(self, qid: str, eid: str, step: int = 0, ts: float = BASE_TS + 1, variant: str = "") -> dict:
        rng = self.rng
        fb: dict[str, Any] = {"event_id": eid, "schema": SCHEMA_FEEDBACK, "query_id": qid, "step": step, "ts": ts}
        # Utilities stay above the active-learning threshold (-0.3): no samples, no resets.
        form = variant or rng.choice(["utility", "nll", "both"])
        if form == "edge":
            fb["nll_with"], fb["nll_without"] = 0.0, 1e6
        elif form == "utility":
            fb["utility"] = rng.uniform(-0.25, 1.5)
        else:
            fb["nll_with"] = rng.uniform(0.5, 3.0)
            fb["nll_without"] = fb["nll_with"] + rng.uniform(-0.25, 1.5)
            if form == "both":
                fb["utility"] = fb["nll_without"] - fb["nll_with"]
        return fb

    def good_label(self, qid: str, eid: str, kind: str, labeler: str | None = None) -> dict:
        rng = self.rng
        lab: dict[str, Any] = {
            "event_id": eid,
            "schema": SCHEMA_LABEL,
            "query_id": qid,
            "ts": BASE_TS + 2,
            "labeler": labeler or f"labeler {rng.choice(ODD_UNICODE)}",
            "kind": kind,
        }
        if kind == "rating":
            lab["rating"] = rng.randint(0, 5)
        elif kind == "verdict":
            lab["answer_correct"] = rng.random() < 0.5
        else:
            lab["sample_id"] = f"unknown-sample-{eid}"
            lab["correct_memories"] = rng.sample(range(self.s), k=rng.randint(0, 3))
        return lab

    def good_qid(self, i: int) -> str:
        if i % 4 == 0:
            rng = self.rng
            return f"{rng.choice(ODD_UNICODE)}q{i}{rng.choice(ODD_UNICODE)}{rng.choice(ODD_UNICODE)}"
        return f"q-{i}"

    def good_pairs(self, n: int) -> tuple[list[Msg], list[str]]:
        msgs: list[Msg] = []
        eids: list[str] = []
        variants = ["plain"] * 6 + ["extras", "optional", "ints", "edge"]
        for i in range(n):
            qid = self.good_qid(i)
            variant = variants[i % len(variants)]
            step = self.rng.choice([0, 0, 0, 1, 7, 2**31])
            eid = f"ev-{i}-{qid}"
            ts = BASE_TS + self.rng.uniform(0.0, 3600.0)
            ev = self.good_event(qid, eid, step, ts, variant)
            fb = self.good_feedback(qid, f"fb-{i}", step, ts + self.rng.uniform(-5.0, 30.0), variant)
            if variant == "edge":
                fb = self.good_feedback(qid, f"fb-{i}", step, ts + 1.0, "edge")
            msgs.append(Msg(R, qid, dumps(ev), f"good:{variant}", None))
            msgs.append(Msg(F, qid, dumps(fb), f"good:{variant}", None))
            eids.append(eid)
        return msgs, eids

    def good_labels(self, n: int, pair_qids: list[str]) -> list[Msg]:
        out = []
        for i in range(n):
            kind = ["rating", "verdict", "memory_choice"][i % 3]
            # Ratings only for queries without feedback: no (U_query, rating) pairs, no drift resets.
            qid = f"lbl-{i}{self.rng.choice(ODD_UNICODE)}" if kind == "rating" else self.rng.choice(pair_qids)
            out.append(Msg(L, qid, dumps(self.good_label(qid, f"lab-{i}", kind)), f"good:label-{kind}", None))
        return out

    # ---- bad values
    def base(self, topic: str, tag: str) -> dict:
        qid = f"bad-{tag}"
        if topic == R:
            return self.good_event(qid, qid)
        if topic == F:
            return self.good_feedback(qid, qid)
        # ASCII text only here; non-ASCII text before a NaN literal: tests/unit/topics/test_bad_input_codec.py.
        return self.good_label(qid, qid, self.rng.choice(["rating", "verdict", "memory_choice"]), "labeler-1")

    def bad(self, topic: str, category: str, reason: str, n: int, make: Callable[[dict, int], Any]) -> list[Msg]:
        """``make(base, i)`` returns bytes, ``(bytes | None, key)``, or a dict (JSON-encoded)."""
        out = []
        for i in range(n):
            base = self.base(topic, f"{topic[0]}.{category}.{i}")
            made = make(base, i)
            key: str | None = base["query_id"]
            if isinstance(made, tuple):
                made, key = made
            value = dumps(made) if isinstance(made, dict) else made
            out.append(Msg(topic, key, value, f"{topic}:{category}", reason))
        return out


def codec_reason(msg: Msg, limits: Limits) -> str | None:
    """What the codec says about a message as the worker reads it (key included), and the
    join's clock: an event or feedback too far in the future is ``ts_in_future``."""
    key = msg.key.encode("utf-8") if msg.key else None
    try:
        value = DECODERS[msg.topic](msg.value, limits, key)
    except Rejected as rej:
        return rej.reason
    if msg.topic != L and value.ts > time.time() + Settings().max_future_skew_s:
        return "ts_in_future"
    return None
