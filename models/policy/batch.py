"""Experiences as padded tensors: the learner's micro-batch (docs/learning.md).

Each experience's candidates, selections, measured per-memory effects and label targets are
laid out at fixed width (C = most candidates, K = most selections in the batch), with
``valid`` masks for the padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from topics.internal import Experience


@dataclass
class Batch:
    """Experiences as padded tensors (C = most candidates, K = most selections)."""

    embedding: torch.Tensor  # [B, D]
    loss: torch.Tensor  # [B]
    entropy: torch.Tensor  # [B]
    slots: torch.Tensor  # [B, C] long (padding: 0)
    valid: torch.Tensor  # [B, C] bool
    scores: torch.Tensor  # [B, C]
    selected: torch.Tensor  # [B, K] positions into C
    selected_valid: torch.Tensor  # [B, K] bool
    temperature: torch.Tensor  # [B]
    logged_logprob: torch.Tensor  # [B]
    utility: np.ndarray  # [B] float64
    effect: np.ndarray  # [B, K] float64: each selected memory's measured effect (per-memory credit)
    has_effect: np.ndarray  # [B, K] bool: positions whose memory has an effect
    target: torch.Tensor | None = None  # [B, C] bool: labelled slots (label batches)
    harmful: torch.Tensor | None = None  # [B, C] bool: slots the labeler marked harmful (label batches)


def make_batch(experiences: Sequence[Experience], device: str = "cpu", with_target: bool = False) -> Batch:
    b = len(experiences)
    c = max(len(e.event.candidates) for e in experiences)
    k = max(max(len(e.event.selected) for e in experiences), 1)
    slots = np.zeros((b, c), np.int64)
    valid = np.zeros((b, c), bool)
    scores = np.zeros((b, c), np.float32)
    selected = np.zeros((b, k), np.int64)
    selected_valid = np.zeros((b, k), bool)
    effect = np.zeros((b, k), np.float64)
    has_effect = np.zeros((b, k), bool)
    target = np.zeros((b, c), bool) if with_target else None
    harmful = np.zeros((b, c), bool) if with_target else None
    for i, e in enumerate(experiences):
        ev = e.event
        n = len(ev.candidates)
        slots[i, :n] = ev.candidates
        valid[i, :n] = True
        scores[i, :n] = ev.scores
        pos = {s: j for j, s in enumerate(ev.candidates)}
        sel = [pos[s] for s in ev.selected]
        selected[i, : len(sel)] = sel
        selected_valid[i, : len(sel)] = True
        if e.slot_effects:
            for j, s in enumerate(ev.selected):
                if s in e.slot_effects and math.isfinite(e.slot_effects[s]):
                    effect[i, j] = e.slot_effects[s]
                    has_effect[i, j] = True
        if target is not None and e.correct_memories:
            for s in e.correct_memories:
                if s in pos:
                    target[i, pos[s]] = True
        if harmful is not None and e.harmful_memories:
            for s in e.harmful_memories:
                if s in pos:
                    harmful[i, pos[s]] = True
    emb = np.stack([e.event.features.query_embedding for e in experiences]).astype(np.float32, copy=False)
    feats = np.array(
        [(e.event.features.last_step_loss, e.event.features.last_step_entropy) for e in experiences], np.float32
    )

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x).to(device)

    return Batch(
        embedding=t(emb),
        loss=t(np.ascontiguousarray(feats[:, 0])),
        entropy=t(np.ascontiguousarray(feats[:, 1])),
        slots=t(slots),
        valid=t(valid),
        scores=t(scores),
        selected=t(selected),
        selected_valid=t(selected_valid),
        temperature=t(np.array([e.event.temperature for e in experiences], np.float32)),
        logged_logprob=t(np.array([e.event.logprob for e in experiences], np.float32)),
        utility=np.array([e.utility for e in experiences], np.float64),
        effect=effect,
        has_effect=has_effect,
        target=t(target) if target is not None else None,
        harmful=t(harmful) if harmful is not None else None,
    )
