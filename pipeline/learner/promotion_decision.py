"""The promotion decision: what the learner does with a checkpoint, inputs in, a typed decision out.

Everything the learner decides about a checkpoint is here, without I/O, so that the learner's
gate (:class:`pipeline.learner.promotion_gate.PromotionGate`, an async shell that holds the
networks, publishes and records) and the lab's in-process loop make the same decisions:

- :func:`is_candidate`: a checkpoint is judged, or served at once (``SERVED_AT_ONCE``: the first
  policy, a rollback, a drift reset, shadow mode's cut-over, a "do not use"). A checkpoint
  served at once ends any canary and becomes the reference that later candidates are judged
  against. A drift reset is served at once because the detector has just shown that the
  serving policy no longer agrees with human judgement, and the gate's window still describes
  the world before the change.
- :func:`decide`: a candidate. In order: *superseded* (a serving version at least as new, e.g.
  a canary promoted just before) → refused; no serving policy yet → promoted; else the gate's
  rule on the window (:func:`pipeline.learner.promotion_gate.judge_window`, called only then),
  then the *label rule* (:func:`label_rule`) for label fine-tunes, then whether an undecided
  candidate becomes the canary: only a full snapshot (*not a delta*: clients hold a canary
  beside the serving policy), only when clients serve canaries (``canary_rate`` > 0), none
  runs and the canary back-off does not hold (clients served none of the last canaries,
  :func:`pipeline.learner.canary.canary_plan`).
- :func:`canary_decision`: the running canary's verdict; it is retired when the serving policy
  changed under it (served at once, or a label fine-tune promoted meanwhile).

docs/learning.md ("The promotion gate") describes the rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from models.offpolicy.estimators import Estimate

SERVED_AT_ONCE = ("init", "rollback", "reset", "cutover", "suppress")  # reasons whose checkpoints skip the gate
DECISIONS = ("promoted", "refused", "insufficient")
# A canary's verdict as the gate records it ("retired": it gave way, undecided).
CANARY_DECISION = {"promoted": "promoted", "refused": "refused", "retired": "insufficient"}

Action = Literal["promote", "refuse", "hold"]


def is_candidate(reason: str, gated: bool) -> bool:
    """Whether a checkpoint published for ``reason`` is a candidate for the gate (else served at once).

    >>> is_candidate("periodic", True), is_candidate("label", True), is_candidate("reset", True)
    (True, True, False)
    >>> is_candidate("periodic", False)  # no gate: every checkpoint serves
    False
    """
    return gated and reason not in SERVED_AT_ONCE


def label_rule(decision: str) -> bool:
    """Whether a label fine-tune is served, given the gate's decision on it.

    Expert answers are not held back for lack of data: a label candidate is promoted when
    the gate promotes it *or lacks the logged decisions to judge it* (a new or quiet
    deployment). It is refused only when the gate had enough data and refused it: the
    logged traffic gives evidence that it may do harm (e.g. mislabelled answers).

    >>> [label_rule(d) for d in ("promoted", "insufficient", "refused")]
    [True, True, False]
    """
    return decision in ("promoted", "insufficient")


@dataclass(frozen=True)
class Candidate:
    """What the decision needs of a candidate checkpoint: its version, its reason, whether it is a delta."""

    version: int
    reason: str = "periodic"
    delta: bool = False


@dataclass(frozen=True)
class Verdict:
    """The gate's rule on the window: ``decision`` (one of ``DECISIONS``), why, and the estimates."""

    decision: str
    reason: str
    estimates: Mapping[str, Estimate] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What to do with a candidate.

    ``decision`` and ``reason`` are what the gate records (its metrics, ``status``): the rule's
    verdict, also when the label rule serves an undecided label fine-tune. ``action``:
    ``promote`` (serve it), ``refuse`` (drop it), ``hold`` (keep it, judge it again as data
    arrives). ``end_canary``: end the running canary first (the candidate replaces it as the
    serving policy); ``start_canary``: make the held candidate the canary.
    """

    decision: str
    reason: str
    action: Action
    end_canary: bool = False
    start_canary: bool = False
    by_label_rule: bool = False
    estimates: Mapping[str, Estimate] = field(default_factory=dict)


def decide(
    candidate: Candidate,
    serving_version: int | None,
    judge: Callable[[], Verdict],
    *,
    canary_running: bool,
    canary_rate: float,
    canary_paused: bool = False,
) -> Decision:
    """The decision on ``candidate``; ``judge`` (the gate's rule on the window) runs only when needed.

    ``serving_version``: the policy clients serve (None: none yet); ``canary_running``: a canary
    runs; ``canary_rate``: the share of requests clients serve a canary on; ``canary_paused``:
    the canary back-off holds (clients served none of the last canaries,
    :func:`pipeline.learner.canary.canary_plan`), so the log alone decides.

    >>> never = lambda: Verdict("promoted", "")
    >>> decide(Candidate(3), 4, never, canary_running=False, canary_rate=0.2).reason
    'superseded by the serving v4'
    >>> undecided = lambda: Verdict("insufficient", "ESS 3 < 50 needed")
    >>> decide(Candidate(5), 4, undecided, canary_running=False, canary_rate=0.2).start_canary
    True
    >>> decide(Candidate(5, delta=True), 4, undecided, canary_running=False, canary_rate=0.2).start_canary
    False
    >>> decide(Candidate(5), 4, undecided, canary_running=False, canary_rate=0.2, canary_paused=True).start_canary
    False
    >>> decide(Candidate(5, "label"), 4, undecided, canary_running=False, canary_rate=0.2).action
    'promote'
    """
    if serving_version is not None and candidate.version <= serving_version:
        # A canary newer than this candidate was promoted just now: nothing left to judge.
        return Decision("refused", f"superseded by the serving v{serving_version}", "refuse")
    if serving_version is None:
        return Decision("promoted", "no serving policy yet", "promote", end_canary=True)
    verdict = judge()
    est = verdict.estimates
    if verdict.decision == "promoted":
        return Decision("promoted", verdict.reason, "promote", end_canary=True, estimates=est)
    if verdict.decision == "refused":
        return Decision("refused", verdict.reason, "refuse", estimates=est)
    if candidate.reason == "label" and label_rule(verdict.decision):
        # Served without a canary: the canary that runs, if any, is retired at its next
        # judgement (the serving policy changed under it).
        return Decision(verdict.decision, verdict.reason, "promote", by_label_rule=True, estimates=est)
    start = not canary_running and canary_rate > 0 and not candidate.delta and not canary_paused
    return Decision(verdict.decision, verdict.reason, "hold", start_canary=start, estimates=est)


@dataclass(frozen=True)
class CanaryDecision:
    """A canary's end: ``verdict`` ``promoted`` (serve it), ``refused`` or ``retired`` (it gave way)."""

    verdict: str
    gain: Estimate | None = None

    def __post_init__(self) -> None:
        if self.verdict not in CANARY_DECISION:
            raise ValueError(f"unknown canary verdict {self.verdict!r}")

    @property
    def decision(self) -> str:
        """As the gate records it (one of ``DECISIONS``)."""
        return CANARY_DECISION[self.verdict]

    @property
    def serve(self) -> bool:
        return self.verdict == "promoted"


def canary_decision(
    canary_serving_version: int,
    serving_version: int,
    judge: Callable[[], tuple[str | None, Estimate | None]],
) -> CanaryDecision | None:
    """The running canary's end, or None while it runs; ``judge`` (its arms' verdict) runs only when needed.

    ``canary_serving_version``: the serving version the canary started against.

    >>> canary_decision(4, 5, lambda: ("promoted", None)).verdict  # served at once meanwhile
    'retired'
    >>> canary_decision(4, 4, lambda: (None, None)) is None
    True
    """
    if canary_serving_version != serving_version:
        return CanaryDecision("retired")
    verdict, gain = judge()
    if verdict is None:
        return None
    return CanaryDecision(verdict, gain)
