"""The learner computes the logging probabilities of events that lack them
(pipeline/learner/logging_policy.py): the same as the client's own, first-class in the
promotion gate, and a client whose fields disagree is counted and left out of it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from models.offpolicy.logged import LoggedDecisions
from models.offpolicy.logging_policy import recompute
from models.policy.network import PolicyNetwork, init_policy
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import LoadedPolicy
from pipeline.learner.logging_policy import LoggingPolicies, masks_of
from pipeline.metrics import Metrics
from topics.internal import Experience
from topics.manifest import Manifest

D, S, H = 8, 40, 16


def manifest(version: int) -> Manifest:
    return Manifest("default", version, 0.0, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1)


def varied_policy(seed: int) -> PolicyNetwork:
    """A network whose masks span orders of magnitude, so that the hard drop removes some candidates."""
    net = init_policy(D, S, H, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        net.out.weight.copy_(torch.randn(net.out.weight.shape, generator=gen))
        net.out.bias.copy_(3.0 * torch.randn(net.out.bias.shape, generator=gen))
        net.alpha.fill_(0.7)
    return net.eval()


def client_log(net: PolicyNetwork, version: int, n: int, seed: int, **serving: Any) -> list[Experience]:
    """What CausalRetriever itself logs, serving ``net`` as ``version`` (with ``serving``'s parameters)."""
    rng = np.random.default_rng(seed)
    emb = rng.normal(size=(S, D)).astype(np.float32)
    r = CausalRetriever(emb, k=3, n_candidates=12, seed=seed, fallback=lambda *a: [0], **serving)
    r.set_policy(LoadedPolicy(manifest(version), net))
    out = []
    for i in range(n):
        q = rng.normal(size=D).astype(np.float32)
        ev = r.retrieve(q, f"q{seed}-{i}", step=i % 4, last_step_loss=float(i % 3), last_step_entropy=0.5).event
        out.append(Experience(ev.event_id, "feedback", ev, float(rng.normal())))
    return out


def stripped(exps: list[Experience]) -> list[Experience]:
    """The events a client that fills only the contract's required fields sends."""
    return [
        dataclasses.replace(
            e, event=dataclasses.replace(e.event, candidate_probs=None, candidate_masks=None, dropped=None)
        )
        for e in exps
    ]


@pytest.mark.parametrize(
    "serving",
    [
        {"temperature": 0.05},
        {"temperature": 1.0},
        {"temperature": 0.001},
        {"temperature": 0.05, "explore_rate": 0.5, "explore_temperature": 0.25, "explore_revive": 0.5},
    ],
    ids=["T0.05", "T1", "T0.001", "explore-revive"],
)
def test_recomputed_probabilities_are_what_causal_retriever_logs(serving: dict[str, Any]) -> None:
    net = varied_policy(seed=3)
    logged = client_log(net, 4, 150, seed=5, **serving)
    served = [e for e in logged if not e.event.fallback]
    assert len(served) > 100
    assert any(e.event.dropped for e in served), "the hard drop removed some candidates"
    if serving.get("explore_rate"):
        assert len({e.event.temperature for e in served}) == 2, "both temperatures were served"
    # The learner's recomputation from the events' fields and v4's network...
    decisions = LoggedDecisions.from_experiences(served)
    policy = LoadedPolicy(manifest(4), net)
    rec = recompute(decisions, masks_of(policy, served, decisions.slots.shape), policy.alpha)
    for e, probs, lp in zip(served, rec.probs, rec.logprob, strict=True):
        assert probs == pytest.approx(e.event.candidate_probs, rel=1e-12, abs=1e-15)
        assert lp == pytest.approx(e.event.logprob, rel=1e-12, abs=1e-15)
    # ...and the gate's component, on the stripped events: the client's own values back.
    policies = LoggingPolicies(Metrics())
    policies.hold(manifest(4), net)
    completed = policies.complete(stripped(logged))
    assert [e.id for e in completed] == [e.id for e in logged]  # nothing disagrees, nothing left out
    for original, e in zip(logged, completed, strict=True):
        if original.event.fallback:
            assert e.event.candidate_probs is None
        else:
            assert e.event.candidate_probs == pytest.approx(original.event.candidate_probs, rel=1e-12, abs=1e-15)


def test_version_zero_is_similarity_and_an_unheld_version_keeps_what_it_carries() -> None:
    net = varied_policy(seed=4)
    metrics = Metrics()
    policies = LoggingPolicies(metrics, held=2)
    for v in (5, 6, 7):
        policies.hold(manifest(v), net)
    assert policies.versions == [6, 7]  # bounded: the oldest goes
    no_policy = client_log(net, 1, 30, seed=6, temperature=0.3)  # relabelled below as a client without a policy
    # Every request explores at T = 0.3: a client without a policy logs only those as draws (cold
    # start serves the index's own ranking otherwise, as fallback steps: contract 1.10).
    r = CausalRetriever(
        np.eye(S, D, dtype=np.float32), k=2, n_candidates=6, seed=1, explore_rate=1.0, explore_temperature=0.3
    )
    similarity = [r.retrieve(e.event.features.query_embedding, e.event.query_id).event for e in no_policy]
    assert all(ev.policy_version == 0 for ev in similarity)
    zero = [Experience(ev.event_id, "feedback", ev, 0.0) for ev in similarity]
    old = stripped(client_log(net, 5, 20, seed=7, temperature=0.3))  # v5 is no longer held
    out = policies.complete(stripped(zero) + old)
    assert len(out) == 50
    for original, e in zip(zero, out[:30], strict=True):
        assert e.event.candidate_probs == pytest.approx(original.event.candidate_probs, abs=1e-12)
    assert all(e.event.candidate_probs is None for e in out[30:])  # they fall back, as before
    value = metrics.registry.get_sample_value
    assert value("causalmem_gate_logging_probs_total", {"source": "recomputed"}) == 30
    assert value("causalmem_gate_logging_probs_total", {"source": "version_not_held"}) == 20
    # A client that serves a policy but leaves policy_version out (it is optional, default 0)
    # is not a client without a policy: its events keep what they carry, none is left out.
    unnamed = [
        dataclasses.replace(e, event=dataclasses.replace(e.event, policy_version=0))
        for e in no_policy
        if not e.event.fallback
    ][:10]
    out = policies.complete(unnamed)
    assert [e.event.candidate_probs for e in out] == [e.event.candidate_probs for e in unnamed]
    assert value("causalmem_gate_logging_probs_total", {"source": "unversioned"}) == 10
    assert value("causalmem_gate_logging_mismatch_total", {"field": "logprob"}) is None


def test_a_run_of_canaries_does_not_push_out_the_version_clients_serve() -> None:
    # The learner names a canary with every trial, whether or not clients serve canaries. Held
    # in one table with the served versions, three canaries pushed the serving version out, and
    # a client without candidate_probs (a minimal contract client) then logged no evidence at all:
    # through the pipeline its trials saw no decision, and it never left its first promotion.
    net = varied_policy(seed=5)
    metrics = Metrics()
    policies = LoggingPolicies(metrics)
    policies.hold(manifest(6), net)  # promoted: what clients serve
    for v in range(7, 13):
        policies.hold(manifest(v), net, canary=True)
    assert policies.versions == [6, 11, 12]  # the served version, and the newest canaries
    out = policies.complete(stripped(client_log(net, 6, 20, seed=8, temperature=0.3)))
    assert all(e.event.candidate_probs is not None for e in out if not e.event.fallback)
    value = metrics.registry.get_sample_value
    assert value("causalmem_gate_logging_probs_total", {"source": "version_not_held"}) is None
    assert value("causalmem_gate_logging_probs_total", {"source": "recomputed"}) == sum(
        not e.event.fallback for e in out
    )


def test_a_version_served_again_by_a_rollback_is_held() -> None:
    net = varied_policy(seed=6)
    metrics = Metrics()
    policies = LoggingPolicies(metrics, held=2)
    for v in (1, 4, 5):  # the first policy, then two newer versions: v1 is no longer held
        policies.hold(manifest(v), net)
    assert policies.versions == [4, 5]
    policies.hold(manifest(1), net)  # a rollback to the first policy: clients serve v1 again
    assert policies.versions == [1, 5]
    out = policies.complete(stripped(client_log(net, 1, 10, seed=9, temperature=0.3)))
    assert all(e.event.candidate_probs is not None for e in out if not e.event.fallback)
    value = metrics.registry.get_sample_value
    assert value("causalmem_gate_logging_probs_total", {"source": "version_not_held"}) is None


def test_a_client_whose_fields_disagree_is_counted_once_and_left_out_of_the_gate() -> None:
    net = varied_policy(seed=8)
    logged = [e for e in client_log(net, 2, 60, seed=9, temperature=0.2) if not e.event.fallback]
    metrics = Metrics()
    policies = LoggingPolicies(metrics)
    policies.hold(manifest(2), net)

    def with_event(e: Experience, **changes: Any) -> Experience:
        return dataclasses.replace(e, event=dataclasses.replace(e.event, **changes))

    ev0, ev1 = logged[0].event, logged[1].event
    bad_probs = with_event(logged[0], candidate_probs=np.full(len(ev0.candidates), 1.0 / len(ev0.candidates)))
    # A client that logs T = 0.2 but draws at another temperature: its logprob is not the served one.
    bad_logprob = with_event(logged[1], logprob=ev1.logprob - 0.5, candidate_probs=None)
    probs2 = logged[2].event.candidate_probs
    assert probs2 is not None
    rounded = with_event(logged[2], candidate_probs=np.round(probs2, 4))  # within tolerance
    window = [bad_probs, bad_logprob, rounded, *logged[3:]]
    taken = []
    for _ in range(2):  # the gate looks at a window again and again: each event counts once
        out = policies.complete(window)
        assert [e.id for e in out] == [e.id for e in window[2:]]
        taken.append(policies.take_mismatched())
    # Handed to the gate once each, for dead-letter (contract 1.8 logging_mismatch), with what disagreed.
    assert [(e.id, d.split()[0]) for e, d in taken[0]] == [
        (bad_probs.id, "candidate_probs"),
        (bad_logprob.id, "logprob"),
    ]
    assert taken[1] == []
    value = metrics.registry.get_sample_value
    assert value("causalmem_gate_logging_mismatch_total", {"field": "candidate_probs"}) == 1
    assert value("causalmem_gate_logging_mismatch_total", {"field": "logprob"}) == 1
    assert value("causalmem_gate_logging_probs_total", {"source": "client"}) == len(window) - 2


class Publisher:
    def __init__(self) -> None:
        self.promoted: list[int] = []

    async def promote(self, m: Manifest) -> None:
        self.promoted.append(m.version)

    async def set_canary(self, m: Manifest | None) -> None:
        pass


def test_an_events_own_masks_are_what_its_draw_used() -> None:
    """By id, a client gives a memory its version held no row for the neutral mask, where the
    learner's slot for it has some other row in that version: the event's own
    ``candidate_masks`` are used where it sends them, and only a recomputation from the
    network can disagree."""
    logged = [e for e in client_log(varied_policy(seed=10), 2, 40, seed=12, temperature=0.2) if not e.event.fallback]
    held_rows = varied_policy(seed=11)  # the learner's rows for those slots differ from the client's masks
    metrics = Metrics()
    policies = LoggingPolicies(metrics)
    policies.hold(manifest(2), held_rows)
    assert [e.id for e in policies.complete(logged)] == [e.id for e in logged]
    value = metrics.registry.get_sample_value
    assert value("causalmem_gate_logging_probs_total", {"source": "client"}) == len(logged)
    assert value("causalmem_gate_logging_mismatch_total", {"field": "logprob"}) is None
    bare = [dataclasses.replace(e, id=f"{e.id}-bare") for e in stripped(logged)]
    assert policies.complete(bare) == []  # recomputed from the held network: every one disagrees
    assert value("causalmem_gate_logging_mismatch_total", {"field": "logprob"}) == len(logged)


def test_a_clients_own_ranking_under_an_incumbent_is_checked_against_top_k() -> None:
    """Contract 1.17: CausalRetriever under an incumbent manifest serves its own first k (logprob 0)
    and draws on the explored share. The learner accepts the first as plain top-k by score, checks
    the draws as any other, and leaves out a request whose own ranking did not read the k best."""
    net = varied_policy(seed=10)
    fresh = {"temperature": 0.001, "explore_rate": 0.3, "explore_temperature": 0.5, "drop": "none", "incumbent": True}
    m = dataclasses.replace(manifest(1), serving=fresh)
    rng = np.random.default_rng(11)
    r = CausalRetriever(rng.normal(size=(S, D)).astype(np.float32), k=3, n_candidates=12, seed=11)
    r.set_policy(LoadedPolicy(m, net))
    logged = []
    for i in range(80):
        ev = r.retrieve(rng.normal(size=D).astype(np.float32), f"q{i}").event
        logged.append(Experience(ev.event_id, "feedback", ev, float(rng.normal())))
    own = [e for e in logged if e.event.incumbent]
    assert own and len(own) < len(logged)  # both kinds of request
    e0 = own[0]
    swapped = list(reversed(e0.event.candidates))  # its own ranking is not by score: it read others
    scores = np.asarray(e0.event.scores)[::-1]  # each candidate keeps its score
    event = dataclasses.replace(e0.event, candidates=swapped, scores=scores, selected=swapped[:3])
    other = dataclasses.replace(e0, id="other", event=event)
    metrics = Metrics()
    policies = LoggingPolicies(metrics)
    policies.hold(m, net)
    out = policies.complete([*logged, other])
    assert [e.id for e in out] == [e.id for e in logged]
    (mismatch,) = policies.take_mismatched()
    assert mismatch[0].id == other.id and "not the 3 of highest score" in mismatch[1]
    value = metrics.registry.get_sample_value
    assert value("causalmem_gate_logging_probs_total", {"source": "incumbent"}) == len(own)
    assert value("causalmem_gate_logging_mismatch_total", {"field": "selected"}) == 1
