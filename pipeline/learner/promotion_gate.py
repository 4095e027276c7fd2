"""The promotion gate: counterfactual evaluation of every checkpoint before clients serve it.

The Decision Service / Personalizer way of checking a new policy offline — estimate its
mean utility from logged decisions and their probabilities — made an automatic step of
the learner. A new checkpoint is published as a *candidate* (manifest keyed
``"{policy}/candidate"``); the gate estimates, on the last ``gate_window`` logged
experiences, the values of the candidate, the serving policy and similarity-only
retrieval **as clients serve them** (the serving parameters of :mod:`models.serving.params`:
the mixture of the serving and the exploration temperature, with the hard drop), not at
each event's logged T; the logged T and logprob are the behaviour policy. The estimator is
``auto`` by default (:func:`estimators`): on a log whose rewards are additive over the
memories read, or where no query repeats so that it cannot be told, ``dr-pi``
(:mod:`models.offpolicy.slate`, :mod:`models.offpolicy.served`): slate doubly robust — cross-fitted additive
reward model, pseudo-inverse correction, per-slot correction where per-memory credit is
present — with intervals widened to contain the pseudo-inverse estimator's; on a log whose
repeated (query, set) rewards miss the additive model (LM utilities), ``dr-set``: widened
to the set-level DR's instead (:mod:`models.offpolicy.setlevel`). All are clipped to the values a
top-k can reach on the logged candidates.

A candidate is

* **insufficient** — kept, looked at again as data arrives — while the effective sample
  size of its importance weights is below ``gate_min_ess``, or while the intervals of its
  gains cannot decide (they straddle −ε); the reason says what is missing;
* **refused** when its gain over the serving policy, or over similarity-only, is below
  −ε with 95% confidence (upper bound < −ε);
* **promoted** — republished under ``"{policy}"``, the key clients follow — when both
  gains' lower bounds are above −ε; the gain over similarity-only may also be bounded
  through the latest version promoted above it (:mod:`pipeline.learner.similarity_witness`).

A candidate that waits is replaced, where the gate's rule promotes it, by the largest step
toward it within the trust region around the serving policy (``gate_conservative``,
:mod:`pipeline.learner.conservative`), judged on the same window; and a candidate the window
shows worse than serving (its gain's upper bound below 0) sends the learner back to the serving
weights, as a promoted step does: the learner goes on from the step served, not from its own
candidate beyond it (``gate_reanchor``, :attr:`PromotionGate.on_resume`).

A full candidate that the window cannot decide becomes the *canary* when the serving
parameters give clients a ``canary_rate`` (contract 1.4, :mod:`pipeline.learner.canary`):
clients serve it on that share of their requests, and it is promoted or refused on those
requests' utilities against the serving policy's. Canary events stay out of the
off-policy window (another behaviour policy drew them).

What to do with a candidate — the superseded check, the rule's verdict, the label rule for
label fine-tunes, whether it becomes the canary (never a delta), how a canary ends — is
decided by :mod:`pipeline.learner.promotion_decision` (pure functions, which the lab's
in-process loop calls too); :class:`PromotionGate` computes the verdicts, holds the networks
and carries the decisions out (publishes, records, metrics).

docs/learning.md ("The promotion gate") says how much traffic a decision takes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from models.offpolicy.estimators import DEFAULT_LEVEL, Estimate
from models.offpolicy.logged import TOPK, LoggedDecisions, Served
from models.offpolicy.served import SlateLog, evaluate_served, gain_served
from models.offpolicy.setlevel import additivity
from models.offpolicy.slate import MomentCache
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from pipeline.config import GateConfig
from pipeline.learner.canary import CanaryBackoff, CanaryRun, is_canary
from pipeline.learner.conservative import (
    Judge,
    Keep,
    Lineage,
    StepDecision,
    canary_regressed,
    reanchors,
    step_toward,
)
from pipeline.learner.logging_policy import LoggingPolicies
from pipeline.learner.promotion_decision import DECISIONS, Candidate, Decision, Verdict, canary_decision, decide
from pipeline.learner.similarity_witness import CHAINED, Witness, next_witness, through
from pipeline.metrics import Metrics
from pipeline.modeltopic import CheckpointPublisher
from topics.delta import DeltaManifest
from topics.internal import Experience
from topics.manifest import Manifest

log = logging.getLogger(__name__)

# The DR reward model's prior for slots the log rarely shows: this quantile of logged utility.
# Pessimistic on purpose: a candidate that moves its reads there must earn the trust that
# the serving policy's logged reads already have.
PESSIMISM = 0.1


@dataclass
class GateDecision:
    decision: str  # "promoted" | "refused" | "insufficient"
    candidate_version: int
    serving_version: int
    reason: str
    gain: Estimate | None = None
    candidate: Estimate | None = None
    serving: Estimate | None = None
    similarity: Estimate | None = None
    ess: float | None = None  # the smaller effective sample size of the candidate's and serving's weights
    ess_needed: float | None = None

    def summary(self) -> dict[str, Any]:
        def est(e: Estimate | None) -> dict[str, float] | None:
            return None if e is None else {"value": e.value, "low": e.low, "high": e.high, "ess": e.ess}

        return {
            "decision": self.decision,
            "candidate_version": self.candidate_version,
            "serving_version": self.serving_version,
            "reason": self.reason,
            "ess": self.ess,
            "ess_needed": self.ess_needed,
            "gain": est(self.gain),
            "candidate": est(self.candidate),
            "serving": est(self.serving),
            "similarity": est(self.similarity),
        }


def more_needed(g: Estimate, epsilon: float) -> str:
    """What an undecided gain interval lacks: roughly how many times the data to exclude −ε.

    The interval's half-width shrinks as 1/√n; deciding needs it below |gain + ε|.

    >>> more_needed(Estimate(0.0, -0.04, 0.04, 100.0, 500, "dr-gain", 0.0), 0.02)
    'gain +0.0000 in [-0.0400, +0.0400] straddles −ε (-0.0200): about 4× the decisions needed'
    """
    half = (g.high - g.low) / 2.0
    margin = abs(g.value + epsilon)
    factor = (half / margin) ** 2 if margin > 0 else math.inf
    need = f"about {factor:.0f}× the decisions needed" if math.isfinite(factor) else "no amount of data decides"
    return f"gain {g.value:+.4f} in [{g.low:+.4f}, {g.high:+.4f}] straddles −ε ({-epsilon:+.4f}): {need}"


def widest(results: Iterable[dict[str, Estimate]]) -> dict[str, Estimate]:
    """The first estimator's estimates, each interval widened to contain the others'.

    >>> a = Estimate(1.0, 0.8, 1.2, 50.0, 9, "dr", 0.0)
    >>> e = widest([{"x": a}, {"x": Estimate(0.9, 0.5, 1.1, 40.0, 9, "pi", 0.0)}])["x"]
    >>> e.value, e.low, e.high, e.method
    (1.0, 0.5, 1.2, 'dr|pi')
    """
    first, *rest = list(results)
    out = dict(first)
    for other in rest:
        for name, e in other.items():
            f = out[name]
            low, high = min(f.low, e.low), max(f.high, e.high)
            out[name] = Estimate(f.value, low, high, f.ess, f.n, f"{f.method}|{e.method}", f.clipped_share)
    return out


def judge(
    decisions: LoggedDecisions,
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    epsilon: float,
    min_ess: float,
    method: str = "dr-pi",
    n_boot: int = 200,
    seed: int = 0,
    params: ServingParams | None = None,
    cache: MomentCache | None = None,
    serving_params: ServingParams | None = None,
    witness: Witness | None = None,
    level: float = DEFAULT_LEVEL,
) -> tuple[str, str, dict[str, Estimate]]:
    """The gate's rule on a log, without Kafka: ``(decision, reason, estimates)``.

    Every policy is judged as served by ``params`` (default: :class:`ServingParams`'s
    defaults), the serving policy by its own manifest's ``serving_params`` where given;
    similarity-only is plain top-k (``"topk"``, :func:`models.offpolicy.logged.topk_logits`).
    ``estimates`` holds ``gain`` (over serving), ``gain_similarity``, ``candidate``,
    ``serving`` and ``similarity``, and with a ``witness`` the gain over similarity-only
    bounded through it (:mod:`pipeline.learner.similarity_witness`). ``cache`` keeps the
    logging moments of each step for the next judgement (:class:`~models.offpolicy.slate.MomentCache`).
    ``level``: the intervals' confidence (two-sided; a conservative step's judgements run at a
    higher one, :data:`pipeline.learner.conservative.STEP_LEVEL`).
    """
    params = params or ServingParams()
    if len(decisions) == 0:
        return "insufficient", "no logged decisions yet", {}
    note = ""
    moments = method not in ("ips", "snips")  # every other estimator needs candidate_probs
    slog = SlateLog.prepare(decisions, prior_quantile=PESSIMISM, seed=seed, moments=moments, cache=cache)
    if 2 * len(slog) < len(decisions):
        # Events from clients that do not log candidate_probs: only the standard slate IPS
        # (the logged propensity of the ordered selection) can judge them.
        method, note = "ips", f" [ips: {slog.left_out} of {len(decisions)} events lack candidate_probs]"
        slog = SlateLog.prepare(decisions, prior_quantile=PESSIMISM, seed=seed, moments=False)
    decision, reason, estimates = judge_log(
        slog, candidate, serving, epsilon, min_ess, method, params, n_boot, seed, serving_params, witness, level
    )
    return decision, reason + note, estimates


def judge_log(
    slog: SlateLog,
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    epsilon: float,
    min_ess: float,
    method: str,
    params: ServingParams,
    n_boot: int = 200,
    seed: int = 0,
    serving_params: ServingParams | None = None,
    witness: Witness | None = None,
    level: float = DEFAULT_LEVEL,
) -> tuple[str, str, dict[str, Estimate]]:
    """:func:`judge`'s rule on a log already prepared (:class:`~models.offpolicy.served.SlateLog`):
    the estimators, the gains over serving and over similarity-only (directly, and through
    ``witness`` where given), and :func:`rule`."""
    targets = {"candidate": Served(candidate, params), "serving": Served(serving, serving_params or params)}
    # Similarity-only is plain top-k, as a client without the policy serves it, not similarity
    # drawn at the serving temperature: on near-tied similarity scores (real embeddings) a
    # draw at T = 0.05 is far below top-k, and a candidate above it may still be below top-k.
    targets["similarity"] = Served(TOPK, params)
    methods, note = estimators(slog, method, epsilon)
    kw: dict[str, Any] = {"n_boot": n_boot, "seed": seed, "level": level}
    values = widest(evaluate_served(slog, targets, m, **kw) for m in methods)

    def gain_over(baseline: Served) -> Estimate:
        return widest({"g": gain_served(slog, targets["candidate"], baseline, m, **kw)} for m in methods)["g"]

    g, gs = gain_over(targets["serving"]), gain_over(targets["similarity"])
    estimates = {"gain": g, "gain_similarity": gs, **values}
    if witness is not None:
        # Computed whatever the direct bound says: the next witness is the tighter of the two.
        estimates[CHAINED] = through(gain_over(Served(witness.net, witness.params)), witness)
    decision, reason = rule(g, gs, values["candidate"], epsilon, min_ess, len(slog), estimates.get(CHAINED))
    return decision, reason + note, estimates


def estimators(slog: SlateLog, method: str, epsilon: float) -> tuple[tuple[str, ...], str]:
    """The estimators whose intervals a judgement takes the widest of, and a note for the reason.

    ``dr-pi``: DR's estimates with intervals widened to contain PI's as well (either one alone
    under-covers on some logs, docs/benchmarks.md "Promotion gate calibration"); ``dr-set``:
    widened to the set-level DR's instead; ``auto``: ``dr-set`` where the log shows that
    rewards are not additive over the memories read (:func:`models.offpolicy.setlevel.additivity`: the
    same query read the same set repeatedly and its rewards miss the additive model), else
    ``dr-pi``. Any other name is that estimator alone.
    """
    if method == "dr-pi":
        return ("dr", "pi"), ""
    if method == "dr-set":
        return ("dr", "set-dr"), ""
    if method == "auto":
        fit = additivity(slog.decisions, slog.pred, epsilon)
        return (("dr", "pi") if fit.additive else ("dr", "set-dr")), f" [{fit.describe()}]"
    return (method,), ""


def rule(
    g: Estimate,
    gs: Estimate,
    candidate: Estimate,
    epsilon: float,
    min_ess: float,
    n: int,
    chained: Estimate | None = None,
) -> tuple[str, str]:
    """The decision on the gains over serving (``g``) and over similarity-only (``gs``, and
    ``chained``: the same bounded through the witness, :mod:`pipeline.learner.similarity_witness`).

    The chained bound can only certify: a refusal over similarity-only takes the direct one.
    """
    if g.ess < min_ess:
        return "insufficient", f"ESS {g.ess:.0f} < {min_ess:.0f} needed ({n} logged decisions)"
    if g.high < -epsilon:
        return "refused", f"gain over serving {g.value:+.4f}, upper bound {g.high:+.4f} < −ε"
    if gs.high < -epsilon:
        return "refused", f"below similarity-only by {-gs.value:.4f} (upper bound {gs.high:+.4f} < −ε)"
    certified = gs if chained is None or gs.low >= chained.low else chained
    if g.low > -epsilon and certified.low > -epsilon:
        how = "" if certified is gs else f"; over similarity-only {certified.low:+.4f} ({certified.method})"
        return "promoted", f"gain {g.value:+.4f} (lower bound {g.low:+.4f}), estimate {candidate.value:+.4f}{how}"
    gs = certified
    undecided = g if not g.low > -epsilon else gs
    what = "over serving" if undecided is g else "over similarity-only"
    return "insufficient", f"{what}: {more_needed(undecided, epsilon)} (ESS {g.ess:.0f})"


def step_judge(
    config: GateConfig,
    params: ServingParams,
    serving_params: ServingParams | None = None,
    cache: MomentCache | None = None,
    witness: Witness | None = None,
) -> Judge:
    """The gate's judgement with its ε, ESS, method, serving parameters and witness bound: what
    a conservative step is selected and certified by (:mod:`pipeline.learner.conservative`)."""
    return partial(
        judge,
        epsilon=config.epsilon,
        min_ess=config.min_ess,
        method=config.method,
        params=params,
        cache=cache,
        serving_params=serving_params,
        witness=witness,
    )


def judge_window(
    experiences: Sequence[Experience],
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    config: GateConfig,
    n_boot: int = 200,
    params: ServingParams | None = None,
    cache: MomentCache | None = None,
    serving_params: ServingParams | None = None,
    witness: Witness | None = None,
) -> tuple[str, str, dict[str, Estimate]]:
    """:func:`judge` on the last ``config.window`` of ``experiences`` (the gate's window)."""
    decisions = LoggedDecisions.from_experiences(list(experiences)[-config.window :])
    return judge(
        decisions,
        candidate,
        serving,
        config.epsilon,
        config.min_ess,
        method=config.method,
        n_boot=n_boot,
        params=params,
        cache=cache,
        serving_params=serving_params,
        witness=witness,
    )


def network(tensors: dict[str, torch.Tensor]) -> PolicyNetwork:
    """A checkpoint's policy, on CPU, for judging."""
    return PolicyNetwork.from_tensors({k: v.cpu() for k, v in tensors.items()}).eval()


class PromotionGate:
    """Owned by the learner; called with each new candidate checkpoint.

    ``window`` returns the experiences that candidates may be judged on (the learner's
    replay since the last drift reset); the gate takes the last ``config.window``.
    """

    def __init__(
        self,
        config: GateConfig,
        publisher: CheckpointPublisher,
        metrics: Metrics,
        window: Callable[[], Sequence[Experience]],
        serving: ServingParams | None = None,
    ) -> None:
        self.config = config
        self.params = serving or ServingParams()  # how clients serve what the gate promotes
        self.publisher = publisher
        self.metrics = metrics
        self.window = window
        self.serving_net: PolicyNetwork | None = None
        self.serving_manifest: Manifest | None = None
        self.pending: tuple[Manifest, PolicyNetwork] | None = None  # a candidate awaiting data
        self.decisions: list[GateDecision] = []
        self.moments = MomentCache()  # the logging moments of the steps already judged on
        self._deciding = asyncio.Lock()  # one judgement at a time: it awaits a worker thread
        self.canary: CanaryRun | None = None  # contract 1.4: the candidate clients serve on canary_rate
        self._canary_cleared = False  # a canary left on the topic by an earlier learner run is ended once
        # No canaries while clients serve none (a probe now and then).
        self.backoff = CanaryBackoff(config.canary_idle, config.canary_probe_s)
        # The networks of the versions clients may serve: the logging probabilities of events without them.
        self.logging_policies = LoggingPolicies(metrics, remember=4 * config.window)
        # Where the events whose logged propensities disagree with the recomputation go (the
        # learner's dead-letter writer, contract 1.8 ``logging_mismatch``); None: counted and logged only.
        self.on_mismatch: Callable[[Experience, str], None] | None = None
        # The learner's local copy of a conservative step it publishes (Publishing sets it); None: none.
        self.keep_step: Keep | None = None
        # (serving version, candidate version) → the slots given to another memory between them
        # (the learner's memory bank sets it); a step takes the candidate's rows there.
        self.slots_given: Callable[[int, int], list[int]] | None = None
        # Called with the serving version and its network when a candidate is judged worse than
        # serving, or a step toward it was promoted (``gate_reanchor``): the learner resumes
        # training from them. None: nothing is done.
        self.on_resume: Callable[[int, PolicyNetwork], None] | None = None
        self._reanchored_for: int | None = None  # the candidate version that last sent the learner back
        # Which candidates descend from the learner's weights, and its candidates that waited in
        # a row (at STALL_WAITS it resumes from serving too).
        self.lineage = Lineage()
        # The latest version promoted with a direct bound over similarity-only: later candidates'
        # gains over similarity-only are also bounded through it (pipeline/learner/similarity_witness.py).
        self.witness: Witness | None = None

    def canaries_paused(self) -> str | None:
        """The back-off's reason while canaries are paused (clients serve none), else None."""
        return self.backoff.plan(time.time()).reason if self.backoff.paused else None

    def set_serving(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
        """Serve ``manifest`` without a judgement (the learner's start, a reset, a rollback): the
        witness goes, since nothing vouches for its margin over what is served now."""
        self.serving_manifest, self.serving_net = manifest, network(tensors)
        self.logging_policies.hold(manifest, self.serving_net)
        self.witness = None

    async def promote(self, manifest: Manifest, net: PolicyNetwork) -> None:
        """Publish ``manifest`` as the serving policy and judge later candidates against it."""
        await self.publisher.promote(manifest)
        self.serving_manifest, self.serving_net = manifest, net
        self.logging_policies.hold(manifest, net)
        if self.pending is not None and self.pending[0].version <= manifest.version:
            self.pending = None
        self.metrics.checkpoint_version.labels(role="serving").set(manifest.version)
        self.metrics.checkpoint_timestamp.labels(role="serving").set(manifest.created_ts)

    def _record(self, result: GateDecision) -> None:
        """A decision that took effect: the metrics and the last 100 decisions (``status``)."""
        m = self.metrics
        m.gate_decisions.labels(decision=result.decision).inc()
        for name in DECISIONS:
            m.gate_last_decision.labels(decision=name).set(1.0 if name == result.decision else 0.0)
        self.decisions = [*self.decisions[-99:], result]

    async def consider(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> GateDecision:
        candidate = network(tensors)
        async with self._deciding:
            return await self._decide_now(manifest, candidate)

    async def reconsider(self) -> GateDecision | None:
        """Look again at a candidate that lacked data (called at the checkpoint cadence)."""
        async with self._deciding:  # the pending candidate as it is once no other judgement runs
            if self.pending is None:
                return None
            manifest, candidate = self.pending
            return await self._decide_now(manifest, candidate)

    async def serve_at_once(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
        """A checkpoint served without the gate (init, reset, rollback): it ends any canary."""
        await self.end_canary()
        self.set_serving(manifest, tensors)

    async def end_canary(self) -> None:
        """Tell clients to stop serving the canary (also one left by an earlier learner run)."""
        if self.canary is not None or not self._canary_cleared:
            await self.publisher.set_canary(None)
            self.metrics.checkpoint_version.labels(role="canary").set(0)
        self.canary, self._canary_cleared = None, True

    async def _judge_canary(self) -> None:
        """The running canary's verdict on the arms so far (:func:`canary_decision`); a decided one ends."""
        run = self.canary
        if run is None:
            return
        serving_version = self.serving_manifest.version if self.serving_manifest else 0
        window = list(self.window())
        epsilon = self.config.epsilon
        outcome = await asyncio.to_thread(
            canary_decision, run.serving_version, serving_version, lambda: run.judge(window, epsilon)
        )
        if outcome is None:
            return
        if run.serving_version == serving_version:  # ended on its own arms: the back-off counts it
            self.backoff.ended(run, time.time())
            if canary_regressed(outcome):
                # Its own requests show the learner's trajectory below serving: as for a candidate
                # the window shows worse, training goes on from the serving weights.
                self._resume_from_serving(run.version)
        reason = run.describe(outcome.gain)
        if outcome.serve:
            await self.promote(run.manifest, run.net)
            log.info("gate: promoted %s", reason)
            if self.lineage.follows_canary(run.version) and self._resume_learner(run.version, run.net):
                # The learner took other weights after this candidate was published: its next
                # candidates would be judged against a policy they do not descend from.
                log.info("gate: the learner goes on from the canary v%d", run.version)
        else:
            log.info("gate: %s %s", outcome.verdict, reason)
        result = GateDecision(
            outcome.decision, run.version, serving_version, f"{outcome.verdict}: {reason}", outcome.gain
        )
        result.ess = outcome.gain.ess if outcome.gain is not None else None
        self._record(result)
        await self.end_canary()

    async def _start_canary(self, manifest: Manifest, candidate: PolicyNetwork, window: list[Experience]) -> None:
        """Make the held ``candidate`` the canary (:func:`decide` said when)."""
        assert self.serving_manifest is not None
        serving, rate, most = self.serving_manifest.version, self.params.canary_rate, self.config.canary_max
        # In a worker thread: it fits a reward model on the window.
        self.canary = await asyncio.to_thread(CanaryRun, manifest, candidate, serving, window, rate, most)
        await self.publisher.set_canary(manifest)
        self.metrics.checkpoint_version.labels(role="canary").set(manifest.version)
        log.info(
            "gate: v%d is the canary, served on %.0f%% of requests", manifest.version, 100 * self.params.canary_rate
        )

    async def _step_toward(
        self, manifest: Manifest, candidate: PolicyNetwork, window: list[Experience]
    ) -> tuple[Manifest, StepDecision]:
        """A waiting candidate's conservative step: θ_α's published manifest when promoted, else ``manifest``."""
        assert self.serving_net is not None and self.serving_manifest is not None
        wire = self.serving_manifest.serving
        serving_params = ServingParams.from_wire(wire) if wire is not None else None
        judge_step = step_judge(self.config, self.params, serving_params, self.moments, self.witness)
        stepped, step = await step_toward(
            self.publisher,
            manifest,
            candidate,
            self.serving_net,
            window,
            judge_step,
            params=self.params,
            radius=self.config.trust_region,
            serving_params=serving_params,
            keep=self.keep_step,
            fresh=self.slots_given(self.serving_manifest.version, manifest.version) if self.slots_given else (),
        )
        if step.decision == "promoted" and step.alpha is not None:
            self.metrics.gate_conservative_steps.labels(alpha=f"{step.alpha:g}").inc()
        return stepped, step

    def _resume_learner(self, version: int, net: PolicyNetwork) -> bool:
        """Send the learner's training to ``version``'s weights (``gate_reanchor``); False: off or no hook."""
        if not self.config.reanchor or self.on_resume is None:
            return False
        self.on_resume(version, net)
        self.lineage.resumed()
        return True

    def _resume_from_serving(self, candidate_version: int, *, stalled: bool = False) -> None:
        """The learner has wandered below the policy it serves (``candidate_version`` was found
        worse) or, ``stalled``, beyond what the window can judge (:class:`Stall`): it goes on
        from the serving weights, so that its next candidates (and steps toward them) start
        where the log vouches. Once per candidate: a held one judged again, or its canary
        ending, changes nothing more (``gate_reanchor``)."""
        if self.serving_net is None or self.serving_manifest is None:
            return
        if self._reanchored_for == candidate_version:
            return
        if not self._resume_learner(self.serving_manifest.version, self.serving_net):
            return
        self._reanchored_for = candidate_version
        serving = self.serving_manifest.version
        if stalled:
            self.metrics.gate_stall_resumes.inc()
            log.info(
                "gate: %d candidates in a row waited (the last v%d): training resumes from the serving v%d",
                self.lineage.stall.limit,
                candidate_version,
                serving,
            )
        else:
            self.metrics.gate_reanchors.inc()
            log.info("gate: v%d is worse than the serving v%d: training resumes from it", candidate_version, serving)

    async def _decide_now(self, manifest: Manifest, candidate: PolicyNetwork) -> GateDecision:
        """Judge the canary, then decide on ``manifest`` (:func:`decide`) and carry the decision out."""
        if not self._canary_cleared:
            await self.end_canary()
        self.lineage.judging(manifest.version)
        await self._judge_canary()
        window = [e for e in self.window() if not is_canary(e)][-self.config.window :]
        # Each event's logging probabilities (recomputed where it lacks them) before any judgement.
        window = await asyncio.to_thread(self.logging_policies.complete, window)
        for event, detail in self.logging_policies.take_mismatched():
            if self.on_mismatch is not None:
                self.on_mismatch(event, detail)
        serving_net, serving_manifest, witness = self.serving_net, self.serving_manifest, self.witness
        serving_version = serving_manifest.version if serving_manifest is not None else 0

        def judged() -> Verdict:
            assert serving_net is not None and serving_manifest is not None
            decision, reason, est = judge_window(
                window,
                candidate,
                serving_net,
                self.config,
                params=self.params,
                cache=self.moments,
                serving_params=ServingParams.from_wire(serving_manifest.serving)
                if serving_manifest.serving is not None
                else None,
                witness=witness,
            )
            return Verdict(decision, reason, est)

        # A judgement takes seconds (docs/benchmarks.md, "Promotion gate calibration"): it runs
        # in a worker thread on a copy of the window, so that the learner's loop (consuming,
        # heartbeats, the supervisor) keeps running meanwhile.
        outcome = await asyncio.to_thread(
            decide,
            Candidate(manifest.version, manifest.reason, isinstance(manifest, DeltaManifest)),
            serving_version if serving_net is not None and serving_manifest is not None else None,
            judged,
            canary_running=self.canary is not None,
            canary_rate=self.params.canary_rate,
            canary_paused=not self.backoff.plan(time.time()).start,
        )
        held, held_manifest = outcome, manifest
        follow = step_judged = False
        label = manifest.reason == "label" or outcome.by_label_rule  # expert answers are served whole
        stepping = self.config.conservative and not label and serving_net is not None and len(window) > 0
        if outcome.action == "hold" and stepping:
            # Where the candidate would wait: the largest step toward it within the trust region,
            # judged on the whole window (pipeline/learner/conservative.py); a promoted one is
            # published and served instead.
            stepped, step = await self._step_toward(manifest, candidate, window)
            step_judged = step.tv is not None
            if step.decision == "promoted" and step.net is not None:
                reason = f"v{stepped.version}, {step.reason}"
                outcome = Decision("promoted", reason, "promote", end_canary=True, estimates=step.estimates)
                manifest, candidate, follow = stepped, step.net, True
            else:
                outcome = replace(outcome, reason=f"{outcome.reason}; {step.reason}")
        if reanchors(held, held_manifest.reason):
            self._resume_from_serving(held_manifest.version)
        elif self.config.reanchor and self.lineage.stall.judged(
            held_manifest.version, outcome.action, held_manifest.reason, step_judged
        ):
            self._resume_from_serving(held_manifest.version, stalled=True)
        est = outcome.estimates
        result = GateDecision(
            outcome.decision,
            manifest.version,
            serving_version,
            outcome.reason,
            est.get("gain"),
            est.get("candidate"),
            est.get("serving"),
            est.get("similarity"),
            ess=est["gain"].ess if "gain" in est else None,
            ess_needed=self.config.min_ess,
        )
        m = self.metrics
        m.gate_ess.set(result.ess if result.ess is not None else 0.0)
        m.gate_ess_needed.set(self.config.min_ess)
        for name in ("candidate", "serving", "similarity"):
            e = est.get(name)
            if e is not None:
                m.gate_estimate.labels(policy=name).set(e.value)
        if outcome.end_canary:
            await self.end_canary()
        if outcome.action == "promote":
            await self.promote(manifest, candidate)
            # Served: a step part of the way toward the learner's candidate. The learner goes on
            # from the step, within the trust region the log vouches for, rather than from its
            # own weights beyond it (where its next candidates could not be judged).
            if follow and self._resume_learner(manifest.version, candidate):
                log.info("gate: the learner goes on from the step v%d", manifest.version)
            if not outcome.by_label_rule:
                self.witness = next_witness(
                    self.witness, manifest.version, candidate, self.params, est, self.config.epsilon
                )
            if "gain" in est and not outcome.by_label_rule:
                m.gate_promoted_gain.observe(est["gain"].value)
            if outcome.by_label_rule:
                log.info("gate: label fine-tune v%d promoted (gate: %s)", manifest.version, outcome.reason)
            else:
                log.info("gate: promoted v%d: %s", manifest.version, outcome.reason)
        elif outcome.action == "refuse":
            self.pending = None
            log.warning("gate: refused v%d, serving stays v%d: %s", manifest.version, serving_version, outcome.reason)
        else:
            self.pending = (manifest, candidate)
            log.info("gate: v%d waits: %s", manifest.version, outcome.reason)
            if outcome.start_canary:
                await self._start_canary(manifest, candidate, window)
        self._record(result)  # once the decision took effect
        return result
