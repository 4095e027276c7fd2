#!/usr/bin/env python3
"""An outside team's producer, written from the wire contract alone (docs/contract.md §3, §6).

It imports nothing from causal-memory-pipeline: only aiokafka, orjson, numpy and the
standard library. It publishes N RetrievalEvents with their LLMFeedback, keyed by
query_id, plus a few deliberately bad messages that the pipeline must dead-letter, and
prints one JSON summary line.

The events come from a serving side that has no policy yet (mask m = 0 for every slot),
so the serving rule (contract §6) reduces to: nothing is hard-dropped and z_i = score_i / T. ``selected`` is
drawn in order without replacement from softmax(z) (Plackett–Luce) and ``logprob`` is the
log-probability of that ordered draw.

Topics must exist (``causalmem init-topics``): the producer refuses to auto-create them,
because an auto-created input topic gets the broker's default partition count and breaks
the co-partitioned join.

    python examples/contract_publisher.py --bootstrap 127.0.0.1:19092 --dim 384 --slots 1024 --events 100
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
import uuid

import numpy as np
import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

RETRIEVAL_TOPIC = "retrieval-events"
FEEDBACK_TOPIC = "llm-feedback"


# --------------------------------------------------------------------------- serving rule, m = 0


def logsumexp(x: np.ndarray) -> float:
    top = float(np.max(x))
    return top + math.log(float(np.sum(np.exp(x - top))))


def plackett_luce_draw(z: np.ndarray, k: int, rng: np.random.Generator) -> tuple[list[int], float]:
    """Draw k positions in order without replacement from softmax(z); return them and log π.

    log π(selected) = Σ_j [ z_{σ_j} − logsumexp_{i ∈ C \\ {σ_1..σ_{j−1}}} z_i ]
    """
    remaining = list(range(len(z)))
    chosen: list[int] = []
    logprob = 0.0
    for _ in range(min(k, len(z))):
        zr = z[remaining]
        lse = logsumexp(zr)
        probs = np.exp(zr - lse)
        pick = remaining[int(rng.choice(len(remaining), p=probs / probs.sum()))]
        logprob += float(z[pick]) - lse
        chosen.append(pick)
        remaining.remove(pick)
    return chosen, logprob


# --------------------------------------------------------------------------- messages


def make_step(
    rng: np.random.Generator, run: str, query_id: str, step: int, dim: int, slots: int, n_candidates: int, k: int
) -> tuple[dict, dict]:
    """One RetrievalEvent and its LLMFeedback."""
    q = rng.normal(size=dim)
    q /= np.linalg.norm(q)
    candidates = [int(s) for s in rng.choice(slots, size=min(n_candidates, slots), replace=False)]
    scores = np.sort(rng.uniform(0.1, 0.95, size=len(candidates)))[::-1]
    temperature = 0.2
    z = scores / temperature  # m = 0: no hard drop, z_i = score_i · (1 + α·0) / T
    positions, logprob = plackett_luce_draw(z, k, rng)
    selected = [candidates[p] for p in positions]
    now = time.time()
    event = {
        "schema": "retrieval_event/v1",
        "event_id": f"{run}-r-{query_id}-{step}",
        "query_id": query_id,
        "step": step,
        "ts": now,
        "policy": "default",
        "policy_version": 0,
        "features": {
            "query_embedding": [float(v) for v in q],
            "last_step_loss": float(rng.uniform(0.0, 3.0)),
            "last_step_entropy": float(rng.uniform(0.0, 4.0)),
        },
        "candidates": candidates,
        "scores": [float(s) for s in scores],
        "selected": selected,
        "temperature": temperature,
        "logprob": logprob,
        "fallback": False,
        "mask_max": 0.0,
    }
    if step % 3 == 0:  # contract 1.1: the texts and the answer, as a service sends them for an LM evaluator
        event["query_text"] = f"question {query_id}/{step}"
        event["memory_texts"] = {str(s): f"memory {s}" for s in selected}
        event["answer_text"] = f"answer {query_id}/{step}"
    # The LLM evaluator's answer: mean NLL of the answer span with and without the
    # retrieved memories (u = nll_without − nll_with; positive = the memories helped).
    # Here the even slots "help", so there is something to learn.
    helped = sum(1 for s in selected if s % 2 == 0) - 0.5 * len(selected)
    nll_without = float(rng.uniform(1.5, 3.0))
    nll_with = max(0.0, nll_without - 0.4 * helped + float(rng.normal(0.0, 0.05)))
    feedback = {
        "schema": "llm_feedback/v1",
        "event_id": f"{run}-f-{query_id}-{step}",
        "query_id": query_id,
        "step": step,
        "ts": now + 0.5,
        "nll_with": nll_with,
        "nll_without": nll_without,
    }
    if step % 4 == 0:
        # Contract 1.1, per-memory credit: the NLL with every selected memory but one, per slot
        # (keys are slot numbers as strings). Without an even slot the answer gets harder.
        feedback["nll_without_slot"] = {
            str(s): max(0.0, nll_with + (0.4 if s % 2 == 0 else -0.1) + float(rng.normal(0.0, 0.05))) for s in selected
        }
    return event, feedback


def bad_messages(rng: np.random.Generator, run: str, dim: int, slots: int) -> list[tuple[str, bytes, bytes, str]]:
    """(topic, key, value, expected dead-letter reason) for messages the pipeline must reject."""
    out: list[tuple[str, bytes, bytes, str]] = []
    qid = f"{run}-bad-0"
    out.append(
        (RETRIEVAL_TOPIC, qid.encode(), b'{"schema": "retrieval_event/v1", "event_id": "x", "query_', "bad_json")
    )
    event, _ = make_step(rng, run, f"{run}-bad-1", 0, dim + 1, slots, 8, 3)  # D+1 embedding values
    out.append((RETRIEVAL_TOPIC, event["query_id"].encode(), orjson.dumps(event), "embedding_length"))
    out.append((RETRIEVAL_TOPIC, f"{run}-bad-2".encode(), b'{"x": NaN}', "non_finite"))
    _, feedback = make_step(rng, run, f"{run}-bad-3", 0, dim, slots, 8, 3)
    raw = orjson.dumps(feedback).replace(b'"nll_with":', b'"nll_with":NaN,"ignored":', 1)
    out.append((FEEDBACK_TOPIC, feedback["query_id"].encode(), raw, "non_finite"))
    return out


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    run = args.run_id or uuid.uuid4().hex[:8]
    topics = {name: args.prefix + name for name in (RETRIEVAL_TOPIC, FEEDBACK_TOPIC)}

    admin = AIOKafkaAdminClient(bootstrap_servers=args.bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
    finally:
        await admin.close()
    missing = sorted(t for t in topics.values() if t not in existing)
    if missing:
        print(f"topics {missing} do not exist; create them first (causalmem init-topics)", file=sys.stderr)
        return 2

    # Default partitioner (murmur2 of the key), as Kafka's Java client: the pipeline joins
    # both topics partition by partition. No idempotence (docs/contract.md §2): at-least-once; the
    # pipeline dedupes on event_id.
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, acks="all", enable_idempotence=False, linger_ms=10)
    await producer.start()
    futures = []
    sent = events = 0
    expected_reasons: list[str] = []
    try:
        step_of: dict[str, int] = {}
        query_ids: list[str] = []
        while events < args.events:
            # A query has 1-3 steps (agent turns); the next step of an open query or a new one.
            if query_ids and rng.random() < 0.5 and step_of[query_ids[-1]] < 3:
                qid = query_ids[-1]
            else:
                qid = f"{run}-q{len(query_ids)}"
                query_ids.append(qid)
                step_of[qid] = 0
            event, feedback = make_step(rng, run, qid, step_of[qid], args.dim, args.slots, args.candidates, args.k)
            step_of[qid] += 1
            key = qid.encode()
            futures.append(await producer.send(topics[RETRIEVAL_TOPIC], orjson.dumps(event), key=key))
            futures.append(await producer.send(topics[FEEDBACK_TOPIC], orjson.dumps(feedback), key=key))
            events += 1
            sent += 2
        if not args.no_bad:
            for short, key, value, reason in bad_messages(rng, run, args.dim, args.slots):
                futures.append(await producer.send(topics[short], value, key=key))
                expected_reasons.append(reason)
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    summary = {
        "sent": sent,
        "events": events,
        "feedback": events,
        "queries": len(query_ids),
        "bad": len(expected_reasons),
        "bad_reasons": expected_reasons,
        "run_id": run,
    }
    print(orjson.dumps(summary).decode(), flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default="127.0.0.1:19092", help="Kafka bootstrap HOST:PORT")
    p.add_argument("--prefix", default="", help="topic name prefix of the deployment")
    p.add_argument("--dim", type=int, default=384, help="D, the query embedding length")
    p.add_argument("--slots", type=int, default=1024, help="S, memory slots")
    p.add_argument("--events", type=int, default=100, help="retrieval events to publish (each with its feedback)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated contents")
    p.add_argument("--candidates", type=int, default=8, help="candidates per retrieval")
    p.add_argument("-k", type=int, default=3, help="memories selected per retrieval")
    p.add_argument("--run-id", help="id prefix (default: random; the same ids again are deduplicated)")
    p.add_argument("--no-bad", action="store_true", help="do not send the deliberately bad messages")
    args = p.parse_args(argv)
    if args.dim < 1 or args.slots < 1 or args.events < 0 or args.candidates < 1 or args.k < 1:
        p.error("--dim, --slots, --candidates and -k must be positive, --events non-negative")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
