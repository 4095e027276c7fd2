"""The canary through a real broker (contract 1.4): the learner's gate makes an undecided
candidate the canary, a client serves it on its share of requests, and the gate decides
on those requests' utilities; coupled (contract 1.5), those requests draw both slates and
the canary serves half of those where they differ."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import LoadedPolicy, PolicySubscriber
from pipeline.modeltopic import scan_model_topic
from tests.helpers import until
from tests.integration.test_gate import _send, learner_running
from topics.internal import Experience

GOOD = set(range(16))  # the first half of the memories helps, the second half harms


@pytest.mark.broker
@pytest.mark.parametrize("coupled", [False, True], ids=["ab", "coupled"])
async def test_the_gate_decides_a_canary_on_the_requests_it_served(topics_ready, coupled: bool) -> None:
    s = topics_ready.replace(
        gate=True,
        gate_min_ess=1e9,  # the off-policy estimates never decide: only the canary can
        # Coupled: every request drawn (only those whose slates differ can serve the canary's),
        # and a canary gives way after 100 of those.
        serve_canary_rate=1.0 if coupled else 0.3,
        serve_canary_coupled=coupled,
        gate_canary_max=100 if coupled else 40,
        lr=1e-2,
        batch_size=16,
        checkpoint_interval_s=0.3,
    )
    rng = np.random.default_rng(5)
    memories = rng.normal(size=(32, 8)).astype(np.float32)
    memories /= np.linalg.norm(memories, axis=1, keepdims=True)
    retriever = CausalRetriever(memories, k=2, n_candidates=8, seed=1, conn=s)
    canaries: list[LoadedPolicy | None] = []

    def on_canary(c: LoadedPolicy | None) -> None:
        canaries.append(c)
        retriever.set_canary(c)

    sub = PolicySubscriber(s.bootstrap, s.policy, s, on_update=retriever.set_policy, on_canary=on_canary)
    events = []
    async with learner_running(s) as learner, sub:
        await sub.wait_for_policy(1, timeout=30)
        for round_ in range(60):
            batch = []
            for i in range(40):
                q = rng.normal(size=8).astype(np.float32)
                r = retriever.retrieve(q, f"q{round_}-{i}", ts=1_767_225_600.0 + 40 * round_ + i)
                u = float(np.mean([1.0 if m in GOOD else -1.0 for m in r.slots])) + 0.1 * float(rng.normal())
                events.append(r.event)
                batch.append(Experience(r.event.event_id, "feedback", r.event, u))
            await _send(s, batch)
            await asyncio.sleep(0.3)
            if any(d.reason.startswith(("promoted: canary", "refused: canary")) for d in learner.gate.decisions):
                break
        await until(lambda: any("canary v" in d.reason for d in learner.gate.decisions), 60, "a decision on a canary")
        decided = [d for d in learner.gate.decisions if "canary v" in d.reason]
        promoted = [d for d in decided if d.decision == "promoted"]
        if promoted:
            await sub.wait_for_policy(promoted[0].candidate_version, timeout=30)
    assert not any(d.decision == "promoted" and "canary" not in d.reason for d in learner.gate.decisions)
    loaded = [c for c in canaries if c is not None]
    assert loaded, "the client loaded a canary"
    flagged = [e for e in events if e.canary]
    assert flagged and {e.policy_version for e in flagged} <= {c.version for c in loaded}
    served = sum(1 for e in events if e.policy_version > 0 or e.canary)
    drawn = [e for e in events if e.canary_arm is not None]
    if not coupled:
        assert not drawn
        assert 0.15 < len(flagged) / served < 0.45, len(flagged) / served
    else:
        assert len(drawn) / served > 0.5, len(drawn) / served  # all but the requests between canaries
        assert {e.canary_version for e in drawn} <= {c.version for c in loaded}
        assert all(bool(e.canary) == (e.canary_arm == "canary") for e in drawn)
        assert all(e.policy_version != e.canary_version for e in drawn if e.canary_arm != "canary")
        differing = [e for e in drawn if e.canary_arm != "tie"]
        assert differing and 0.3 < len(flagged) / len(differing) < 0.7, (len(flagged), len(differing))
    # Learning towards the helpful half, the canaries were better than the first policy.
    assert promoted, [d.reason for d in decided]
    assert promoted[0].gain is not None and promoted[0].gain.low > -s.gate_epsilon
    assert promoted[0].gain.method == ("coupled" if coupled else "canary")
    index = await scan_model_topic(s.bootstrap, s)
    assert index.serving[s.policy].version >= promoted[0].candidate_version
