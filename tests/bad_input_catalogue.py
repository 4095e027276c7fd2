"""The catalogue of bad wire messages for the bad-input scale test (docs/contract.md).

:func:`bad_messages` draws, for each of ``retrieval-events``, ``llm-feedback`` and
``human-labels``, messages of every category: every reason in ``topics.fields.REASONS``,
truncated bytes, huge arrays, deep nesting, wrong types, NaN/inf (as non-JSON literals and
as ``1e400``), lone surrogates, invalid UTF-8, a BOM, missing keys and keys that differ
from the query id. Each carries the reason it is meant to be rejected with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from topics.fields import SCHEMA_FEEDBACK, SCHEMA_LABEL, SCHEMA_RETRIEVAL

from .bad_input_cases import DELETE, RAW, F, Gen, L, Msg, R, dumps, set_path


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
    string_fields = {
        R: ["query_text", "answer_text", "event_id", "policy"],
        F: ["event_id"],
        L: ["labeler", "event_id"],
    }

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
            return set_path(b, f, "s" * (16 * 1024 + 1 + i if f in ("query_text", "answer_text") else 257 + i))

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
        ("answer_text", 5),
        ("answer_text", ["the answer"]),
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
        kind = rng.randrange(9)
        if kind == 7:  # contract 1.5: the canary's arm on a request the canary did not serve
            return {**b, "canary_arm": "canary", "canary_version": 2}
        if kind == 8:  # contract 1.5: the other slate on a tie
            return {**b, "canary_arm": "tie", "canary_version": 2, "canary_other": [c[0]]}
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

    # contract 1.1: nll_without_slot, the leave-one-out NLL per selected slot
    def slots_without_pair_f(b: dict, i: int) -> dict:
        b = {k: v for k, v in b.items() if k not in ("nll_with", "nll_without")}
        return {**b, "utility": 0.5, "nll_without_slot": {"0": 1.0}}

    add(F, "slots_without_pair", "inconsistent", 20, slots_without_pair_f)
    add(
        F,
        "slots_wrong_type",
        "wrong_type",
        20,
        lambda b, i: {
            **b,
            "nll_with": 1.0,
            "nll_without": 2.0,
            "nll_without_slot": rng.choice([[1.0], "x", 3, {"a": 1.0}, {"0": "1.0"}, {"0": True}]),
        },
    )
    add(
        F,
        "slots_out_of_range",
        "out_of_range",
        20,
        lambda b, i: {
            **b,
            "nll_with": 1.0,
            "nll_without": 2.0,
            "nll_without_slot": rng.choice([{str(s): 1.0}, {"-1": 1.0}, {"0": -0.5}]),
        },
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
