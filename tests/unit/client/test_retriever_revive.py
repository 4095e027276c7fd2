"""Exploration reaches dropped candidates (docs/contract.md §6, step 3b): no absorbing drop,
and the logged logprob stays the probability of the order over the candidates as served."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from models.serving.rule import adjusted_logits, keep_dynamic, plackett_luce_logprob
from pipeline.client import overlap
from pipeline.client import retriever as retriever_module
from pipeline.client.retriever import CausalRetriever

N = 8
MASKS = np.array([2.0, 1.5, 1e-4, 1.0, 1e-5, 0.8, 1e-4, 0.5])  # three below 1% of the max


@pytest.fixture(autouse=True)
def fixed_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy's masks are MASKS whatever the query: its features are not needed."""
    monkeypatch.setattr(overlap, "policy_features", lambda *a: np.zeros(1, np.float32))
    monkeypatch.setattr(retriever_module, "masks_from_features", lambda policy, h, slots: MASKS[slots])


def retriever(**kw: object) -> CausalRetriever:
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(N, 4)).astype(np.float32)
    r = CausalRetriever(emb, k=3, n_candidates=N, seed=1, fallback=lambda *a: [], **kw)  # type: ignore[arg-type]
    r.policy = SimpleNamespace(alpha=0.5, version=3, net=None)  # type: ignore[assignment]
    return r


def test_without_exploration_a_dropped_memory_is_never_served() -> None:
    r = retriever(explore_rate=0.0)
    q = np.ones(4, np.float32)
    for i in range(300):
        ev = r.retrieve(q, f"q{i}").event
        assert set(ev.candidates) == {s for s in range(N) if MASKS[s] >= 0.01 * MASKS.max()}


def test_exploratory_requests_revive_dropped_candidates_with_true_logprob() -> None:
    r = retriever(explore_rate=1.0, explore_temperature=5.0, explore_revive=0.5)
    q = np.ones(4, np.float32)
    dropped = {s for s in range(N) if not keep_dynamic(MASKS)[s]}
    revived_seen: set[int] = set()
    read: set[int] = set()
    for i in range(300):
        ev = r.retrieve(q, f"q{i}").event
        served = set(ev.candidates)
        assert served | set(ev.dropped or []) == set(range(N)) and not served & set(ev.dropped or [])
        revived_seen |= served & dropped
        read |= set(ev.selected) & dropped
        # The logprob is exactly Plackett–Luce over the candidates as sent.
        z = adjusted_logits(ev.scores, MASKS[ev.candidates], 0.5, ev.temperature)
        pos = [ev.candidates.index(s) for s in ev.selected]
        assert ev.logprob == pytest.approx(plackett_luce_logprob(z, pos), rel=1e-12)
    assert revived_seen == dropped and read  # every dropped memory came back, some were read


def test_revival_only_on_exploratory_requests() -> None:
    r = retriever(explore_rate=0.3, explore_revive=1.0)
    q = np.ones(4, np.float32)
    for i in range(200):
        ev = r.retrieve(q, f"q{i}").event
        explored = ev.temperature == r.explore_temperature
        assert (len(ev.candidates) == N) == explored
