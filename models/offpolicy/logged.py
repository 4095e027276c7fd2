"""The logged decisions of a retrieval log, and a target policy's probability of each.

The off-policy estimators (:mod:`models.offpolicy.estimators`) compare policies on a log of
retrieval events. This module holds that log as padded arrays (:class:`LoggedDecisions`)
and computes, for a target policy, the log-probability of each logged selection by the
serving rule over the *logged* candidates: z_i = score_i·(1 + α·m_i)/T with the logged T
(or the T of a :class:`Tempered` policy), then Plackett–Luce. A
:class:`~models.policy.network.PolicyNetwork` target also applies its own hard drop (m_i <
0.01·max m over the logged candidates): when it drops a slot the log selected, its
probability of that selection is 0 (log −inf, weight 0). ``"similarity"`` is the rule with
m = 0 (z = score/T), ``"topk"`` plain top-k by similarity (what the benchmarks call
similarity-only: no draw, no exploration, :func:`topk_logits`) and ``"uniform"`` draws k of
the n candidates uniformly in order, π = (n−k)!/n!.

>>> d = LoggedDecisions.from_lists([[1, 2]], [[0.9, 0.1]], [[2]], [1.0], [np.log(0.5)], [1.0])
>>> round(float(np.exp(log_weights(d, "uniform")[0])), 6)  # (1/2) / 0.5
1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from models.serving.rule import DYNAMIC_DROP_RATIO, plackett_luce_logprob_torch
from topics.internal import Experience

BLOCK_ELEMENTS = 1 << 22  # elements per bootstrap / sampling block (bounds memory)
TOPK = "topk"  # plain top-k by similarity: what a client without a policy's intervention serves
RANK_GAP = 40.0  # topk's logit step between ranks: deterministic order, no underflow


@dataclass(frozen=True)
class LoggedDecisions:
    """N logged decisions as padded arrays (C = most candidates, K = most selections).

    ``selected`` holds *positions* into each candidate row, in selection order.

    >>> d = LoggedDecisions.from_lists([[7, 8, 9]], [[0.3, 0.2, 0.1]], [[9, 7]], [0.5], [-2.0], [1.0])
    >>> d.slots.tolist(), d.selected.tolist(), len(d)
    ([[7, 8, 9]], [[2, 0]], 1)
    """

    slots: np.ndarray  # [N, C] int64 candidate slots (padding 0)
    valid: np.ndarray  # [N, C] bool: real candidates
    scores: np.ndarray  # [N, C] float64 similarity scores (padding 0)
    selected: np.ndarray  # [N, K] int64 positions into the candidate row (padding 0)
    selected_valid: np.ndarray  # [N, K] bool
    temperature: np.ndarray  # [N] float64, the logged T
    logprob: np.ndarray  # [N] float64, log π_serving(selected | s)
    utility: np.ndarray  # [N] float64
    embedding: np.ndarray  # [N, D] float32 query embeddings
    loss: np.ndarray  # [N] float32 last_step_loss
    entropy: np.ndarray  # [N] float32 last_step_entropy
    # The logging policy's first-draw probabilities over the logged candidates (the events'
    # candidate_probs; NaN rows where an event lacks them) and per-memory credit
    # (Experience.slot_effects, aligned with ``selected``; NaN where absent). None: none at all.
    first_probs: np.ndarray | None = None  # [N, C] float64
    effects: np.ndarray | None = None  # [N, K] float64

    def __len__(self) -> int:
        return int(self.utility.shape[0])

    @property
    def n_candidates(self) -> np.ndarray:
        """Number of logged candidates per decision."""
        counts: np.ndarray = self.valid.sum(axis=1)
        return counts

    @property
    def n_selected(self) -> np.ndarray:
        """Number of selected slots k per decision."""
        counts: np.ndarray = self.selected_valid.sum(axis=1)
        return counts

    def subset(self, rows: np.ndarray) -> LoggedDecisions:
        """The decisions picked by a boolean mask or index array (same padding)."""
        fields = {k: v[rows] if isinstance(v, np.ndarray) else v for k, v in self.__dict__.items()}
        return LoggedDecisions(**fields)

    def selected_slots(self) -> np.ndarray:
        """Selected slot ids [N, K] (padding where ``selected_valid`` is False)."""
        return np.take_along_axis(self.slots, self.selected, axis=1)

    @classmethod
    def from_lists(
        cls,
        candidates: Sequence[Sequence[int]],
        scores: Sequence[Sequence[float] | np.ndarray],
        selected: Sequence[Sequence[int]],
        temperature: Sequence[float],
        logprob: Sequence[float],
        utility: Sequence[float],
        embedding: np.ndarray | Sequence[Sequence[float]] | None = None,
        loss: Sequence[float] | None = None,
        entropy: Sequence[float] | None = None,
        first_probs: Sequence[Sequence[float] | np.ndarray | None] | None = None,
        effects: Sequence[dict[int, float] | None] | None = None,
    ) -> LoggedDecisions:
        """Build from ragged per-decision lists; ``selected`` are slot ids, as in the events.

        ``first_probs`` (per decision, aligned with its candidates, or None) and ``effects``
        (per decision, selected slot → effect, or None) are optional.

        Raises ``ValueError`` on inconsistent input (a selected slot that is not a candidate,
        repeated slots, T ≤ 0, non-finite logprob or utility).
        """
        n = len(candidates)
        if not all(len(x) == n for x in (scores, selected, temperature, logprob, utility)):
            raise ValueError("all per-decision inputs must have the same length")
        c = max((len(x) for x in candidates), default=0)
        k = max((len(x) for x in selected), default=0)
        slots = np.zeros((n, c), np.int64)
        valid = np.zeros((n, c), bool)
        score_arr = np.zeros((n, c), np.float64)
        sel = np.zeros((n, k), np.int64)
        sel_valid = np.zeros((n, k), bool)
        for i, (cand, sc, chosen) in enumerate(zip(candidates, scores, selected, strict=True)):
            if len(sc) != len(cand):
                raise ValueError(f"decision {i}: {len(sc)} scores for {len(cand)} candidates")
            pos = {int(s): j for j, s in enumerate(cand)}
            if len(pos) != len(cand) or len(set(chosen)) != len(chosen):
                raise ValueError(f"decision {i}: repeated slots")
            try:
                positions = [pos[int(s)] for s in chosen]
            except KeyError as exc:
                raise ValueError(f"decision {i}: selected slot {exc.args[0]} is not a candidate") from None
            slots[i, : len(cand)] = cand
            valid[i, : len(cand)] = True
            score_arr[i, : len(cand)] = sc
            sel[i, : len(positions)] = positions
            sel_valid[i, : len(positions)] = True
        temp = np.asarray(temperature, np.float64).reshape(n)
        lp = np.asarray(logprob, np.float64).reshape(n)
        u = np.asarray(utility, np.float64).reshape(n)
        if not (np.isfinite(temp).all() and (temp > 0).all()):
            raise ValueError("temperatures must be finite and > 0")
        if not (np.isfinite(lp).all() and np.isfinite(u).all() and np.isfinite(score_arr).all()):
            raise ValueError("logprob, utility and scores must be finite")
        emb = np.zeros((n, 0), np.float32) if embedding is None else np.asarray(embedding, np.float32).reshape(n, -1)
        probs_arr = None
        if first_probs is not None and any(p is not None for p in first_probs):
            probs_arr = np.full((n, c), np.nan)
            for i, p in enumerate(first_probs):
                if p is not None and len(p) == len(candidates[i]):
                    probs_arr[i] = 0.0
                    probs_arr[i, : len(p)] = np.asarray(p, np.float64)
        eff_arr = None
        if effects is not None and any(e for e in effects):
            eff_arr = np.full((n, k), np.nan)
            for i, e in enumerate(effects):
                for j, slot in enumerate(selected[i]):
                    if e and int(slot) in e and np.isfinite(e[int(slot)]):
                        eff_arr[i, j] = float(e[int(slot)])
        return cls(
            slots=slots,
            valid=valid,
            scores=score_arr,
            selected=sel,
            selected_valid=sel_valid,
            temperature=temp,
            logprob=lp,
            utility=u,
            embedding=emb,
            loss=np.zeros(n, np.float32) if loss is None else np.asarray(loss, np.float32).reshape(n),
            entropy=np.zeros(n, np.float32) if entropy is None else np.asarray(entropy, np.float32).reshape(n),
            first_probs=probs_arr,
            effects=eff_arr,
        )

    @classmethod
    def from_experiences(cls, experiences: Sequence[Experience], include_fallback: bool = False) -> LoggedDecisions:
        """The ``feedback`` experiences of a joined log (fallback events left out by default)."""
        kept = [e for e in experiences if e.kind == "feedback" and (include_fallback or not e.event.fallback)]
        evs = [e.event for e in kept]
        emb = np.stack([ev.features.query_embedding for ev in evs]) if evs else None
        return cls.from_lists(
            candidates=[ev.candidates for ev in evs],
            scores=[np.asarray(ev.scores, np.float64) for ev in evs],
            selected=[ev.selected for ev in evs],
            temperature=[ev.temperature for ev in evs],
            logprob=[ev.logprob for ev in evs],
            utility=[e.utility for e in kept],
            embedding=emb,
            loss=[ev.features.last_step_loss for ev in evs],
            entropy=[ev.features.last_step_entropy for ev in evs],
            first_probs=[ev.candidate_probs for ev in evs],
            effects=[e.slot_effects for e in kept],
        )


def from_experiences(experiences: Sequence[Experience], include_fallback: bool = False) -> LoggedDecisions:
    """Shorthand for :meth:`LoggedDecisions.from_experiences`."""
    return LoggedDecisions.from_experiences(experiences, include_fallback=include_fallback)


# --------------------------------------------------------------------------- target policies


@dataclass(frozen=True)
class Tempered:
    """A target policy served at a fixed temperature instead of each event's logged T.

    >>> Tempered("similarity", 0.3).temperature
    0.3
    """

    policy: PolicyNetwork | str
    temperature: float


TargetPolicy = PolicyNetwork | str | Tempered


@dataclass(frozen=True)
class Served:
    """A target policy as clients serve it: the mixture of :meth:`ServingParams.components`
    (each at its own T) with the serving parameters' hard drop. ``base``: the network of the
    version a probe over a certified version names (``params.base``, contract 1.23), which
    clients serve on the share not explored.

    >>> [t.temperature for _, t in Served("similarity", ServingParams(explore_temperature=0.25)).components()]
    [0.05, 0.25]
    """

    policy: PolicyNetwork | str
    params: ServingParams
    base: PolicyNetwork | None = None

    def components(self) -> list[tuple[float, Tempered]]:
        return [(w, Tempered(self.policy, t)) for w, t in self.params.components()]


def component_logits(
    decisions: LoggedDecisions, target: Served, batch_size: int = 1024
) -> list[tuple[float, np.ndarray, np.ndarray, bool]]:
    """(weight, z, kept, uniform) per mixture component of a served target, over the logged candidates.

    The network's mask is computed once; each component rescales it to its own T. A network
    served as an *incumbent* (contract 1.17: not yet certified) is the mixture of plain top-k,
    the client's own ranking, on the share not explored and the network's draw at
    ``explore_temperature`` on the explored one; a probe over a certified version (1.23) the
    mixture of that version's draw at ``temperature`` on the share not explored and the
    network's at ``explore_temperature`` on the explored one.
    """
    base, params = target.policy, target.params
    uniform = isinstance(base, str) and base == "uniform"
    if isinstance(base, str) and base == TOPK:
        return [(1.0, *topk_logits(decisions), False)]
    adjusted, kept = _adjusted(base, params, decisions, batch_size)
    explored = params.explore_rate
    if isinstance(base, PolicyNetwork) and (params.incumbent or params.base is not None):
        if params.incumbent:
            rest = topk_logits(decisions)
        elif target.base is not None:
            base_adjusted, base_kept = _adjusted(target.base, params, decisions, batch_size)
            rest = (base_adjusted / params.temperature, base_kept)
        else:
            raise ValueError(f"a probe over v{params.base} is valued with that version's network (Served.base)")
        parts = [(round(1.0 - explored, 12), *rest, False)] if explored < 1.0 else []
        return parts + ([(explored, adjusted / params.explore_temperature, kept, False)] if explored > 0 else [])
    return [(w, adjusted / t, kept, uniform) for w, t in params.components()]


def _adjusted(
    policy: PolicyNetwork | str, params: ServingParams, decisions: LoggedDecisions, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(adjusted scores, kept) of ``policy`` over the logged candidates, before its temperature."""
    if isinstance(policy, PolicyNetwork):
        masks = candidate_masks(policy, decisions, batch_size)
        if params.drop == "dynamic":
            kept = keep_dynamic_rows(masks, decisions.valid, params.drop_ratio)
        elif params.drop == "fixed":
            kept = decisions.valid & np.isfinite(masks) & (masks >= params.drop_ratio)
        else:
            kept = decisions.valid & np.isfinite(masks)
        alpha = float(policy.alpha.detach().reshape(-1)[0])
        with np.errstate(invalid="ignore", over="ignore"):
            return np.where(kept, decisions.scores * (1.0 + alpha * masks), 0.0), kept
    if policy in ("similarity", "uniform"):
        kept = decisions.valid.copy()
        return (np.where(kept, decisions.scores, 0.0) if policy == "similarity" else np.zeros(kept.shape)), kept
    raise ValueError(f"unknown policy {policy!r}: expected a PolicyNetwork, 'similarity', 'topk' or 'uniform'")


