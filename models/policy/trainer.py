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

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models.memory.stats import MemoryStats
from models.policy.baseline import MAX_QUERIES, QueryMeans, make_baseline, query_key
from models.policy.batch import Batch, make_batch
from models.policy.network import PolicyNetwork, init_policy, neutral_rows
from models.policy.reinforce import credit_loss, importance_weights, impute_effects, label_loss, reinforce_loss
from models.policy.row_adam import LazyRowAdam
from models.policy.sparse_adam import RowSparseAdam, adam
from models.policy.trainer_config import TrainerConfig
from models.serving.rule import adjusted_logits_torch, plackett_luce_terms_torch
from topics.internal import Experience

__all__ = ["Batch", "PolicyTrainer", "TrainerConfig", "UpdateStats", "adam", "make_batch"]


@dataclass
class UpdateStats:
    applied: int = 0
    skipped_non_finite: int = 0
    loss: float = 0.0
    grad_norm: float = 0.0
    weights: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    credited: int = 0  # selected memories that had their own effect (per-memory credit)


@dataclass
class _QueryUpdates:
    """A step's updates of each query's means (:class:`QueryMeans`), taken once the step is: a
    skipped batch leaves no trace."""

    residuals: list[tuple[bytes, float, float, float]] = field(default_factory=list)  # query, r, weight, start
    effects: list[tuple[bytes, int, float, float, float]] = field(default_factory=list)  # query, slot, e, weight, start

    def apply(self, means: QueryMeans) -> None:
        for query, r, weight, start in self.residuals:
            means.update(query, r, weight, start)
        for query, slot, e, weight, start in self.effects:
            means.update_effect(query, slot, e, weight, start)


@contextlib.contextmanager
def _learning_rate_scaled(optimizer: RowSparseAdam, scale: float) -> Iterator[None]:
    """Every parameter group's learning rate times ``scale`` for one step (1: untouched)."""
    if scale == 1.0:
        yield
        return
    groups = optimizer.param_groups  # the dense part's and the rows'
    lrs = [g["lr"] for g in groups]
    for g, lr in zip(groups, lrs, strict=True):
        g["lr"] = lr * scale
    try:
        yield
    finally:
        for g, lr in zip(groups, lrs, strict=True):
            g["lr"] = lr


def _label_usable(e: Experience) -> bool:
    """A label teaches something: a labelled candidate, or a harmful one beside others."""
    cands = set(e.event.candidates)
    good = set(e.correct_memories or ()) & cands
    bad = set(e.harmful_memories or ()) & cands
    return bool(good) or (bool(bad) and len(cands - bad) > 0)


