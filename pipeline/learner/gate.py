"""The promotion gate: counterfactual evaluation of every checkpoint before clients serve it.

The Decision Service / Personalizer way of checking a new policy offline — estimate its
mean utility from logged decisions and their probabilities — made an automatic step of
the learner. A new checkpoint is published as a *candidate* (manifest keyed
``"{policy}/candidate"``); the gate estimates, on the last ``gate_window`` logged
experiences, the candidate's gain over the serving policy (self-normalised IPS, paired
bootstrap interval, see :mod:`models.estimators`) — doubly robust by default — and promotes it — republishes its
manifest under ``"{policy}"``, the key clients follow — only when

* the effective sample size is at least ``gate_min_ess``,
* the lower confidence bound of the gain is above ``−gate_epsilon``, and
* its estimate is not below the similarity-only policy (m = 0), when that policy's
  estimate is itself reliable (enough effective samples).

Otherwise the serving policy stays, and the refusal is logged and counted with the
estimates. A candidate without enough data is kept and looked at again as data arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from models.estimators import Estimate, evaluate, gain
from models.logged import LoggedDecisions
from models.policy import PolicyNetwork
from models.reward_model import SlotRewardModel
from pipeline.component_config import GateConfig
from pipeline.metrics import Metrics
from pipeline.modeltopic import CheckpointPublisher
from topics.internal import Experience
from topics.manifest import Manifest

log = logging.getLogger(__name__)

PESSIMISM = 0.1  # the DR reward model's prior for rarely seen slots: this quantile of logged utility


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

    def summary(self) -> dict[str, Any]:
        def est(e: Estimate | None) -> dict[str, float] | None:
            return None if e is None else {"value": e.value, "low": e.low, "high": e.high, "ess": e.ess}

        return {
            "decision": self.decision,
            "candidate_version": self.candidate_version,
            "serving_version": self.serving_version,
            "reason": self.reason,
            "gain": est(self.gain),
            "candidate": est(self.candidate),
            "serving": est(self.serving),
            "similarity": est(self.similarity),
        }


def judge(
    decisions: LoggedDecisions,
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    epsilon: float,
    min_ess: float,
    method: str = "dr",
    n_boot: int = 200,
    seed: int = 0,
) -> tuple[str, str, dict[str, Estimate]]:
    """The gate's rule on a log, without Kafka: ``(decision, reason, estimates)``.

    With ``method="dr"`` (the default) the sample-size rule counts logged decisions: the
    direct model learns from every one of them, whatever the importance weights. With
    ``"snips"``/``"ips"`` it counts the importance weights' effective sample size, which a
    near-greedy serving policy keeps tiny (a candidate that reorders a top-3 even slightly
    gives the logged order almost no probability), so such a gate rarely decides.
    """
    if len(decisions) == 0:
        return "insufficient", "no logged decisions yet", {}
    # Pessimistic about slots the log rarely shows: a candidate that moves its reads there
    # must earn the trust that the serving policy's logged reads already have.
    model = SlotRewardModel(prior_quantile=PESSIMISM).fit(decisions) if method == "dr" else None
    estimator = cast(Literal["ips", "snips", "dr"], method)
    g = gain(decisions, candidate, serving, method=estimator, n_boot=n_boot, seed=seed, reward_model=model)
    values = evaluate(
        decisions,
        {"candidate": candidate, "serving": serving, "similarity": "similarity"},
        method=estimator,
        n_boot=n_boot,
        seed=seed,
        reward_model=model,
    )
    estimates = {"gain": g, **values}
    support = float(len(decisions)) if method == "dr" else g.ess
    if support < min_ess:
        what = "logged decisions" if method == "dr" else "effective sample size"
        return "insufficient", f"{what} {support:.0f} < {min_ess:.0f}", estimates
    if not g.low > -epsilon:
        why = f"gain over serving {g.value:+.4f}, lower bound {g.low:+.4f} ≤ −ε ({-epsilon:+.4f})"
        return "refused", why, estimates
    sim, cand = values["similarity"], values["candidate"]
    sim_support = float(len(decisions)) if method == "dr" else sim.ess
    if sim_support >= min_ess and cand.value < sim.value:
        return "refused", f"estimate {cand.value:+.4f} below similarity-only {sim.value:+.4f}", estimates
    return "promoted", f"gain {g.value:+.4f} (lower bound {g.low:+.4f}), estimate {cand.value:+.4f}", estimates


def judge_window(
    experiences: Sequence[Experience],
    candidate: PolicyNetwork,
    serving: PolicyNetwork,
    config: GateConfig,
    n_boot: int = 200,
) -> tuple[str, str, dict[str, Estimate]]:
    """:func:`judge` on the last ``config.window`` of ``experiences`` (the gate's window)."""
    decisions = LoggedDecisions.from_experiences(list(experiences)[-config.window :])
    return judge(decisions, candidate, serving, config.epsilon, config.min_ess, method=config.method, n_boot=n_boot)


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
    ) -> None:
        self.config = config
        self.publisher = publisher
        self.metrics = metrics
        self.window = window
        self.serving_net: PolicyNetwork | None = None
        self.serving_manifest: Manifest | None = None
        self.pending: tuple[Manifest, PolicyNetwork] | None = None  # a candidate awaiting data
        self.decisions: list[GateDecision] = []

    def set_serving(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
        self.serving_manifest = manifest
        self.serving_net = PolicyNetwork.from_tensors({k: v.cpu() for k, v in tensors.items()}).eval()

    async def consider(self, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> GateDecision:
        candidate = PolicyNetwork.from_tensors({k: v.cpu() for k, v in tensors.items()}).eval()
        return await self._decide(manifest, candidate)

    async def reconsider(self) -> GateDecision | None:
        """Look again at a candidate that lacked data (called at the checkpoint cadence)."""
        if self.pending is None:
            return None
        manifest, candidate = self.pending
        return await self._decide(manifest, candidate)

    async def _decide(self, manifest: Manifest, candidate: PolicyNetwork) -> GateDecision:
        est: dict[str, Estimate] = {}
        if self.serving_net is None or self.serving_manifest is None:
            decision, reason = "promoted", "no serving policy yet"
        else:
            decision, reason, est = judge_window(self.window(), candidate, self.serving_net, self.config)
        serving_version = self.serving_manifest.version if self.serving_manifest else 0
        result = GateDecision(
            decision,
            manifest.version,
            serving_version,
            reason,
            est.get("gain"),
            est.get("candidate"),
            est.get("serving"),
            est.get("similarity"),
        )
        m = self.metrics
        m.gate_decisions.labels(decision=decision).inc()
        for name in ("candidate", "serving", "similarity"):
            e = est.get(name)
            if e is not None:
                m.gate_estimate.labels(policy=name).set(e.value)
        if decision == "promoted":
            await self.publisher.promote(manifest)
            self.serving_manifest, self.serving_net, self.pending = manifest, candidate, None
            m.checkpoint_version.labels(role="serving").set(manifest.version)
            m.checkpoint_timestamp.labels(role="serving").set(manifest.created_ts)
            log.info("gate: promoted v%d: %s", manifest.version, reason)
        elif decision == "refused":
            self.pending = None
            log.warning("gate: refused v%d, serving stays v%d: %s", manifest.version, serving_version, reason)
        else:
            self.pending = (manifest, candidate)
            log.info("gate: v%d waits: %s", manifest.version, reason)
        self.decisions = [*self.decisions[-99:], result]  # recorded once the decision took effect
        return result
