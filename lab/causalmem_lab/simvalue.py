"""True values of policies on the simulator, as served: for benchmarks that compare a policy's
estimate with its truth (``causalmem bench staleness``).

The simulator's memories have known per-memory values φ (need × role effect), and a step's
utility is the mean φ of its selection plus noise, so the true value of any policy *as served*
(:class:`~models.serving.params.ServingParams`: the mixture of the serving and the exploration
temperature, with the hard drop) is mean_x θ_π(x)ᵀφ(x)/k, with θ_π the exact Plackett–Luce
inclusion probabilities over the full candidate lists, averaged over a sample of queries.
"""

from __future__ import annotations

import numpy as np

from causalmem_lab.roles import HARMFUL, HELPFUL
from causalmem_lab.simulator import Environment, Scenario
from models.offpolicy.logged import LoggedDecisions, Served, component_logits
from models.offpolicy.slate import inclusion
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams


class World:
    """The simulator's memory bank, its queries and the true per-memory values."""

    def __init__(self, scenario: Scenario, n_candidates: int = 20) -> None:
        self.env = Environment(scenario)
        self.s = scenario
        self.n_candidates = n_candidates
        self.effect = {HELPFUL: scenario.helpful_effect, HARMFUL: scenario.harmful_effect}

    def queries(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        qs = [self.env.next_query() for _ in range(n)]
        return np.array([q.intent for q in qs]), np.stack([q.embedding for q in qs])

    def candidates(self, emb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sims = emb @ self.env.memory.T
        top = np.argsort(-sims, axis=1)[:, : self.n_candidates]
        return top.astype(np.int64), np.take_along_axis(sims, top, axis=1).astype(np.float64)

    def phi(self, intents: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """True per-memory values need·effect(role), [N, C] (the utility is their mean over S)."""
        out = np.zeros(slots.shape)
        for i, (intent, row) in enumerate(zip(intents, slots, strict=True)):
            roles = self.env.roles[int(intent)]
            out[i] = [self.effect.get(roles.get(int(s), -1), 0.0) for s in row]
        scaled: np.ndarray = out * self.env.need[intents][:, None]
        return scaled


def full_decisions(slots: np.ndarray, scores: np.ndarray, emb: np.ndarray, k: int) -> LoggedDecisions:
    """Every candidate list as a decision (selection: the first k), to compute policies on."""
    n = slots.shape[0]
    return LoggedDecisions.from_lists(
        slots.tolist(), scores.tolist(), slots[:, :k].tolist(), [1.0] * n, [0.0] * n, [0.0] * n, embedding=emb
    )


def value_of(policy: PolicyNetwork | str, params: ServingParams, full: LoggedDecisions, phi: np.ndarray) -> float:
    """mean θᵀφ/k: the exact value of a served policy on these queries."""
    k = int(full.n_selected[0])
    v = 0.0
    for weight, z, kept, uniform in component_logits(full, Served(policy, params)):
        zz = np.where(kept, np.zeros_like(z) if uniform else z, -np.inf)
        p = np.exp(zz - zz.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        q, _ = inclusion(p, k, second=False)
        v += weight * float(((q * phi).sum(axis=1) / k).mean())
    return v
