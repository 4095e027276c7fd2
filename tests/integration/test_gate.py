"""Rollback and evaluate through the broker, and the logged traffic the promotion rule's tests send."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from models.policy.network import PolicyNetwork
from models.serving.rule import (
    adjusted_logits,
    first_draw_probs,
    keep_dynamic,
    plackett_luce_logprob,
    sample_plackett_luce,
)
from pipeline import kafka
from pipeline.cli.rollback import rollback
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from pipeline.modeltopic import scan_model_topic
from pipeline.policy_evaluation.evaluate import evaluate_window
from tests.helpers import running, until
from topics.events import Features, RetrievalEvent
from topics.fields import encode
from topics.internal import Experience

D, S, H = 8, 32, 16
GOOD = set(range(0, 8))  # helpful slots
BAD = set(range(8, 16))  # harmful ones


def _masks(net: PolicyNetwork, emb: np.ndarray, slots: list[int]) -> np.ndarray:
    with torch.no_grad():
        h = net.features(torch.from_numpy(emb[None]), torch.zeros(1), torch.zeros(1))
        return net.candidate_masks(h, torch.tensor([slots]))[0].double().numpy()


def log_of(
    net: PolicyNetwork,
    n: int,
    seed: int = 0,
    temperature: float = 0.5,
    policy: str = "default",
    questions: int | None = None,
    noise: float = 0.1,
) -> list[Experience]:
    """Decisions logged by ``net`` serving with the §4 rule; utility +1 per good slot, −1 per bad one.

    ``questions``: the queries recur, drawn from that many (the same for every seed), as users'
    questions do; else each decision has a query of its own. ``noise``: the sd of the utility noise.
    """
    rng = np.random.default_rng(seed)
    fixed = np.random.default_rng(99)
    asked = [
        (fixed.normal(size=D).astype(np.float32), fixed.choice(16, size=8, replace=False), fixed.uniform(0.3, 0.9, 8))
        for _ in range(questions or 0)
    ]
    out = []
    for i in range(n):
        if asked:
            emb, drawn, scores = asked[int(rng.integers(len(asked)))]
            cands = [int(c) for c in drawn]
        else:
            emb = rng.normal(size=D).astype(np.float32)
            cands = [int(c) for c in rng.choice(16, size=8, replace=False)]
            scores = rng.uniform(0.3, 0.9, size=8)
        m = _masks(net, emb, cands)
        keep = keep_dynamic(m)
        kept = [c for c, k in zip(cands, keep, strict=True) if k]
        z = adjusted_logits(scores[keep], m[keep], float(net.alpha.detach()[0]), temperature)
        pos = sample_plackett_luce(z, 2, rng)
        sel = [kept[p] for p in pos]
        u = sum(1.0 if s in GOOD else -1.0 for s in sel) / 2 + noise * rng.normal()
        ev = RetrievalEvent(
            f"g{seed}-{i}",
            f"gq{seed}-{i}",
            0,
            1_800_000_000.0 + i,
            Features(emb, 0.0, 0.0),
            kept,
            scores[keep],
            sel,
            temperature,
            plackett_luce_logprob(z, pos),
            False,
            policy=policy,
            candidate_probs=first_draw_probs(z),  # what CausalRetriever logs
        )
        out.append(Experience(ev.event_id, "feedback", ev, float(u)))
    return out


def tilted(base: PolicyNetwork, towards: set[int], amount: float = 4.0) -> PolicyNetwork:
    """A copy of ``base`` whose mask is large on ``towards`` and small elsewhere."""
    net = PolicyNetwork.from_tensors(base.tensors())
    with torch.no_grad():
        for s in range(S):
            net.out.bias[s] += amount if s in towards else -amount
    return net


@contextlib.asynccontextmanager
async def learner_running(settings):
    async with running(Learner(settings.learner(), settings.bootstrap, Metrics())) as learner:
        await until(lambda: learner.active.is_set(), 30, "learner active")
        yield learner


async def _send(settings, exps: list[Experience]) -> None:
    p = kafka.producer(settings.bootstrap, settings)
    await p.start()
    try:
        for e in exps:
            await p.send(settings.topics().experiences.name, encode(e.to_dict()), partition=0)
        await p.flush()
    finally:
        await p.stop()


@pytest.mark.broker
async def test_rollback_serves_an_earlier_checkpoint_and_evaluate_reports(topics_ready) -> None:
    s = topics_ready.replace(checkpoint_interval_s=0.3, batch_size=16)
    async with learner_running(s) as learner:
        init = PolicyNetwork.from_tensors(learner.trainer.tensors())
        await _send(s, log_of(init, 400, seed=5, policy=s.policy))
        await until(lambda: learner.trainer.experiences >= 400 and not learner.dirty and learner.version >= 3, 60, "v3")
        newest = learner.version
        index = await scan_model_topic(s.bootstrap, s)
        v2 = await fetch_checkpoint(s.bootstrap, s, index, index.manifests[(s.policy, 2)])
        assert await rollback(s.bootstrap, s, 2, "test", timeout=30) == 0
        index = await scan_model_topic(s.bootstrap, s)
        serving = index.serving[s.policy]
        assert serving.reason == "rollback" and serving.version > newest and serving.metrics["rolled_back_to"] == 2
        tensors = await fetch_checkpoint(s.bootstrap, s, index, serving)
        assert all(torch.equal(tensors[k], v2[k]) for k in v2)
        assert await rollback(s.bootstrap, s, newest + 10, "test", timeout=1) == 1  # not an earlier version

    report = await evaluate_window(s.bootstrap, s, 300, ("ips", "snips", "dr"))
    assert report["decisions"] == 300
    est = report["estimates"]
    assert set(est) == {"serving", "similarity-only", "uniform"}
    for per in est.values():
        for e in per.values():
            assert e["low"] <= e["value"] <= e["high"] and e["ess"] > 0
