"""The promotion rule's evidence: what each held-out decision says about each version.

For every held-out logged decision the rule (:mod:`pipeline.learner.promotion`) needs the
probability, under each version it tests *as clients serve it* (the manifest's serving
parameters: the mixture of the serving and exploration temperatures, the hard drop), of the
set of memories the decision read, and the same under the policy that drew it. Sets, not
ordered slates: a prompt's utility does not depend on the order of its memories, and a set's
probability under Plackett–Luce is the sum over its k! orderings
(:func:`models.offpolicy.setlevel.set_probability`), far larger than any one ordering's.

The logging probability is the one of the draw that happened: each event's first-draw
probabilities (its ``candidate_probs``, or the learner's recomputation from the version that
served it, :class:`pipeline.learner.logging_policy.LoggingPolicies`) at the temperature it
logged. That the request explored or not is a coin the client tossed before the draw and the
logged temperature reveals, so the draw's own probability is the exact propensity given it.

Similarity-only (:data:`pipeline.learner.promotion.SIMILARITY`) is plain top-k over the
logged candidates: what the client serves without the policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from models.offpolicy.logged import TOPK, LoggedDecisions, Served
from models.offpolicy.setlevel import set_probability, target_set_probability
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from pipeline.learner.promotion import SIMILARITY, Evidence
from topics.internal import Experience

Version = tuple[PolicyNetwork, ServingParams]  # a version's network and how clients serve it


def usable(experiences: Sequence[Experience]) -> list[Experience]:
    """The experiences that can be evidence: joined feedback of a policy draw (not a fallback) whose
    first-draw probabilities are known."""
    return [
        e
        for e in experiences
        if e.kind == "feedback"
        and not e.event.fallback
        and e.event.canary_arm is None  # a coupled canary drew two slates: not one draw's probability
        and e.event.candidate_probs is not None
        and e.event.selected
    ]


def logging_probability(decisions: LoggedDecisions) -> np.ndarray:
    """P(S_i | x_i) of each logged set under the draw that read it, from its first-draw probabilities.

    >>> d = LoggedDecisions.from_lists([[1, 2, 3]], [[0.3, 0.2, 0.1]], [[1, 2]], [1.0], [-1.0], [0.0],
    ...                                first_probs=[[0.5, 0.3, 0.2]])
    >>> round(float(logging_probability(d)[0]), 6)  # 0.5·0.3/0.5 + 0.3·0.5/0.7
    0.514286
    """
    assert decisions.first_probs is not None
    out = np.zeros(len(decisions))
    ks = decisions.n_selected
    for k in np.unique(ks):
        rows = np.flatnonzero(ks == k)
        out[rows] = set_probability(np.nan_to_num(decisions.first_probs[rows]), decisions.selected[rows, : int(k)])
    return out


def build(experiences: Sequence[Experience], versions: Mapping[int, Version], params: ServingParams) -> Evidence:
    """The evidence of ``experiences`` (already :func:`usable`) for each of ``versions``.

    ``versions`` maps each version the rule tests to its network and serving parameters;
    :data:`SIMILARITY` needs none (``params`` gives its k and nothing else).
    """
    if not experiences:
        empty = np.zeros(0)
        return Evidence(empty, empty, np.zeros(0, np.int64), {v: empty for v in (*versions, SIMILARITY)})
    decisions = LoggedDecisions.from_experiences(list(experiences))
    rows = np.arange(len(decisions))
    members = decisions.selected
    probs = {SIMILARITY: target_set_probability(decisions, Served(TOPK, params), rows, members)}
    for v, (net, p) in versions.items():
        if v != SIMILARITY:
            probs[v] = target_set_probability(decisions, Served(net, p), rows, members)
    logged_by = np.array([e.event.policy_version for e in experiences], np.int64)
    return Evidence(decisions.utility, logging_probability(decisions), logged_by, probs)