def topk_logits(decisions: LoggedDecisions) -> tuple[np.ndarray, np.ndarray]:
    """(z, kept) of plain top-k by similarity: only each row's k most similar candidates are
    kept (k = the event's number of selections), drawn in score order.

    Plackett–Luce over the kept slots with logits −RANK_GAP·rank draws them in rank order
    with probability 1 − O(e^−RANK_GAP), and no probability underflows to 0.

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.1, 0.3, 0.2]], [[2, 3]], [1.0], [-1.0], [0.0])
    >>> z, kept = topk_logits(d)
    >>> kept.tolist(), bool(z[0, 1] > z[0, 2])
    ([[False, True, True]], True)
    """
    scores = np.where(decisions.valid, decisions.scores, -np.inf)
    order = np.argsort(-scores, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :].repeat(order.shape[0], 0), axis=1)
    kept = decisions.valid & (rank < decisions.n_selected[:, None])
    z = np.where(kept, -RANK_GAP * rank.astype(np.float64), 0.0)
    return z, kept


def resolve_target(policy: TargetPolicy, decisions: LoggedDecisions) -> tuple[PolicyNetwork | str, np.ndarray]:
    if isinstance(policy, Tempered):
        if isinstance(policy.policy, Tempered) or not (policy.temperature > 0 and np.isfinite(policy.temperature)):
            raise ValueError("Tempered needs a base policy and a finite temperature > 0")
        return policy.policy, np.full(len(decisions), float(policy.temperature))
    return policy, decisions.temperature


