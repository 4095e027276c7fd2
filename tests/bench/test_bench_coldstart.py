"""``causalmem bench coldstart`` on a tiny configuration: the held-out memories, the report's shape."""

from __future__ import annotations

import argparse

import torch
from causalmem_lab.bench import coldstart as bench
from causalmem_lab.roles import HELPFUL

from models.policy.network import NEUTRAL_BIAS


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_options(p)
    return p.parse_args(
        ["--pretrain-queries", "150", "--steps", "3", "--eval-queries", "3", "--refresh", "100", *extra]
    )


def test_new_memories_are_absent_while_the_policy_learns_so_their_rows_stay_untouched() -> None:
    s, env, bank, trainer, _cfg = bench.pretrain(0, _args())
    assert trainer.updates > 0
    assert len(bank.new_slots) == s.intents and bank.n_live + s.intents == env.n_memories
    assert all(env.role(int(bank.order[slot]), i) == HELPFUL for i, slot in enumerate(bank.new_slots))
    new = torch.as_tensor(bank.new_slots)
    # never a candidate, so never a gradient: still the neutral rows the network started with
    assert torch.allclose(trainer.net.out.bias.detach()[new], torch.full((len(new),), NEUTRAL_BIAS))
    live_bias = trainer.net.out.bias.detach()[: bank.n_live]
    assert not torch.allclose(live_bias, torch.full_like(live_bias, NEUTRAL_BIAS)), "the live rows learnt"


def test_the_report_has_both_initialisations_for_each_seed() -> None:
    report = bench.run_seed(1, _args("--pretrain-queries", "40"))
    assert set(report) == set(bench.INITS)
    for r in report.values():
        assert r["steps"] == 3 and len(r["first_step"]) == 8
        assert 0.0 <= r["entered_at_0"] <= r["entered_by_end"] <= 1.0
        assert 0.0 <= r["in_top_k_mean"] <= 1.0 and 0.0 <= r["median_steps"] <= 4
