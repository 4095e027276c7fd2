"""The throughput bench's learner part: the learner's apply against the bare REINFORCE step.

The bare step had kept a dense ``clip_grad_norm_`` after the output layer's gradients became
row-sparse, so ``causalmem bench throughput`` stopped at its learner part (a sparse tensor
has no ``linalg_vector_norm``); nothing ran it outside the bench.
"""

from __future__ import annotations

import torch
from causalmem_lab.bench.throughput import BareStep, learner_vs_bare, make_events

from models.policy.batch import make_batch
from pipeline.config import Settings


def test_the_bare_step_trains_the_rows_it_read_and_the_comparison_runs() -> None:
    settings = Settings(embedding_dim=8, slots=64, hidden=16, batch_size=16)
    exps = make_events(64, 8, 64, seed=0)
    bare = BareStep(8, 64, 1e-2)
    before = bare.net.out.weight.detach().clone()
    batch = make_batch(exps[:16])
    bare(batch)
    changed = (bare.net.out.weight.detach() != before).any(dim=1).nonzero().ravel().tolist()
    read = sorted({int(x) for x in torch.as_tensor(batch.slots)[torch.as_tensor(batch.valid)].tolist()})
    assert changed and set(changed) <= set(read)
    step = learner_vs_bare(settings, exps, rounds=1)
    assert step["bare_per_s"] > 0 and step["learner_per_s"] > 0 and step["learner_with_decode_per_s"] > 0
