"""Contract 1.5's coupled canary without a broker: the client draws both slates with the
same random numbers (pipeline/client/choice.py), the learner's estimate of the gain
(models/offpolicy/coupled.py, pipeline/learner/canary.py), and the events' new fields."""

from __future__ import annotations

import dataclasses

import numpy as np
import orjson
import pytest
import torch

from models.offpolicy.coupled import CANARY_SHARE, CoupledArms, coupled_term
from models.policy.network import init_policy
from models.serving.params import ServingParams
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import LoadedPolicy
from pipeline.learner.canary import CanaryRun, is_canary
from tests.integration.test_gate import log_of
from topics.events import decode_retrieval_event
from topics.fields import Limits, Rejected, encode
from topics.internal import Experience
from topics.manifest import Manifest

D, S, H = 8, 24, 16
COUPLED = ServingParams(canary_rate=1.0, canary_coupled=True)


def loaded(version: int, seed: int, serving: ServingParams = COUPLED, spread: float = 0.0) -> LoadedPolicy:
    """A policy; ``spread`` moves each memory's output bias by that much noise (a fresh one is neutral)."""
    net = init_policy(D, S, hidden=H, seed=seed)
    with torch.no_grad():
        net.out.bias.add_(spread * torch.randn(S, generator=torch.Generator().manual_seed(seed)))
    m = Manifest("default", version, 0.0, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1, serving=serving.to_wire())
    return LoadedPolicy(manifest=m, net=net)


def retriever(serving: LoadedPolicy, canary: LoadedPolicy | None, seed: int = 0) -> CausalRetriever:
    rng = np.random.default_rng(42)
    memories = rng.normal(size=(S, D)).astype(np.float32)
    r = CausalRetriever(memories, k=3, n_candidates=10, seed=seed)
    r.set_policy(serving)
    r.set_canary(canary)
    return r


def queries(n: int, seed: int = 7) -> np.ndarray:
    pool = np.random.default_rng(seed).normal(size=(40, D)).astype(np.float32)
    return pool[np.arange(n) % len(pool)]


def test_the_same_policy_as_canary_ties_on_every_request() -> None:
    a, b = loaded(1, seed=1), loaded(2, seed=1)  # two versions, one network
    r = retriever(a, b)
    events = [r.retrieve(q, f"q{i}").event for i, q in enumerate(queries(300))]
    assert {e.canary_arm for e in events} == {"tie"}
    assert all(e.canary_version == 2 and e.policy_version == 1 and not e.canary for e in events)
    # Exploratory requests (10% at T = 0.25) are among them: the coin is shared as well.
    assert {e.temperature for e in events} == {0.05, 0.25}


@pytest.mark.slow  # several seconds: make test runs it, make check does not
def test_the_coupled_estimate_is_the_gain_of_the_canary_as_served() -> None:
    serving, canary = loaded(1, seed=1, spread=0.5), loaded(2, seed=5, spread=0.5)
    utility = np.random.default_rng(3).normal(size=S)  # each memory's worth; a slate's is the mean

    def value(policy: LoadedPolicy, n: int, seed: int) -> tuple[float, float]:
        r = retriever(policy, None, seed=seed)
        us = [float(utility[r.retrieve(q, f"v{i}").slots].mean()) for i, q in enumerate(queries(n, seed=7))]
        return float(np.mean(us)), float(np.std(us) / np.sqrt(n))

    vs, se_s = value(serving, 6000, 10)
    vc, se_c = value(canary, 6000, 11)
    r = retriever(serving, canary, seed=12)
    arms = CoupledArms(prior_d2=1.0)
    events = [r.retrieve(q, f"c{i}").event for i, q in enumerate(queries(6000, seed=7))]
    us = [float(utility[e.selected].mean()) for e in events]
    arms.extend([str(e.canary_arm) for e in events], us, np.zeros(len(us)))
    d = np.asarray(arms.terms)
    se = float(d.std() / np.sqrt(len(d)))
    assert 0.02 < arms.differing / len(arms) < 0.98  # the two policies differ on some requests, not all
    assert abs(d.mean() - (vc - vs)) < 4 * np.sqrt(se**2 + se_s**2 + se_c**2), (d.mean(), vc - vs)
    # With a reward model (doubly robust): still the gain, with less spread for a fair model.
    model = utility + 0.3 * np.random.default_rng(4).normal(size=S)
    assert all(bool(e.canary_other) == (e.canary_arm != "tie") for e in events)
    served_pred = np.array([model[e.selected].mean() for e in events])
    other_pred = np.array([model[e.canary_other].mean() if e.canary_other else 0.0 for e in events])
    dr = CoupledArms(prior_d2=1.0)
    dr.extend([str(e.canary_arm) for e in events], us, served_pred, other_pred)
    d_dr = np.asarray(dr.terms)
    se_dr = float(d_dr.std() / np.sqrt(len(d_dr)))
    assert abs(d_dr.mean() - (vc - vs)) < 4 * np.sqrt(se_dr**2 + se_s**2 + se_c**2), (d_dr.mean(), vc - vs)
    assert d_dr.std() < 0.7 * d.std()
    # The canary's slate is served on its share of the differing requests, and only there.
    served = sum(bool(e.canary) for e in events)
    assert abs(served / arms.differing - CANARY_SHARE) < 0.05
    assert all(e.policy_version == 2 for e in events if e.canary)


def test_an_explicit_a_b_manifest_keeps_the_1_4_split() -> None:
    ab = ServingParams(canary_rate=0.5)
    r = retriever(loaded(1, 1, ab), loaded(2, 5, ab, spread=0.5))
    events = [r.retrieve(q, f"q{i}").event for i, q in enumerate(queries(200))]
    assert all(e.canary_arm is None for e in events)
    assert 0.35 < sum(bool(e.canary) for e in events) / len(events) < 0.65


