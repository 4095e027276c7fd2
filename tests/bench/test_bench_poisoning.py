"""``causalmem bench poisoning`` on a small world: a liar's share of the traffic is what was asked,
the honest clients' harmful-read rate is measured on their own retrievals, and a run repeats."""

from __future__ import annotations

import math

from causalmem_lab.bench import poisoning

SMALL = {"embedding_dim": 8, "slots": 64, "intents": 3, "background": 20, "n_candidates": 8}


def _run(share: float, mode: str, defence: str) -> dict:
    return poisoning.run_one(0, share, mode, defence, queries=150, refresh_every=60, world=SMALL, hidden=16)


def test_a_run_measures_the_honest_clients_and_the_liar_has_its_share() -> None:
    honest = _run(0.0, "spread", "none")
    assert honest["liar_steps"] == 0 and honest["flagged_after_liar_steps"] is None
    assert 0.0 <= honest["harmful_read_rate"] <= 1.0 and honest["honest_retrievals"] > 50
    lying = _run(0.25, "intent", "default")
    assert math.isclose(lying["liar_share_of_steps"], 0.25, abs_tol=0.08)
    assert lying["honest_retrievals"] > 50  # the same honest queries, the liar's on top
    assert _run(0.25, "intent", "default") == lying  # seeded: a run repeats


def test_another_initialisation_is_the_same_traffic_with_another_network() -> None:
    base, again = (
        poisoning.run_one(
            0, 0.0, "spread", "none", queries=1200, refresh_every=60, world=SMALL, hidden=16, trainer_seed=t
        )
        for t in (None, 1000)
    )
    assert (base["trainer_seed"], again["trainer_seed"]) == (0, 1000)
    assert again["honest_retrievals"] == base["honest_retrievals"]  # the same honest queries
    assert again["harmful_read_rate"] != base["harmful_read_rate"]  # served by another network


def test_a_seed_is_the_mean_over_initialisations_and_the_report_states_their_noise() -> None:
    # 1,200 queries: at lr 3e-4 two initialisations of this small world still serve alike after 600.
    one = poisoning.run_seed(0, 0.0, "spread", "none", inits=2, queries=1200, refresh_every=60, world=SMALL, hidden=16)
    rates = [r["harmful_read_rate"] for r in one["runs"]]
    assert [r["trainer_seed"] for r in one["runs"]] == [0, poisoning.NOISE_SEED]
    assert one["harmful_read_rate"] == sum(rates) / 2 and one["sd_between_inits"] > 0
    se = poisoning.standard_error([one], [one], inits=2)
    assert se is not None and math.isclose(se, one["sd_between_inits"])  # sqrt((sd² + sd²) / 2 / 1)
    assert poisoning.standard_error([one], [one], inits=1) is None
