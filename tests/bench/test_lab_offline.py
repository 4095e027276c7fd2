"""The in-process learning loop (lab/causalmem_lab/offline.py) on a tiny scenario: it refreshes,
resets and gates with the learner's own rules."""

from __future__ import annotations

from causalmem_lab.offline import OfflineConfig, run_offline
from causalmem_lab.simulator import Scenario

from pipeline.config import Settings

TINY = Scenario(
    embedding_dim=8, slots=64, intents=3, background=20, days=2, queries_per_day=120, drift_day=1.0, n_candidates=8
)


def test_refreshes_and_resets_each_serve_a_new_version() -> None:
    cfg = OfflineConfig(hidden=16, refresh_every=40, drift_min_pairs=20, drift_cooldown_s=86400.0, page_hinkley=False)
    result = run_offline(TINY, cfg)
    assert len(result.tally.version) > 400
    assert result.resets, "the drift on day 1 fires a reset"
    assert result.alpha and not result.gate
    # Ungated: every refresh and every reset is served, in order.
    assert max(result.tally.version) == 1 + len(result.alpha) + len(result.resets)
    assert result.tally.version == sorted(result.tally.version)


def test_a_gate_without_enough_data_keeps_the_first_policy() -> None:
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, gate_min_ess=1e9)
    result = run_offline(TINY, cfg)
    assert result.gate and set(result.gate) == {"insufficient"}
    assert set(result.tally.version) == {1}
    # Served as the learner serves a fresh first policy under the gate: the similarity
    # ranking (T = 0.001), not drawn at the serving temperature, until a promotion.
    assert result.served is not None and result.served.serving is not None
    assert result.served.serving.temperature == 0.001
    assert run_offline(TINY, OfflineConfig(hidden=16, refresh_every=40, reset=False)).served.serving is None  # type: ignore[union-attr]


def test_keeps_what_the_learner_keeps() -> None:
    assert OfflineConfig().replay_window_s == Settings().learner().replay_window_s
    assert OfflineConfig().gate_config() is None
    assert OfflineConfig(gate=True).gate_config() == Settings().learner().gate


def test_a_canary_serves_the_pending_candidate_on_its_share_and_is_judged_on_it() -> None:
    cfg = OfflineConfig(
        hidden=16, refresh_every=40, reset=False, gate=True, gate_min_ess=1e9, canary_rate=0.3, canary_max=15
    )
    result = run_offline(TINY, cfg)
    assert set(result.gate) == {"insufficient"}  # the off-policy gate never decides here
    # Undecided canaries give way to newer candidates after 15 canary decisions or are judged.
    assert result.canary and all(v.split()[0] in ("promoted", "refused", "retired") for v in result.canary)
    n = len(result.tally.utility)
    assert 0.15 * n < len(result.canary_utility) < 0.35 * n
    # Canary requests are measured apart from the policy as served, like exploration.
    assert sum(result.tally.explore) >= len(result.canary_utility)
    promoted = [v for v in result.canary if v.startswith("promoted")]
    assert (max(result.tally.version) > 1) == bool(promoted)


def test_without_a_canary_share_nothing_is_canaried() -> None:
    cfg = OfflineConfig(hidden=16, refresh_every=40, reset=False, gate=True, gate_min_ess=1e9)
    result = run_offline(TINY, cfg)
    assert not result.canary and not result.canary_utility
    assert set(result.tally.version) == {1}
