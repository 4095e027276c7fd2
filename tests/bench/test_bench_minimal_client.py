"""The benches' minimal contract client (``minimal_t1`` in process and through the pipeline,
the real-LM ``*_minimal`` rows): its events carry only the contract's required fields, it serves
no canary, and the gate judges them on the logging probabilities that the learner's own
component (:class:`pipeline.learner.logging_policy.LoggingPolicies`) computes."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from causalmem_lab import offline
from causalmem_lab.bench import inprocess, learning, lmlearning
from causalmem_lab.offline import OfflineConfig, run_offline
from causalmem_lab.simrun import run_scenario
from rich.console import Console

from pipeline import kafka
from pipeline.config import Settings
from pipeline.learner import logging_policy
from tests.bench.test_lab_offline import TINY
from topics.internal import Experience


def test_the_row_is_a_gated_minimal_client_exploring_every_request_at_t1() -> None:
    row = inprocess.ROWS["minimal_t1"]
    assert row.minimal_client and row.gate
    assert (row.explore_rate, row.explore_temperature) == (1.0, 1.0)
    assert row.gate_epsilon is None and row.lr is None  # the product's defaults


def test_its_events_carry_only_the_required_fields_and_the_learner_computes_the_probabilities(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert offline.LoggingPolicies is logging_policy.LoggingPolicies  # the product's, not a copy
    seen: list[list[Experience]] = []
    completed: list[list[Experience]] = []

    class Recording(logging_policy.LoggingPolicies):
        def complete(self, window: Sequence[Experience]) -> list[Experience]:
            seen.append(list(window))
            completed.append(super().complete(window))
            return completed[-1]

    monkeypatch.setattr(offline, "LoggingPolicies", Recording)
    cfg = OfflineConfig(
        hidden=16,
        refresh_every=40,
        batch_size=16,
        reset=False,
        gate=True,
        explore_rate=1.0,
        explore_temperature=1.0,
        minimal_client=True,
    )
    result = run_offline(TINY, cfg)
    assert result.gate and seen, "every candidate was judged on a window the learner completed"
    assert not result.canary_utility  # a minimal client serves no canary
    events = [e.event for window in seen for e in window]
    assert events and all(ev.candidate_probs is None and ev.candidate_masks is None for ev in events)
    assert all(ev.dropped is None and ev.mask_max is None and not ev.canary for ev in events)
    assert all(ev.temperature == 1.0 for ev in events)  # every request explored at T = 1
    # What the gate judged: every served event with the probabilities of the version that drew it.
    judged = [e.event for window in completed for e in window if not e.event.fallback]
    assert judged and all(ev.candidate_probs is not None for ev in judged)


def test_causal_retrievers_own_probabilities_agree_with_the_recomputation() -> None:
    # The same loop for the full client: nothing is left out of the gate's window as a mismatch.
    cfg = OfflineConfig(hidden=16, refresh_every=40, batch_size=16, reset=False, gate=True, canary_rate=0.0)
    seen: list[tuple[int, int]] = []

    class Counting(logging_policy.LoggingPolicies):
        def complete(self, window: Sequence[Experience]) -> list[Experience]:
            out = super().complete(window)
            seen.append((len(window), len(out)))
            return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(offline, "LoggingPolicies", Counting)
        run_offline(TINY, cfg)
    assert seen and all(n == kept for n, kept in seen)


def test_the_table_shows_the_served_leak_at_the_start_and_the_end_and_the_promotions() -> None:
    seed = {"leak": 0.02, "recall": 0.9, "utility": 0.8, "steps_to_90pct_recall": 1200.0}
    seeds: list[dict[str, Any]] = [
        {
            **seed,
            "leak_start": 0.5,
            "requests_to_half_leak": 900.0,
            "promoted": 13.0,
            "served_version": 14.0,
            "pairs": 6011.0,
        },
        {
            **seed,
            "leak_start": 0.6,
            "requests_to_half_leak": None,
            "promoted": 15.0,
            "served_version": 16.0,
            "pairs": 5989.0,
        },
    ]
    mean = inprocess.mean_of(seeds)
    text = inprocess.table({"rows": {"minimal_t1": {"name": "m", "per_seed": seeds, "mean": mean}}})
    cells = "| m | 50.0% / 60.0% → **55.0%** | 2.0% / 2.0% → **2.0%** | 900 / – → **900** | 13 / 15 → **14** |"
    assert cells + " 14 / 16 → **15** |" in text


def test_the_pipeline_rows_are_minimal_clients_at_the_learners_defaults() -> None:
    row = learning.ROWS["minimal_t1"]
    assert row.minimal_client and (row.explore_rate, row.explore_temperature) == (1.0, 1.0)
    assert row.pipeline_env == {}  # the gate and every other setting at the product's defaults
    lm = lmlearning.ROWS["credit25_gated_minimal"]
    assert lm.spec.minimal_client and lm.spec.pipeline_env == {} and lm.attribution_rate == 0.25
    assert lm.spec.explore_rate is None  # served as the manifest says (near-greedy)
    t1 = lmlearning.ROWS["step_gated_minimal_t1"]
    assert t1.spec.minimal_client and t1.attribution_rate == 0.0 and t1.spec.explore_temperature == 1.0


@pytest.mark.broker
@pytest.mark.slow
def test_through_the_pipeline_it_sends_only_the_required_fields_and_serves_no_canary(
    broker: Any, tmp_path: Path
) -> None:
    scenario = dataclasses.replace(learning.learning_scenario(True, False, 0), days=0.5, queries_per_day=300)
    spec = dataclasses.replace(learning.ROWS["minimal_t1"], rate=400.0, checkpoint_interval=0.5)
    console = Console(quiet=True)
    result = asyncio.run(run_scenario(scenario, spec, broker.bootstrap, tmp_path, console, prefix="minimal-"))
    topic = Settings(topic_prefix="minimal-").topics().retrieval_events.name
    settings = Settings(bootstrap=broker.bootstrap)
    sent = [orjson.loads(m.value) for m in asyncio.run(kafka.read_all(broker.bootstrap, settings, topic))]
    assert len(sent) == len(result.tally.leak) > 100
    optional = {"candidate_probs", "candidate_masks", "dropped", "mask_max", "canary", "canary_arm", "memory_texts"}
    assert all(not optional & set(ev) for ev in sent), sorted(optional & set(sent[0]))
    assert {ev["temperature"] for ev in sent} == {1.0}  # every request explored at T = 1
    assert all(result.tally.explore)  # none is the policy as the manifest serves it
    row = learning.minimal_client(result, scenario)
    assert row["minimal_leak_start"] is not None and row["minimal_served_version"] >= 1
