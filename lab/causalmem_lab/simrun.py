"""A simulated agent driving the real pipeline: shared by ``causalmem demo`` and the learning benchmark.

One run = a worker and a learner (real ``causalmem`` processes) on a broker, a
:class:`PolicySubscriber` hot-loading serving checkpoints into the agent's retriever, an
:class:`EventPublisher` sending retrieval events, LLM feedback, ratings and verdicts, and
optionally an automatic labeler answering queued samples from the ground truth.
:class:`RunSpec` says which retrieval policy the agent uses and how the pipeline is
configured, so benchmark rows differ in exactly one thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from causalmem_lab.dmem import DMem
from causalmem_lab.minimal_client import required_only
from causalmem_lab.simulator import DAY, Environment, Scenario, Tally, scenario_retriever, serve
from models.serving.rule import adjusted_logits, first_draw_probs

log = logging.getLogger(__name__)

# A simulated run publishes as fast as it can; a service's publisher drops the oldest events
# beyond its buffer, the lab holds every one (the run's events fit in memory).
LAB_BUFFER = 1_000_000


@dataclass
class RunSpec:
    """One way of running the scenario (a benchmark row)."""

    name: str = "causal policy, hard drop, dynamic threshold"
    use_policy: bool = True  # False: similarity-only (no checkpoint is ever loaded)
    drop: str | float = "dynamic"  # "dynamic", "none" (soft intervention) or a fixed threshold
    dmem: bool = False  # D-MEM re-ranking (similarity + β·δ) instead of a policy
    greedy: bool = True  # similarity-only: plain top-k (False: drawn at the serving temperature, m = 0)
    explore: bool = True
    labels: bool = True  # the automatic labeler answers queued samples
    reset: bool = True  # drift resets reach the learner
    rate: float = 120.0  # retrieval steps per wall-clock second
    checkpoint_interval: float = 2.0
    max_learner_lag: int = 256  # experiences; the agent waits while the learner is further behind
    attribution_rate: float | None = None  # the scenario's share of steps with per-memory credit (None: as is)
    explore_revive: float = 0.1  # CausalRetriever's chance of reviving a dropped candidate when exploring
    # The agent's exploration, set explicitly (None: the scenario's); 1.0 explores every request.
    explore_rate: float | None = None
    explore_temperature: float | None = None
    # A client written from docs/contract.md's required fields: its events carry no optional
    # field (causalmem_lab.minimal_client.required_only) and it serves no canary.
    minimal_client: bool = False

    pipeline_env: dict[str, str] = field(default_factory=dict)  # extra CAUSALMEM_* for worker and learner


@dataclass
class RunResult:
    spec: RunSpec
    tally: Tally
    env: Environment
    published: dict[str, int]
    worker_metrics: dict[str, float]
    learner_metrics: dict[str, float]
    corr_series: list[tuple[float, float, int]]  # (event time, correlation, pairs)
    resets: list[dict[str, Any]]  # reset commands sent (event time, details)
    versions_loaded: int
    labels_answered: int
    label_effect: dict[str, float]
    wall_s: float
    policy: Any = None  # the LoadedPolicy the agent's retriever served at the end (None: never one)
    # Where that is a probe over a certified version (contract 1.23): the version it names, which
    # the retriever served on the share not explored.
    base: Any = None


def pipeline_env(scenario: Scenario, spec: RunSpec, prefix: str, state_dir: Path) -> dict[str, str]:
    return {
        "CAUSALMEM_TOPIC_PREFIX": prefix,
        "CAUSALMEM_EMBEDDING_DIM": str(scenario.embedding_dim),
        "CAUSALMEM_SLOTS": str(scenario.slots),
        "CAUSALMEM_STATE_DIR": str(state_dir),
        "CAUSALMEM_CHECKPOINT_INTERVAL_S": str(spec.checkpoint_interval),
        # Event time runs ~10,000× faster than wall time here (one simulated day in ~8 s):
        # a 10-minute join window would be 60 ms of wall time.
        "CAUSALMEM_JOIN_WINDOW_S": str(DAY),
        "CAUSALMEM_LABEL_WINDOW_S": str(2 * DAY),
        "CAUSALMEM_DRIFT_MIN_PAIRS": "1000",
        "CAUSALMEM_DRIFT_PAGE_HINKLEY": "1",
        "CAUSALMEM_DRIFT_COOLDOWN_S": str(2 * DAY),
        "CAUSALMEM_DRIFT_RESET": "1" if spec.reset else "0",
        **spec.pipeline_env,
    }


def first_draw_mass(net: Any, sample: Any, slots: set[int]) -> float:
    """First-draw probability the policy ``net`` gives ``slots`` among a sample's candidates."""
    if net is None or not sample.candidates or sample.scores is None:
        return float("nan")
    with torch.no_grad():
        f = sample.features
        h = net.features(
            torch.from_numpy(f.query_embedding[None]),
            torch.tensor([f.last_step_loss]),
            torch.tensor([f.last_step_entropy]),
        )
        m = net.candidate_masks(h, torch.tensor([sample.candidates]))[0].double().numpy()
    p = first_draw_probs(adjusted_logits(sample.scores, m, float(net.alpha.detach()[0]), sample.temperature or 1.0))
    return float(sum(p[i] for i, s in enumerate(sample.candidates) if s in slots))


