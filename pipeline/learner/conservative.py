"""Conservative steps: what the gate promotes when the learner's candidate itself cannot be decided.

Once a policy has converged, the learner's candidates differ from serving by small gains,
and over ~2,000 logged decisions the interval of a whole step's gain straddles −ε: no
candidate can be decided and serving freezes. Tightening the rule cannot help and
loosening ε would break the gate's promise. What helps is a *smaller step*: conservative
policy improvement (Kakade & Langford 2002) moves the deployed policy only part of the way,
and high-confidence policy improvement (Thomas, Theocharous & Ghavamzadeh 2015) deploys a
policy only with a certificate computed on data that did not choose it. The step is

    θ_α = θ_serve + α(θ_new − θ_serve),  α in :data:`GRID` (1/2, 1/4, 1/8, 1/16)

(:func:`models.offpolicy.trust_region.interpolate`). A smaller α serves closer to the
serving policy (:func:`models.offpolicy.trust_region.served_tv`, the trust-region distance
reported with each step): its importance weights relative to serving's stay near 1, so the
gain's interval shrinks with the step — roughly α·(gain ± half-width), faster where the whole
step's weights are heavy-tailed (a low ESS) — while −ε does not. The grid stops at 1/16: a
smaller step would clear −ε whatever its direction and move serving too little to matter.

α is chosen honestly (the gate's certificate must not be biased by the choice):

1. the window is split in two halves (by each event's id where the gate knows it, so
   that an event stays on one side across the sliding windows the gate looks at);
2. **selection** on the first half: the largest α whose step the gate's own judgement
   (:func:`pipeline.learner.promotion_gate.judge`, injected as ``judge``) would promote
   *and* whose estimated gain over serving is positive, within the trust region;
3. **certificate** on the other half: the gate's judgement of that one step, on decisions
   the selection never saw — promoted (gain lower bound above −ε over serving and over
   similarity-only, ESS enough) with a positive estimated gain.

Requiring a positive estimate on both halves, and not only a lower bound above −ε, is what
stops an unproven direction: a step small enough always clears −ε, whatever its direction.
The learner keeps training its own θ_new; the serving version published for the step
carries θ_α's weights (:func:`publish_step`).

Everything here but :func:`publish_step` is a pure function of the log and the networks.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from models.offpolicy.estimators import Estimate
from models.offpolicy.logged import LoggedDecisions, Served
from models.offpolicy.trust_region import interpolate, served_tv
from models.policy.network import PolicyNetwork
from models.policy.weights import to_safetensors
from models.serving.params import ServingParams
from pipeline.modeltopic import CheckpointPublisher
from topics.internal import Experience
from topics.manifest import Manifest

GRID = (0.5, 0.25, 0.125, 0.0625)  # α = 1 is θ_new itself: the gate has just judged it on the whole window
MAX_TV = 0.5  # a step moving more of the first draw's probability than this is not tried (weights far from 1)

# (decisions, candidate, serving) → the gate's (decision, reason, estimates)
Judge = Callable[[LoggedDecisions, PolicyNetwork, PolicyNetwork], tuple[str, str, dict[str, Estimate]]]
# (the step's manifest, its tensors, the published blob) → its local copy, saved before it is sent
Keep = Callable[[Manifest, dict[str, torch.Tensor], bytes], None]


@dataclass(frozen=True)
class Step:
    """One α looked at on the selection half."""

    alpha: float
    tv: float  # mean total variation of θ_α's served first draw from serving's
    decision: str  # the gate's judgement of θ_α on the selection half ("" when outside the trust region)
    gain: Estimate | None

    def describe(self) -> str:
        g = "" if self.gain is None else f", gain {self.gain.value:+.4f} (lower bound {self.gain.low:+.4f})"
        return f"α={self.alpha:g}: TV {self.tv:.3f}, {self.decision or 'outside the trust region'}{g}"


@dataclass
class StepDecision:
    """The outcome for one waiting candidate: ``promoted`` (``net`` is θ_α) or ``insufficient``."""

    decision: str
    reason: str
    alpha: float | None = None
    net: PolicyNetwork | None = None
    estimates: dict[str, Estimate] = field(default_factory=dict)  # the certificate's, on its half
    steps: tuple[Step, ...] = ()
    selected_on: int = 0  # decisions in the selection half
    certified_on: int = 0  # decisions in the certification half


def split_by_id(ids: Sequence[str]) -> np.ndarray:
    """Which half each decision falls in (True: selection), from its event id: stable across windows.

    >>> split_by_id(["e1", "e2", "e3", "e4", "e1"]).tolist()  # the same id, the same half
    [True, True, True, False, True]
    """
    return np.array([zlib.crc32(i.encode()) & 1 == 1 for i in ids], dtype=bool)


def split_random(n: int, seed: int = 0) -> np.ndarray:
    """Two halves of equal size (±1), drawn with ``seed``.

    >>> int(split_random(10).sum())
    5
    """
    out = np.zeros(n, bool)
    out[np.random.default_rng(seed).permutation(n)[: n // 2]] = True
    return out


def conservative_step(
    first: LoggedDecisions,
    second: LoggedDecisions,
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    judge: Judge,
    *,
    params: ServingParams,
    serving_params: ServingParams | None = None,
    grid: Sequence[float] = GRID,
    max_tv: float = MAX_TV,
    fresh: Sequence[int] = (),
) -> StepDecision:
    """Select a step toward ``candidate`` on ``first`` and certify it on ``second``.

    Parameters
    ----------
    first, second
        The gate's window in two disjoint halves: α is selected on ``first`` and certified on
        ``second`` (:func:`split_by_id` for the gate, :func:`split_random` otherwise).
    candidate, serving
        θ_new and the serving policy's network (same architecture, else no step).
    judge
        The gate's judgement, ``(decisions, candidate, serving) → (decision, reason, estimates)``
        (:func:`pipeline.learner.promotion_gate.judge` with the gate's ε, ESS, method and serving
        parameters bound): the certificate is exactly the gate's rule, on the other half.
    params, serving_params
        How clients serve a step, and how they serve the serving policy (the trust-region distance).
    grid, max_tv
        The step sizes, tried from the largest; the trust region's bound on the mean served TV.
    fresh
        Slots given to another memory between ``serving`` and ``candidate``: every step takes
        the candidate's rows there (:func:`models.offpolicy.trust_region.interpolate`).
    """
    if serving.arch != candidate.arch:
        return StepDecision("insufficient", "no smaller step: the architecture changed")
    base = Served(serving, serving_params or params)
    steps: list[Step] = []
    chosen: tuple[float, PolicyNetwork] | None = None
    for alpha in sorted(grid, reverse=True):
        net = interpolate(serving, candidate, alpha, fresh)
        tv = float(served_tv(first, Served(net, params), base).mean()) if len(first) else 0.0
        if tv > max_tv:
            steps.append(Step(alpha, tv, "", None))
            continue
        decision, _, est = judge(first, net, serving)
        gain = est.get("gain")
        steps.append(Step(alpha, tv, decision, gain))
        if decision == "promoted" and gain is not None and gain.value > 0:
            chosen = (alpha, net)
            break
    tried = "; ".join(s.describe() for s in steps)
    looked = StepDecision("insufficient", "", steps=tuple(steps), selected_on=len(first), certified_on=len(second))
    if chosen is None:
        return replace(looked, reason=f"no smaller step shows a gain on the selection half ({tried})")
    alpha, net = chosen
    decision, reason, est = judge(second, net, serving)
    gain = est.get("gain")
    if decision != "promoted" or gain is None or not gain.value > 0:
        why = reason if decision != "promoted" else f"estimated gain {gain.value if gain else float('nan'):+.4f} ≤ 0"
        text = f"step α={alpha:g} selected ({tried}) but not certified on the other half: {why}"
        return replace(looked, reason=text, alpha=alpha, estimates=est)
    text = (
        f"step α={alpha:g} toward the candidate, certified on {len(second)} decisions the selection never saw: {reason}"
    )
    return replace(looked, decision="promoted", reason=text, alpha=alpha, net=net, estimates=est)


def step_on_window(
    window: Sequence[Experience],
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    judge: Judge,
    *,
    params: ServingParams,
    serving_params: ServingParams | None = None,
    fresh: Sequence[int] = (),
) -> StepDecision:
    """:func:`conservative_step` on the gate's window of experiences, split in halves by event id
    (:func:`split_by_id`): what the learner's gate and the lab's in-process loop both call."""
    pick = split_by_id([e.id for e in window])
    first = LoggedDecisions.from_experiences([e for e, p in zip(window, pick, strict=True) if p])
    second = LoggedDecisions.from_experiences([e for e, p in zip(window, pick, strict=True) if not p])
    return conservative_step(
        first, second, candidate, serving, judge, params=params, serving_params=serving_params, fresh=fresh
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
    serving_params: ServingParams | None = None,
    keep: Keep | None = None,
    fresh: Sequence[int] = (),
) -> tuple[Manifest, StepDecision]:
    """The gate's hook: a step toward the waiting ``manifest``, published as a candidate when certified.

    ``window`` is the gate's window of experiences, split by event id (:func:`split_by_id`);
    the judgement runs in a worker thread; ``keep`` saves the learner's local copy of a
    published step; ``fresh``: the slots given to another memory since the serving version.
    Returns the published step's manifest (the gate then promotes it) or ``manifest`` itself
    with an ``insufficient`` decision.
    """
    step = await asyncio.to_thread(
        step_on_window, window, candidate, serving, judge, params=params, serving_params=serving_params, fresh=fresh
    )
    if step.decision != "promoted":
        return manifest, step
    return await publish_step(publisher, manifest, step, keep), step
