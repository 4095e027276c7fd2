"""A candidate's gain over similarity-only, bounded through a version already certified above it.

The gate promotes a candidate only when the lower bounds of its gains over the serving
policy *and* over similarity-only (plain top-k) are above −ε
(:func:`pipeline.learner.promotion_gate.rule`). Once a policy has learnt, the serving policy
logs slates far from top-k, and the window can no longer bound a candidate's gain over
top-k directly (e.g. +0.44 in [−0.95, +1.31] on 2,000 decisions, docs/benchmarks.md
"Freshness"), even for a step that serves within the trust region of a policy the gate has
already judged above top-k. The log still bounds the gain over that earlier policy tightly:
both serve close to the logging policy.

The **witness** is a promoted version whose own judgement bounded its gain over
similarity-only *directly*, with that lower bound (its *margin* m): the latest one whose direct
bound was at least its bound through the witness before it (:func:`next_witness`). A later
candidate c is then also bounded through it:

    V(c) − V(top-k) = [V(c) − V(witness)] + [V(witness) − V(top-k)] ≥ low(c − witness) + m,

where low(c − witness) is the gate's interval on the current window. Each of the two
statements holds at the gate's confidence, so the chained bound fails at most twice as often
as one interval (a union bound), and the candidate's *direct* bound is always taken when it is
the larger. Only one witness is kept (several would multiply the error rate), and there is no
chain of chains: a version promoted through the witness does not become one. The witness is
dropped where the policies' values may have changed under it: a drift reset, a rollback,
any checkpoint served without the gate, and a restart of the learner (it is not persisted).

The two pure functions here are the rule; :class:`~pipeline.learner.promotion_gate.PromotionGate`
and the lab's in-process loop (``lab/causalmem_lab/offline.py``) both hold a witness and call them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from models.offpolicy.estimators import Estimate
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams

CHAINED = "gain_similarity_chained"  # the estimates' key of the bound through the witness


@dataclass(frozen=True)
class Witness:
    """A promoted version whose gain over similarity-only was bounded directly: ``margin``.

    ``params`` are the serving parameters it was judged as served by (the gate's).
    """

    version: int
    net: PolicyNetwork
    params: ServingParams
    margin: float


def through(gain_over_witness: Estimate, witness: Witness) -> Estimate:
    """The candidate's gain over similarity-only through ``witness``: its gain over the witness
    on the current window, shifted by the witness's certified margin.

    >>> net = PolicyNetwork(4, 8, hidden=4)
    >>> a = Witness(7, net, ServingParams(), margin=0.25)
    >>> e = through(Estimate(-0.01, -0.03, 0.01, 300.0, 2000, "dr-gain", 0.0), a)
    >>> round(e.value, 4), round(e.low, 4), round(e.high, 4), e.method
    (0.24, 0.22, 0.26, 'dr-gain through v7 (margin +0.2500)')
    """
    g = gain_over_witness
    m = witness.margin
    method = f"{g.method} through v{witness.version} (margin {m:+.4f})"
    return replace(g, value=g.value + m, low=g.low + m, high=g.high + m, method=method)


def next_witness(
    witness: Witness | None,
    version: int,
    net: PolicyNetwork,
    params: ServingParams,
    estimates: Mapping[str, Estimate],
    epsilon: float,
) -> Witness | None:
    """The witness after ``version`` was promoted on a judgement with these ``estimates``.

    The promoted version becomes the witness when its *direct* bound over similarity-only
    (``gain_similarity``) was above −ε and at least its bound through the current witness
    (closer to what is served now, so later candidates' gains over it are tighter); otherwise
    the witness stays. A promotion without a direct bound (a canary's, a label fine-tune's)
    leaves it as it is.

    >>> net = PolicyNetwork(4, 8, hidden=4)
    >>> e = lambda low: Estimate(low + 0.01, low, low + 0.02, 300.0, 2000, "dr-gain", 0.0)
    >>> first = next_witness(None, 3, net, ServingParams(), {"gain_similarity": e(0.30)}, 0.02)
    >>> first.version, first.margin
    (3, 0.3)
    >>> held = next_witness(first, 4, net, ServingParams(), {"gain_similarity": e(-0.01), CHAINED: e(0.28)}, 0.02)
    >>> held.version  # promoted through v3: the chained bound was the larger
    3
    >>> next_witness(held, 5, net, ServingParams(), {"gain_similarity": e(0.40), CHAINED: e(0.31)}, 0.02).version
    5
    >>> next_witness(held, 6, net, ServingParams(), {}, 0.02).version  # no direct bound: kept
    3
    """
    direct = estimates.get("gain_similarity")
    if direct is None or not direct.low > -epsilon:
        return witness
    chained = estimates.get(CHAINED)
    if witness is not None and chained is not None and chained.low > direct.low:
        return witness
    return Witness(version, net, params, direct.low)
