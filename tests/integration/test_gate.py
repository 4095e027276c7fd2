"""The promotion gate, rollback and evaluate, through the broker."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch

from models.offpolicy.logged import LoggedDecisions
from models.policy.network import PolicyNetwork, init_policy
from models.serving.rule import (
    adjusted_logits,
    first_draw_probs,
    keep_dynamic,
    plackett_luce_logprob,
    sample_plackett_luce,
)
from pipeline import kafka
from pipeline.client.subscriber import PolicySubscriber, fetch_checkpoint
from pipeline.learner.loop import Learner
from pipeline.learner.promotion_gate import judge
from pipeline.metrics import Metrics
from pipeline.modeltopic import scan_model_topic
from pipeline.policy_evaluation.evaluate import evaluate_window
from pipeline.policy_evaluation.rollback import rollback
from tests.helpers import until
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


def test_judge_refuses_a_harmful_candidate_and_promotes_a_better_one() -> None:
    serving = init_policy(D, S, H, seed=1)
    decisions = LoggedDecisions.from_experiences(log_of(serving, 1500))
    harmful, better = tilted(serving, BAD), tilted(serving, GOOD)
    decision, reason, est = judge(decisions, harmful, serving, epsilon=0.02, min_ess=30)
    assert decision == "refused", reason
    assert est["gain"].high < 0
    decision, reason, est = judge(decisions, better, serving, epsilon=0.02, min_ess=30)
    assert decision == "promoted", reason
    assert est["gain"].low > 0 and est["candidate"].value > est["similarity"].value


def test_judge_waits_for_data() -> None:
    serving = init_policy(D, S, H, seed=1)
    decisions = LoggedDecisions.from_experiences(log_of(serving, 20))
    decision, reason, _ = judge(decisions, tilted(serving, GOOD), serving, epsilon=0.02, min_ess=50)
    assert decision == "insufficient", reason
    assert judge(LoggedDecisions.from_experiences([]), serving, serving, 0.02, 1)[0] == "insufficient"


@contextlib.asynccontextmanager
async def learner_running(settings):
    learner = Learner(settings.learner(), settings.bootstrap, Metrics())
    await learner.start()
    task = asyncio.create_task(learner.run())
    try:
        await until(lambda: learner.active.is_set(), 30, "learner active")
        yield learner
    finally:
        await learner.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


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
async def test_gated_learner_serves_only_promoted_checkpoints(topics_ready) -> None:
    s = topics_ready.replace(
        gate=True, gate_min_ess=30.0, gate_window=1500, lr=1e-2, batch_size=16, checkpoint_interval_s=0.3
    )
    loaded: list[int] = []
    sub = PolicySubscriber(s.bootstrap, s.policy, s, on_update=lambda p: loaded.append(p.version))
    async with learner_running(s) as learner, sub:
        await sub.wait_for_policy(1, timeout=30)
        init = PolicyNetwork.from_tensors(learner.trainer.tensors())
        # Traffic logged by the serving policy; the learner learns to prefer the good slots.
        await _send(s, log_of(init, 1200, seed=3, policy=s.policy))
        await until(lambda: any(d.decision == "promoted" for d in learner.gate.decisions), 60, "a promotion")
        promoted = [d for d in learner.gate.decisions if d.decision == "promoted"]
        assert promoted[0].gain is not None and promoted[0].gain.low > -s.gate_epsilon
        await until(
            lambda: (
                learner.trainer.experiences >= 1200
                and not learner.dirty
                # the trainer's last checkpoint, or a conservative step toward it (a version of its own)
                and learner.gate.decisions[-1].candidate_version >= learner.version
                # decided, or undecided because it barely differs from the policy just
                # promoted (its gain straddles −ε): either way judged, and not serving
                and (learner.gate.pending is None or learner.gate.decisions[-1].decision == "insufficient")
            ),
            180,  # each judgement computes slate moments (1–2 s) while the learner keeps training
            "the gate to have judged the last candidate",
        )
        # Now poison it: mislabelled answers drag the last layer toward the harmful slots.
        serving_before = learner.gate.serving_manifest.version

        bad_labels = []
        for i, e in enumerate(log_of(init, 300, seed=4, policy=s.policy)):
            bad = [c for c in e.event.candidates if c in BAD]
            if bad:
                bad_labels.append(Experience(f"bad-{i}", "label", e.event, 0.0, correct_memories=bad))
        learner.trainer.label_optimizer.param_groups[0]["lr"] = 0.5
        await _send(s, bad_labels)
        await until(lambda: learner.trainer.labels_applied >= len(bad_labels) and not learner.dirty, 60, "labels")
        await until(lambda: learner.gate.decisions[-1].candidate_version == learner.version, 30, "gate decision")
        last = learner.gate.decisions[-1]
        assert last.decision == "refused", last.reason
        assert learner.gate.serving_manifest.version == serving_before
    index = await scan_model_topic(s.bootstrap, s)
    promoted_versions = {d.candidate_version for d in learner.gate.decisions if d.decision == "promoted"} | {1}
    assert loaded and set(loaded) <= promoted_versions, (loaded, promoted_versions)
    assert index.candidate[s.policy].version > index.serving[s.policy].version


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


@pytest.mark.broker
async def test_a_candidate_worse_than_serving_sends_the_learner_back_to_the_serving_weights(topics_ready) -> None:
    # gate_reanchor at its default: the learner wanders toward the harmful slots (here: made to),
    # the gate finds its candidate worse than serving, and training resumes from the serving weights.
    s = topics_ready.replace(
        gate=True, gate_min_ess=30.0, gate_window=1500, batch_size=16, checkpoint_interval_s=0.3, serve_canary_rate=0.0
    )
    assert s.gate_reanchor and s.gate_conservative
    async with learner_running(s) as learner:
        gate = learner.gate
        assert gate is not None
        await until(lambda: gate.serving_manifest is not None, 30, "the first policy")
        init = PolicyNetwork.from_tensors(learner.trainer.tensors())
        await _send(s, log_of(init, 1200, seed=5, policy=s.policy))
        await until(
            lambda: (
                learner.trainer.experiences >= 1200
                and not learner.dirty
                and bool(gate.decisions)
                and gate.decisions[-1].candidate_version >= learner.version
            ),
            120,
            "the gate to have judged the learner's last candidate",
        )
        serving_version = gate.serving_manifest.version
        assert gate.serving_net is not None
        learner.trainer.load(tilted(gate.serving_net, BAD).tensors())  # the learner has wandered off
        learner.dirty = True
        await until(lambda: learner.metrics.gate_reanchors._value.get() >= 1, 60, "a resume from serving")
        last = gate.decisions[-1]
        assert last.decision != "promoted" and last.gain is not None and last.gain.high < 0, last.reason
        assert gate.serving_manifest.version == serving_version  # nothing worse was served
        # The trainer now holds the serving weights (no experience arrived since).
        served = gate.serving_net.tensors()
        assert all(torch.equal(t, served[k]) for k, t in learner.trainer.tensors().items())
