"""How fresh the served policy is in the in-process loop, and what its candidates are truly worth.

The in-process counterpart of ``causalmem bench freshness``, measured in steps (one step is
one pair; at 100 pairs/s a step is 10 ms): for each step, the steps until the retriever
serves a policy that has learnt from it (:func:`freshness_steps`). Where the loop recorded
every version's true value (:func:`true_value`, exact on a fixed set of the simulator's
queries), :func:`staleness` also says what the gate held back: the true gain of each
candidate over the policy served when it was judged, and how far the served value fell
from its best.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams

__all__ = ["freshness_steps", "staleness", "true_value"]


def freshness_steps(versions: np.ndarray, created: dict[int, int]) -> np.ndarray:
    """Per step i: j − i for the first step j at which the served version has learnt from
    step i (``created[version] > i``), else inf (never, within the run).

    ``versions``: the version served at each step; ``created``: per version, the number of
    steps it has learnt from.

    >>> freshness_steps(np.array([1, 1, 2, 2, 2, 3]), {1: 0, 2: 2, 3: 4}).tolist()
    [2.0, 1.0, 3.0, 2.0, inf, inf]
    """
    n = len(versions)
    out = np.full(n, np.inf)
    covered = 0  # steps before this one have their freshness
    for j, v in enumerate(versions):
        upto = min(created[int(v)], j + 1, n)  # a policy cannot serve a step before it happens
        if upto > covered:
            out[covered:upto] = j - np.arange(covered, upto)
            covered = upto
    return out


def true_value(scenario: Any, queries: int = 1500) -> Callable[[PolicyNetwork], float]:
    """A policy's exact value as served (the serving temperature, no exploration) on
    ``queries`` of the simulator's queries: mean θᵀφ/k (:mod:`causalmem_lab.simvalue`)."""
    from causalmem_lab.simvalue import World, full_decisions, value_of

    world = World(scenario, scenario.n_candidates)
    intents, emb = world.queries(queries)
    slots, scores = world.candidates(emb)
    full = full_decisions(slots, scores, emb, scenario.k)
    phi = world.phi(intents, slots)
    served = ServingParams(temperature=scenario.temperature, explore_rate=0.0)
    return lambda net: value_of(net, served, full, phi)


def staleness(result: Any, warmup: int = 2000, tail: float = 0.3, end: int = 0) -> dict[str, float | None]:
    """Freshness after the first ``warmup`` steps and over the last ``tail`` of the run (both
    without the last ``end`` steps, which the run stops before any policy could cover); with
    true values, the candidates' mean gain over the served policy in that tail (negative: the
    gate held back worse candidates) and the served value's fall from its best.

    >>> from types import SimpleNamespace as NS
    >>> r = NS(tally=NS(version=[1, 1, 2, 2, 2, 3]), created={1: 0, 2: 2, 3: 4},
    ...        values={1: 0.0, 2: 0.5, 3: 0.4}, refreshes=[(2, 2, 1), (4, 3, 2)])
    >>> s = staleness(r, warmup=0, tail=0.5)
    >>> s["median_steps"], s["never_tail"], round(s["candidate_gain_tail"], 2), round(s["served_fall"], 2)
    (2.5, 0.6666666666666666, -0.1, 0.1)
    """
    versions = np.asarray(result.tally.version)
    n = len(versions)
    fresh = freshness_steps(versions, result.created)[: max(0, n - end)]
    after, last = fresh[min(warmup, n) :], fresh[int(n * (1 - tail)) :]
    out: dict[str, float | None] = {
        "median_steps": float(np.median(after)) if len(after) else None,
        "never": float(np.isinf(after).mean()) if len(after) else None,
        "median_steps_tail": float(np.median(last)) if len(last) else None,
        "never_tail": float(np.isinf(last).mean()) if len(last) else None,
    }
    values = result.values
    if values:
        start = n * (1 - tail)
        gains = [values[c] - values[s] for step, c, s in result.refreshes if step >= start and s in values]
        served = [values[int(v)] for v in versions]
        out["candidate_gain_tail"] = float(np.mean(gains)) if gains else None
        out["served_value_final"] = served[-1]
        out["served_fall"] = float(max(served) - served[-1])
    return out
