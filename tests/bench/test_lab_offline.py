"""The in-process learning loop (lab/causalmem_lab/offline.py) on a tiny scenario: it refreshes,
resets and gates with the learner's own rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from causalmem_lab import offline
from causalmem_lab.offline import PRODUCT, OfflineConfig, run_offline
from causalmem_lab.simulator import Scenario, Tally

from models.policy.network import init_policy
from models.serving.params import ServingParams
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import Settings
from pipeline.learner import promotion
from pipeline.learner.logging_policy import LoggingPolicies
from pipeline.metrics import Metrics
from topics.fields import PROBE
from topics.manifest import Manifest

TINY = Scenario(
    embedding_dim=8, slots=64, intents=3, background=20, days=2, queries_per_day=120, drift_day=1.0, n_candidates=8
)


def test_refreshes_and_resets_each_serve_a_new_version() -> None:
    cfg = OfflineConfig(
        hidden=16, refresh_every=40, drift_min_pairs=20, drift_cooldown_s=86400.0, page_hinkley=False, gate=False
    )
    result = run_offline(TINY, cfg)
    assert len(result.tally.version) > 400
    assert result.resets, "the drift on day 1 fires a reset"
    assert result.alpha and not result.gate
    # Ungated: every refresh and every reset is served, in order.
    assert max(result.tally.version) == 1 + len(result.alpha) + len(result.resets)
    assert result.tally.version == sorted(result.tally.version)


def _probes(result: Any) -> set[int]:
    """The versions served as probes (incumbents carrying a candidate's weights, contract 1.19)."""
    return {
        v for v, p in result.served_versions.items() if p.manifest.reason == PROBE and p.serving and p.serving.incumbent
    }


def test_a_gate_without_enough_data_keeps_the_first_policy() -> None:
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, canary_rate=0.0)
    result = run_offline(TINY, cfg)  # too few decisions for a bound
    assert result.gate and set(result.gate) == {"insufficient"}
    # The first policy, and the probes that carry each candidate's weights on the exploration
    # share only (contract 1.19): every version served is an incumbent.
    assert 1 in set(result.tally.version) and set(result.tally.version) - {1} <= _probes(result)
    # Served as the learner serves a fresh first policy under the gate: the similarity
    # ranking (T = 0.001), not drawn at the serving temperature, until a promotion.
    assert result.served is not None and result.served.serving is not None
    assert result.served.serving.temperature == 0.001
    # Ungated, every checkpoint names the configured serving parameters, as the product's
    # learner writes them in every manifest: a version is measured as clients serve it (without
    # them a reader falls back to the contract's dynamic drop, which these clients never served).
    ungated = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=False)
    served = run_offline(TINY, ungated).served
    assert served is not None and served.serving is not None
    assert (served.serving.temperature, served.serving.drop) == (0.05, PRODUCT.serve_drop)


def test_keeps_what_the_learner_keeps_and_defaults_to_the_products_settings() -> None:
    product = Settings()
    cfg = OfflineConfig()
    assert cfg.replay_window_s == product.learner().replay_window_s
    assert OfflineConfig(gate=False).gate_config() is None
    assert cfg.gate_config() == product.learner().gate  # gated with the learner's rule, as the product is
    sized = product.replace(embedding_dim=TINY.embedding_dim, slots=TINY.slots, device="cpu")
    assert cfg.trainer(TINY) == sized.trainer()
    assert OfflineConfig(lr=0.5).trainer(TINY) == sized.replace(lr=0.5).trainer()
    assert (cfg.batch_size, cfg.warmup_epochs, cfg.warmup_half_life_s) == (
        product.batch_size,
        product.warmup_epochs,
        product.warmup_half_life_s,
    )
    assert (cfg.canary_rate, cfg.canary_coupled, cfg.drop, cfg.reset) == (
        product.serve_canary_rate,
        product.serve_canary_coupled,
        product.serve_drop,
        product.drift_reset,
    )


def test_a_canary_serves_the_newest_trials_candidate_on_its_share() -> None:
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, canary_rate=0.3)
    result = run_offline(TINY, cfg)
    trials = [v for _, k, v, _ in result.actions if k == "trial"]
    assert trials and result.canary_utility
    n = len(result.tally.utility)
    assert len(result.canary_utility) < 0.35 * n  # its share, once a trial is open
    # Canary requests are measured apart from the policy as served, like exploration.
    assert sum(result.tally.explore) >= len(result.canary_utility)


