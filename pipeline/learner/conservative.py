"""Conservative steps: what the gate promotes when the learner's candidate itself cannot be decided.

Once a policy has converged, the learner's candidates differ from serving by small gains,
and over ~2,000 logged decisions the interval of a whole step's gain straddles −ε: no
candidate can be decided and serving freezes. Tightening the rule cannot help and
loosening ε would break the gate's promise. What helps is a *smaller step*: conservative
policy improvement (Kakade & Langford 2002) moves the deployed policy only part of the way,
and a trust region bounds how far (TRPO, SPIBB: stay where the log can vouch for the policy).
The step is

    θ_α = θ_serve + α(θ_new − θ_serve),  α the largest of :data:`STEP_GRID` (1/2 … 1/32)
    whose served first draw is within mean total variation ``trust_region`` of serving's

(:func:`models.offpolicy.trust_region.largest_step`). Close to the serving policy, its
importance weights relative to serving's stay near 1 and the paired gain's terms shrink with
the distance, so the gain's interval is tight where the whole step's straddles −ε. Where that
step is still undecided and its estimated gain is not below 0, the smallest step of the grid is
judged too; each of the two judgements runs at half the gate's error rate (:data:`STEP_LEVEL`).

α is chosen from the logged contexts and candidates alone — no utility is read — so the
gate judges θ_α on the *whole* window with its own rule
(:func:`pipeline.learner.promotion_gate.judge`, injected as ``judge``), and that judgement is
not biased by the choice: promoted when the gain's lower bounds over serving and over
similarity-only are above −ε, as for any candidate. A converged policy's small steps get
through; a large one never does without the whole candidate's own certificate, since no step
is larger than the trust region; a step that the log finds worse than −ε is not promoted at
any size. The serving version published for the step carries θ_α's weights
(:func:`publish_step`), and with ``gate_reanchor`` the learner goes on from them.

:func:`regressed` is the other half of the design: a candidate whose gain over serving is
below 0 with confidence (the upper bound) shows that the learner has wandered off from the
policy it serves; the learner then resumes training from the serving weights
(``gate_reanchor``, :meth:`pipeline.learner.promotion_gate.PromotionGate.consider`), so that
its next candidates, and the steps toward them, start from the policy the log vouches for.
It does the same after :data:`STALL_WAITS` candidates in a row waited (:class:`Stall`): not
shown worse, but moved beyond what the window can judge.

Everything here but :func:`publish_step` and :func:`step_toward` is a pure function of the
log and the networks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from models.offpolicy.estimators import DEFAULT_LEVEL, Estimate
from models.offpolicy.logged import LoggedDecisions, Served
from models.offpolicy.trust_region import STEP_GRID, interpolate, largest_step, served_tv
from models.policy.network import PolicyNetwork
from models.policy.weights import to_safetensors
from models.serving.params import ServingParams
from pipeline.learner.promotion_decision import CanaryDecision, Decision
from pipeline.modeltopic import CheckpointPublisher
from topics.internal import Experience
from topics.manifest import Manifest


class Judge(Protocol):
    """(decisions, candidate, serving; the intervals' confidence level) → the gate's (decision, reason, estimates)."""

    def __call__(
        self, decisions: LoggedDecisions, candidate: PolicyNetwork, serving: PolicyNetwork, *, level: float
    ) -> tuple[str, str, dict[str, Estimate]]: ...


# At most two steps are judged on a window (the largest within the trust region, then the
# smallest of the grid), each at half the gate's error rate (Bonferroni): the chance that either
# promotes a step truly worse than serving by ε stays within the gate's for one judgement.
STEP_TRIES = 2
STEP_LEVEL = 1.0 - (1.0 - DEFAULT_LEVEL) / STEP_TRIES
# (the step's manifest, its tensors, the published blob) → its local copy, saved before it is sent
Keep = Callable[[Manifest, dict[str, torch.Tensor], bytes], None]


@dataclass
class StepDecision:
    """The outcome for one waiting candidate: ``promoted`` (``net`` is θ_α) or ``insufficient``.

    ``tv``: the step's mean served total variation from serving (None: no step was judged).
    """

    decision: str
    reason: str
    alpha: float | None = None
    net: PolicyNetwork | None = None
    estimates: dict[str, Estimate] = field(default_factory=dict)
    tv: float | None = None


def reanchors(decision: Decision, candidate_reason: str) -> bool:
    """Whether the learner resumes from the serving weights after ``decision`` on a candidate
    published for ``candidate_reason``: it was not promoted and :func:`regressed` (never for a
    label fine-tune: expert answers are not abandoned).

    A step toward the candidate that the log finds worse does not count: measured through the
    pipeline, resuming after such steps too served fresh pairs later (docs/learning.md,
    "Conservative steps").

    >>> worse = {"gain": Estimate(-0.05, -0.09, -0.01, 90.0, 2000, "dr-gain", 0.0)}
    >>> reanchors(Decision("insufficient", "", "hold", estimates=worse), "periodic")
    True
    >>> reanchors(Decision("insufficient", "", "hold", estimates=worse), "label")
    False
    >>> reanchors(Decision("promoted", "", "promote", estimates=worse), "periodic")
    False
    """
    return decision.action != "promote" and candidate_reason != "label" and regressed(decision.estimates)


def canary_regressed(outcome: CanaryDecision) -> bool:
    """Whether a canary that ended on its own requests showed the candidate worse than serving
    (not served, the gain's upper bound below 0): the learner resumes from the serving weights,
    as after :func:`reanchors`.

    >>> worse = Estimate(-0.06, -0.11, -0.004, 130.0, 130, "canary", 0.0)
    >>> canary_regressed(CanaryDecision("retired", worse)), canary_regressed(CanaryDecision("refused", worse))
    (True, True)
    >>> from dataclasses import replace
    >>> undecided = replace(worse, high=0.01)
    >>> canary_regressed(CanaryDecision("retired", undecided)), canary_regressed(CanaryDecision("retired"))
    (False, False)
    """
    return not outcome.serve and outcome.gain is not None and regressed({"gain": outcome.gain})


# Candidates in a row that wait (neither they nor a step toward them within the trust region
# could be promoted) before the learner resumes from the serving weights (:class:`Stall`).
# Measured through the pipeline, the learner's candidates on near-greedy traffic that wait once
# go on drifting from serving (the window's ESS for them falls from ~1,000 to ~100 within ten
# candidates), so waiting longer only lengthens the stall; three is ~6 s at the default 2 s cadence.
STALL_WAITS = 3


@dataclass
class Stall:
    """The learner's candidates that waited in a row; at ``limit`` of them it resumes from serving.

    A candidate that waits, and whose step within the trust region the log cannot certify
    either, shows that the learner has moved out of the region the window can judge: its next
    candidates, a few updates further on, are judged on fewer effective decisions still. Its
    weights are not shown worse (that is :func:`reanchors`), only unjudgeable; going on from the
    serving weights brings the next candidates back to where the log can decide them.

    Only waits where a step was judged count (``step_judged``): where no step fits the trust
    region (from the first policy, served at T = 0.001) or steps are off, a whole candidate is
    the only way forward, and the learner must be let go far enough for one to be decided. A
    candidate judged again (it waited for data) counts once; a label fine-tune is never
    abandoned, and a promotion or a refusal starts the count again.

    >>> s = Stall(limit=2)
    >>> s.judged(5, "hold", "periodic", True), s.judged(5, "hold", "periodic", True)
    (False, False)
    >>> s.judged(6, "hold", "periodic", False)  # no step fitted: not counted
    False
    >>> s.judged(7, "hold", "periodic", True)
    True
    >>> s.waited  # it starts again after a resume
    0
    >>> s.judged(8, "hold", "periodic", True), s.judged(9, "promote", "periodic", False)
    (False, False)
    >>> s.judged(10, "hold", "periodic", True), s.judged(11, "hold", "label", True)
    (False, False)
    """

    limit: int = STALL_WAITS
    waited: int = 0
    last: int = 0  # the latest candidate version counted

    def judged(self, version: int, action: str, candidate_reason: str, step_judged: bool) -> bool:
        """Record the gate's ``action`` on candidate ``version`` (``step_judged``: a step toward it
        within the trust region was judged); True: the learner resumes from serving now."""
        if version <= self.last and action == "hold":
            return False  # the same candidate again: it waited once
        self.last = max(self.last, version)
        if action != "hold" or candidate_reason == "label":
            self.waited = 0
            return False
        if not step_judged:
            return False
        self.waited += 1
        if self.waited < self.limit:
            return False
        self.waited = 0
        return True

    def reset(self) -> None:
        """The learner resumed for another reason: its candidates start a new count."""
        self.waited = 0


@dataclass
class Lineage:
    """Which candidates descend from the weights the learner trains now: the gate's bookkeeping
    of its resumes, shared by the gate and the lab's loop.

    ``left_at`` is the newest candidate judged when the learner last took other weights (a
    resume from serving, a step served): candidates up to it, a canary among them, are of the
    weights it left. ``stall`` counts the waits in a row since (:class:`Stall`).

    >>> g = Lineage()
    >>> g.judging(7); g.follows_canary(7)  # the learner's weights descend from v7
    False
    >>> g.judging(8); g.resumed(); g.follows_canary(7), g.follows_canary(9)
    (True, False)
    """

    stall: Stall = field(default_factory=Stall)
    latest: int = 0  # the newest candidate version judged
    left_at: int = 0

    def judging(self, version: int) -> None:
        """Candidate ``version`` is being judged."""
        self.latest = max(self.latest, version)

    def resumed(self) -> None:
        """The learner took other weights: the candidates so far are of those it left."""
        self.left_at = self.latest
        self.stall.reset()

    def follows_canary(self, version: int) -> bool:
        """Whether the learner goes on from canary ``version`` once it is promoted."""
        return version <= self.left_at


def regressed(estimates: Mapping[str, Estimate]) -> bool:
    """Whether a judgement shows the candidate worse than serving: the gain's upper bound below 0.

    >>> regressed({"gain": Estimate(-0.01, -0.02, -0.001, 90.0, 2000, "dr-gain", 0.0)})
    True
    >>> regressed({"gain": Estimate(-0.01, -0.02, 0.001, 90.0, 2000, "dr-gain", 0.0)}), regressed({})
    (False, False)
    """
    gain = estimates.get("gain")
    return gain is not None and gain.high < 0.0


def trust_region_step(
    decisions: LoggedDecisions,
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    judge: Judge,
    *,
    params: ServingParams,
    radius: float,
    serving_params: ServingParams | None = None,
    grid: Sequence[float] = STEP_GRID,
    fresh: Sequence[int] = (),
) -> StepDecision:
    """The largest step toward ``candidate`` within the trust region, judged on all of ``decisions``;
    where it is undecided and the log does not show it worse (its gain's estimate ≥ 0), the
    smallest step of ``grid`` too. Each judgement runs at :data:`STEP_LEVEL` (half the gate's
    error rate each), so that two tries keep one judgement's promise.

    Parameters
    ----------
    decisions
        The gate's window: α is chosen on its contexts (no utility read) and θ_α judged on it.
    candidate, serving
        θ_new and the serving policy's network (same architecture, else no step).
    judge
        The gate's judgement, ``(decisions, candidate, serving) → (decision, reason, estimates)``
        (:func:`pipeline.learner.promotion_gate.judge` with the gate's ε, ESS, method and serving
        parameters bound): the step is promoted exactly when the gate's rule promotes it.
    params, serving_params
        How clients serve a step, and how they serve the serving policy (the trust-region distance).
    radius, grid
        The trust region's bound on the mean served total variation; the step sizes, from the largest.
    fresh
        Slots given to another memory between ``serving`` and ``candidate``: every step takes
        the candidate's rows there (:func:`models.offpolicy.trust_region.interpolate`).
    """
    if serving.arch != candidate.arch:
        return StepDecision("insufficient", "no smaller step: the architecture changed")
    if len(decisions) == 0:
        return StepDecision("insufficient", "no logged decisions to judge a step on")
    found = largest_step(
        decisions,
        serving,
        candidate,
        params=params,
        serving_params=serving_params,
        radius=radius,
        grid=grid,
        fresh=fresh,
    )
    if found is None:
        return StepDecision("insufficient", f"no step of α ≥ {min(grid):g} serves within TV {radius:g} of serving")
    alpha, net, tv = found
    decision, reason, est = judge(decisions, net, serving, level=STEP_LEVEL)
    where = f"step α={alpha:g} (TV {tv:.3f} ≤ {radius:g}) on {len(decisions)} decisions"
    if decision == "promoted":
        return StepDecision("promoted", f"{where}: {reason}", alpha=alpha, net=net, estimates=est, tv=tv)
    held = StepDecision("insufficient", f"{where}: {reason}", alpha=alpha, estimates=est, tv=tv)
    smallest, gain = min(grid), est.get("gain")
    if decision != "insufficient" or alpha <= smallest or gain is None or gain.value < 0.0:
        return held
    # The largest step's interval is too wide, not its estimate wrong: the smallest step's
    # interval shrinks with its distance from serving, so it may be decided where the larger one is not.
    net = interpolate(serving, candidate, smallest, fresh)
    tv = float(served_tv(decisions, Served(net, params), Served(serving, serving_params or params)).mean())
    decision, reason, est = judge(decisions, net, serving, level=STEP_LEVEL)
    where = f"{held.reason}; step α={smallest:g} (TV {tv:.3f}) on {len(decisions)} decisions"
    if decision == "promoted":
        return StepDecision("promoted", f"{where}: {reason}", alpha=smallest, net=net, estimates=est, tv=tv)
    return StepDecision("insufficient", f"{where}: {reason}", alpha=smallest, estimates=est, tv=tv)


def step_on_window(
    window: Sequence[Experience],
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    judge: Judge,
    *,
    params: ServingParams,
    radius: float,
    serving_params: ServingParams | None = None,
    fresh: Sequence[int] = (),
) -> StepDecision:
    """:func:`trust_region_step` on the gate's window of experiences: what the learner's gate and
    the lab's in-process loop both call."""
    decisions = LoggedDecisions.from_experiences(list(window))
    return trust_region_step(
        decisions, candidate, serving, judge, params=params, radius=radius, serving_params=serving_params, fresh=fresh
    )


async def publish_step(
    publisher: CheckpointPublisher, candidate: Manifest, step: StepDecision, keep: Keep | None = None
) -> Manifest:
    """Publish θ_α as a full candidate checkpoint beside ``candidate`` (the gate then promotes it).

    It copies the candidate's manifest fields (reason, baseline, metrics, input offsets,
    serving parameters) so that a learner restored from it resumes where the candidate's
    trainer was (with θ_α's weights and a fresh optimizer); ``metrics.conservative_step``
    records α and the candidate it steps toward. A full snapshot, never a delta: every
    parameter moved. ``keep`` saves the learner's local copy before anything is sent, as for
    every other version (a rollback to the step must not need the model topic to hold it).
    """
    if step.net is None or step.alpha is None:
        raise ValueError("only a promoted step is published")
    tensors = step.net.tensors()
    blob = to_safetensors(tensors)
    metrics: dict[str, Any] = dict(candidate.metrics)
    metrics.pop("writer", None)  # the publisher writes its own
    metrics["conservative_step"] = {"alpha": step.alpha, "toward_version": candidate.version}
    return await publisher.publish(
        blob,
        alpha=float(tensors["alpha"].reshape(-1)[0]),
        reason=candidate.reason,
        arch=dict(candidate.arch),
        baseline=candidate.baseline,
        metrics=metrics,
        input_offsets=dict(candidate.input_offsets),
        candidate=True,
        serving=candidate.serving,
        delta=None,
        prepare=(lambda manifest: keep(manifest, tensors, blob)) if keep is not None else None,
    )


async def step_toward(
    publisher: CheckpointPublisher,
    manifest: Manifest,
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    window: Sequence[Experience],
    judge: Judge,
    *,
    params: ServingParams,
    radius: float,
    serving_params: ServingParams | None = None,
    keep: Keep | None = None,
    fresh: Sequence[int] = (),
) -> tuple[Manifest, StepDecision]:
    """The gate's hook: a step toward the waiting ``manifest``, published as a candidate when promoted.

    ``window`` is the gate's window of experiences; ``radius`` the trust region; the judgement
    runs in a worker thread; ``keep`` saves the learner's local copy of a published step;
    ``fresh``: the slots given to another memory since the serving version. Returns the
    published step's manifest (the gate then promotes it) or ``manifest`` itself with an
    ``insufficient`` decision.
    """
    step = await asyncio.to_thread(
        step_on_window,
        window,
        candidate,
        serving,
        judge,
        params=params,
        radius=radius,
        serving_params=serving_params,
        fresh=fresh,
    )
    if step.decision != "promoted":
        return manifest, step
    return await publish_step(publisher, manifest, step, keep), step
