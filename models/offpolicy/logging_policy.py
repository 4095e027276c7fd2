"""The logging policy's probabilities, recomputed from what every event carries.

Every estimator but plain slate IPS needs the logging policy's first-draw probabilities
over each event's candidates (``candidate_probs``). A client that fills only the
contract's required fields does not send them, but each event carries everything they are
made of (docs/contract.md §6): its ``candidates`` (the slots kept after the hard drop,
revived ones included), their ``scores``, the ``temperature`` of the draw, the query's
``features``, and ``policy_version``, the checkpoint whose mask m and α served it. Given
that version's masks over the candidates (the caller computes them with that version's
network), the serving rule (:mod:`models.serving.rule`, the functions the client's own draw
calls) gives the probabilities and the log-probability of the logged order again:
z_i = score_i·(1 + α·m_i)/T, softmax(z), Plackett–Luce. Version 0, a client without a
policy, is m = 0 and α = 0 (§6 step 2).

Nothing about the hard drop needs recomputing: the event's candidates are what it kept.

>>> d = LoggedDecisions.from_lists([[3, 5]], [[1.0, 0.0]], [[3]], [1.0], [-0.3133], [0.0])
>>> r = recompute(d, np.zeros((1, 2)), 0.0)
>>> [round(p, 4) for p in r.probs[0].tolist()], round(float(r.logprob[0]), 4)
([0.7311, 0.2689], -0.3133)
>>> disagreement(np.array([0.7311, 0.2689]), -0.3133, r.probs[0], float(r.logprob[0])) is None
True
>>> disagreement(None, -1.0, r.probs[0], float(r.logprob[0]))
'logprob'
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.offpolicy.logged import LoggedDecisions
from models.serving.rule import adjusted_logits, first_draw_probs, plackett_luce_logprob

# How far a client's own fields may be from the recomputation. The contract's test vectors
# pin logprob to a relative error of 10⁻⁵ (docs/contract.md §6); these leave room for a
# client that rounds what it sends (the contract's example rounds candidate_probs to 4
# decimals) while any other policy, version or temperature is far outside them.
PROB_TOLERANCE = 1e-3  # absolute, on each first-draw probability
LOGPROB_TOLERANCE = 1e-3  # relative to max(1, |logprob|)


@dataclass(frozen=True)
class Recomputed:
    """Per decision: the first-draw probabilities over its candidates and log π of its logged order."""

    probs: list[np.ndarray]
    logprob: np.ndarray  # [N] float64


def recompute(decisions: LoggedDecisions, masks: np.ndarray, alpha: float) -> Recomputed:
    """The logging probabilities of ``decisions`` under masks ``masks`` [N, C] and ``alpha``.

    Each decision's logits, first-draw probabilities and log-probability of its logged order
    come from the serving rule's functions, row by row, at the decision's own logged
    temperature over its logged candidates (padding in ``masks`` is ignored).
    """
    n = len(decisions)
    if masks.shape != decisions.slots.shape:
        raise ValueError(f"masks {masks.shape} for decisions {decisions.slots.shape}")
    probs: list[np.ndarray] = []
    logprob = np.zeros(n, np.float64)
    for i in range(n):
        valid = decisions.valid[i]  # a prefix: the candidates in their logged order
        z = adjusted_logits(decisions.scores[i, valid], masks[i, valid], alpha, float(decisions.temperature[i]))
        probs.append(first_draw_probs(z))
        logprob[i] = plackett_luce_logprob(z, decisions.selected[i, decisions.selected_valid[i]].tolist())
    return Recomputed(probs, logprob)


def disagreement(
    logged_probs: np.ndarray | None, logged_logprob: float, probs: np.ndarray, logprob: float
) -> str | None:
    """Which of an event's own fields disagrees with the recomputation beyond tolerance, or None.

    ``"logprob"`` is checked first (every event carries it), then ``"candidate_probs"``
    (where the event carries them).

    >>> disagreement(np.array([0.5, 0.5]), -0.69, np.array([0.9, 0.1]), -0.69)
    'candidate_probs'
    """
    if abs(logged_logprob - logprob) > LOGPROB_TOLERANCE * max(1.0, abs(logprob)):
        return "logprob"
    if logged_probs is None:
        return None
    if len(logged_probs) != len(probs) or float(np.max(np.abs(logged_probs - probs), initial=0.0)) > PROB_TOLERANCE:
        return "candidate_probs"
    return None
