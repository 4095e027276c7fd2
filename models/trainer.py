"""The policy's learning step, free of Kafka: REINFORCE micro-batches, label fine-tuning,
last-layer reset and warm-up (docs/learning.md).

:class:`PolicyTrainer` owns the network, the optimizer and the baseline; it is built
from a :class:`TrainerConfig` (which ``pipeline.config.Settings.trainer()`` fills from
the product's settings). The learner process feeds it decoded experiences; the
benchmarks and tests drive it directly.

>>> import numpy as np
>>> from topics.events import Features, RetrievalEvent
>>> from topics.internal import Experience
>>> t = PolicyTrainer(TrainerConfig(embedding_dim=4, slots=6, hidden=8, lr=1e-2))
>>> ev = RetrievalEvent("e1", "q1", 0, 1.0, Features(np.ones(4, np.float32), 0.0, 0.0),
...                     [0, 1, 2], np.array([0.9, 0.8, 0.7]), [0], 1.0, -1.0, False)
>>> stats = t.update([Experience("e1", "feedback", ev, utility=1.0)])
>>> stats.applied, stats.skipped_non_finite
(1, 0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models.baseline import make_baseline
from models.memory_stats import MemoryStats
from models.policy import PolicyNetwork, init_policy
from models.reinforce import credit_loss, importance_weights, impute_effects, label_loss, reinforce_loss
from models.serving_rule import adjusted_logits_torch, plackett_luce_terms_torch
from topics.internal import Experience


def adam(params: Iterable[torch.Tensor], lr: float) -> torch.optim.Adam:
    """Adam with the fused kernel (CPU and CUDA): ~10× faster steps for this network."""
    plist = list(params)
    try:
        return torch.optim.Adam(plist, lr=lr, fused=True)
    except (RuntimeError, TypeError):  # a device without the fused kernel
        return torch.optim.Adam(plist, lr=lr)


@dataclass(frozen=True)
class TrainerConfig:
    """What :class:`PolicyTrainer` needs: the network's shape and the learning settings.

    >>> TrainerConfig(embedding_dim=8, slots=32).hidden
    512
    """

    embedding_dim: int
    slots: int
    hidden: int = 512
    lr: float = 1e-3
    grad_clip: float = 1.0
    importance_clip: float = 5.0
    baseline: str = "moving"  # moving | cluster | none
    baseline_fading: float = 0.01
    label_lr: float = 1e-2
    reset_scope: str = "network"  # a drift reset re-initialises: network | last_layer
    # Once per-memory credit has arrived, steps without it get imputed effects (per-slot
    # means + a share of the residual; docs/learning.md). False: the step reward there.
    credit_impute: bool = True
    device: str = "cpu"
    seed: int = 0


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


@dataclass
class UpdateStats:
    applied: int = 0
    skipped_non_finite: int = 0
    loss: float = 0.0
    grad_norm: float = 0.0
    weights: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    credited: int = 0  # selected memories that had their own effect (per-memory credit)


def _label_usable(e: Experience) -> bool:
    """A label teaches something: a labelled candidate, or a harmful one beside others."""
    cands = set(e.event.candidates)
    good = set(e.correct_memories or ()) & cands
    bad = set(e.harmful_memories or ()) & cands
    return bool(good) or (bool(bad) and len(cands - bad) > 0)


class PolicyTrainer:
    """Network + Adam + baseline; one call per micro-batch.

    ``net`` (optional) starts from given weights instead of ``config.seed``'s.
    """

    def __init__(self, config: TrainerConfig, net: PolicyNetwork | None = None) -> None:
        c = self.config = config
        self.device = c.device
        self.net = (net or init_policy(c.embedding_dim, c.slots, c.hidden, seed=c.seed)).to(c.device)
        self.baseline = make_baseline(c.baseline, c.baseline_fading)
        self.optimizer = adam(self.net.parameters(), c.lr)
        self.label_optimizer = adam([self.net.out.weight, self.net.out.bias], c.label_lr)
        self.updates = 0
        self.experiences = 0
        self.labels_applied = 0
        # Reads and measured effects per memory, for operators; restart empty with the
        # process and at a drift reset (docs/learning.md).
        self.memory_stats = MemoryStats(c.slots)

    # ------------------------------------------------------------------ REINFORCE
    def update(self, experiences: Sequence[Experience], sample_weights: np.ndarray | None = None) -> UpdateStats:
        """One REINFORCE step on a micro-batch of joined experiences.

        ``sample_weights`` (optional, e.g. recency during a warm-up) scale each term.
        """
        stats = UpdateStats()
        if not experiences:
            return stats
        batch = make_batch(experiences, self.device)
        before = self.baseline.state()
        # A = u − b for each experience in order, b updated after each (docs/learning.md).
        pairs = zip(batch.utility, experiences, strict=True)
        adv = np.array([self.baseline.advantage(u, e.event.features.query_embedding) for u, e in pairs], np.float32)
        if not np.isfinite(adv).all():
            # Caught here, not by the loss: per-memory credit may not use the step's
            # advantage at all, and a non-finite utility would still poison the baseline.
            self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading, before)
            stats.skipped_non_finite = 1
            self.experiences += len(experiences)
            return stats
        net = self.net
        h = net.features(batch.embedding, batch.loss, batch.entropy)
        m = net.candidate_masks(h, batch.slots)
        z = adjusted_logits_torch(batch.scores, m, net.alpha, batch.temperature)
        terms, dists = plackett_luce_terms_torch(z, batch.valid, batch.selected, batch.selected_valid)
        logp = terms.sum(dim=1)
        w = importance_weights(logp, batch.logged_logprob, self.config.importance_clip)
        if sample_weights is not None:
            w = w * torch.as_tensor(sample_weights, dtype=w.dtype, device=w.device)
        step_adv = torch.from_numpy(adv).to(self.device)
        if batch.has_effect.any() or (self.config.credit_impute and len(self.baseline.slots)):
            loss = self._credit_loss(batch, terms, dists, step_adv, w)
            stats.credited = int(batch.has_effect.sum())
        else:
            loss = reinforce_loss(logp, step_adv, w)
        stats.weights = w.tolist()
        stats.advantages = adv.tolist()
        self.experiences += len(experiences)
        if not self._step(loss, self.optimizer, list(net.parameters()), stats):
            # A skipped batch leaves no trace, the baseline included: one non-finite value
            # must not poison every later advantage.
            self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading, before)
            return stats

        stats.applied = len(experiences)
        self.updates += 1
        for e in experiences:
            self.memory_stats.update(e.event.selected, e.slot_effects)
        return stats

    def _credit_loss(
        self, batch: Batch, terms: torch.Tensor, dists: torch.Tensor, step_adv: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """Per-memory credit (docs/learning.md): b̂ read for the whole batch, then updated."""
        slot_base = self.baseline.slots.means(batch.slots.cpu().numpy()) * batch.valid.cpu().numpy()
        selected, sel_valid = batch.selected.cpu().numpy(), batch.selected_valid.cpu().numpy()
        effect, has = batch.effect, batch.has_effect
        if self.config.credit_impute and len(self.baseline.slots):
            # Doubly robust: the positions without a measured effect get an imputed one.
            base = self.baseline.slots
            chosen = np.take_along_axis(slot_base, selected, axis=1).astype(np.float64)
            imputed = impute_effects(batch.utility, chosen, sel_valid, base.residual)
            for r in batch.utility - (chosen * sel_valid).sum(axis=1):
                base.update_residual(float(r))
            effect, has = np.where(has, effect, imputed), has | sel_valid
        loss = credit_loss(
            terms,
            dists,
            batch.selected,
            step_adv,
            torch.from_numpy(effect.astype(np.float32)).to(self.device),
            torch.from_numpy(has).to(self.device),
            torch.from_numpy(slot_base.astype(np.float32)).to(self.device),
            w,
        )
        sel_slots = np.take_along_axis(batch.slots.cpu().numpy(), selected, axis=1)
        for i, j in zip(*np.nonzero(batch.has_effect), strict=True):
            self.baseline.slots.update(int(sel_slots[i, j]), float(batch.effect[i, j]))
        return loss

    def _step(
        self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], stats: UpdateStats
    ) -> bool:
        stats.loss = float(loss.detach())
        if not math.isfinite(stats.loss):
            stats.skipped_non_finite = 1
            return False
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)  # (Tensor.backward is untyped for mypy)
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip))
        stats.grad_norm = norm
        if not math.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)
            stats.skipped_non_finite = 1
            return False
        optimizer.step()
        return True

    # ------------------------------------------------------------------ labels
    def fine_tune(self, labelled: Sequence[Experience], steps: int = 1) -> UpdateStats:
        """Move probability mass toward the labelled slots and away from those marked harmful,
        updating the last layer only."""
        stats = UpdateStats()
        usable = [e for e in labelled if _label_usable(e)]
        if not usable:
            return stats
        batch = make_batch(usable, self.device, with_target=True)
        assert batch.target is not None
        params = [self.net.out.weight, self.net.out.bias]
        for _ in range(steps):
            with torch.no_grad():  # backbone frozen: no gradient reaches it
                h = self.net.features(batch.embedding, batch.loss, batch.entropy)
                alpha = self.net.alpha.detach()
            m = self.net.candidate_masks(h, batch.slots)
            z = adjusted_logits_torch(batch.scores, m, alpha, batch.temperature)
            loss = label_loss(z, batch.valid, batch.target, batch.harmful)
            if not self._step(loss, self.label_optimizer, params, stats):
                return stats
        stats.applied = len(usable)
        self.labels_applied += len(usable)
        return stats

    # ------------------------------------------------------------------ drift reset
    def reset(
        self,
        replay: Sequence[Experience],
        epochs: int = 2,
        batch_size: int = 32,
        half_life_s: float | None = 86400.0,
    ) -> UpdateStats:
        """The drift reset: re-initialise the policy as ``config.reset_scope`` says, then warm up.

        ``"network"`` (the default) re-initialises every layer and both optimizers: the
        hidden layer trained on the old world slows relearning down even under a fresh
        last layer (measured in docs/learning.md, "Drift reset"). ``"last_layer"`` is
        :meth:`reset_last_layer` (the seed's design).
        """
        if self.config.reset_scope == "last_layer":
            return self.reset_last_layer(replay, epochs, batch_size, half_life_s)
        if self.config.reset_scope != "network":
            raise ValueError(f"unknown reset_scope {self.config.reset_scope!r} (network, last_layer)")
        c = self.config
        self.net = init_policy(c.embedding_dim, c.slots, c.hidden, seed=c.seed + 1000 + self.updates).to(c.device)
        self.optimizer = adam(self.net.parameters(), c.lr)
        self.label_optimizer = adam([self.net.out.weight, self.net.out.bias], c.label_lr)
        return self._warm_up(replay, epochs, batch_size, half_life_s)

    def reset_last_layer(
        self,
        replay: Sequence[Experience],
        epochs: int = 2,
        batch_size: int = 32,
        half_life_s: float | None = 86400.0,
    ) -> UpdateStats:
        """Re-initialise ``out``, clear its optimizer state, then warm up (:meth:`_warm_up`)."""
        gen = torch.Generator().manual_seed(self.config.seed + 1000 + self.updates)
        self.net.reset_last_layer(gen)
        for p in (self.net.out.weight, self.net.out.bias):
            self.optimizer.state.pop(p, None)
            self.label_optimizer.state.pop(p, None)
        return self._warm_up(replay, epochs, batch_size, half_life_s)

    def _warm_up(
        self, replay: Sequence[Experience], epochs: int, batch_size: int, half_life_s: float | None
    ) -> UpdateStats:
        """Re-estimate b and warm up on replay.

        The baseline restarts: the warm-up replays the kept experiences in event-time
        order with a fresh moving baseline, which ends at the level of the most recent
        utilities (the old average describes a world that no longer exists). Each
        experience is weighed by its age (``0.5 ** (age / half_life_s)``, newest = 1): the
        7 days kept mostly predate the change, and weighing them equally re-teaches the
        old world.
        """
        feedback = sorted((e for e in replay if e.kind == "feedback"), key=lambda e: e.event.ts)
        total = UpdateStats()
        weights = np.ones(len(feedback))
        if feedback and half_life_s:
            newest = feedback[-1].event.ts
            ages = np.array([newest - e.event.ts for e in feedback])
            weights = 0.5 ** (ages / half_life_s)
        self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading)
        for _ in range(epochs):
            # Each pass replays in event-time order with a fresh moving baseline, so every
            # advantage is measured against the utilities of its own time: a baseline from
            # after the change would make every old success look like a great one.
            self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading)
            for i in range(0, len(feedback), batch_size):
                s = self.update(feedback[i : i + batch_size], weights[i : i + batch_size])
                total.applied += s.applied
                total.skipped_non_finite += s.skipped_non_finite
        # What operators see restarts with the world: the warm-up material, counted once.
        self.memory_stats = MemoryStats(self.config.slots)
        for e in feedback:
            self.memory_stats.update(e.event.selected, e.slot_effects)
        labels = [e for e in replay if e.kind == "label"]
        if labels:
            self.fine_tune(labels)
        return total

    # ------------------------------------------------------------------ state
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.net.tensors()

    def load(self, tensors: dict[str, torch.Tensor], baseline_state: dict[str, Any] | None = None) -> None:
        self.net.load_tensors({k: v.to(self.device) for k, v in tensors.items()})
        self.optimizer = adam(self.net.parameters(), self.config.lr)
        self.label_optimizer = adam([self.net.out.weight, self.net.out.bias], self.config.label_lr)
        self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading, baseline_state)

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """Adam moments by parameter name (kept in the learner's local state directory)."""
        out: dict[str, torch.Tensor] = {}
        names = dict(self.net.named_parameters())
        for prefix, opt in (("main", self.optimizer), ("label", self.label_optimizer)):
            for name, p in names.items():
                st = opt.state.get(p)
                if not st:
                    continue
                out[f"{prefix}.{name}.exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
                out[f"{prefix}.{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
                out[f"{prefix}.{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).cpu()
        return out

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        names = dict(self.net.named_parameters())
        for prefix, opt in (("main", self.optimizer), ("label", self.label_optimizer)):
            for name, p in names.items():
                key = f"{prefix}.{name}"
                if f"{key}.exp_avg" not in tensors:
                    continue
                opt.state[p] = {
                    "step": torch.tensor(float(tensors[f"{key}.step"][0])),
                    "exp_avg": tensors[f"{key}.exp_avg"].to(self.device).clone(),
                    "exp_avg_sq": tensors[f"{key}.exp_avg_sq"].to(self.device).clone(),
                }