class PolicyTrainer:
    """Network + Adam + baseline; one call per micro-batch.

    ``net`` (optional) starts from given weights instead of ``config.seed``'s. The output
    layer learns with row-sparse, lazy Adam (models/policy/row_adam.py): a step costs the same at
    S = 10^3 and 10^6. :meth:`take_changed_rows` says which output rows were written.
    """

    def __init__(self, config: TrainerConfig, net: PolicyNetwork | None = None) -> None:
        c = self.config = config
        self.device = c.device
        self.net = (net or init_policy(c.embedding_dim, c.slots, c.hidden, seed=c.seed)).to(c.device)
        self.baseline = make_baseline(c.baseline, c.baseline_fading)
        self.query_means = self._new_query_means()
        self._new_optimizers()
        self._row_generator = torch.Generator().manual_seed(c.seed + 2000)  # neutral rows of init_rows
        self.updates = 0
        self.experiences = 0
        self.labels_applied = 0
        # Reads and measured effects per memory, for operators; restart empty with the
        # process and at a drift reset (docs/learning.md).
        self.memory_stats = MemoryStats(c.slots)

    # ------------------------------------------------------------------ REINFORCE
    def update(
        self,
        experiences: Sequence[Experience],
        sample_weights: np.ndarray | None = None,
        step_scale: float = 1.0,
        baseline_weights: np.ndarray | None = None,
    ) -> UpdateStats:
        """One REINFORCE step on a micro-batch of joined experiences.

        ``sample_weights`` (optional, e.g. recency during a warm-up) scale each term, and each
        utility's step in the baseline unless ``baseline_weights`` are given (the warm-up gives
        its principals' weights alone: the baseline follows the utilities of their own time,
        not their age). ``step_scale`` (in (0, 1]) scales the step's learning rate: the learner
        gives the weight the micro-batch carries, so that experiences of weight 0 left out of it
        do not make the others' steps more frequent (Adam's step does not shrink with the batch).
        """
        stats = UpdateStats()
        if not experiences:
            return stats
        batch = make_batch(experiences, self.device)
        before = self.baseline.state()
        # A = u − b for each experience in order, b updated after each by the experience's sample
        # weight (docs/learning.md): b is the mean of the utilities the update learns from, so a
        # principal held to a share of the update is held to it in b too.
        given = baseline_weights if baseline_weights is not None else sample_weights
        given = np.ones(len(experiences)) if given is None else np.asarray(given, np.float64)
        rows = zip(batch.utility, experiences, given, strict=True)
        adv = np.array(
            [self.baseline.advantage(u, e.event.features.query_embedding, float(w)) for u, e, w in rows], np.float32
        )
        if not np.isfinite(adv).all():
            # Caught here, not by the loss: per-memory credit may not use the step's
            # advantage at all, and a non-finite utility would still poison the baseline.
            self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading, before)
            stats.skipped_non_finite = 1
            self.experiences += len(experiences)
            return stats
        net = self.net
        # At large S the candidates' moment rows are gathered while the forward pass runs.
        self.optimizer.prefetch(batch.slots[batch.valid])
        h = net.features(batch.embedding, batch.loss, batch.entropy)
        m = net.candidate_masks(h, batch.slots)
        z = adjusted_logits_torch(batch.scores, m, net.alpha, batch.temperature)
        terms, dists = plackett_luce_terms_torch(z, batch.valid, batch.selected, batch.selected_valid)
        logp = terms.sum(dim=1)
        w = importance_weights(logp, batch.logged_logprob, self.config.importance_clip)
        if sample_weights is not None:
            w = w * torch.as_tensor(sample_weights, dtype=w.dtype, device=w.device)
        step_adv = torch.from_numpy(adv).to(self.device)
        taken = _QueryUpdates()  # each query's means, taken once the step is
        if batch.has_effect.any() or self.imputes():
            loss, taken = self._credit_loss(batch, experiences, terms, dists, step_adv, w, sample_weights)
            stats.credited = int(batch.has_effect.sum())
        else:
            loss = reinforce_loss(logp, step_adv, w)
        stats.weights = w.tolist()
        stats.advantages = adv.tolist()
        self.experiences += len(experiences)
        if not self._step(loss, self.optimizer, stats, step_scale):
            # A skipped batch leaves no trace, the baseline included: one non-finite value
            # must not poison every later advantage.
            self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading, before)
            return stats

        stats.applied = len(experiences)
        self.updates += 1
        taken.apply(self.query_means)
        for e in experiences:
            self.memory_stats.update(e.event.selected, e.slot_effects)
        return stats

    def imputes(self) -> bool:
        """Whether positions without a measured per-memory effect get an imputed one (per-slot
        means + a share of the residual, docs/learning.md "Per-memory credit"): once any
        credit has arrived. Before, the loss is the step reward's."""
        return len(self.baseline.slots) > 0

    def _credit_loss(
        self,
        batch: Batch,
        experiences: Sequence[Experience],
        terms: torch.Tensor,
        dists: torch.Tensor,
        step_adv: torch.Tensor,
        w: torch.Tensor,
        sample_weights: np.ndarray | None,
    ) -> tuple[torch.Tensor, _QueryUpdates]:
        """Per-memory credit (docs/learning.md): b̂ read for the whole batch, then updated, each
        experience by its sample weight: the per-slot means impute other steps' credit, so a
        principal held to a share of the updates must be held to it there too. b̂ is each query's
        own mean effect of a slot where it has one, the slot's over all queries elsewhere; each
        query's residual mean is read here too. The updates of each query's means are returned
        with the loss, taken only once the step is."""
        weight = np.ones(len(batch.utility)) if sample_weights is None else np.asarray(sample_weights, np.float64)
        slots, valid = batch.slots.cpu().numpy(), batch.valid.cpu().numpy()
        overall = self.baseline.slots.means(slots)
        queries = [query_key(e.event.features.query_embedding) for e in experiences]
        slot_base = self.query_means.effects(queries, slots, overall) * valid
        selected, sel_valid = batch.selected.cpu().numpy(), batch.selected_valid.cpu().numpy()
        effect, has = batch.effect, batch.has_effect
        taken = _QueryUpdates()
        if self.imputes():
            # Doubly robust: the positions without a measured effect get an imputed one.
            base = self.baseline.slots
            chosen = np.take_along_axis(slot_base, selected, axis=1)
            own = self.query_means.residuals(queries, base.residual)
            imputed = impute_effects(batch.utility, chosen, sel_valid, own)
            unexplained = batch.utility - (chosen * sel_valid).sum(axis=1)
            for q, r, wi, c in zip(queries, unexplained, weight, own, strict=True):
                base.update_residual(float(r), float(wi))
                taken.residuals.append((q, float(r), float(wi), float(c)))
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
        sel_slots = np.take_along_axis(slots, selected, axis=1)
        sel_overall = np.take_along_axis(overall, selected, axis=1)
        for i, j in zip(*np.nonzero(batch.has_effect), strict=True):
            slot, e = int(sel_slots[i, j]), float(batch.effect[i, j])
            self.baseline.slots.update(slot, e, float(weight[i]))
            taken.effects.append((queries[i], slot, e, float(weight[i]), float(sel_overall[i, j])))
        return loss, taken

    def _new_query_means(self) -> QueryMeans:
        """Each query's residual and effect means for per-memory credit (none kept without a
        baseline: b = 0)."""
        c = self.config
        return QueryMeans(c.baseline_fading, max_queries=0 if c.baseline == "none" else MAX_QUERIES)

    def _new_optimizers(self) -> None:
        """Fresh optimizers: the backbone dense, the output layer row-sparse (models/policy/row_adam.py)."""
        net, c = self.net, self.config
        backbone = [p for name, p in net.named_parameters() if not name.startswith("out.")]
        previous = getattr(self, "optimizer", None)
        if isinstance(previous, RowSparseAdam):  # a reset or a load: its row mover's thread ends
            previous.close()
        # Huge pages for the main moments: every candidate's rows are read and written each step.
        self.optimizer = RowSparseAdam(backbone, net.out.weight, net.out.bias, c.lr, huge_pages=True)
        # Labels train the output layer alone; its moments are committed only for labelled rows.
        self.label_optimizer = RowSparseAdam([], net.out.weight, net.out.bias, c.label_lr)

    def _step(self, loss: torch.Tensor, optimizer: RowSparseAdam, stats: UpdateStats, scale: float = 1.0) -> bool:
        stats.loss = float(loss.detach())
        if not math.isfinite(stats.loss):
            stats.skipped_non_finite = 1
            return False
        optimizer.zero_grad()
        torch.autograd.backward(loss)  # (Tensor.backward is untyped for mypy)
        norm = optimizer.clip_grad_norm_(self.config.grad_clip)
        stats.grad_norm = norm
        if not math.isfinite(norm):
            optimizer.zero_grad()
            stats.skipped_non_finite = 1
            return False
        with _learning_rate_scaled(optimizer, scale):
            self.net.changed.mark(optimizer.step())
        optimizer.zero_grad()  # the sparse gradients are not kept between steps
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
        for _ in range(steps):
            with torch.no_grad():  # backbone frozen: no gradient reaches it
                h = self.net.features(batch.embedding, batch.loss, batch.entropy)
                alpha = self.net.alpha.detach()
            m = self.net.candidate_masks(h, batch.slots)
            z = adjusted_logits_torch(batch.scores, m, alpha, batch.temperature)
            loss = label_loss(z, batch.valid, batch.target, batch.harmful)
            if not self._step(loss, self.label_optimizer, stats):
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
        sample_weights: Sequence[float] | np.ndarray | None = None,
    ) -> UpdateStats:
        """The drift reset: re-initialise the policy as ``config.reset_scope`` says, then warm up.

        ``"network"`` (the default) re-initialises every layer and both optimizers: the
        hidden layer trained on the old world slows relearning down even under a fresh
        last layer (measured in docs/learning.md, "Drift reset"). ``"last_layer"`` is
        :meth:`reset_last_layer` (the seed's design). ``sample_weights``: one per experience of
        ``replay`` (e.g. each principal's capped influence), multiplying the age weights; an
        experience of weight 0 is left out.
        """
        if self.config.reset_scope == "last_layer":
            return self.reset_last_layer(replay, epochs, batch_size, half_life_s, sample_weights)
        if self.config.reset_scope != "network":
            raise ValueError(f"unknown reset_scope {self.config.reset_scope!r} (network, last_layer)")
        c = self.config
        # In place (no second network at S = 10^6); every row counts as changed (RowTracker).
        self.net.reinitialise(seed=c.seed + 1000 + self.updates)
        self._new_optimizers()
        return self._warm_up(replay, epochs, batch_size, half_life_s, sample_weights)

    def reset_last_layer(
        self,
        replay: Sequence[Experience],
        epochs: int = 2,
        batch_size: int = 32,
        half_life_s: float | None = 86400.0,
        sample_weights: Sequence[float] | np.ndarray | None = None,
    ) -> UpdateStats:
        """Re-initialise ``out``, clear its optimizer state, then warm up (:meth:`_warm_up`)."""
        gen = torch.Generator().manual_seed(self.config.seed + 1000 + self.updates)
        self.net.reset_last_layer(gen)
        out = self.net.out
        self.optimizer.rows.close()
        self.optimizer.rows = LazyRowAdam(out.weight, out.bias, self.config.lr, huge_pages=True)
        self.label_optimizer.rows = LazyRowAdam(out.weight, out.bias, self.config.label_lr)
        return self._warm_up(replay, epochs, batch_size, half_life_s, sample_weights)

    def _warm_up(
        self,
        replay: Sequence[Experience],
        epochs: int,
        batch_size: int,
        half_life_s: float | None,
        sample_weights: Sequence[float] | np.ndarray | None = None,
    ) -> UpdateStats:
        """Re-estimate b and warm up on replay.

        The baseline restarts: the warm-up replays the kept experiences in event-time
        order with a fresh moving baseline, which ends at the level of the most recent
        utilities (the old average describes a world that no longer exists). Each
        experience is weighed by its age (``0.5 ** (age / half_life_s)``, newest = 1): the
        7 days kept mostly predate the change, and weighing them equally re-teaches the
        old world. ``sample_weights`` (one per experience of ``replay``) multiply those; an
        experience of weight 0 is not replayed at all.
        """
        given = np.ones(len(replay)) if sample_weights is None else np.asarray(sample_weights, np.float64)
        if given.shape != (len(replay),):
            raise ValueError(f"{given.shape[0] if given.ndim else 1} sample weights for {len(replay)} experiences")
        kept = sorted(
            ((e, float(w)) for e, w in zip(replay, given, strict=True) if e.kind == "feedback" and w > 0),
            key=lambda pair: pair[0].event.ts,
        )
        feedback = [e for e, _ in kept]
        total = UpdateStats()
        weights = principal_weights = np.array([w for _, w in kept], np.float64)
        if feedback and half_life_s:
            newest = feedback[-1].event.ts
            ages = np.array([newest - e.event.ts for e in feedback])
            weights = weights * 0.5 ** (ages / half_life_s)
        self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading)
        for _ in range(epochs):
            # Each pass replays in event-time order with a fresh moving baseline, so every
            # advantage is measured against the utilities of its own time: a baseline from
            # after the change would make every old success look like a great one.
            self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading)
            self.query_means = self._new_query_means()
            for i in range(0, len(feedback), batch_size):
                part = slice(i, i + batch_size)
                s = self.update(feedback[part], weights[part], baseline_weights=principal_weights[part])
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
        self._new_optimizers()
        self.baseline = make_baseline(self.config.baseline, self.config.baseline_fading, baseline_state)

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """Adam moments (kept in the learner's local state directory): the backbone's by
        parameter name (``main.hidden.weight.exp_avg``, ...), the output layer's for its
        touched rows only (``main.out.rows``, ``main.out.step``, ``main.out.weight.exp_avg``
        [n, H], ...; models/policy/row_adam.py)."""
        names: dict[torch.Tensor, str] = {p: name for name, p in self.net.named_parameters()}
        out = self.optimizer.state_tensors("main", names)
        out.update(self.label_optimizer.state_tensors("label", names))
        return out

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of :meth:`optimizer_tensors`; also reads the dense layout of earlier versions."""
        names: dict[torch.Tensor, str] = {p: name for name, p in self.net.named_parameters()}
        self.optimizer.load_state_tensors("main", names, tensors)
        self.label_optimizer.load_state_tensors("label", names, tensors)

    # ------------------------------------------------------------------ rows
    def init_rows(
        self, slots: Sequence[int], weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> None:
        """Re-initialise the output rows of ``slots``: to ``weight`` [n, H] and ``bias`` [n]
        (e.g. a cold start from similar memories), else to neutral rows (mask ≈ 1,
        :func:`models.policy.network.neutral_rows`); forget their Adam moments; mark them changed.

        >>> t = PolicyTrainer(TrainerConfig(embedding_dim=4, slots=6, hidden=8))
        >>> _ = t.take_changed_rows()
        >>> t.init_rows([4, 1], torch.ones(2, 8), torch.zeros(2))
        >>> t.take_changed_rows().tolist(), float(t.net.out.weight[4, 0].detach())
        ([1, 4], 1.0)
        """
        idx = [int(s) for s in slots]
        if not idx:
            return
        if len(set(idx)) != len(idx) or min(idx) < 0 or max(idx) >= self.config.slots:
            raise ValueError(f"init_rows: slots must be distinct and in [0, {self.config.slots})")
        n, h = len(idx), self.config.hidden
        if weight is None or bias is None:
            fresh_w, fresh_b = neutral_rows(n, h, self._row_generator)
            weight = fresh_w if weight is None else weight
            bias = fresh_b if bias is None else bias
        if tuple(weight.shape) != (n, h) or tuple(bias.shape) != (n,):
            raise ValueError(f"init_rows: weight must be [{n}, {h}] and bias [{n}]")
        rows = torch.tensor(idx, dtype=torch.long, device=self.net.out.weight.device)
        self.net.set_rows(rows, weight, bias)
        self.optimizer.rows.reset_rows(rows)
        self.label_optimizer.rows.reset_rows(rows)
        # A reused slot holds a new memory: its predecessor's reads, effects and baseline go too.
        self.memory_stats.forget(idx)
        self.baseline.slots.forget(idx)
        self.query_means.forget(idx)

    def unsuppress(self, slots: Sequence[int]) -> None:
        """Undo :meth:`PolicyNetwork.suppress <models.policy.network.PolicyNetwork.suppress>` for ``slots``:
        neutral rows again (mask ≈ 1, as a new memory's) with fresh Adam moments. Unlike
        :meth:`init_rows` the memory's reads, effects and baseline are kept: it is the same memory.

        >>> t = PolicyTrainer(TrainerConfig(embedding_dim=4, slots=6, hidden=8))
        >>> t.net.suppress([2]); t.unsuppress([2])
        >>> round(float(torch.nn.functional.softplus(t.net.out.bias[2]).detach()), 3)
        1.0
        """
        idx = sorted({int(s) for s in slots})
        if not idx:
            return
        weight, bias = neutral_rows(len(idx), self.config.hidden, self._row_generator)
        rows = torch.tensor(idx, dtype=torch.long, device=self.net.out.weight.device)
        self.net.set_rows(rows, weight, bias)
        self.optimizer.rows.reset_rows(rows)
        self.label_optimizer.rows.reset_rows(rows)

    def take_changed_rows(self) -> np.ndarray:
        """The output rows written since the last call (int64, sorted, unique): by updates,
        fine-tunes, :meth:`init_rows`, suppression; a reset or a load marks all of them, and
        so does a new trainer (its first call returns every row)."""
        return self.net.changed.take()

    def keep_changed_rows(self, rows: np.ndarray) -> None:
        """Give back rows taken by :meth:`take_changed_rows` whose checkpoint was not published,
        so that the next delta still ships them.

        >>> t = PolicyTrainer(TrainerConfig(embedding_dim=4, slots=6, hidden=8))
        >>> _ = t.take_changed_rows()
        >>> t.init_rows([2]); rows = t.take_changed_rows()
        >>> t.keep_changed_rows(rows); t.take_changed_rows().tolist()
        [2]
        """
        self.net.changed.mark(rows)
