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

The messages come from tests/bad_input_cases.py and tests/bad_input_catalogue.py. A
Hypothesis test drives the join stage the same way at a smaller scale, with shrinking
(tests/integration/test_bad_input_join_stage.py).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from causalmem_lab.procs import Child

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.config import Settings
from pipeline.modeltopic import scan_model_topic
from pipeline.promtext import metric
from tests.bad_input_cases import F, Gen, L, Msg, R, codec_reason
from tests.bad_input_catalogue import bad_messages
from tests.conftest import settings_env
from topics.fields import REASONS
from topics.internal import decode_experience

pytestmark = [pytest.mark.broker, pytest.mark.slow]

DL_KEEP = 64 * 1024  # dead_letter_value keeps this much of the original value


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


# --------------------------------------------------------------------------- the scale test


async def _publish(s: Settings, msgs: list[Msg]) -> None:
    async with EventPublisher(s.bootstrap, s, validate=False, max_events=len(msgs)) as pub:  # a bulk load: hold all
        for m in msgs:
            await pub.send_raw(m.topic, m.value, m.key)
        assert await pub.flush(timeout=120) and pub.dropped == 0


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