def test_without_a_canary_share_nothing_is_canaried() -> None:
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, canary_rate=0.0)
    result = run_offline(TINY, cfg)
    assert not result.canary_utility


def test_a_minimal_client_serves_no_canary_though_the_learner_names_one() -> None:
    # As the product's learner, the loop names a canary with each trial at its configured rate;
    # a minimal client (contract §7.2's canary is optional) serves none of them.
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, canary_rate=0.3, minimal_client=True)
    result = run_offline(TINY, cfg)
    assert any(k == "trial" for _, k, _, _ in result.actions)
    assert not result.canary_utility


def test_the_loop_decides_with_the_promotion_rule() -> None:
    """The loop carries out pipeline.learner.promotion.decide, and every promotion names its path."""
    assert offline.is_candidate is promotion.is_candidate
    # The loop holds no rule of its own: it defines no function but its snapshot and itself.
    own = {n for n, v in vars(offline).items() if callable(v) and getattr(v, "__module__", "") == offline.__name__}
    assert own == {"OfflineConfig", "OfflineResult", "SequenceGate", "_snapshot", "run_offline"}
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, canary_rate=0.0)
    result = run_offline(TINY, cfg)
    kinds = {k for _, k, _, _ in result.actions}
    assert "trial" in kinds
    assert all(p in ("improved", "within-epsilon") for _, k, _, p in result.actions if k == "promote")
    served = set(result.tally.version)
    promoted = {v for _, k, v, _ in result.actions if k == "promote"}
    assert served - {1} - _probes(result) <= promoted  # nothing but incumbents is served without the rule
    # Every candidate that started a trial is kept, and every bound looked at names a trial's.
    assert {v for _, k, v, _ in result.actions if k == "trial"} <= set(result.trialled)
    assert all(v in result.trialled and low <= high for _, v, _, low, high in result.looks)


def rolled_back(
    republish: Callable[[LoadedPolicy, str], LoadedPolicy],
) -> tuple[offline.SequenceGate, list[int], LoadedPolicy]:
    """The loop's gate just after the guardrail rolled v2 back to v1 (its copy is due after the
    checkpoint being judged), the versions it serves, and v1."""
    manifest = Manifest("default", 1, 0.0, "init", {}, 0.5, 0.0, "0" * 64, 1, 1)
    first = LoadedPolicy(manifest, init_policy(8, 64, 16, seed=0))
    served: list[int] = []
    gate = offline.SequenceGate(
        promotion.Rule(),
        first,
        ServingParams(),
        0.0,
        LoggingPolicies(Metrics()),
        offline.OfflineResult(Tally()),
        lambda p: served.append(p.version),
        lambda p: None,
        republish,
    )
    gate.state = replace(gate.state, serving=2, awaiting=1)  # clients serve v2 until the copy comes
    gate.copies.append((1, "guardrail: v2 below similarity-only"))
    return gate, served, first


def test_a_drift_reset_served_while_a_copy_is_due_ends_the_wait_as_in_the_learner() -> None:
    """A look that rolls back (or promotes after a newer probe) has the learner publish a copy
    after the checkpoint being judged; a drift reset served at that checkpoint ends the rule's wait,
    and the learner then publishes no copy (it would undo the reset): neither does the loop."""
    copied: list[int] = []

    def republish(policy: LoadedPolicy, reason: str) -> LoadedPolicy:
        copied.append(policy.version)
        return policy

    gate, served, first = rolled_back(republish)
    gate.refresh(LoadedPolicy(replace(first.manifest, version=3, reason="reset"), first.net), step=600)
    assert served == [3] and copied == [] and gate.state.awaiting is None


def test_the_loop_serves_a_rollbacks_copy_after_the_checkpoint_judged() -> None:
    """As the learner: the copy the rule waits for goes out after the checkpoint being judged, is
    served at once, and ends the wait."""
    copied: list[int] = []

    def republish(policy: LoadedPolicy, reason: str) -> LoadedPolicy:
        copied.append(policy.version)
        manifest = replace(policy.manifest, version=9, reason="rollback", metrics={"rolled_back_to": policy.version})
        return LoadedPolicy(manifest, policy.net)

    gate, served, first = rolled_back(republish)
    gate.refresh(LoadedPolicy(replace(first.manifest, version=3, reason="periodic"), first.net), step=600)
    assert copied == [1] and served == [9]
    assert (gate.state.serving, gate.state.awaiting) == (9, None)
