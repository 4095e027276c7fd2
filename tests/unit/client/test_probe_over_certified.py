"""A probe over a certified version (contract 1.23): a client serves the certified version it
held on every request but the exploration share, which draws under the probe's weights; each
request is logged under the probe, those drawn under the certified version with ``base``. The
learner recomputes each request's probabilities under the weights that drew it, and values the
probe as that mixture: on its own decisions, its importance weights are exactly 1."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from models.serving.params import ServingParams
from pipeline.client.retriever import CausalRetriever
from pipeline.learner import evidence
from pipeline.learner.logging_policy import LoggingPolicies
from pipeline.metrics import Metrics
from tests.adapter_fakes import CONN, DIM, SLOTS, policy
from tests.unit.client.test_cold_start import _check_share
from topics.events import RetrievalEvent, decode_retrieval_event
from topics.fields import encode
from topics.internal import Experience

K = 3
SERVING = ServingParams()  # as the learner publishes: T 0.05, 10% explored at T 0.1, no drop
EVEN = {s: 8.0 for s in range(0, SLOTS, 2)}  # the certified version reads even slots
ODD = {s: 8.0 for s in range(1, SLOTS, 2)}  # the probe's weights, odd ones
CERTIFIED = policy(version=4, bias=EVEN, serving=SERVING.to_wire())
PROBE = policy(version=6, reason="probe", bias=ODD, serving=replace(SERVING, base=4).to_wire())


def _served(r: CausalRetriever, n: int, seed: int) -> list[tuple[list[int], RetrievalEvent]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        q = np.abs(rng.normal(size=DIM)).astype(np.float32)  # positive scores: a mask only raises them
        res = r.retrieve(q / np.linalg.norm(q), query_id=f"q{i}")
        out.append((res.slots, res.event))
    return out


def _retriever(seed: int) -> CausalRetriever:
    rng = np.random.default_rng(seed)
    emb = np.abs(rng.normal(size=(SLOTS, DIM))).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    return CausalRetriever(emb, texts=[f"m{i}" for i in range(SLOTS)], k=K, n_candidates=12, seed=seed)


def test_a_client_serves_the_certified_version_but_on_the_exploration_share() -> None:
    r = _retriever(0)
    r.set_policy(CERTIFIED)
    r.set_policy(PROBE)
    served = _served(r, 1_000, seed=1)
    explored = []
    for slots, ev in served:
        assert ev.policy_version == PROBE.version and not ev.incumbent and not ev.fallback
        explored.append(not ev.base)
        evens = sum(1 for s in ev.candidates if s % 2 == 0)
        odds = len(ev.candidates) - evens
        if ev.base:  # the certified version's draw at the serving temperature
            assert ev.temperature == SERVING.temperature
            assert evens < K or all(s % 2 == 0 for s in slots)
        else:  # the probe's weights at the exploration temperature
            assert ev.temperature == SERVING.explore_temperature
            assert odds < K or all(s % 2 == 1 for s in slots)
    _check_share(explored, SERVING.explore_rate)
    # A newer probe over the same version keeps it; a promotion (no base) serves as any version.
    r.set_policy(replace(PROBE, manifest=replace(PROBE.manifest, version=8)))
    assert any(ev.base for _, ev in _served(r, 50, seed=2))
    r.set_policy(replace(PROBE, manifest=replace(PROBE.manifest, version=9, serving=SERVING.to_wire())))
    assert not any(ev.base for _, ev in _served(r, 50, seed=3))


def test_a_client_without_the_certified_version_keeps_serving_what_it_holds() -> None:
    """One started while the probe serves never held the version it names, and cannot serve the
    probe as the learner values it: it keeps what it serves, as a reader before 1.23 does (with
    nothing yet, the index's own ranking, contract §6 step 2b), until a version it can serve."""
    r = _retriever(4)
    r.set_policy(PROBE)
    assert r.policy is None
    served = _served(r, 200, seed=5)
    assert all(ev.policy_version == 0 and not ev.base for _, ev in served)
    other = policy(version=3, bias=ODD, serving=SERVING.to_wire())  # an older version, not the probe's base
    r.set_policy(other)
    r.set_policy(PROBE)
    assert r.policy is other and all(ev.policy_version == 3 for _, ev in _served(r, 50, seed=6))
    r.set_policy(CERTIFIED)  # the next version it can serve
    assert r.policy is CERTIFIED


def test_a_coupled_canary_over_a_probe_names_the_version_that_drew_each_slate() -> None:
    """Contract 1.5 over a probe: where the canary's slate is served, the event is the canary's
    (no ``base``); where the serving side's is, the probe's (with ``base`` on the share not explored)."""
    r = _retriever(9)
    r.set_policy(CERTIFIED)
    coupled = replace(SERVING, base=4, canary_rate=0.5, canary_coupled=True)
    r.set_policy(policy(version=6, reason="probe", bias=ODD, serving=coupled.to_wire()))
    canary = policy(version=7, bias={s: 8.0 for s in range(0, SLOTS, 3)}, serving=SERVING.to_wire())
    r.set_canary(canary)
    served = _served(r, 400, seed=10)
    arms = {ev.canary_arm for _, ev in served}
    assert "canary" in arms
    for _, ev in served:
        decode_retrieval_event(encode(ev.to_dict()), CONN.limits)  # what the pipeline accepts
        if ev.canary:
            assert ev.policy_version == canary.version and not ev.base
        else:
            assert ev.policy_version == 6


def test_the_learner_recomputes_each_request_under_the_weights_that_drew_it() -> None:
    """What a client written from the contract sends (no ``candidate_probs``): the learner finds
    each request's probabilities under the certified version or the probe as ``base`` says, with
    no mismatch, and values the probe as the mixture clients served: weights exactly 1."""
    r = _retriever(6)
    r.set_policy(CERTIFIED)
    r.set_policy(PROBE)
    served = _served(r, 600, seed=7)
    bare = [replace(ev, candidate_probs=None, candidate_masks=None) for _, ev in served]
    rng = np.random.default_rng(8)
    experiences = [Experience(ev.event_id, "feedback", ev, float(rng.normal())) for ev in bare]
    policies = LoggingPolicies(Metrics())
    policies.hold(CERTIFIED.manifest, CERTIFIED.net)
    for v in (5, 6):  # a probe before, then this one: the certified version stays held
        policies.hold(replace(PROBE.manifest, version=v), PROBE.net)
    policies.hold(replace(CERTIFIED.manifest, version=7), CERTIFIED.net)  # an unrelated version after
    completed = policies.complete(experiences)
    assert len(completed) == len(experiences) and not policies.take_mismatched()
    for (_, ev), e in zip(served, completed, strict=True):
        assert e.event.candidate_probs is not None
        assert np.allclose(e.event.candidate_probs, ev.candidate_probs, atol=1e-6)
    probe_params = ServingParams.from_wire(PROBE.manifest.serving)
    versions = {4: (CERTIFIED.net, SERVING), 6: (PROBE.net, probe_params)}
    usable = evidence.usable(completed, versions)
    assert len(usable) == len(completed)
    ev = evidence.build(usable, versions, SERVING)
    assert np.allclose(ev.weights(6), 1.0)  # the probe as served is what drew every decision
    assert not np.allclose(ev.weights(4), 1.0)  # the certified version as served explores with its own weights
    # Without the certified version's network (a probe replaced since, the anchor promoted past it) the
    # probe is not valued, and its decisions keep their own draw's probability.
    assert evidence.drawn_from(usable, {6: versions[6]}) == {}
    alone = evidence.build(usable, {6: versions[6]}, SERVING)
    assert 6 not in alone.probs and not np.allclose(alone.logging, ev.logging)
    # Nor is a canary mixed with it (a later canary's requests still naming it as the other version).
    mixed = [
        replace(e, event=replace(e.event, policy_version=7, canary=True, canary_rate=0.2, alternative_version=6))
        for e in usable[:50]
    ]
    beside = evidence.build(mixed, {6: versions[6], 7: (CERTIFIED.net, SERVING)}, SERVING)
    assert 6 not in beside.probs and beside.mixed_with is not None and (beside.mixed_with == -1).all()
