"""Bad input at scale (docs/contract.md): it never stops a worker and never reaches the model.

A seeded generator writes >10,000 messages to ``retrieval-events``, ``llm-feedback`` and
``human-labels``: good retrieval/feedback pairs (distinct query ids, some with RTL,
zero-width and other valid unicode in their ids, unknown extra fields, edge-of-range
values) and bad messages of every category: every reason in ``topics.fields.REASONS``,
truncated bytes, huge arrays, deep nesting, wrong types, NaN/inf (as non-JSON literals and
as ``1e400``), lone surrogates, invalid UTF-8, a BOM, missing keys and keys that differ
from the query id. Each bad message's intended reason is checked against the codec when
it is generated, so the end-to-end assertions are about the pipeline: a real ``causalmem
worker`` and ``causalmem learner`` must dead-letter exactly the bad messages with those
reasons, join every good pair exactly once, apply every joined experience, and publish
only finite checkpoints.

A Hypothesis test drives the join stage the same way at a smaller scale, with shrinking.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.config import Settings
from pipeline.deadletter import DeadLetterWriter
from pipeline.lab.procs import Child
from pipeline.metrics import Metrics
from pipeline.modeltopic import scan_model_topic
from pipeline.promtext import metric
from pipeline.worker.join import JoinStage
from topics.fields import REASONS, SCHEMA_FEEDBACK, SCHEMA_LABEL, SCHEMA_RETRIEVAL, Limits, Rejected
from topics.internal import decode_experience
from topics.names import DECODERS

from .conftest import settings_env

pytestmark = [pytest.mark.broker, pytest.mark.slow]

R, F, L = "retrieval-events", "llm-feedback", "human-labels"
DL_KEEP = 64 * 1024  # dead_letter_value keeps this much of the original value
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
        # ASCII text only here; non-ASCII text before a NaN literal is covered by its own test below.
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


def bad_messages(g: Gen) -> list[Msg]:
    rng, d, s = g.rng, g.d, g.s
    out: list[Msg] = []

    def add(topic: str, category: str, reason: str, n: int, make: Callable[[dict, int], Any]) -> None:
        out.extend(g.bad(topic, category, reason, n, make))

    required = {
        R: [
            "schema",
            "event_id",
            "query_id",
            "step",
            "ts",
            "features",
            "candidates",
            "scores",
            "selected",
            "temperature",
            "logprob",
            "fallback",
            "features.query_embedding",
            "features.last_step_loss",
            "features.last_step_entropy",
        ],
        F: ["schema", "event_id", "query_id", "step", "ts"],
        L: ["schema", "event_id", "query_id", "ts", "labeler", "kind"],
    }
    string_fields = {R: ["query_text", "event_id", "policy"], F: ["event_id"], L: ["labeler", "event_id"]}

    for topic, scale in ((R, 1.0), (F, 0.6), (L, 0.35)):

        def n(k: int, scale: float = scale) -> int:
            return max(3, int(k * scale))

        # -- bad_json: truncated bytes, garbage, empty, tombstones, invalid UTF-8, lone surrogates, depth, BOM
        def truncated(b: dict, i: int) -> bytes:
            raw = dumps(b)
            head = len(dumps({"event_id": b["event_id"]})) - 1  # keep the unique id in what remains
            return raw[: rng.randint(head, len(raw) - 1)]

        add(topic, "truncated", "bad_json", n(150), truncated)
        add(
            topic,
            "garbage",
            "bad_json",
            n(60),
            lambda b, i: (
                rng.choice([b"\x00", b"<xml>", b"\x1f\x8b\x08", b"{'single': 'quotes'", b"{,}"])
                + b["event_id"].encode()
                + rng.randbytes(rng.randint(0, 200))
            ),
        )
        add(topic, "empty", "bad_json", n(10), lambda b, i: b"")
        add(topic, "tombstone", "bad_json", n(10), lambda b, i: (None, b["query_id"]))
        add(topic, "bom", "bad_json", n(10), lambda b, i: b"\xef\xbb\xbf" + dumps(b))
        fields = string_fields[topic]

        def invalid_utf8(b: dict, i: int, fields: list[str] = fields) -> bytes:
            bad = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82", b"\x80x"])
            return dumps(set_path(b, rng.choice(fields), RAW), b'"id ' + bad + f' {i}"'.encode())

        add(topic, "invalid_utf8", "bad_json", n(80), invalid_utf8)

        def lone_surrogate(b: dict, i: int, fields: list[str] = fields) -> bytes:
            text = rng.choice(["\\ud800", "x\\udfffy", "\\ud83d\\u0041", "\\udc00\\ud800", "\\ud834"])
            return dumps(set_path(b, rng.choice(fields), RAW), f'"{text}{i}"')

        add(topic, "lone_surrogate", "bad_json", n(60), lone_surrogate)

        def deep(b: dict, i: int) -> bytes:
            depth = rng.randint(1100, 5000)
            text = "[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth
            return dumps(set_path(b, "x_deep", RAW), text)

        add(topic, "deep_nesting", "bad_json", n(40), deep)

        # -- not_object
        add(
            topic,
            "not_object",
            "not_object",
            n(60),
            lambda b, i: rng.choice(
                [
                    dumps([b]),
                    dumps([b["event_id"]]),
                    dumps(b["event_id"]),
                    str(i).encode(),
                    b"null",
                    b"true",
                    b"-0.5e3",
                    b"[]",
                ]
            ),
        )

        # -- oversize: whole message, strings over their limits, huge arrays
        add(topic, "oversize_bytes", "oversize", 4 if topic != L else 2, lambda b, i: {**b, "pad": "p" * 280_000})

        def oversize_string(b: dict, i: int, fields: list[str] = fields) -> dict:
            f = rng.choice(fields)
            return set_path(b, f, "s" * (16 * 1024 + 1 + i if f == "query_text" else 257 + i))

        add(topic, "oversize_string", "oversize", n(40), oversize_string)

        def long_qid(b: dict, i: int) -> Any:
            qid = "Q" * rng.randint(257, 1000) + str(i)
            return set_path(b, "query_id", qid), qid

        add(topic, "oversize_query_id", "oversize", n(10), long_qid)

        # -- unknown_schema
        schemas = ["retrieval_event/v2", "llm_feedback/v9", "human_label/v0", "RETRIEVAL_EVENT/V1", "", 1, ["x"]]
        schemas += [SCHEMA_RETRIEVAL, SCHEMA_FEEDBACK, SCHEMA_LABEL, " " + SCHEMA_FEEDBACK, SCHEMA_LABEL + "\u200b"]
        own = {R: SCHEMA_RETRIEVAL, F: SCHEMA_FEEDBACK, L: SCHEMA_LABEL}[topic]
        wrong = [x for x in schemas if x != own]
        add(topic, "unknown_schema", "unknown_schema", n(60), lambda b, i, w=wrong: {**b, "schema": rng.choice(w)})

        # -- missing_field (absent or null)
        def missing(b: dict, i: int, req: list[str] = required[topic]) -> dict:
            return set_path(b, rng.choice(req), DELETE if rng.random() < 0.5 else None)

        add(topic, "missing_field", "missing_field", n(120), missing)

        # -- non_finite: NaN/Infinity literals (json.dumps style) and 1e400
        num_paths = {
            R: ["ts", "temperature", "logprob", "features.last_step_loss", "scores", "features.query_embedding"],
            F: ["ts", "utility", "nll_with", "nll_without"],
            L: ["ts", "rating"],
        }[topic]

        def non_finite(b: dict, i: int, literals: list[str], num_paths: list[str] = num_paths) -> bytes:
            path = rng.choice(num_paths)
            lit = rng.choice(literals)
            if path in ("scores", "features.query_embedding"):
                parent = b["features"]["query_embedding"] if path.startswith("features") else b["scores"]
                j = rng.randrange(len(parent))
                values = [RAW if k == j else v for k, v in enumerate(parent)]
                return dumps(set_path(b, path, values), lit)
            return dumps(set_path(b, path, RAW), lit)

        add(topic, "nan_literal", "non_finite", n(80), lambda b, i: non_finite(b, i, ["NaN", "Infinity", "-Infinity"]))
        add(topic, "inf_1e400", "non_finite", n(80), lambda b, i: non_finite(b, i, ["1e400", "-1e400", "1E999"]))

        # -- key problems: no key, a key other than the query id
        add(topic, "key_none", "key_mismatch", n(100), lambda b, i: (b, None))

        def wrong_key(b: dict, i: int) -> Any:
            qid = f"café-{i}-{b['event_id']}"  # precomposed é
            b = {**b, "query_id": qid}
            key = rng.choice(
                [
                    qid.replace("é", "e\u0301"),  # the same text in NFD
                    qid + "\u200b",
                    " " + qid,
                    qid.upper(),
                    "q-1",  # another (good) query's id
                    "\u202e" + qid,
                ]
            )
            return b, key

        add(topic, "key_wrong", "key_mismatch", n(100), wrong_key)

        # -- ts_in_future: valid for the codec (ts ≤ 1e11), but far ahead of the worker's clock
        if topic != L:
            add(topic, "ts_future", "ts_in_future", n(30), lambda b, i: {**b, "ts": rng.uniform(4e9, 1e11)})

    # -- per-topic categories: wrong types, out of range, inconsistencies, embedding length
    wrong_types_r = [
        ("step", "3"),
        ("step", 1.5),
        ("step", True),
        ("ts", "now"),
        ("ts", True),
        ("features", [1, 2]),
        ("features", "x"),
        ("features.query_embedding", "abc"),
        ("features.query_embedding", {"0": 1}),
        ("features.query_embedding", ["0.1"] * d),
        ("features.query_embedding", [True] * d),
        ("features.query_embedding", [[0.1]] * d),
        ("features.query_embedding", [None] * d),
        ("features.last_step_loss", "1"),
        ("candidates", "1,2"),
        ("candidates", [1.5]),
        ("candidates", [True]),
        ("scores", {"a": 1}),
        ("selected", "0"),
        ("temperature", "hot"),
        ("logprob", []),
        ("fallback", "false"),
        ("fallback", 0),
        ("event_id", 5),
        ("query_id", 5),
        ("policy", 1),
        ("memory_texts", {"x": "t"}),
        ("memory_texts", {"1": 5}),
        ("memory_texts", []),
        ("dropped", "x"),
    ]

    def wrong_type_r(b: dict, i: int) -> dict:
        path, value = rng.choice(wrong_types_r)
        if path in ("candidates",) and isinstance(value, list):
            return {**b, "candidates": value, "scores": [0.5] * len(value), "selected": []}
        return set_path(b, path, value)

    add(R, "wrong_type", "wrong_type", 150, wrong_type_r)
    out_of_range_r: list[tuple[str, Any]] = [
        ("step", -1),
        ("step", 2**31 + 1),
        ("ts", -5.0),
        ("ts", 1e12),
        ("temperature", 0),
        ("temperature", -1.0),
        ("temperature", 1e7),
        ("logprob", 0.5),
        ("features.last_step_loss", 2e6),
        ("features.last_step_entropy", -2e6),
        ("query_id", ""),
        ("event_id", ""),
        ("policy_version", -1),
        ("mask_max", -0.5),
        ("memory_texts", {str(s): "x"}),
    ]

    def out_of_range_r_make(b: dict, i: int) -> Any:
        choice = rng.randrange(len(out_of_range_r) + 5)
        if choice < len(out_of_range_r):
            path, value = out_of_range_r[choice]
            b2 = set_path(b, path, value)
            return (b2, None) if path == "query_id" else b2
        if choice == len(out_of_range_r):  # a slot >= S
            return {**b, "candidates": [s, *b["candidates"][1:]], "selected": []}
        if choice == len(out_of_range_r) + 1:  # a negative slot
            return {**b, "candidates": [-1, *b["candidates"][1:]], "selected": []}
        if choice == len(out_of_range_r) + 2:  # an embedding value beyond max_abs_value
            return set_path(b, "features.query_embedding", [2e6, *b["features"]["query_embedding"][1:]])
        if choice == len(out_of_range_r) + 3:  # a negative probability
            return {**b, "candidate_probs": [-0.1] * len(b["candidates"])}
        return dumps(set_path(b, "step", RAW), "1" + "0" * 30)  # beyond 64 bits

    add(R, "out_of_range", "out_of_range", 150, out_of_range_r_make)

    def embedding_length(b: dict, i: int) -> dict:
        k = rng.choice([x for x in range(0, 4 * d + 1) if x != d])
        return set_path(b, "features.query_embedding", [0.25] * k)

    add(R, "embedding_length", "embedding_length", 100, embedding_length)

    def oversize_array_r(b: dict, i: int) -> dict:
        kind = rng.randrange(4)
        if kind == 0:
            cands = [rng.randrange(s) for _ in range(rng.randint(1025, 3000))]
            return {**b, "candidates": cands, "scores": [0.1] * len(cands), "selected": []}
        if kind == 1:
            return set_path(b, "features.query_embedding", [0.5] * rng.randint(4 * d + 1, 5000))
        if kind == 2:
            return {**b, "memory_texts": {str(k): "m" for k in range(1025 + i)}}
        return {**b, "query_text": "t" * (16 * 1024 + 1 + i)}

    add(R, "oversize_array", "oversize", 60, oversize_array_r)

    def inconsistent_r(b: dict, i: int) -> dict:
        c = b["candidates"]
        kind = rng.randrange(7)
        if kind == 0:
            return {**b, "scores": [*b["scores"], 0.5]}
        if kind == 1:
            return {**b, "scores": b["scores"][:-1]}
        if kind == 2:
            other = next(x for x in range(s) if x not in c)
            return {**b, "selected": [other]}
        if kind == 3:
            return {**b, "candidates": [c[0], c[0]], "scores": [0.1, 0.2], "selected": []}
        if kind == 4:
            return {**b, "candidates": [c[0]], "scores": [0.1], "selected": [c[0], c[0]]}
        if kind == 5:
            return {**b, "candidates": [], "scores": [], "selected": []}
        return {**b, "candidate_masks": [0.5] * (len(c) + 1)}

    add(R, "inconsistent", "inconsistent", 100, inconsistent_r)

    wrong_types_f = [
        ("step", "0"),
        ("ts", "x"),
        ("utility", "0.5"),
        ("utility", True),
        ("nll_with", [1]),
        ("nll_without", {}),
        ("event_id", 1),
        ("query_id", 1.0),
    ]

    add(F, "wrong_type", "wrong_type", 80, lambda b, i: set_path(b, *rng.choice(wrong_types_f)))

    def missing_utility_f(b: dict, i: int) -> dict:
        b = {k: v for k, v in b.items() if k not in ("utility", "nll_with", "nll_without")}
        return rng.choice([b, {**b, "nll_with": 1.0}, {**b, "nll_without": 1.0}, {**b, "utility": None}])

    add(F, "missing_utility", "missing_field", 50, missing_utility_f)

    def out_of_range_f(b: dict, i: int) -> Any:
        b = {k: v for k, v in b.items() if k not in ("utility", "nll_with", "nll_without")}
        kind = rng.randrange(9)
        if kind == 0:
            return {**b, "nll_with": -0.1, "nll_without": 1.0}
        if kind == 1:
            return {**b, "nll_with": 1.0, "nll_without": -1.0}
        if kind == 2:
            return {**b, "utility": 2e6}
        if kind == 3:
            return {**b, "utility": -2e6}
        if kind == 4:
            return {**b, "utility": 0.1, "step": -1}
        if kind == 5:
            return {**b, "utility": 0.1, "ts": -1.0}
        if kind == 6:
            return {**b, "utility": 0.1, "ts": 1e12}
        if kind == 7:
            return {**b, "utility": 0.1, "event_id": ""}
        return {**b, "utility": 0.1, "query_id": ""}, None

    add(F, "out_of_range", "out_of_range", 80, out_of_range_f)
    add(
        F,
        "inconsistent",
        "inconsistent",
        60,
        lambda b, i: {**b, "nll_with": 1.0, "nll_without": 2.0, "utility": rng.choice([0.9, 1.1, -1.0, 0.0])},
    )

    wrong_types_l = [
        ("labeler", 5),
        ("kind", 3),
        ("ts", "yesterday"),
        ("step", "1"),
        ("event_id", ["e"]),
    ]

    def wrong_type_l(b: dict, i: int) -> dict:
        kind = rng.randrange(len(wrong_types_l) + 5)
        if kind < len(wrong_types_l):
            return set_path(b, *wrong_types_l[kind])
        base = {k: b[k] for k in ("event_id", "schema", "query_id", "ts", "labeler")}
        return [
            {**base, "kind": "verdict", "answer_correct": "false"},
            {**base, "kind": "verdict", "answer_correct": 0},
            {**base, "kind": "rating", "rating": "3"},
            {**base, "kind": "rating", "rating": 2.5},
            {**base, "kind": "memory_choice", "sample_id": "s", "correct_memories": "1,2"},
        ][kind - len(wrong_types_l)]

    add(L, "wrong_type", "wrong_type", 40, wrong_type_l)

    def missing_kind_field_l(b: dict, i: int) -> dict:
        base = {k: b[k] for k in ("event_id", "schema", "query_id", "ts", "labeler")}
        return rng.choice(
            [
                {**base, "kind": "rating"},
                {**base, "kind": "verdict", "answer_correct": None},
                {**base, "kind": "memory_choice", "correct_memories": [1]},
                {**base, "kind": "memory_choice", "sample_id": "s"},
            ]
        )

    add(L, "missing_kind_field", "missing_field", 30, missing_kind_field_l)

    def out_of_range_l(b: dict, i: int) -> Any:
        base = {k: b[k] for k in ("event_id", "schema", "query_id", "ts", "labeler")}
        return rng.choice(
            [
                {**base, "kind": "rating", "rating": 6},
                {**base, "kind": "rating", "rating": -1},
                {**base, "kind": "thumbs"},
                {**base, "kind": "memory_choice", "sample_id": "s", "correct_memories": [s]},
                {**base, "kind": "rating", "rating": 3, "step": -1},
                {**base, "kind": "rating", "rating": 3, "ts": -1.0},
                {**base, "kind": "rating", "rating": 3, "labeler": ""},
                ({**base, "kind": "rating", "rating": 3, "query_id": ""}, None),
            ]
        )

    add(L, "out_of_range", "out_of_range", 40, out_of_range_l)
    add(
        L,
        "inconsistent",
        "inconsistent",
        20,
        lambda b, i: {
            **{k: b[k] for k in ("event_id", "schema", "query_id", "ts", "labeler")},
            "kind": "memory_choice",
            "sample_id": "s",
            "correct_memories": [1, 2, 1],
        },
    )
    add(
        L,
        "oversize_skip_reason",
        "oversize",
        10,
        lambda b, i: {
            **{k: b[k] for k in ("event_id", "schema", "query_id", "ts", "labeler")},
            "kind": "memory_choice",
            "sample_id": "s",
            "correct_memories": [],
            "skip_reason": "r" * 1025,
        },
    )
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


def generate(seed: int, s: Settings, good_pairs: int) -> tuple[list[Msg], list[str]]:
    g = Gen(seed, s.embedding_dim, s.slots)
    good, eids = g.good_pairs(good_pairs)
    qids = [m.key for m in good if m.topic == R]
    labels = g.good_labels(max(30, good_pairs // 20), [q for q in qids if q])
    bad = bad_messages(g)
    msgs = good + labels + bad
    limits = s.limits()
    wrong = [(m.category, m.reason, codec_reason(m, limits)) for m in msgs if codec_reason(m, limits) != m.reason]
    assert not wrong, f"generator bug: intended vs codec reason {wrong[:10]}"
    g.rng.shuffle(msgs)
    return msgs, eids


def signature(topic: str, key: bytes | None, head: bytes | None, size: int) -> tuple:
    return (topic, key, head, size)


def msg_signature(s: Settings, m: Msg) -> tuple:
    full = s.topics().by_short_name(m.topic).name
    key = m.key.encode("utf-8") if m.key else None
    head = None if m.value is None else m.value[:DL_KEEP]
    return signature(full, key, head, 0 if m.value is None else len(m.value))


def dl_signature(key: bytes | None, record: dict) -> tuple:
    if "original" in record:
        head: bytes | None = record["original"].encode("utf-8")
    elif "original_b64" in record:
        head = base64.b64decode(record["original_b64"])
    else:
        head = None
    return signature(record["source"]["topic"], key, head, record["original_size"])


# ------------------------------------------------- found by the generator: character vs byte positions


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("topic", [R, F, L])
def test_non_finite_literal_after_non_ascii_text_is_non_finite(topic: str, literal: str) -> None:
    g = Gen(7, 8, 32)
    qid = "\u202eq-é"  # valid unicode before the literal
    base = {R: g.good_event(qid, "e1"), F: g.good_feedback(qid, "e1"), L: g.good_label(qid, "e1", "rating")}[topic]
    msg = Msg(topic, qid, dumps(set_path(base, "ts", RAW), literal), "nan-after-unicode", "non_finite")
    assert codec_reason(msg, Limits(embedding_dim=8, slots=32)) == "non_finite"


@pytest.mark.parametrize("qid,literal", [("q-ascii", "NaN"), ("q-ascii", "-Infinity"), ("\u202eq-é", "1e400")])
def test_non_finite_literal_control_cases(qid: str, literal: str) -> None:
    """The same messages with ASCII before the literal, or with 1e400, are non_finite today."""
    base = Gen(7, 8, 32).good_event(qid, "e1")
    msg = Msg(R, qid, dumps(set_path(base, "ts", RAW), literal), "control", "non_finite")
    assert codec_reason(msg, Limits(embedding_dim=8, slots=32)) == "non_finite"


# --------------------------------------------------------------------------- the scale test


async def _publish(s: Settings, msgs: list[Msg]) -> None:
    async with EventPublisher(s.bootstrap, s, validate=False) as pub:
        for m in msgs:
            await pub.send_raw(m.topic, m.value, m.key)
        await pub.flush()


def _wait(pred: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s: {what()}")


GOOD_PAIRS = 3500


def test_ten_thousand_messages_bad_input_is_dead_lettered_good_input_learned(topics_ready: Settings, tmp_path: Path):
    s = topics_ready.replace(join_window_s=1e10)
    assert (s.embedding_dim, s.slots) == (8, 32)
    t0 = time.monotonic()
    msgs, good_eids = generate(20240601, s, GOOD_PAIRS)
    bad = [m for m in msgs if m.reason is not None]
    assert len(msgs) >= 10_000, len(msgs)
    assert {m.reason for m in bad} == set(REASONS), "every rejection reason is exercised"
    by_topic = Counter(m.topic for m in msgs)
    assert min(by_topic[R], by_topic[F], by_topic[L]) > 500, by_topic
    keyless = sum(1 for m in msgs if m.key is None)
    assert keyless >= 150

    # Each bad message must be recognisable on the dead-letter topic by (topic, key, value).
    expected_by_sig: dict[tuple, str] = {}
    for m in bad:
        sig = msg_signature(s, m)
        assert expected_by_sig.setdefault(sig, m.category) == m.category, f"ambiguous bad message {m.category}"
    expected_counts = Counter(m.category for m in bad)
    expected_reason = {m.category: m.reason for m in bad}

    env = {**settings_env(s), "CAUSALMEM_JOIN_WINDOW_S": "1e10"}
    worker = Child("worker", s.bootstrap, env, ["--log-level", "info"], log_path=tmp_path / "worker.log")
    learner = Child("learner", s.bootstrap, env, ["--log-level", "info"], log_path=tmp_path / "learner.log")
    children = [worker, learner]
    try:
        asyncio.run(_publish(s, msgs))
        published_s = time.monotonic() - t0
        n_bad, n_good = len(bad), len(good_eids)

        def state() -> dict[str, float]:
            w, lm = worker.metrics(), learner.metrics()
            return {
                "rejected": metric(w, "causalmem_events_rejected_total"),
                "joins": metric(w, "causalmem_joins_total"),
                "applied": metric(lm, "causalmem_learner_experiences_total", kind="feedback"),
            }

        target = {"rejected": n_bad, "joins": n_good, "applied": n_good}

        def diag() -> str:
            return (
                f"have {state()}, want {target}; worker alive={worker.alive()} learner alive={learner.alive()}\n"
                f"--- worker log:\n{worker.log_tail(3000)}\n--- learner log:\n{learner.log_tail(3000)}"
            )

        _wait(lambda: state() == target, 100, diag)
        time.sleep(2.0)  # anything extra (a duplicate, a late rejection) would show now
        assert state() == target, diag()
        assert worker.alive() and learner.alive(), diag()

        # Rejections by (topic, reason) in the worker's metrics.
        w = worker.metrics()
        want_metric = Counter((s.topics().by_short_name(m.topic).name, m.reason) for m in bad)
        for (topic, reason), count in want_metric.items():
            assert metric(w, "causalmem_events_rejected_total", topic=topic, reason=reason) == count, (topic, reason)
        lm = learner.metrics()
        assert metric(lm, "causalmem_events_rejected_total") == 0, "the learner saw a bad experience"
        assert metric(lm, "causalmem_learner_skipped_total") == 0, "the learner skipped experiences"

        # The dead-letter topic holds exactly the bad messages, each with its intended reason.
        dead = asyncio.run(kafka.read_all(s.bootstrap, s, s.topics().dead_letter.name, idle_s=2.0))
        assert len(dead) == n_bad, (len(dead), n_bad)
        got: dict[str, Counter] = defaultdict(Counter)
        unmatched = []
        for rec in dead:
            body = orjson.loads(rec.value)
            assert body["schema"] == "dead_letter/v1" and body["reason"] in REASONS
            category = expected_by_sig.get(dl_signature(rec.key, body))
            if category is None:
                unmatched.append((rec.key, body["reason"], body["source"], body.get("original", "")[:80]))
                continue
            got[category][body["reason"]] += 1
        assert not unmatched, f"dead letters matching no bad message sent: {unmatched[:5]}"
        mismatched = {
            cat: dict(got[cat])
            for cat in expected_counts
            if got[cat] != Counter({expected_reason[cat]: expected_counts[cat]})
        }
        assert not mismatched, {c: (expected_reason[c], expected_counts[c], mismatched[c]) for c in mismatched}

        # Every good pair joined exactly once; nothing bad reached the experiences topic.
        exps = asyncio.run(kafka.read_all(s.bootstrap, s, s.topics().experiences.name, idle_s=2.0))
        ids = Counter(decode_experience(m.value, s.limits()).id for m in exps)
        assert set(ids) == set(good_eids), (len(set(ids) - set(good_eids)), len(set(good_eids) - set(ids)))
        assert all(c == 1 for c in ids.values()), [i for i, c in ids.items() if c > 1][:5]

        # The learner's newest checkpoint covers every experience and holds only finite tensors.
        def newest() -> Any:
            return asyncio.run(scan_model_topic(s.bootstrap, s)).serving.get(s.policy)

        _wait(
            lambda: (m := newest()) is not None and m.metrics.get("experiences") == n_good,
            30,
            lambda: f"newest manifest {newest()}",
        )
        index = asyncio.run(scan_model_topic(s.bootstrap, s))
        manifest = index.serving[s.policy]
        assert manifest.input_offsets[f"{s.topics().experiences.name}:0"] == len(exps)
        tensors = asyncio.run(fetch_checkpoint(s.bootstrap, s, index, manifest))
        assert all(torch.isfinite(t).all() for t in tensors.values())
        assert worker.alive() and learner.alive(), diag()
        print(
            f"\n{len(msgs)} messages ({n_bad} bad in {len(expected_counts)} categories, {n_good} good pairs) "
            f"published in {published_s:.1f} s, settled after {time.monotonic() - t0:.1f} s"
        )
    finally:
        for c in children:
            c.stop()


# --------------------------------------------------------------------------- Hypothesis, smaller scale

D_H, S_H = 8, 32
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5)
)


@st.composite
def good_event_st(draw: st.DrawFn, qid: str, eid: str) -> dict:
    cands = draw(st.lists(st.integers(0, S_H - 1), min_size=1, max_size=10, unique=True))
    sel = draw(st.lists(st.sampled_from(cands), unique=True, max_size=len(cands)))
    return {
        "schema": SCHEMA_RETRIEVAL,
        "event_id": eid,
        "query_id": qid,
        "step": draw(st.integers(0, 2**31)),
        "ts": draw(st.floats(BASE_TS, BASE_TS + 1e4)),
        "features": {
            "query_embedding": draw(st.lists(finite, min_size=D_H, max_size=D_H)),
            "last_step_loss": draw(finite),
            "last_step_entropy": draw(finite),
        },
        "candidates": cands,
        "scores": draw(st.lists(finite, min_size=len(cands), max_size=len(cands))),
        "selected": sel,
        "temperature": draw(st.floats(1e-6, 1e6)),
        "logprob": draw(st.floats(-1e6, 1e-6)),
        "fallback": False,
    }


@st.composite
def arbitrary_message(draw: st.DrawFn, n: int) -> tuple[str, bytes | None, bytes | None]:
    """(topic, key, value): raw bytes, arbitrary JSON, or a good event/feedback with one field mutated."""
    topic = draw(st.sampled_from([R, F]))
    qid = f"zz\u200b{n}"
    base = (
        draw(good_event_st(qid, f"x{n}"))
        if topic == R
        else {"schema": SCHEMA_FEEDBACK, "event_id": f"x{n}", "query_id": qid, "step": 0, "ts": BASE_TS, "utility": 0.1}
    )
    kind = draw(st.sampled_from(["bytes", "json", "mutate", "mutate", "nonjson"]))
    if kind == "bytes":
        value: bytes | None = draw(st.binary(max_size=300) | st.none())
    elif kind == "json":
        value = json.dumps(draw(json_value)).encode()
    else:
        paths = [*base, *(f"features.{k}" for k in base.get("features", {}))]
        path = draw(st.sampled_from(paths))
        new = DELETE if draw(st.booleans()) and kind == "mutate" else draw(json_value)
        # json.dumps writes NaN/Infinity literals (orjson would write null) and escapes lone surrogates.
        value = json.dumps(set_path(base, path, new)).encode()
    key = draw(st.sampled_from([qid.encode(), None, b"other", qid.encode() + b"\xff"]))
    return topic, key, value


@st.composite
def batch_st(draw: st.DrawFn) -> tuple[list[tuple[str, str, bytes]], list[tuple[str, bytes | None, bytes | None]]]:
    good = []
    for i in range(draw(st.integers(0, 5))):
        qid = draw(st.sampled_from(ODD_UNICODE)) + f"g{i}"
        ev = draw(good_event_st(qid, f"g{i}"))
        fb = {
            "schema": SCHEMA_FEEDBACK,
            "event_id": f"g{i}",  # a feedback may reuse its event's id
            "query_id": qid,
            "step": ev["step"],
            "ts": draw(st.floats(BASE_TS, BASE_TS + 1e4)),
            "utility": draw(st.floats(-1e6, 1e6)),
        }
        good += [(R, qid, orjson.dumps(ev)), (F, qid, orjson.dumps(fb))]
    good = draw(st.permutations(good))
    other = [draw(arbitrary_message(i)) for i in range(draw(st.integers(0, 12)))]
    return good, other


def _records(s: Settings, msgs: list[tuple[str, bytes | None, bytes | None]]) -> dict[TopicPartition, list]:
    batch: dict[TopicPartition, list] = {}
    for topic, key, value in msgs:
        tp = TopicPartition(s.topics().by_short_name(topic).name, 0)
        records = batch.setdefault(tp, [])
        records.append(
            ConsumerRecord(tp.topic, 0, len(records), 0, 0, key, value, None, len(key or b""), len(value or b""), [])
        )
    return batch


@hsettings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(batch=batch_st())
def test_join_stage_routes_any_batch_like_the_codec(topics_ready: Settings, batch: Any) -> None:
    """Any batch: the join stage never raises, dead-letters exactly what the codec rejects
    (with the codec's reason, on the dead-letter topic) and what lies in the future
    (``ts_in_future``), and joins every good pair."""
    s = topics_ready.replace(join_window_s=1e10)
    assert (s.embedding_dim, s.slots) == (D_H, S_H)
    good, other = batch
    limits = s.limits()
    msgs = [(t, q.encode(), v) for t, q, v in good] + list(other)
    expected: Counter = Counter()
    for topic, key, value in other:
        try:
            decoded = DECODERS[topic](value, limits, key)
        except Rejected as rej:
            expected[rej.reason] += 1
        else:  # valid, but the join also holds ts to its clock
            if decoded.ts > time.time() + s.max_future_skew_s:
                expected["ts_in_future"] += 1
    dl_topic = s.topics().dead_letter.name

    async def run() -> None:
        metrics = Metrics()
        stage = JoinStage(s.join(), s.bootstrap, metrics)
        # Only the stage's output side is started: the batch is handed to process() directly
        # (a consumer group join would cost seconds per example on the embedded broker).
        producer = kafka.producer(s.bootstrap, s)
        await producer.start()
        stage._producer = producer
        stage._dead = dead_writer = DeadLetterWriter(producer, dl_topic, metrics)
        try:
            before = await kafka.high_watermark(s.bootstrap, s, dl_topic)
            await stage.process(_records(s, msgs))
            await dead_writer.flush()
        finally:
            await producer.stop()
        assert stage.joined_total == len(good) // 2
        rejected: Counter = Counter()
        for topic in (s.topics().retrieval_events.name, s.topics().llm_feedback.name):
            for reason in REASONS:
                rejected[reason] += int(metrics.rejected.labels(topic=topic, reason=reason)._value.get())
        assert +rejected == expected
        dead = await kafka.read_all(s.bootstrap, s, dl_topic, start={0: before}, idle_s=0.5)
        assert Counter(orjson.loads(m.value)["reason"] for m in dead) == expected

    asyncio.run(run())