async def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(pred):
            return
        await asyncio.sleep(0.3)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


async def _wait_for_learner(
    learner: Any, max_lag: int, sub: Any = None, max_versions: int = 2, timeout: float = 30.0
) -> float:
    """Sleep while the learner's input lag exceeds ``max_lag`` experiences, or while the
    agent's subscriber is more than ``max_versions`` serving checkpoints behind the
    learner's newest; return the seconds waited.

    The subscriber loads every serving checkpoint in turn, in the agent's own event loop:
    on a loaded machine it fell further and further behind (measured: serving v147 when the
    learner had published v232, days of event time), and the figures then described a
    stale policy, not the learning rule.
    """
    from pipeline.promtext import metric

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        values = await asyncio.to_thread(learner.metrics)
        behind = 0.0
        if sub is not None and sub.current is not None:
            behind = metric(values, "causalmem_checkpoint_version", role="serving") - sub.current.version
        if metric(values, "causalmem_consumer_lag_messages") <= max_lag and behind <= max_versions:
            break
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def _drain(worker: Any, learner: Any, steps: int, timeout: float) -> None:
    """Wait until the worker joined every step and the learner applied every join (or it stalls)."""
    from pipeline.promtext import metric

    deadline = time.monotonic() + timeout
    last, stable = -1.0, 0
    while time.monotonic() < deadline:
        w, lm = await asyncio.to_thread(worker.metrics), await asyncio.to_thread(learner.metrics)
        joins = metric(w, "causalmem_joins_total")
        applied = metric(lm, "causalmem_learner_experiences_total", kind="feedback")
        if joins >= steps and applied >= joins - metric(w, "causalmem_fallbacks_total"):
            return
        stable = stable + 1 if applied == last else 0
        last = applied
        if stable > 40:  # nothing moved for ~12 s
            return
        await asyncio.sleep(0.3)


