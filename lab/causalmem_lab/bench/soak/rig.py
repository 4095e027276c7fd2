"""The soak's rig: broker, worker and learner processes, a paced producer and a sampler.

The producer in this process publishes RetrievalEvent + LLMFeedback *pairs* paced by a
token bucket (burst: one second of tokens), while a sampler records every second the
worker's consumer lag, the learner's lag on ``experiences``, the pairs produced, joined and
applied, and the RSS of the broker, worker and learner (``/proc/<pid>/status`` VmRSS).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.bench.soak.judge import RATE_TOLERANCE, caught_up, judge_phase
from causalmem_lab.bench.throughput import make_events
from causalmem_lab.procs import Child
from pipeline import kafka
from pipeline.config import Settings
from pipeline.promtext import labelled, metric
from topics.events import RetrievalEvent
from topics.feedback import LLMFeedback
from topics.fields import encode

SAMPLE_S = 1.0
TICK_S = 0.01
STARTUP_TIMEOUT_S = 120.0


class PairSource:
    """RetrievalEvent + LLMFeedback pairs with unique ids and wall-clock event time."""

    def __init__(self, settings: Settings, seed: int, pool: int = 256) -> None:
        t = settings.topics()
        self.events_topic = t.retrieval_events.name
        self.feedback_topic = t.llm_feedback.name
        self.templates = [e.event for e in make_events(pool, settings.embedding_dim, settings.slots, seed=seed)]
        self.utilities = np.random.default_rng(seed + 1).normal(0.2, 0.6, size=pool)
        self.policy = settings.policy
        self.run = uuid.uuid4().hex[:6]
        self.n = 0

    def next(self) -> tuple[bytes, bytes, bytes]:
        i = self.n
        self.n += 1
        tpl: RetrievalEvent = self.templates[i % len(self.templates)]
        qid = f"soak-{self.run}-{i}"
        ts = time.time()
        ev = dataclasses.replace(tpl, event_id=f"se-{self.run}-{i}", query_id=qid, ts=ts, policy=self.policy)
        fb = LLMFeedback(f"sf-{self.run}-{i}", qid, 0, ts, float(self.utilities[i % len(self.utilities)]))
        return qid.encode(), encode(ev.to_dict()), encode(fb.to_dict())


@dataclasses.dataclass
class Counters:
    sent_pairs: int = 0
    sent_bytes: int = 0
    delivered: int = 0
    errors: int = 0

    def on_delivery(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.errors += 1
        else:
            self.delivered += 1


async def produce_at(producer: Any, src: PairSource, counters: Counters, rate: float, duration: float) -> float:
    """Send pairs at ``rate`` per second for ``duration`` s (token bucket); return the time spent."""
    t0 = time.monotonic()
    last = t0
    tokens = 0.0
    burst = max(1.0, rate)  # one second of tokens: short stalls are caught up, long ones lost
    while True:
        now = time.monotonic()
        if now >= t0 + duration:
            break
        tokens = min(burst, tokens + rate * (now - last))
        last = now
        n = int(tokens)
        tokens -= n
        for _ in range(n):
            key, ev, fb = src.next()
            for topic, value in ((src.events_topic, ev), (src.feedback_topic, fb)):
                fut = await producer.send(topic, value, key=key)
                fut.add_done_callback(counters.on_delivery)
                counters.sent_bytes += len(value) + len(key)
            counters.sent_pairs += 1
        await asyncio.sleep(TICK_S)
    return time.monotonic() - t0


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def say(msg: str) -> None:
    print(msg, flush=True)


class Rig:
    """Broker, worker, learner and a producer, with a sampler reading the children's metrics."""

    def __init__(self, settings: Settings, logdir: Path, seed: int = 0) -> None:
        self.seed = seed
        self.base = settings
        self.logdir = logdir
        self.broker: Any = None
        self.worker: Child | None = None
        self.learner: Child | None = None
        self.producer: Any = None
        self.counters = Counters()
        self.last: dict[str, Any] = {}  # last good scrape values, carried over failed scrapes

    async def start(self) -> None:
        from pipeline.broker import own_broker

        bootstrap, self.broker = own_broker(self.base.bootstrap, self.logdir / "broker.log")
        prefix = f"{self.base.topic_prefix}soak-{uuid.uuid4().hex[:6]}."
        self.settings = s = self.base.replace(
            bootstrap=bootstrap, topic_prefix=prefix, state_dir=str(self.logdir / "state")
        )
        self.bootstrap = bootstrap
        await kafka.wait_for_broker(bootstrap, s)
        await kafka.create_topics(bootstrap, s)
        self.exp_topic = s.topics().experiences.name
        env = {
            "CAUSALMEM_TOPIC_PREFIX": prefix,
            "CAUSALMEM_STATE_DIR": s.state_dir,
            "CAUSALMEM_PARTITIONS": str(s.partitions),
            "CAUSALMEM_POLICY": s.policy,
            "CAUSALMEM_EMBEDDING_DIM": str(s.embedding_dim),
            "CAUSALMEM_SLOTS": str(s.slots),
            "CAUSALMEM_HIDDEN": str(s.hidden),
            "CAUSALMEM_JOIN_WINDOW_S": str(s.join_window_s),
            "CAUSALMEM_CHECKPOINT_INTERVAL_S": str(s.checkpoint_interval_s),
        }
        for f in dataclasses.fields(s.security):
            value = getattr(s.security, f.name)
            if value and f.name != "sasl_password":  # the password only travels in the inherited env
                env[f"CAUSALMEM_KAFKA_{f.name.upper()}"] = str(value)
        self.worker = Child("worker", bootstrap, env, log_path=self.logdir / "worker.log")
        self.learner = Child("learner", bootstrap, env, log_path=self.logdir / "learner.log")
        worker, learner = self.worker, self.learner
        await self._wait(lambda: bool(worker.metrics()), "the worker's metrics")
        await self._wait(
            lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") >= s.partitions,
            "the worker's join stage to own every input partition",
        )
        await self._wait(
            lambda: metric(learner.metrics(), "causalmem_checkpoint_publishes_total") > 0,
            "the learner to be elected and publish its first checkpoint",
        )
        self.producer = kafka.producer(bootstrap, s, linger_ms=20)
        await self.producer.start()
        self.source = PairSource(s, self.seed)

    async def _wait(self, pred: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_alive()
            if await asyncio.to_thread(pred):
                return
            await asyncio.sleep(0.25)
        raise TimeoutError(f"timed out after {STARTUP_TIMEOUT_S:.0f} s waiting for {what}")

    def _check_alive(self) -> None:
        for child in (self.worker, self.learner):
            if child is not None and not child.alive():
                raise RuntimeError(f"{child.verb} exited with {child.proc.returncode}:\n{child.log_tail()}")
        if self.broker is not None and not self.broker.running():
            raise RuntimeError("the embedded broker exited")

    async def stop(self) -> None:
        if self.producer is not None:
            try:
                await self.producer.stop()
            except Exception as exc:
                say(f"  (producer stop: {exc!r})")
        for child in (self.worker, self.learner):
            if child is not None:
                await asyncio.to_thread(child.stop)
        if self.broker is not None:
            self.broker.stop()

    def pids(self) -> dict[str, int | None]:
        return {
            "broker": self.broker.pid if self.broker is not None else None,
            "worker": self.worker.proc.pid if self.worker else None,
            "learner": self.learner.proc.pid if self.learner else None,
        }

    def read(self) -> dict[str, Any]:
        """Absolute values now (blocking: scrapes and /proc reads)."""
        assert self.worker is not None and self.learner is not None
        w = self.worker.metrics()
        lm = self.learner.metrics()
        vals: dict[str, Any] = dict(self.last)
        if w:
            vals["worker_lag"] = metric(w, "causalmem_consumer_lag_messages")
            vals["worker_lag_by_topic"] = labelled(w, "causalmem_consumer_lag_messages", "topic")
            vals["events_in"] = metric(w, "causalmem_events_in_total")
            vals["joined"] = metric(w, "causalmem_joins_total")
            vals["join_expired"] = metric(w, "causalmem_join_expired_total")
        if lm:
            vals["learner_lag"] = metric(lm, "causalmem_consumer_lag_messages", topic=self.exp_topic)
            vals["applied"] = metric(lm, "causalmem_learner_experiences_total", kind="feedback")
            vals["checkpoints"] = metric(lm, "causalmem_checkpoint_publishes_total")
        for k in ("worker_lag", "events_in", "joined", "join_expired", "learner_lag", "applied", "checkpoints"):
            vals.setdefault(k, 0.0)
        self.last = vals
        out: dict[str, Any] = dict(vals)
        out["rss_mb"] = {k: v for k, v in ((k, rss_mb(p)) for k, p in self.pids().items()) if v is not None}
        return out

    # ------------------------------------------------------------------ phases

    async def phase(
        self, label: str, rate: float, duration: float, *, drain_limit_s: float, keep_up: float, progress_s: float
    ) -> dict[str, Any]:
        """Produce at ``rate`` pairs/s for ``duration`` s, sampling, then drain; judged."""
        c = self.counters
        base = await asyncio.to_thread(self.read)
        sent0, bytes0 = c.sent_pairs, c.sent_bytes
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()
        done = asyncio.Event()

        def sample(now_abs: dict[str, Any]) -> dict[str, Any]:
            produced = c.sent_pairs - sent0
            applied = now_abs["applied"] - base["applied"]
            return {
                "t": round(time.monotonic() - t0, 3),
                "produced": produced,
                "events_in": now_abs["events_in"] - base["events_in"],
                "joined": now_abs["joined"] - base["joined"],
                "applied": applied,
                "backlog": produced - applied,
                "worker_lag": now_abs["worker_lag"],
                "learner_lag": now_abs["learner_lag"],
                "worker_lag_by_topic": now_abs.get("worker_lag_by_topic", {}),
                "rss_mb": now_abs["rss_mb"],
            }

        async def sampler() -> None:
            next_print = progress_s
            k = 1
            while not done.is_set():
                s = sample(await asyncio.to_thread(self.read))
                samples.append(s)
                self._check_alive()
                if s["t"] >= next_print:
                    next_print += progress_s
                    say(progress_line(label, s))
                delay = t0 + k * SAMPLE_S - time.monotonic()
                k += 1
                if delay > 0:
                    try:
                        await asyncio.wait_for(done.wait(), delay)
                    except TimeoutError:
                        pass

        task = asyncio.create_task(sampler())
        try:
            spent = await produce_at(self.producer, self.source, c, rate, duration)
        finally:
            done.set()
            await task
        # drain: the producer's last batches, then the pipeline
        produced = c.sent_pairs - sent0
        await self.producer.flush()
        deadline = t0 + spent + drain_limit_s
        while True:
            s = sample(await asyncio.to_thread(self.read))
            s["t"] = max(s["t"], spent + 1e-3)
            samples.append(s)
            self._check_alive()
            if caught_up(s, produced, keep_up) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        verdict = judge_phase(
            samples, spent, rate, drain_limit_s=drain_limit_s, keep_up=keep_up, rate_tolerance=RATE_TOLERANCE
        )
        verdict["label"] = label
        verdict["input_bytes"] = c.sent_bytes - bytes0
        verdict["input_mb_per_min"] = (c.sent_bytes - bytes0) / 1e6 / spent * 60.0
        verdict["join_expired"] = samples[-1].get("join_expired", 0.0) if samples else 0.0
        verdict["producer_errors"] = c.errors
        verdict["samples"] = samples
        verdict["loadavg"] = loadavg()
        return verdict

    async def wait_drained(self, timeout: float) -> float | None:
        """Seconds until every pair sent so far is applied and both lags are 0 (None: timed out)."""
        await self.producer.flush()
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            now = await asyncio.to_thread(self.read)
            self._check_alive()
            if now["applied"] >= self.counters.sent_pairs and now["worker_lag"] <= 0 and now["learner_lag"] <= 0:
                return time.monotonic() - t0
            await asyncio.sleep(0.5)
        return None


def progress_line(label: str, s: dict[str, Any]) -> str:
    rss = " ".join(f"{k} {v:,.0f}" for k, v in s["rss_mb"].items())
    rate = s["produced"] / s["t"] if s["t"] > 0 else 0.0
    return (
        f"  [{label}] t={s['t']:5.0f} s  sent {s['produced']:,} pairs ({rate:,.0f}/s)  joined {s['joined']:,.0f}  "
        f"applied {s['applied']:,.0f}  lag worker {s['worker_lag']:,.0f} learner {s['learner_lag']:,.0f}  "
        f"RSS MB {rss}"
    )
