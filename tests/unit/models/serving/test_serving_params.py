"""Serving parameters: part of the policy's configuration, recorded in the manifest, followed by clients."""

from __future__ import annotations

import numpy as np
import pytest

from models.policy.network import Arch, init_policy
from models.serving.params import DYNAMIC_DROP_RATIO, EXPLORE_TEMPERATURE_ABSENT, ServingParams
from models.serving.rule import DYNAMIC_DROP_RATIO as RULE_RATIO
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import Settings
from pipeline.metrics import Metrics
from topics.fields import Rejected, encode
from topics.manifest import Manifest, decode_manifest

D, S = 4, 8


def _manifest(serving: dict | None) -> Manifest:
    return Manifest(
        policy="default",
        version=3,
        created_ts=1_767_225_600.0,
        reason="periodic",
        arch=Arch(D, S, 8).to_dict(),
        alpha=0.5,
        baseline=0.0,
        sha256="0" * 64,
        size=10,
        chunks=1,
        serving=serving,
    )


def test_params_validate_and_round_trip_through_the_manifest() -> None:
    p = ServingParams(temperature=0.1, explore_rate=0.2, explore_temperature=0.5, drop="fixed", drop_ratio=0.3)
    m = decode_manifest(encode(_manifest(p.to_wire()).to_dict()))
    assert ServingParams.from_wire(m.serving) == p and p.drop_spec == 0.3
    assert p.components() == ((0.8, 0.1), (0.2, 0.5))
    # A manifest written before contract 1.2 has no "serving": readers take the defaults, and no canary.
    old = decode_manifest(encode(_manifest(None).to_dict()))
    assert old.serving is None and "serving" not in _manifest(None).to_dict()
    absent = ServingParams(drop="dynamic", canary_rate=0.0, explore_temperature=EXPLORE_TEMPERATURE_ABSENT)
    assert ServingParams.from_wire(old.serving) == absent
    assert ServingParams.from_wire({"temperature": 0.05}).explore_temperature == EXPLORE_TEMPERATURE_ABSENT == 0.25
    assert DYNAMIC_DROP_RATIO == RULE_RATIO
    for bad in ({"temperature": -1.0}, {"explore_rate": 1.5}, {"drop": "sometimes"}, {"temperature": "hot"}):
        with pytest.raises(Rejected):
            decode_manifest(encode(_manifest(bad).to_dict()))
    with pytest.raises(ValueError):
        ServingParams(temperature=0.0)


def test_settings_build_the_serving_params_from_the_environment() -> None:
    s = Settings.from_env(
        {"CAUSALMEM_SERVE_TEMPERATURE": "0.1", "CAUSALMEM_SERVE_EXPLORE_RATE": "0.2", "CAUSALMEM_SERVE_DROP": "none"}
    )
    assert s.serving() == ServingParams(
        temperature=0.1, explore_rate=0.2, drop="none", canary_rate=Settings.serve_canary_rate
    )
    assert s.learner().serving == s.serving()
    # Manifests without canary_rate mean no canary (contract 1.4); the learner's default serves one.
    assert Settings().learner().serving == ServingParams(canary_rate=Settings.serve_canary_rate)
    assert Settings.from_env({"CAUSALMEM_SERVE_CANARY_RATE": "0"}).serving().canary_rate == 0.0


def test_retriever_follows_the_manifest_unless_given_explicit_values() -> None:
    memories = np.eye(S, D, dtype=np.float32) + 0.01
    net = init_policy(D, S, 8, seed=0)
    served = ServingParams(temperature=0.2, explore_rate=0.5, explore_temperature=0.9, drop="none")
    policy = LoadedPolicy(manifest=_manifest(served.to_wire()), net=net)
    r = CausalRetriever(memories, fallback=lambda *a: [], seed=0)
    assert (r.temperature, r.explore_rate, r.drop) == (0.05, 0.1, "dynamic")  # before any manifest: the defaults
    r.set_policy(policy)
    assert (r.temperature, r.explore_rate, r.explore_temperature, r.drop) == (0.2, 0.5, 0.9, "none")
    temps = {r.retrieve(np.ones(D, np.float32), f"q{i}").event.temperature for i in range(40)}
    assert temps == {0.2, 0.9}
    explicit = CausalRetriever(memories, fallback=lambda *a: [], temperature=0.07, explore_rate=0.0, seed=0)
    explicit.set_policy(policy)
    assert (explicit.temperature, explicit.explore_rate, explicit.drop) == (0.07, 0.0, "none")
    # a policy from an older learner (no serving field) leaves the retriever as it is
    older = CausalRetriever(memories, fallback=lambda *a: [], seed=0)
    older.set_policy(LoadedPolicy(manifest=_manifest(None), net=net))
    assert (older.temperature, older.explore_rate, older.canary_rate) == (0.05, 0.1, 0.0)


def test_gate_gauges_show_the_last_decision_and_its_ess() -> None:
    from prometheus_client import generate_latest

    from pipeline.promtext import parse
    from pipeline.status.live import gate_view

    m = Metrics(role="learner")
    m.gate_last_decision.labels(decision="insufficient").set(1.0)
    m.gate_last_decision.labels(decision="promoted").set(0.0)
    m.gate_ess.set(38.0)
    m.gate_ess_needed.set(200.0)
    text = generate_latest(m.registry).decode()
    assert gate_view(parse(text)) == {"decision": "insufficient", "ess": 38.0, "ess_needed": 200.0}