async def run_scenario(
    scenario: Scenario,
    spec: RunSpec,
    bootstrap: str,
    logdir: Path,
    console: Any,
    prefix: str | None = None,
    label: str = "simulated agent",
    env: Any = None,
) -> RunResult:
    """Run one scenario through a fresh worker and learner (with their own topic prefix).

    ``env`` replaces the simulator's :class:`Environment` built from ``scenario`` (any world
    with its interface, e.g. :class:`causalmem_lab.lmworld.LMWorld`).
    """
    rich_progress = importlib.import_module("rich.progress")
    from causalmem_lab.procs import Child
    from pipeline import kafka
    from pipeline.client.publisher import EventPublisher
    from pipeline.client.subscriber import PolicySubscriber
    from pipeline.config import Settings
    from pipeline.labeling.queue import LabelQueue, run_queue_until
    from pipeline.promtext import metric, scrape
    from topics.events import Features, RetrievalEvent
    from topics.feedback import LLMFeedback
    from topics.internal import decode_control
    from topics.labels import HumanLabel

    t_start = time.monotonic()
    if spec.attribution_rate is not None:
        scenario = scenario.replace(attribution_rate=spec.attribution_rate)
    logdir.mkdir(parents=True, exist_ok=True)
    prefix = prefix if prefix is not None else f"run-{uuid.uuid4().hex[:6]}."
    env_vars = pipeline_env(scenario, spec, prefix, logdir / "state")
    settings = Settings.from_env({**os.environ, **env_vars}, bootstrap=bootstrap)
    await kafka.wait_for_broker(bootstrap, settings)
    await kafka.create_topics(bootstrap, settings)
    worker = Child("worker", bootstrap, env_vars, log_path=logdir / "worker.log")
    learner = Child("learner", bootstrap, env_vars, log_path=logdir / "learner.log")
    env = env if env is not None else Environment(scenario)
    similarity_only = not spec.use_policy and not spec.dmem
    retriever = scenario_retriever(
        env,
        scenario,
        # Similarity-only is plain top-k: a temperature so small that the draw is the ranking.
        temperature=1e-4 if similarity_only and spec.greedy else scenario.temperature,
        drop=spec.drop,
        explore_rate=(scenario.explore_rate if spec.explore_rate is None else spec.explore_rate)
        if spec.explore and spec.use_policy
        else 0.0,
        explore_temperature=scenario.explore_temperature
        if spec.explore_temperature is None
        else spec.explore_temperature,
        explore_revive=spec.explore_revive,
    )
    dmem = DMem() if spec.dmem else None
    tally = Tally()
    published = {"retrieval-events": 0, "llm-feedback": 0, "human-labels": 0}
    corr_series: list[tuple[float, float, int]] = []
    versions = {"n": 0}
    intents: dict[str, int] = {}
    now_ts = {"t": scenario.start_ts}
    answered: list[tuple[Any, set[int], Any]] = []  # (sample, correct slots, policy when answered)

    def on_update(loaded: Any) -> None:
        versions["n"] += 1
        if spec.use_policy:
            retriever.set_policy(loaded)

    def answer(sample: Any) -> tuple[list[int] | None, int | None]:
        intent = intents.get(sample.query_id)
        if intent is None:
            return None, None
        good = [s for s in sample.candidates if s in set(env.helpful(intent))]
        lo, hi = scenario.need_range
        rating = round(5 * (env.need[intent] - lo) / (hi - lo))
        if good:
            answered.append((sample, set(good), retriever.policy.net if retriever.policy else None))
        return (good or None), rating

    def dmem_retrieve(st: Any, q: Any) -> Any:
        slots, scores = retriever.search(np.ascontiguousarray(st.embedding, dtype=np.float32), scenario.n_candidates)
        assert dmem is not None
        order = np.argsort(-dmem.rerank(scores.tolist(), slots.tolist()), kind="stable")[: scenario.k]
        selected = [int(slots[i]) for i in order]
        event = RetrievalEvent(
            uuid.uuid4().hex,
            q.query_id,
            st.step,
            st.ts,
            Features(st.embedding, st.last_step_loss, st.last_step_entropy),
            [int(s) for s in slots],
            scores,
            selected,
            scenario.temperature,
            0.0,
            False,
        )
        return selected, event

    try:
        for child in (worker, learner):
            await _wait(lambda c=child: bool(c.metrics()) or not c.alive(), 90, f"{child.verb} metrics")
            if not child.alive():
                raise RuntimeError(f"{child.verb} exited:\n{child.log_tail()}")
        await _wait(
            lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0,
            90,
            "the worker's join stage to own partitions",
        )
        async with (
            PolicySubscriber(
                bootstrap,
                settings.policy,
                settings,
                on_update=on_update,
                on_canary=retriever.set_canary if spec.use_policy and not spec.minimal_client else None,
            ) as sub,
            EventPublisher(bootstrap, settings, max_events=LAB_BUFFER) as pub,
            LabelQueue(bootstrap, settings, "auto-labeler") as queue,
        ):
            await sub.wait_for_policy(timeout=90)
            stop = asyncio.Event()
            labeler = asyncio.create_task(run_queue_until(queue, stop, answer) if spec.labels else asyncio.sleep(0))

            async def sample_correlation() -> None:
                while not stop.is_set():
                    values = await asyncio.to_thread(scrape, worker.url)
                    if values:
                        corr = metric(values, "causalmem_utility_rating_correlation")
                        pairs = int(metric(values, "causalmem_utility_rating_pairs"))
                        corr_series.append((now_ts["t"], corr, pairs))
                    await asyncio.sleep(0.5)

            sampler = asyncio.create_task(sample_correlation())
            progress = rich_progress.Progress(
                rich_progress.TextColumn(f"[bold]{label}[/]"),
                rich_progress.BarColumn(),
                rich_progress.MofNCompleteColumn(),
                rich_progress.TextColumn(
                    "day {task.fields[day]:>4.1f}  policy v{task.fields[v]}  "
                    "leak {task.fields[leak]:.0%}  recall {task.fields[recall]:.0%}"
                ),
                rich_progress.TimeRemainingColumn(),
                console=console,
            )
            wall0 = time.monotonic()
            steps = 0
            total = scenario.total_queries
            with progress:
                task = progress.add_task("agent", total=total, day=0.0, v=0, leak=0.0, recall=0.0)
                for qi in range(total):
                    q = env.next_query()
                    intents[q.query_id] = q.intent
                    now_ts["t"] = q.ts
                    for step in range(q.steps):
                        st = env.step_features(q, step)
                        if dmem is not None:
                            selected, event = dmem_retrieve(st, q)
                        else:
                            res = serve(retriever, st)
                            selected, event = res.slots, res.event
                        true_u, nll_with, nll_without, nll_without_slot = env.feedback(q.intent, selected)
                        u = nll_without - nll_with
                        q.utilities.append(u)
                        if dmem is not None:
                            dmem.update(selected, u)
                        # Exploration and the canary's requests are not the serving policy as served.
                        explore = bool(event.canary) or event.temperature != retriever.temperature
                        tally.record(env, q.intent, selected, true_u, st.ts, event.policy_version, explore)
                        await pub.publish(required_only(event) if spec.minimal_client else event)
                        await pub.publish(
                            LLMFeedback(
                                uuid.uuid4().hex,
                                q.query_id,
                                step,
                                st.ts + 1.0,
                                u,
                                nll_with=nll_with,
                                nll_without=nll_without,
                                nll_without_slot=nll_without_slot,
                            )
                        )
                        published["retrieval-events"] += 1
                        published["llm-feedback"] += 1
                        steps += 1
                    end_ts = q.ts + 5.0 * q.steps + 30.0
                    rating = env.rating(q.intent)
                    if rating is not None:
                        await pub.publish(
                            HumanLabel(uuid.uuid4().hex, q.query_id, end_ts, "rater", "rating", rating=rating)
                        )
                        published["human-labels"] += 1
                    verdict = env.verdict(float(np.mean(q.utilities)))
                    if verdict is not None:
                        await pub.publish(
                            HumanLabel(uuid.uuid4().hex, q.query_id, end_ts, "rater", "verdict", answer_correct=verdict)
                        )
                        published["human-labels"] += 1
                    if qi % 25 == 0:
                        recent = tally.window(max(0.0, 1 - 300 / max(1, len(tally.leak))), 1.0)
                        progress.update(
                            task,
                            completed=qi + 1,
                            day=env.day_of(q.ts),
                            v=sub.current.version if sub.current else 0,
                            leak=recent["leak"],
                            recall=recent["recall"],
                        )
                        await asyncio.sleep(max(0.0, steps / spec.rate - (time.monotonic() - wall0)))
                        # Backpressure: a learner that falls behind would serve an ever older
                        # policy, and what is measured would be the machine's load, not the
                        # learning rule. Wait (bounded) until it has caught up.
                        waited = await _wait_for_learner(
                            learner, spec.max_learner_lag, sub if spec.use_policy else None
                        )
                        wall0 += waited

                progress.update(task, completed=total)
            if not await pub.flush(timeout=120) or pub.dropped:
                raise RuntimeError(f"the broker took {pub.sent} events; {pub.dropped} dropped")
            await _drain(worker, learner, published["retrieval-events"], timeout=90)
            await asyncio.sleep(spec.checkpoint_interval + 1.0)
            stop.set()
            await asyncio.gather(labeler, sampler, return_exceptions=True)
            final = retriever.policy.net if retriever.policy else (sub.current.net if sub.current else None)
            effect = {}
            if answered:
                effect = {
                    "labelled_samples": float(len(answered)),
                    "mass_when_answered": float(np.nanmean([first_draw_mass(n, s, g) for s, g, n in answered])),
                    "mass_final": float(np.nanmean([first_draw_mass(final, s, g) for s, g, _ in answered])),
                }
            labels_answered = queue.done
        worker_metrics, learner_metrics = worker.metrics(), learner.metrics()
        resets = []
        for msg in await kafka.read_all(bootstrap, settings, settings.topics().control.name, partitions=[0]):
            with contextlib.suppress(Exception):
                ctl = decode_control(msg.value, settings.limits())
                if ctl.command == "reset":
                    resets.append({"ts": ctl.ts, **ctl.details, "reason": ctl.reason})
        return RunResult(
            spec,
            tally,
            env,
            published,
            worker_metrics,
            learner_metrics,
            corr_series,
            resets,
            versions["n"],
            labels_answered,
            effect,
            time.monotonic() - t_start,
            retriever.policy,
            retriever.core.base,
        )
    finally:
        for child in (worker, learner):
            child.stop()