def candidate_masks(net: PolicyNetwork, decisions: LoggedDecisions, batch_size: int = 1024) -> np.ndarray:
    """The network's mask m over each decision's logged candidates, [N, C] float64 (no grad)."""
    n, c = decisions.slots.shape
    if decisions.embedding.shape[1] != net.arch.embedding_dim:
        raise ValueError(f"embedding dim {decisions.embedding.shape[1]} != network's {net.arch.embedding_dim}")
    out = np.zeros((n, c), np.float64)
    if n == 0 or c == 0:
        return out
    param = next(net.parameters())
    with torch.no_grad():
        for lo in range(0, n, batch_size):
            hi = min(n, lo + batch_size)

            def t(x: np.ndarray, dtype: torch.dtype = param.dtype) -> torch.Tensor:
                return torch.as_tensor(np.ascontiguousarray(x), dtype=dtype, device=param.device)

            h = net.features(t(decisions.embedding[lo:hi]), t(decisions.loss[lo:hi]), t(decisions.entropy[lo:hi]))
            m = net.candidate_masks(h, t(decisions.slots[lo:hi], torch.long))
            out[lo:hi] = m.to("cpu", torch.float64).numpy()
    return out


def keep_dynamic_rows(masks: np.ndarray, valid: np.ndarray, ratio: float = DYNAMIC_DROP_RATIO) -> np.ndarray:
    """Row-wise serving-rule hard drop over the valid candidates: keep m_i ≥ ratio·max m (none if non-finite).

    >>> keep_dynamic_rows(np.array([[1.0, 0.001, 0.5]]), np.array([[True, True, True]])).tolist()
    [[True, False, True]]
    """
    with np.errstate(invalid="ignore"):
        finite = np.where(valid, np.isfinite(masks), True).all(axis=1)
        top = np.where(valid, masks, -np.inf).max(axis=1, initial=-np.inf)
        keep: np.ndarray = valid & np.asarray(finite)[:, None] & (masks >= ratio * top[:, None])
        return keep


