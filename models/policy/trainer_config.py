"""What :class:`models.policy.trainer.PolicyTrainer` is built from, without loading torch.

The configuration (``pipeline.config.Settings``) takes its learning defaults from here, so
each is written once and ``import pipeline.config`` stays free of torch.

>>> TrainerConfig(embedding_dim=8, slots=32).hidden
512
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerConfig:
    """What :class:`~models.policy.trainer.PolicyTrainer` needs: the network's shape and the learning settings."""

    embedding_dim: int
    slots: int
    hidden: int = 512
    lr: float = 3e-4
    grad_clip: float = 1.0
    importance_clip: float = 5.0
    baseline: str = "moving"  # moving | cluster | none
    baseline_fading: float = 0.01
    label_lr: float = 1e-2
    reset_scope: str = "network"  # a drift reset re-initialises: network | last_layer
    device: str = "cpu"
    seed: int = 0