def test_coupled_terms_and_the_interval() -> None:
    assert coupled_term("canary", 1.0, 0.5, 0.5) == pytest.approx(0.5 / CANARY_SHARE)
    # A canary whose differing requests all do worse by 1 on a third of the requests: refused.
    worse = CoupledArms(prior_d2=1.0)
    rng = np.random.default_rng(0)
    for i in range(600):
        arm = "tie" if i % 3 else ("canary" if rng.random() < 0.5 else "serving")
        worse.extend([arm], [0.0 if arm == "canary" else 1.0 if arm == "serving" else 0.5], np.array([0.5]))
    g = worse.gain(0.02)
    assert g is not None and g.high < -0.02 and g.value == pytest.approx(-1 / 3, abs=0.1)
    # Few requests: no interval; a few ties do not read as no variance.
    few = CoupledArms(prior_d2=4.0)
    few.extend(["tie"] * 19, [0.0] * 19, np.zeros(19))
    assert few.gain(0.02) is None
    few.extend(["tie"], [0.0], np.zeros(1))
    g = few.gain(0.02)
    assert g is not None and g.low < -0.02  # 20 ties: too few to rule out a loss


def _event(arm: str | None, canary: bool, version: int, canary_version: int | None, i: int) -> Experience:
    e = log_of(init_policy(D, S, hidden=H, seed=1), 1, seed=i)[0].event
    ev = dataclasses.replace(
        e,
        event_id=f"e{i}",
        policy_version=version,
        canary=True if canary else None,
        canary_arm=arm,
        canary_version=canary_version,
        ts=2e9 + i,
    )
    return Experience(ev.event_id, "feedback", ev, 1.0 if canary else 0.0)


def test_the_learner_reads_coupled_requests_of_its_canary_only() -> None:
    before = [_event(None, False, 1, None, i) for i in range(30)]
    run = CanaryRun(
        Manifest("default", 3, 0.0, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1),
        init_policy(D, S, hidden=H, seed=1),
        1,
        before,
        1.0,
        100,
    )
    later = [_event("tie", False, 1, 3, 100 + i) for i in range(40)]
    later += [_event("canary", True, 3, 3, 200 + i) for i in range(5)]
    later += [_event("serving", False, 1, 3, 300 + i) for i in range(5)]
    later += [_event("tie", False, 1, 2, 400 + i) for i in range(7)]  # an older canary's
    assert all(is_canary(e) for e in later) and not any(is_canary(e) for e in before)
    decided, gain = run.judge(before + later, 0.02)
    assert len(run.coupled) == 50 and run.coupled.differing == 10
    assert gain is not None and gain.method == "coupled" and gain.value > 0
    assert decided in (None, "promoted") and "50 coupled decisions, 10 differing" in run.describe(gain)
    assert not run.arms.canary and not run.arms.serving  # no A/B arm from coupled requests


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"canary_arm": "maybe", "canary_version": 2}, "out_of_range"),
        ({"canary_arm": "tie"}, "inconsistent"),
        ({"canary_version": 2}, "inconsistent"),
        ({"canary_arm": "canary", "canary_version": 2}, "inconsistent"),
        ({"canary_arm": "serving", "canary_version": 2, "canary": True}, "inconsistent"),
        ({"canary_arm": "tie", "canary_version": -1}, "out_of_range"),
        ({"canary_arm": "tie", "canary_version": 2, "canary_other": [1]}, "inconsistent"),
        ({"canary_arm": "serving", "canary_version": 2, "canary_other": []}, "inconsistent"),
        ({"canary_arm": "serving", "canary_version": 2, "canary_other": [1, 1]}, "inconsistent"),
    ],
)
def test_a_coupled_event_that_contradicts_itself_is_rejected(fields: dict[str, object], reason: str) -> None:
    base = orjson.loads(encode(_event(None, False, 1, None, 0).event.to_dict()))
    with pytest.raises(Rejected) as exc:
        decode_retrieval_event(orjson.dumps({**base, **fields}), Limits(embedding_dim=D))
    assert exc.value.reason == reason


def test_a_coupled_event_round_trips() -> None:
    e = _event("canary", True, 3, 3, 0).event
    back = decode_retrieval_event(encode(e.to_dict()), Limits(embedding_dim=D))
    assert (back.canary, back.canary_arm, back.canary_version) == (True, "canary", 3)


@pytest.mark.slow  # several seconds: make test runs it, make check does not
def test_a_coupled_event_logs_the_true_probability_of_what_it_served() -> None:
    """The served slate's probability is (1 − q)·π_serving + q·π_canary (docs/contract.md §3):
    the learner's importance weights divide by it. Checked against the frequencies of one query."""
    r = retriever(loaded(1, seed=1, spread=0.3), loaded(2, seed=5, spread=0.3), seed=3)
    q = queries(1)[0]
    events = [r.retrieve(q, f"q{i}").event for i in range(8000)]
    plain = [e for e in events if e.temperature == 0.05]
    counts: dict[tuple[int, ...], list[float]] = {}
    for e in plain:
        counts.setdefault(tuple(e.selected), []).append(e.logprob)
    assert {e.canary_arm for e in plain} >= {"tie", "canary", "serving"}
    top = sorted(counts.items(), key=lambda kv: -len(kv[1]))[:4]
    for slate, logprobs in top:
        assert max(logprobs) - min(logprobs) < 1e-9, slate  # one probability per slate, whichever arm
        share = len(logprobs) / len(plain)
        p = float(np.exp(logprobs[0]))
        assert abs(share - p) < 4 * np.sqrt(p * (1 - p) / len(plain)) + 1e-3, (slate, share, p)
