"""``causalmem bench throughput``: the pipeline against raw aiokafka, the learner against bare torch.

Measured side by side in one run, on one broker:

1. **raw consume**: an aiokafka consumer group reading N joined-experience-sized messages
   with ``getmany`` and decoding each with orjson (the most a consumer can do here);
2. **pipeline**: a real ``causalmem worker`` and ``causalmem learner``, warmed up by a few
   batches of pairs through every stage (start-up is not timed: faust's group join and
   table recovery come after the join's first read); then N RetrievalEvents and N
   LLMFeedback produced at once: time from the worker's first read of them until every
   stage is done with all N, i.e. the learner has applied all N
   experiences *and* the worker's outcomes stage has written all N queries' U_query (the
   last write of each to the ``query-utility`` table's changelog, whose record timestamps
   say when). Its rate counts input messages (2N), as the issue asks. The window that
   closes at the learner's last update alone (the figure reported before, while the
   outcomes stage could still be working) is reported next to it;
3. **learner step**: the learner's code path for one micro-batch (``Learner.apply``:
   tensorising experiences, baseline, importance weights, metrics, the update) against a
   bare torch REINFORCE step on the same batches already in tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from causalmem_lab.procs import Child
from models.policy.batch import make_batch
from models.policy.network import init_policy
from models.policy.reinforce import importance_weights, reinforce_loss
from models.policy.sparse_adam import RowSparseAdam
from models.serving.rule import adjusted_logits_torch, plackett_luce_logprob_torch
from pipeline import kafka
from pipeline.cli.common import settings_from
from pipeline.config import KafkaSecurity, Settings
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from pipeline.promtext import metric
from topics.events import Features, RetrievalEvent
from topics.feedback import LLMFeedback
from topics.fields import encode
from topics.internal import Experience, decode_experience

TARGET_PIPELINE = 0.25
WARMUP_BATCHES = 4  # learner batches of warm-up pairs through every stage before the timed input
TARGET_LEARNER = 0.80


def make_events(n: int, d: int, s: int, seed: int = 0, candidates: int = 20, k: int = 3) -> list[Experience]:
    rng = np.random.default_rng(seed)
    base = 1_767_225_600.0  # 2026-01-01: in the past (the join rejects ts beyond now + max_future_skew_s)
    out = []
    for i in range(n):
        cand = [int(c) for c in rng.choice(s, size=candidates, replace=False)]
        ev = RetrievalEvent(
            event_id=f"b{seed}-{i}",
            query_id=f"bq{seed}-{i}",
            step=0,
            ts=base + i * 0.01,
            features=Features(
                rng.normal(size=d).astype(np.float32), float(rng.uniform(0, 3)), float(rng.uniform(0, 2))
            ),
            candidates=cand,
            scores=rng.uniform(0.2, 0.9, size=candidates),
            selected=cand[:k],
            temperature=0.05,
            logprob=float(-rng.uniform(0.1, 3.0)),
            fallback=False,
        )
        out.append(Experience(ev.event_id, "feedback", ev, float(rng.normal(0.2, 0.6))))
    return out


def security_env(settings: Settings) -> dict[str, str]:
    """The ``CAUSALMEM_KAFKA_*`` variables of ``settings``' SASL/TLS and producer settings that
    are set, for a child process.

    >>> security_env(Settings())
    {'CAUSALMEM_KAFKA_SECURITY_PROTOCOL': 'PLAINTEXT', 'CAUSALMEM_KAFKA_IDEMPOTENCE': 'auto'}
    """
    sec = dataclasses.asdict(settings.security)
    return {f"{KafkaSecurity.ENV_PREFIX}{k.upper()}": str(v) for k, v in sec.items() if v is not None}


async def produce(bootstrap: str, settings: Settings, items: list[tuple[str, bytes, bytes]]) -> None:
    p = kafka.producer(bootstrap, settings, linger_ms=20)
    await p.start()
    try:
        futures = [await p.send(topic, value, key=key) for topic, key, value in items]
        await asyncio.gather(*futures)
    finally:
        await p.stop()


async def raw_consume(bootstrap: str, settings: Settings, topic: str, n: int) -> float:
    """Messages per second for a consumer group reading and decoding n messages."""
    c = kafka.consumer(bootstrap, settings, topic, group_id=f"bench-raw-{uuid.uuid4().hex[:6]}", max_poll_records=5000)
    await c.start()
    try:
        seen = 0
        first = None
        while seen < n:
            batch = await c.getmany(timeout_ms=500, max_records=5000)
            for msgs in batch.values():
                if msgs and first is None:
                    first = time.perf_counter()
                for m in msgs:
                    orjson.loads(m.value)
                seen += len(msgs)
        assert first is not None
        return n / (time.perf_counter() - first)
    finally:
        await c.stop()


async def outcomes_done(bootstrap: str, settings: Settings, n: int, timeout: float = 600.0) -> float:
    """When the worker's outcomes stage wrote its last of ``n`` queries' U_query (epoch seconds).

    Read from the ``query-utility`` changelog, incrementally: its record timestamps are the
    worker's own send times, so polling late costs no precision.
    """
    topic = f"{settings.worker().app_id}-query-utility-changelog"
    keys: set[bytes] = set()
    last_ms = 0
    start: dict[int, int] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        for m in await kafka.read_all(bootstrap, settings, topic, start=dict(start), idle_s=0.5):
            keys.add(m.key)
            last_ms = max(last_ms, m.timestamp)
            start[m.partition] = max(start.get(m.partition, 0), m.offset + 1)
        if len(keys) >= n:
            return last_ms / 1000.0
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the outcomes stage wrote {len(keys)} of {n} queries within {timeout:g} s")


def pipeline_run(
    bootstrap: str,
    settings: Settings,
    env: dict[str, str],
    items: list[tuple[str, bytes, bytes]],
    warmup: list[tuple[str, bytes, bytes]],
    logdir: Path,
) -> dict[str, float]:
    """Start a worker and a learner, warm them up, then time every stage on ``items`` (pairs).

    The warm-up pairs go through every stage first (faust's tables recovered and opened,
    the learner's first batches done), so that start-up is not timed; then the timed
    input is produced at once, and the window runs from the worker's first read of it
    until every stage is done with it.
    """
    n, w = len(items) // 2, len(warmup) // 2
    worker = Child("worker", bootstrap, env, log_path=logdir / "worker.log")
    learner = Child("learner", bootstrap, env, log_path=logdir / "learner.log")

    def applied() -> float:
        return metric(learner.metrics(), "causalmem_learner_experiences_total", kind="feedback")

    def check() -> None:
        if not worker.alive() or not learner.alive():
            raise RuntimeError(f"a process died:\n{worker.log_tail()}\n{learner.log_tail()}")

    try:
        asyncio.run(produce(bootstrap, settings, warmup))
        deadline = time.monotonic() + 300
        while applied() < w:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError("the warm-up did not reach the learner within 300 s")
            time.sleep(0.2)
        asyncio.run(outcomes_done(bootstrap, settings, w, timeout=300))
        read_before = metric(worker.metrics(), "causalmem_events_in_total")
        producer = threading.Thread(target=lambda: asyncio.run(produce(bootstrap, settings, items)))
        producer.start()
        t_first = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            # Until the first read: poll the worker often (it is idle). Afterwards poll the
            # learner rarely (a scrape costs it CPU) and take the end time from its own
            # last-update timestamp.
            if t_first is None:
                if metric(worker.metrics(), "causalmem_events_in_total") > read_before:
                    t_first = time.time()
                time.sleep(0.02)
            else:
                lm = learner.metrics()
                if metric(lm, "causalmem_learner_experiences_total", kind="feedback") >= w + n:
                    learner_end = metric(lm, "causalmem_learner_last_update_timestamp_seconds")
                    end = max(learner_end, asyncio.run(outcomes_done(bootstrap, settings, w + n)))
                    producer.join()
                    return {
                        "learner_window_seconds": learner_end - t_first,
                        "learner_window_input_per_s": 2 * n / (learner_end - t_first),
                        "seconds": end - t_first,
                        "input_per_s": 2 * n / (end - t_first),
                        "experiences_per_s": n / (end - t_first),
                    }
                time.sleep(0.5)
            check()

        raise TimeoutError("the pipeline did not apply every experience within 600 s")
    finally:
        worker.stop()
        learner.stop()


class BareStep:
    """The REINFORCE step with nothing around it: tensors in, Adam step out."""

    def __init__(self, d: int, s: int, lr: float, seed: int = 0) -> None:
        self.net = init_policy(d, s, seed=seed)
        # The trainer's optimizer: the output layer's gradients are row-sparse (models/policy/row_adam.py).
        backbone = [p for name, p in self.net.named_parameters() if not name.startswith("out.")]
        self.opt = RowSparseAdam(backbone, self.net.out.weight, self.net.out.bias, lr, huge_pages=True)
        self.b = 0.0

    def __call__(self, batch: Any) -> None:
        adv = torch.as_tensor(batch.utility - self.b, dtype=torch.float32)
        self.b = float(0.99 * self.b + 0.01 * batch.utility.mean())
        h = self.net.features(batch.embedding, batch.loss, batch.entropy)
        m = self.net.candidate_masks(h, batch.slots)
        z = adjusted_logits_torch(batch.scores, m, self.net.alpha, batch.temperature)
        logp = plackett_luce_logprob_torch(z, batch.valid, batch.selected, batch.selected_valid)
        loss = reinforce_loss(logp, adv, importance_weights(logp, batch.logged_logprob, 5.0))
        self.opt.zero_grad()
        torch.autograd.backward(loss)
        self.opt.clip_grad_norm_(1.0)
        self.opt.step()
        self.opt.zero_grad()


def learner_vs_bare(settings: Settings, exps: list[Experience], rounds: int = 7) -> dict[str, float]:

    b = settings.batch_size
    chunks = [exps[i : i + b] for i in range(0, len(exps) - b + 1, b)]
    raw_chunks = [[encode(e.to_dict()) for e in c] for c in chunks]
    limits = settings.limits()
    learner = Learner(settings.learner(), "127.0.0.1:1", Metrics(role="learner"))  # apply() never touches Kafka
    bare = BareStep(settings.embedding_dim, settings.slots, settings.lr)
    tensors = [make_batch(c) for c in chunks]
    for c, t in zip(chunks[:5], tensors[:5], strict=True):  # warm-up (allocator, kernels)
        learner.apply(list(c))
        bare(t)
    learner_t, decode_t, bare_t = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for c in chunks:
            learner.apply(list(c))
        learner_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for raw in raw_chunks:
            learner.apply([decode_experience(r, limits) for r in raw])
        decode_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in tensors:
            bare(t)
        bare_t.append(time.perf_counter() - t0)
    n = len(chunks) * b
    return {
        "batch_size": b,
        "learner_per_s": n / statistics.median(learner_t),
        "learner_with_decode_per_s": n / statistics.median(decode_t),
        "bare_per_s": n / statistics.median(bare_t),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.broker import own_broker

    n = args.events or 20_000
    base = settings_from(args)  # the environment, then the flags (--security-protocol, --sasl-username, ...)
    d, s = base.embedding_dim, base.slots
    logdir = Path(tempfile.mkdtemp(prefix="causalmem-bench-"))
    bootstrap, broker = own_broker(args.bootstrap, logdir / "broker.log")
    try:
        prefix = f"bench-{uuid.uuid4().hex[:6]}."
        settings = base.replace(bootstrap=bootstrap, topic_prefix=prefix, state_dir=str(logdir / "state"))
        await kafka.wait_for_broker(bootstrap, settings)
        await kafka.create_topics(bootstrap, settings)
        print(
            f"bench throughput: N={n:,} events, D={d}, S={s}, batch {settings.batch_size}, broker {bootstrap}; "
            f"logs in {logdir} (removed after a successful run)",
            flush=True,
        )
        exps = make_events(n, d, s, seed=args.seed)
        # "Joined-experience-sized": a RetrievalEvent in its contract JSON joined with its
        # utility, i.e. what a pipeline reads per joined step. (Our own internal experience
        # messages are smaller — the embedding travels as base64 float32 — which is part of
        # what the pipeline measure credits, not the baseline.)
        exp_bytes = [encode({**e.event.to_dict(), "utility": e.utility}) for e in exps]

        size = int(np.mean([len(b) for b in exp_bytes]))
        raw_topic = settings.topics().experiences.name.replace("experiences", "bench-raw")
        from topics.names import TopicSpec

        await kafka.create_topics(bootstrap, settings, [TopicSpec(raw_topic, settings.partitions)])
        await produce(
            bootstrap,
            settings,
            [(raw_topic, e.event.query_id.encode(), b) for e, b in zip(exps, exp_bytes, strict=True)],
        )
        raw = [await raw_consume(bootstrap, settings, raw_topic, n) for _ in range(3)]
        raw_rate = statistics.median(raw)
        print(f"  raw consume: {raw_rate:,.0f} msg/s ({size:,} B messages; median of {raw})", flush=True)

        t = settings.topics()

        def pairs(batch: list[Experience]) -> list[tuple[str, bytes, bytes]]:
            out = []
            for e in batch:
                key = e.event.query_id.encode()
                out.append((t.retrieval_events.name, key, encode(e.event.to_dict())))
                fb = LLMFeedback(f"f-{e.id}", e.event.query_id, 0, e.event.ts + 0.5, e.utility)
                out.append((t.llm_feedback.name, key, encode(fb.to_dict())))
            return out

        items = pairs(exps)
        warmup = pairs(make_events(WARMUP_BATCHES * settings.batch_size, d, s, seed=args.seed + 1))
        env = {
            "CAUSALMEM_TOPIC_PREFIX": prefix,
            "CAUSALMEM_STATE_DIR": str(logdir / "state"),
            "CAUSALMEM_EMBEDDING_DIM": str(d),
            "CAUSALMEM_SLOTS": str(s),
            "CAUSALMEM_JOIN_WINDOW_S": "86400",
            **security_env(settings),  # the worker and learner connect as the bench does
        }
        pipe = await asyncio.to_thread(pipeline_run, bootstrap, settings, env, items, warmup, logdir)
        print(
            f"  pipeline, every stage: {pipe['input_per_s']:,.0f} input msg/s "
            f"({pipe['experiences_per_s']:,.0f} experiences/s); "
            f"to the learner's last update only: {pipe['learner_window_input_per_s']:,.0f} input msg/s",
            flush=True,
        )
    finally:
        if broker is not None:
            broker.stop()
    step = learner_vs_bare(settings, exps[: min(n, 4096)])
    result = {
        "events": n,
        "embedding_dim": d,
        "slots": s,
        "message_bytes": size,
        "raw_consume_per_s": raw_rate,
        "pipeline_input_per_s": pipe["input_per_s"],
        "pipeline_experiences_per_s": pipe["experiences_per_s"],
        "pipeline_seconds": pipe["seconds"],
        "pipeline_ratio": pipe["input_per_s"] / raw_rate,
        "pipeline_learner_window_seconds": pipe["learner_window_seconds"],
        "pipeline_learner_window_input_per_s": pipe["learner_window_input_per_s"],
        "pipeline_learner_window_ratio": pipe["learner_window_input_per_s"] / raw_rate,
        "worker_store": settings.worker_store,
        **step,
        "learner_ratio": step["learner_per_s"] / step["bare_per_s"],
        "learner_with_decode_ratio": step["learner_with_decode_per_s"] / step["bare_per_s"],
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    # The run's logs, its broker's and its state (~60 MB) go once it succeeded; a failure keeps them.
    shutil.rmtree(logdir, ignore_errors=True)
    return result


def report(r: dict[str, Any]) -> str:
    def ok(ratio: float, target: float) -> str:
        return "meets" if ratio >= target else "BELOW"

    lines = [
        "| measure | rate | ratio | target |",
        "|---|---|---|---|",
        f"| raw aiokafka consume (getmany + orjson), {r['message_bytes']:,} B "
        f"| {r['raw_consume_per_s']:,.0f} msg/s | 1.00 | |",
        f"| pipeline end to end (worker + learner), input messages, every stage done "
        f"| {r['pipeline_input_per_s']:,.0f} msg/s "
        f"| {r['pipeline_ratio']:.2f} | ≥ {TARGET_PIPELINE:.2f} ({ok(r['pipeline_ratio'], TARGET_PIPELINE)}) |",
        f"| the same, window closed at the learner's last update (as reported before) "
        f"| {r['pipeline_learner_window_input_per_s']:,.0f} msg/s | {r['pipeline_learner_window_ratio']:.2f} | |",
        f"| bare torch REINFORCE step, batch {r['batch_size']} | {r['bare_per_s']:,.0f} exp/s | 1.00 | |",
        f"| learner update (`Learner.apply`) | {r['learner_per_s']:,.0f} exp/s | {r['learner_ratio']:.2f} "
        f"| ≥ {TARGET_LEARNER:.2f} ({ok(r['learner_ratio'], TARGET_LEARNER)}) |",
        f"| learner update incl. JSON decoding | {r['learner_with_decode_per_s']:,.0f} exp/s "
        f"| {r['learner_with_decode_ratio']:.2f} | |",
    ]
    return "\n".join(lines)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, help="events (default 20,000)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic events")


def main(args: argparse.Namespace) -> int:
    r = asyncio.run(run(args))
    print()
    print(report(r))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2))
    return 0