def target_logits(
    decisions: LoggedDecisions, policy: TargetPolicy, batch_size: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """The target's adjusted logits z [N, C] and its kept candidates [N, C] over the logged ones.

    >>> d = LoggedDecisions.from_lists([[1, 2]], [[0.6, 0.2]], [[1]], [0.5], [-0.5], [0.0])
    >>> z, kept = target_logits(d, "similarity")
    >>> z.round(6).tolist(), kept.tolist()
    ([[1.2, 0.4]], [[True, True]])
    """
    base, temp = resolve_target(policy, decisions)
    if isinstance(base, PolicyNetwork):
        masks = candidate_masks(base, decisions, batch_size)
        kept = keep_dynamic_rows(masks, decisions.valid)
        alpha = float(base.alpha.detach().reshape(-1)[0])
        with np.errstate(invalid="ignore", over="ignore"):
            z = decisions.scores * (1.0 + alpha * masks) / temp[:, None]
        return np.where(kept, z, 0.0), kept
    if base == "similarity":
        return np.where(decisions.valid, decisions.scores / temp[:, None], 0.0), decisions.valid.copy()
    if base == "uniform":
        return np.zeros(decisions.valid.shape, np.float64), decisions.valid.copy()
    raise ValueError(f"unknown policy {base!r}: expected a PolicyNetwork, 'similarity' or 'uniform'")


def uniform_logprob(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """log of (n−k)!/n!: an ordered draw of k out of n, uniformly without replacement.

    >>> round(float(np.exp(uniform_logprob(np.array([3]), np.array([2]))[0])), 12)  # 1/(3·2)
    0.166666666667
    """
    n = np.asarray(n, np.int64)
    k = np.asarray(k, np.int64)
    j = np.arange(int(k.max(initial=0)))
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(j[None, :] < k[:, None], np.log(np.maximum(n[:, None] - j[None, :], 0)), 0.0)
    logprob: np.ndarray = -terms.sum(axis=1)
    return logprob


def logprob_from_logits(
    decisions: LoggedDecisions, z: np.ndarray, kept: np.ndarray, uniform: bool, chunk: int = 8192
) -> np.ndarray:
    n = len(decisions)
    if uniform:
        out = uniform_logprob(kept.sum(axis=1), decisions.n_selected)
    else:
        out = np.zeros(n, np.float64)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            out[lo:hi] = plackett_luce_logprob_torch(
                torch.from_numpy(np.ascontiguousarray(z[lo:hi])),
                torch.from_numpy(np.ascontiguousarray(kept[lo:hi])),
                torch.from_numpy(np.ascontiguousarray(decisions.selected[lo:hi])),
                torch.from_numpy(np.ascontiguousarray(decisions.selected_valid[lo:hi])),
            ).numpy()
    sel_kept = np.take_along_axis(kept, decisions.selected, axis=1)
    dropped = (decisions.selected_valid & ~sel_kept).any(axis=1)
    out[dropped | ~np.isfinite(out)] = -np.inf
    return out


def target_logprobs(decisions: LoggedDecisions, policy: TargetPolicy, batch_size: int = 1024) -> np.ndarray:
    """log π_target(logged selection | s) by the serving rule over the logged candidates, [N].

    −inf where the target's own hard drop removes a selected slot (probability 0).

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[1.0, 0.0, 0.0]], [[1, 2]], [1.0], [-1.0], [0.0])
    >>> lp = target_logprobs(d, "similarity")  # (1 − log(e + 2)) + (0 − log 2)
    >>> bool(np.isclose(lp[0], 1 - np.log(np.e + 2) - np.log(2)))
    True
    >>> bool(np.isclose(target_logprobs(d, "uniform")[0], -np.log(6)))
    True
    """
    base, _ = resolve_target(policy, decisions)
    z, kept = target_logits(decisions, policy, batch_size)
    return logprob_from_logits(decisions, z, kept, uniform=isinstance(base, str) and base == "uniform")


def log_weights(decisions: LoggedDecisions, policy: TargetPolicy, batch_size: int = 1024) -> np.ndarray:
    """log w = log π_target(selected|s) − logged logprob, [N]."""
    log_w: np.ndarray = target_logprobs(decisions, policy, batch_size) - decisions.logprob
    return log_w
