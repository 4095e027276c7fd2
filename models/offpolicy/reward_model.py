"""The direct reward model of the doubly robust estimator: a value per slot.

:class:`SlotRewardModel` gives each slot the shrunk mean utility of the steps that read
it; :class:`AdditiveRewardModel` (the default of DR) fits the slot values jointly, so that
a step's utility is the mean of its slots' values: a slot read next to good slots does not
inherit their reward.

>>> d = LoggedDecisions.from_lists([[1, 2]], [[0.5, 0.5]], [[2]], [1.0], [-0.7], [2.0])
>>> SlotRewardModel(shrinkage=1.0).fit(d).values(np.array([2])).tolist()  # (2 + 1·2)/2
[2.0]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.offpolicy.logged import BLOCK_ELEMENTS, LoggedDecisions, TargetPolicy, target_logits

DEFAULT_SAMPLES = 32
DEFAULT_SHRINKAGE = 5.0


@dataclass
class SlotRewardModel:
    """Direct reward model for DR: a shrunk mean utility per slot.

    Every (decision, selected slot) pair is one observation of the decision's utility (the
    utility is attributed equally to the selected slots). A slot's value is its mean
    utility shrunk toward a prior p with weight n_s/(n_s + λ), v_s = (Σ u + λ·p)/(n_s + λ);
    unseen slots get p. The prior is the global mean ū, or — ``prior_quantile`` set — a low
    quantile of the logged utilities (pessimism about what the log has not shown). A selection's predicted utility is
    the *mean* of its slots' values (ū for an empty selection).

    >>> d = LoggedDecisions.from_lists([[1, 2], [1, 3]], [[0.5, 0.5]] * 2, [[1], [3]], [1.0] * 2, [-0.7] * 2,
    ...                                [1.0, 3.0])
    >>> m = SlotRewardModel(shrinkage=2.0).fit(d)
    >>> m.global_mean, m.values(np.array([1, 3, 99])).tolist()  # (1 + 2·2)/3, (3 + 2·2)/3, ū
    (2.0, [1.6666666666666667, 2.3333333333333335, 2.0])
    """

    shrinkage: float = DEFAULT_SHRINKAGE
    prior_quantile: float | None = None  # None: shrink toward ū; else toward that quantile of u
    global_mean: float = 0.0
    prior: float = 0.0
    slot_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    slot_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))

    def fit(self, decisions: LoggedDecisions) -> SlotRewardModel:
        u = decisions.utility
        self.global_mean = float(u.mean()) if u.size else 0.0
        # A pessimistic prior (a low quantile) makes slots the log has rarely or never shown
        # look bad rather than average: what a safety gate should assume about them.
        q = self.prior_quantile
        self.prior = float(np.quantile(u, q)) if q is not None and u.size else self.global_mean
        mask = decisions.selected_valid
        slots = decisions.selected_slots()[mask]
        obs = np.broadcast_to(u[:, None], mask.shape)[mask]
        ids, inverse, counts = np.unique(slots, return_inverse=True, return_counts=True)
        sums = np.bincount(inverse.reshape(-1), weights=obs, minlength=ids.size)
        self.slot_ids = ids.astype(np.int64)
        self.slot_values = (sums + self.shrinkage * self.prior) / (counts + self.shrinkage)
        return self

    def values(self, slots: np.ndarray) -> np.ndarray:
        """v_s for an array of slot ids (ū for slots never selected in the fit)."""
        slots = np.asarray(slots, np.int64)
        if self.slot_ids.size == 0:
            return np.full(slots.shape, self.prior)
        pos = np.clip(np.searchsorted(self.slot_ids, slots), 0, self.slot_ids.size - 1)
        return np.where(self.slot_ids[pos] == slots, self.slot_values[pos], self.prior)

    def predict(self, decisions: LoggedDecisions) -> np.ndarray:
        """r̂(logged selection): mean slot value over each decision's selected slots, [N]."""
        return self._mean_over(self.values(decisions.selected_slots()), decisions.selected_valid)

    def _mean_over(self, vals: np.ndarray, mask: np.ndarray) -> np.ndarray:
        k = mask.sum(axis=1)
        total = np.where(mask, vals, 0.0).sum(axis=1)
        return np.where(k > 0, total / np.maximum(k, 1), self.global_mean)

    def expected_under(
        self, decisions: LoggedDecisions, policy: TargetPolicy, samples: int = DEFAULT_SAMPLES, seed: int = 0
    ) -> np.ndarray:
        """r̂_π(s): E over π's Plackett–Luce draws of the mean slot value of its first k picks, [N]."""
        z, kept = target_logits(decisions, policy)
        return self.expected_from_logits(decisions, z, kept, samples=samples, seed=seed)

    def expected_from_logits(
        self, decisions: LoggedDecisions, z: np.ndarray, kept: np.ndarray, samples: int = DEFAULT_SAMPLES, seed: int = 0
    ) -> np.ndarray:
        """As :meth:`expected_under` for given logits z and kept candidates.

        k_i = min(logged k, kept candidates). Exact when k_i = 1 (softmax expectation) or
        when the target draws all its kept candidates; otherwise the average over
        ``samples`` seeded Gumbel-top-k draws (unbiased). ū when the target keeps nothing.

        >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.5, 0.5, 0.5]], [[1, 2]], [1.0], [-1.8], [1.0])
        >>> m = SlotRewardModel(slot_ids=np.array([1, 2, 3]), slot_values=np.array([0.0, 1.0, 2.0]))
        >>> r = m.expected_from_logits(d, np.zeros((1, 3)), np.ones((1, 3), bool), samples=4000, seed=0)
        >>> bool(abs(r[0] - 1.0) < 0.05)  # uniform over pairs: mean value 1
        True
        """
        n, c = kept.shape
        vals = self.values(decisions.slots)
        n_kept = kept.sum(axis=1)
        k = np.minimum(decisions.n_selected, n_kept)
        out = np.full(n, self.global_mean, np.float64)
        neg = np.where(kept, z, -np.inf)
        # k = 1: the softmax expectation.
        one = k == 1
        if one.any():
            zz = neg[one]
            p = np.exp(zz - zz.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[one] = (p * np.where(kept[one], vals[one], 0.0)).sum(axis=1)
        # Every kept candidate drawn: order does not matter.
        full = (k > 1) & (k == n_kept)
        out[full] = self._mean_over(vals[full], kept[full])
        rest = np.flatnonzero((k > 1) & (k < n_kept))
        if rest.size:
            rng = np.random.default_rng(seed)
            kmax = int(k[rest].max())
            rows = max(1, BLOCK_ELEMENTS // max(1, samples * c))
            for lo in range(0, rest.size, rows):
                r = rest[lo : lo + rows]
                keys = neg[r][:, None, :] + rng.gumbel(size=(r.size, samples, c))
                top = np.argsort(-keys, axis=2, kind="stable")[:, :, :kmax]  # [R, S, kmax]
                picked = np.take_along_axis(np.broadcast_to(vals[r][:, None, :], keys.shape), top, axis=2)
                use = np.arange(kmax)[None, None, :] < k[r][:, None, None]
                out[r] = (np.where(use, picked, 0.0).sum(axis=2) / k[r][:, None]).mean(axis=1)
        return out


@dataclass
class AdditiveRewardModel(SlotRewardModel):
    """Slot values φ fit jointly: u_i ≈ (1/k_i)·Σ_{m∈S_i} φ_m, ridge-shrunk toward the prior.

    Minimises Σ_i (u_i − mean_{m∈S_i} φ_m)² + (λ/k²)·Σ_m (φ_m − p)² with λ = ``shrinkage``
    (k the typical slate size: λ steps' worth of prior). Per-memory credit, where the log
    has it (``effects``: e_m, the utility lost without memory m), adds one equation
    e_m ≈ φ_m/k per measured slot.

    >>> d = LoggedDecisions.from_lists([[1, 2], [1, 3], [2, 3]], [[0.5, 0.5]] * 3, [[1, 2], [1, 3], [2, 3]],
    ...                                [1.0] * 3, [-0.7] * 3, [1.0, 2.0, 4.0])
    >>> AdditiveRewardModel(shrinkage=0.0).fit(d).values(np.array([1, 2, 3])).round(6).tolist()
    [-1.0, 3.0, 5.0]
    """

    def fit(self, decisions: LoggedDecisions) -> AdditiveRewardModel:
        u = decisions.utility
        self.global_mean = float(u.mean()) if u.size else 0.0
        q = self.prior_quantile
        self.prior = float(np.quantile(u, q)) if q is not None and u.size else self.global_mean
        mask = decisions.selected_valid
        slots = decisions.selected_slots()
        ids, inverse = np.unique(slots[mask], return_inverse=True)
        self.slot_ids = ids.astype(np.int64)
        if ids.size == 0:
            self.slot_values = np.zeros(0)
            return self
        col = np.full(mask.shape, -1, np.int64)
        col[mask] = inverse.reshape(-1)
        k = np.maximum(mask.sum(axis=1), 1).astype(np.float64)
        a = np.zeros((ids.size, ids.size))
        b = np.zeros(ids.size)
        for j in range(mask.shape[1]):
            use = mask[:, j]
            np.add.at(b, col[use, j], u[use] / k[use])
            for jj in range(mask.shape[1]):
                both = use & mask[:, jj]
                np.add.at(a, (col[both, j], col[both, jj]), 1.0 / k[both] ** 2)
        if decisions.effects is not None:
            eff = decisions.effects
            has = mask & np.isfinite(eff)
            kk = np.broadcast_to(k[:, None], mask.shape)[has]
            np.add.at(a, (col[has], col[has]), 1.0 / kk**2)
            np.add.at(b, col[has], eff[has] / kk)
        lam = self.shrinkage / float(np.median(k)) ** 2
        a[np.diag_indices_from(a)] += lam if lam > 0 else 1e-9
        b += (lam if lam > 0 else 1e-9) * self.prior
        self.slot_values = np.linalg.solve(a, b)
        return self
