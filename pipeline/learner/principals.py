"""The learner's book of principals (contract 1.15): each one's share of the recent window, the
weight its experiences get (:mod:`pipeline.learner.influence`), whether its utilities disagree
with the others' (:mod:`pipeline.learner.disagreement`; a flagged one is held at weight 0 while
it disagrees) and whether an operator quarantined it.

:meth:`PrincipalBook.weigh` gives a micro-batch's sample weights; :meth:`PrincipalBook.view`
is what the checkpoints' metrics (``principals``, read by ``causalmem status``) and the
learner's Prometheus metrics show, for at most :data:`SHOWN` principals: the flagged and the
quarantined first, then by share (a client may name itself anything, so the labels are bounded).

>>> import numpy as np
>>> from topics.events import Features, RetrievalEvent
>>> from topics.internal import Experience
>>> ev = RetrievalEvent("e", "q", 0, 1.0, Features(np.zeros(2, np.float32), 0.0, 0.0), [0, 1], np.zeros(2),
...                     [1], 1.0, 0.0, False)
>>> book = PrincipalBook(cap=0.2, window=100, tolerance=0.1, min_n=10)
>>> batch = [Experience("e", "feedback", ev, 0.5, feedback_principal=p) for p in ("a", "a", "b")]
>>> book.weigh(batch, quarantined=["b"]).tolist()
[1.0, 1.0, 0.0]
>>> book.view(["b"])["b"]["quarantined"], round(book.view(["b"])["a"]["share"], 2)
(True, 1.0)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from pipeline.learner.disagreement import Disagreement
from pipeline.learner.influence import InfluenceWindow, capped_weights
from topics.internal import Experience

SHOWN = 20  # principals a checkpoint's metrics and the Prometheus labels name at most


class PrincipalBook:
    """Per principal: share, weight, disagreement, quarantine (module docstring)."""

    def __init__(self, cap: float, window: int, tolerance: float, min_n: int, *, hold: bool = True) -> None:
        self.window = InfluenceWindow(window, cap)
        self.disagreement = Disagreement(tolerance, min_n)
        self.hold = hold
        self.quarantined_experiences: dict[str, int] = {}
        self.held_experiences = 0  # one count: a client names itself, and flagged names could be many

    def weigh(self, feedback: Sequence[Experience], quarantined: Collection[str] = ()) -> np.ndarray:
        """The sample weight of each feedback experience: 0 for a quarantined principal's (counted in
        :attr:`quarantined_experiences`, kept out of the window and the comparison) and for a
        flagged one's (counted in :attr:`held_experiences`, kept out of the window but still
        compared, so that it is weighed again once its utilities agree), else its principal's
        capped weight."""
        blocked = set(quarantined)
        principals = [e.principal for e in feedback]
        for e, p in zip(feedback, principals, strict=True):
            if p in blocked:
                self.quarantined_experiences[p] = self.quarantined_experiences.get(p, 0) + 1
            else:
                self.disagreement.observe(p, e.event.selected, e.utility)
        held = self.held(set(principals) - blocked)
        self.held_experiences += sum(p in held for p in principals)
        return self.window.weights(principals, blocked | held, reads=[e.event.selected for e in feedback])

    def held(self, principals: Collection[str]) -> set[str]:
        """Those of ``principals`` the disagreement flag holds at weight 0: the flagged ones, while
        they are fewer than half of the principals compared (none with ``hold`` off).

        The others' median is the reference only while most principals agree with it; with two
        principals that disagree, both are flagged and neither can be told the liar, so neither is
        held (the flag stays, for an operator). Compared means with enough residuals to be
        flagged: names that sent a report or two do not make a flagged pair a minority."""
        d = self.disagreement
        if not self.hold or not d.flagged:
            return set()
        judged = sum(r.n >= d.min_n for r in d.residuals.values())
        if 2 * len(d.flagged) >= judged:
            return set()
        return d.flagged & set(principals)

    def warm_up_weights(self, experiences: Sequence[Experience], quarantined: Collection[str] = ()) -> np.ndarray:
        """The sample weight of each experience a drift reset warms up on: the same cap, measured
        over that material itself (the warm-up is a training run of its own, so a principal that
        flooded the kept days carries at most its bound of it), 0 for a quarantined or flagged
        principal's; labels weigh 1. Nothing is counted in the running window.

        >>> import numpy as np
        >>> from topics.events import Features, RetrievalEvent
        >>> ev = RetrievalEvent("e", "q", 0, 1.0, Features(np.zeros(2, np.float32), 0.0, 0.0), [0, 1], np.zeros(2),
        ...                     [1], 1.0, 0.0, False)
        >>> kept = [Experience("e", "feedback", ev, 0.5, feedback_principal=p) for p in "aaaaaabcde"]
        >>> [round(float(w), 2) for w in PrincipalBook(0.2, 100, 0.1, 10).warm_up_weights(kept, ["e"])[5:]]
        [0.17, 1.0, 1.0, 1.0, 0.0]

        (four principals left, so each may carry a quarter: ``a``'s six weigh as one.)
        """
        rows = [i for i, e in enumerate(experiences) if e.kind == "feedback"]
        out = np.ones(len(experiences))
        if rows:  # a window of its own, over exactly this material
            material = InfluenceWindow(len(rows), self.window.cap)
            principals = [experiences[i].principal for i in rows]
            blocked = set(quarantined) | self.held(set(principals))
            out[rows] = material.weights(principals, blocked, reads=[experiences[i].event.selected for i in rows])
        return out

    def view(self, quarantined: Collection[str] = ()) -> dict[str, dict[str, Any]]:
        """At most :data:`SHOWN` principals: share of the window, weight per experience, the
        residuals' count, mean and interval, flagged, quarantined."""
        shares = self.window.shares()
        weights = capped_weights(dict(self.window.counts), self.window.cap)
        names = set(shares) | set(quarantined) | set(self.disagreement.principals())
        verdicts = {p: self.disagreement.verdict(p) for p in names}
        blocked = set(quarantined) | self.held(names)
        order = sorted(names, key=lambda p: (p not in blocked, not verdicts[p].flagged, -shares.get(p, 0.0), p))
        out: dict[str, dict[str, Any]] = {}
        for p in order[:SHOWN]:
            v = verdicts[p]
            out[p] = {
                "share": shares.get(p, 0.0),
                "weight": 0.0 if p in blocked else weights.get(p, 1.0),
                "n": v.n,
                "residual": v.mean,
                "low": v.low if np.isfinite(v.low) else None,
                "high": v.high if np.isfinite(v.high) else None,
                "flagged": v.flagged,
                "quarantined": p in quarantined,
            }
        return out
