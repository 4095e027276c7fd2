"""The learning loop in one process, without Kafka: for tuning and quick experiments.

It wires the same pieces as the running system (Environment, CausalRetriever,
PolicyTrainer, DriftMonitor) with the pipeline's delays emulated: the serving policy is
refreshed from the learner every ``refresh_every`` steps (the checkpoint cadence), and
the learner applies micro-batches in arrival order. The learner's own parts decide what
it keeps, judges and serves: :class:`~pipeline.learner.replay.Replay` (the kept window of
event time, the drift warm-up and the gate's window),
:func:`~pipeline.learner.promotion_gate.judge_window` (the gate's rule),
:mod:`pipeline.learner.promotion_decision` (what is a candidate and what is served at once,
the superseded check, the label rule, the delta exclusion, canary start and end: the same
functions the learner's gate calls), :class:`~pipeline.learner.canary.CanaryRun` and
:class:`~pipeline.learner.logging_policy.LoggingPolicies` (the logging probabilities of
events that lack them, computed from the versions served, as the learner's gate does before
every judgement). ``minimal_client`` serves as a client written from docs/contract.md that
fills only the required fields: its events carry no ``candidate_probs``,
``candidate_masks``, ``dropped`` or other optional field, and it serves no canary. This
loop only holds the networks and tells the retriever what to serve. ``causalmem bench
learning`` runs the real pipeline; this is where its settings were explored first
(docs/learning.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from causalmem_lab.lmworld import LMScenario
from causalmem_lab.minimal_client import required_only
from causalmem_lab.simulator import DAY, Environment, Scenario, Tally, scenario_retriever, serve
from models.drift import DriftMonitor
from models.policy.network import PolicyNetwork
from models.policy.trainer import PolicyTrainer, TrainerConfig
from models.serving.params import ServingParams
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import GateConfig, Settings
from pipeline.learner import evidence as gate_evidence
from pipeline.learner import promotion
from pipeline.learner.canary import CanaryBackoff, CanaryRun, is_canary
from pipeline.learner.conservative import Lineage, canary_regressed, reanchors, step_on_window
from pipeline.learner.logging_policy import LoggingPolicies
from pipeline.learner.promotion_decision import Candidate, Verdict, canary_decision, decide, is_candidate
from pipeline.learner.promotion_gate import judge_window, step_judge
from pipeline.learner.publishing import first_serving
from pipeline.learner.replay import Replay
from pipeline.learner.similarity_witness import Witness, next_witness
from pipeline.metrics import Metrics
from topics.internal import Experience
from topics.manifest import Manifest

PRODUCT = Settings()  # the product's defaults: this loop's, unless a field says otherwise


@dataclass
class OfflineConfig:
    """The loop's settings: the product's defaults (:class:`pipeline.config.Settings`) where the
    product has the setting, the lab's own (the refresh cadence in steps, the drift detector's
    tuning for query-level ratings) where it has none."""

    hidden: int = PRODUCT.hidden
    lr: float = PRODUCT.lr
    batch_size: int = PRODUCT.batch_size
    baseline: str = PRODUCT.baseline
    baseline_fading: float = PRODUCT.baseline_fading
    importance_clip: float = PRODUCT.importance_clip
    grad_clip: float = PRODUCT.grad_clip
    refresh_every: int = 300  # steps between checkpoints (the learner counts seconds)
    drop: str | float = PRODUCT.serve_drop  # or a fixed threshold
    explore_rate: float | None = None  # None: the scenario's
    explore_temperature: float | None = None
    explore_revive: float | None = None  # None: the client's (CausalRetriever's)
    reset: bool = PRODUCT.drift_reset
    # The lab's drift detector: every simulated query is rated, far more pairs a day than the
    # product's defaults (50 pairs, 1 day's cooldown, no Page-Hinkley) were set for.
    page_hinkley: bool = True
    drift_min_pairs: int = 1000
    drift_cooldown_s: float = 2 * 86400.0
    warmup_epochs: int = PRODUCT.warmup_epochs
    warmup_half_life_s: float = PRODUCT.warmup_half_life_s
    replay_window_s: float = PRODUCT.drift_window_days * DAY  # what the learner keeps
    learn: bool = True
    gate: bool = PRODUCT.gate
    gate_method: str = PRODUCT.gate_method
    gate_window: int = PRODUCT.gate_window
    gate_epsilon: float = PRODUCT.gate_epsilon
    gate_min_ess: float = PRODUCT.gate_min_ess
    canary_rate: float = PRODUCT.serve_canary_rate  # share of requests that serve the canary (gated; 0: none)
    canary_max: int = PRODUCT.gate_canary_max  # canary decisions after which an undecided canary gives way
    canary_coupled: bool = PRODUCT.serve_canary_coupled  # contract 1.5: canary requests draw both slates
    # The gate's conservative steps (pipeline/learner/conservative.py) where a candidate would wait.
    gate_conservative: bool = PRODUCT.gate_conservative
    gate_trust_region: float = PRODUCT.gate_trust_region
    # The learner resumes from the serving weights where the gate finds its candidate worse, or
    # where STALL_WAITS candidates in a row waited.
    gate_reanchor: bool = PRODUCT.gate_reanchor
    # A client that sends only the contract's required fields (required_only) and serves no canary.
    minimal_client: bool = False
    # "window": today's gate (its rule on the last gate_window decisions); "sequences": the
    # promotion rule of pipeline/learner/promotion.py on held-out decisions.
    gate_rule: str = PRODUCT.gate_rule
    gate_delta: float = PRODUCT.gate_delta  # "sequences": the run's error rate
    gate_holdout: float = PRODUCT.gate_holdout  # "sequences": the share of queries held out of training
    seed: int = PRODUCT.seed

    def trainer(self, scenario: Scenario | LMScenario) -> TrainerConfig:
        """The learner's trainer configuration (``Settings.trainer()``) at ``scenario``'s sizes, on CPU."""
        return PRODUCT.replace(
            embedding_dim=scenario.embedding_dim,
            slots=scenario.slots,
            hidden=self.hidden,
            lr=self.lr,
            grad_clip=self.grad_clip,
            importance_clip=self.importance_clip,
            baseline=self.baseline,
            baseline_fading=self.baseline_fading,
            seed=self.seed,
            device="cpu",
        ).trainer()

    def make_trainer(self, scenario: Scenario | LMScenario) -> PolicyTrainer:
        """The learner's trainer (a bench may run a variant of it)."""
        return PolicyTrainer(self.trainer(scenario))

    def gate_config(self) -> GateConfig | None:
        """The learner's gate rule (``Settings.gate_config()``) with this loop's settings; None ungated."""
        if not self.gate:
            return None
        return PRODUCT.replace(
            gate_window=self.gate_window,
            gate_epsilon=self.gate_epsilon,
            gate_min_ess=self.gate_min_ess,
            gate_method=self.gate_method,
            gate_canary_max=self.canary_max,
            gate_conservative=self.gate_conservative,
            gate_trust_region=self.gate_trust_region,
            gate_reanchor=self.gate_reanchor,
        ).gate_config()


@dataclass
class OfflineResult:
    tally: Tally
    resets: list[float] = field(default_factory=list)
    corr: list[tuple[float, float, int]] = field(default_factory=list)
    alpha: list[tuple[float, float]] = field(default_factory=list)  # (event time, α) at each refresh
    pairs: list[tuple[float, float, int]] = field(default_factory=list)  # (t, U_query, rating)
    gate: list[str] = field(default_factory=list)  # the gate's decision at each refresh
    canary: list[str] = field(default_factory=list)  # the canary's verdicts, e.g. "promoted v7 (212 canary decisions)"
    served: LoadedPolicy | None = None  # the policy the retriever serves at the end
    canary_utility: list[float] = field(default_factory=list)  # true utility of each canary request
    # Each policy version: the step whose experiences it has learnt from (all steps before
    # it), and its true value where run_offline was given a ``value`` function.
    created: dict[int, int] = field(default_factory=dict)
    values: dict[int, float] = field(default_factory=dict)
    # At each refresh: (step, the candidate's version, the version served before its judgement).
    refreshes: list[tuple[int, int, int]] = field(default_factory=list)
    # Each conservative step promoted: (step, α, the step's version, the candidate it stepped toward,
    # the version served before it, the certificate's estimated gain over that version).
    steps_taken: list[tuple[int, float, int, int, int, float]] = field(default_factory=list)
    # (step, candidate version, serving version) where the learner resumed from the serving weights
    reanchors: list[tuple[int, int, int]] = field(default_factory=list)
    # (step, candidate version, serving version) where it resumed because candidates waited in a row
    stalls: list[tuple[int, int, int]] = field(default_factory=list)
    # gate_rule "sequences": every action of the promotion rule, (step, kind, version, path)
    actions: list[tuple[int, str, int, str]] = field(default_factory=list)
    # Every version clients were told to serve, by version (its value can be measured afterwards).
    served_versions: dict[int, LoadedPolicy] = field(default_factory=dict)


def _snapshot(
    trainer: PolicyTrainer, version: int, serving: ServingParams | None = None, reason: str = "periodic"
) -> LoadedPolicy:
    """The trainer's policy as a client would load it; ``serving``: the manifest's serving parameters."""
    net = copy.deepcopy(trainer.net).cpu().eval()
    manifest = Manifest("default", version, 0.0, reason, net.arch.to_dict(), 0.0, 0.0, "0" * 64, 1, 1)
    if serving is not None:
        manifest = replace(manifest, serving=serving.to_wire())
    return LoadedPolicy(manifest=manifest, net=net)


def run_offline(
    scenario: Scenario | LMScenario,
    cfg: OfflineConfig,
    progress: Any = None,
    env: Any = None,
    value: Callable[[PolicyNetwork], float] | None = None,
) -> OfflineResult:
    """Run ``scenario``'s traffic through the loop; ``env`` (optional) is a world with the
    simulator Environment's interface (e.g. :class:`causalmem_lab.lmworld.LMWorld` over an
    :class:`~causalmem_lab.lmworld.LMScenario`), else ``Environment(scenario)``. ``value``
    (optional): a policy's true value, recorded for every version (``OfflineResult.values``)."""
    if env is None:
        assert isinstance(scenario, Scenario), "an LMScenario needs its world (env)"
        env = Environment(scenario)
    gate = cfg.gate_config()
    # Ungated, nothing is a candidate; a minimal client serves no canary (contract §7.2 is optional).
    canary_rate = cfg.canary_rate if gate is not None and not cfg.minimal_client else 0.0
    revive = {} if cfg.explore_revive is None else {"explore_revive": cfg.explore_revive}
    retriever = scenario_retriever(
        env,
        scenario,
        drop=cfg.drop,
        explore_rate=scenario.explore_rate if cfg.explore_rate is None else cfg.explore_rate,
        explore_temperature=scenario.explore_temperature
        if cfg.explore_temperature is None
        else cfg.explore_temperature,
        canary_rate=canary_rate,
        **revive,
    )
    trainer = cfg.make_trainer(scenario)
    canary: CanaryRun | None = None  # the pending candidate clients serve on canary_rate of requests
    serving_params = ServingParams(
        temperature=retriever.temperature,
        explore_rate=retriever.explore_rate,
        explore_temperature=retriever.explore_temperature,
        drop="fixed" if isinstance(cfg.drop, float) else cfg.drop,
        drop_ratio=cfg.drop if isinstance(cfg.drop, float) else PRODUCT.serve_drop_ratio,
        canary_rate=canary_rate,  # clients' share is set explicitly; the manifest says it too
        canary_coupled=cfg.canary_coupled,
    )
    configured_t = retriever.temperature
    current = serving_params  # how the policy clients hold is served
    if gate is not None:
        # As the learner publishes a fresh first policy under the gate (first_serving).
        current = first_serving(serving_params, True, "init", 0)
    version = 1
    pending: list[Experience] = []
    result = OfflineResult(Tally())
    steps = 0

    def snapshot(serving: ServingParams, reason: str = "periodic") -> LoadedPolicy:
        """The trainer's policy as version ``version``, its learnt-from step and value recorded."""
        policy = _snapshot(trainer, version, serving if gate is not None else None, reason)
        result.created[version] = steps - len(pending)  # the pending steps are not learnt yet
        if value is not None:
            result.values[version] = value(policy.net)
        return policy

    first = snapshot(current)
    retriever.set_policy(first)
    retriever.temperature = current.temperature  # as its manifest says (the lab's clients fix their own T)
    result.served_versions[first.version] = first
    monitor = DriftMonitor(
        min_pairs=cfg.drift_min_pairs, cooldown_s=cfg.drift_cooldown_s, page_hinkley=cfg.page_hinkley
    )
    replay = Replay(cfg.replay_window_s)
    # The learner's gate's own component: the versions clients serve, and the logging
    # probabilities it computes for the events that lack them (or drops where they disagree).
    logging_policies = LoggingPolicies(Metrics())
    logging_policies.hold(first.manifest, first.net)

    # As the learner's gate: the latest version promoted with a direct bound over similarity-only
    # (pipeline/learner/similarity_witness.py); a checkpoint served without the gate drops it.
    witness: Witness | None = None
    # As the learner's gate: which candidates descend from the trainer's weights, and the
    # candidates that waited in a row.
    lineage = Lineage()

    def resume(net: PolicyNetwork) -> None:
        """As PromotionGate._resume_learner: training goes on from ``net``'s weights."""
        trainer.resume_from(net.tensors())
        lineage.resumed()

    def end_canary() -> None:
        nonlocal canary
        canary = None
        retriever.set_canary(None)

    def serve_as_configured(policy: LoadedPolicy) -> None:
        """Clients serve ``policy`` with the configured parameters (it is the serving reference)."""
        nonlocal current
        retriever.temperature, current = configured_t, serving_params
        retriever.set_policy(policy)
        result.served_versions[policy.version] = policy
        logging_policies.hold(policy.manifest, policy.net)  # as the learner's gate on promote / set_serving

    # The learner's canary back-off: no canaries while clients serve none (a probe now and then),
    # timed by the simulated clock (the newest step's event time).
    backoff = CanaryBackoff(gate.canary_idle, gate.canary_probe_s) if gate is not None else CanaryBackoff()
    now = 0.0

    def refresh(candidate: LoadedPolicy) -> None:
        """A checkpoint: served at once ungated; gated, the canary's and the candidate's decisions,
        as the learner's gate takes them (pipeline/learner/promotion_gate.py)."""
        nonlocal canary, version, witness
        if gate is None or not is_candidate(candidate.manifest.reason, True):
            end_canary()
            serve_as_configured(candidate)
            witness = None
            return
        assert retriever.policy is not None
        lineage.judging(candidate.manifest.version)
        full = replay.gate_window()
        if canary is not None:
            run = canary
            ended = canary_decision(
                run.serving_version, retriever.policy.version, lambda: run.judge(full, gate.epsilon)
            )
            if ended is not None:
                if run.serving_version == retriever.policy.version:  # ended on its own arms: as the learner
                    backoff.ended(run, now)
                    if gate.reanchor and canary_regressed(ended):  # as the learner's gate: its requests show it worse
                        resume(retriever.policy.net)
                        result.reanchors.append((steps, run.version, retriever.policy.version))
                n = len(run.coupled) or len(run.arms.canary)
                result.canary.append(f"{ended.verdict} v{run.version} ({n} canary decisions)")
                if ended.serve:
                    serve_as_configured(LoadedPolicy(manifest=run.manifest, net=run.net))
                    if gate.reanchor and lineage.follows_canary(run.version):  # as the learner: it goes on from it
                        resume(run.net)
                end_canary()
        window = [e for e in full if not is_canary(e)][-gate.window :]
        # As the learner's gate: each event's logging probabilities before any judgement.
        window = logging_policies.complete(window)
        serving = retriever.policy

        def judged() -> Verdict:
            decision, reason, est = judge_window(
                window,
                candidate.net,
                serving.net,
                gate,
                n_boot=100,
                params=serving_params,  # judged as this loop serves
                serving_params=current,
                witness=witness,
            )
            return Verdict(decision, reason, est)

        d = decide(
            Candidate(candidate.manifest.version, candidate.manifest.reason),
            serving.version,
            judged,
            canary_running=canary is not None,
            canary_rate=canary_rate,
            canary_paused=not backoff.plan(now).start,
        )
        label = d.by_label_rule or candidate.manifest.reason == "label"  # expert answers are served whole

        def resume_if_worse(action: str, step_judged: bool) -> None:
            # As the learner (ControlHandler.resume_from_serving): the candidate is worse than
            # serving, or STALL_WAITS candidates in a row waited, so training goes on from the
            # serving weights (no memory changes slots here).
            if not gate.reanchor:
                return
            record = (steps, candidate.manifest.version, serving.version)
            if reanchors(d, candidate.manifest.reason):
                resume(serving.net)
                result.reanchors.append(record)
            elif lineage.stall.judged(candidate.manifest.version, action, candidate.manifest.reason, step_judged):
                resume(serving.net)
                result.stalls.append(record)

        step_judged = False
        if d.action == "hold" and gate.conservative and not label and window:
            # As the learner's gate: where the candidate would wait, the largest step toward it
            # within the trust region, judged on the whole window, published as a version of its own.
            step = step_on_window(
                window,
                candidate.net,
                serving.net,
                step_judge(gate, serving_params, current, witness=witness),
                params=serving_params,
                radius=gate.trust_region,
                serving_params=current,
            )
            step_judged = step.tv is not None
            if step.decision == "promoted" and step.net is not None and step.alpha is not None:
                resume_if_worse("promote", True)  # in the gate's order: before the step is served
                version += 1
                stepped = LoadedPolicy(manifest=replace(candidate.manifest, version=version), net=step.net)
                result.created[version] = result.created[candidate.manifest.version]  # learnt from the same steps
                if value is not None:
                    result.values[version] = value(step.net)
                gain = step.estimates.get("gain")
                est = gain.value if gain else float("nan")
                toward = candidate.manifest.version
                result.steps_taken.append((steps, step.alpha, version, toward, serving.version, est))
                result.gate.append("promoted")
                end_canary()
                serve_as_configured(stepped)
                witness = next_witness(witness, version, step.net, serving_params, step.estimates, gate.epsilon)
                if gate.reanchor:  # as the learner: it goes on from the step served, not from beyond it
                    resume(step.net)
                return
        resume_if_worse(d.action, step_judged)
        result.gate.append(d.decision)
        if d.end_canary:
            end_canary()
        if d.action == "promote":
            serve_as_configured(candidate)
            if not d.by_label_rule:
                witness = next_witness(
                    witness, candidate.manifest.version, candidate.net, serving_params, d.estimates, gate.epsilon
                )
        elif d.start_canary:
            canary = CanaryRun(candidate.manifest, candidate.net, serving.version, window, canary_rate, gate.canary_max)
            retriever.set_canary(candidate)

    sequences: SequenceGate | None = None
    if gate is not None and cfg.gate_rule == "sequences":
        sequences = SequenceGate(
            promotion.Rule(delta=cfg.gate_delta, epsilon=cfg.gate_epsilon),
            first,
            serving_params,
            canary_rate,
            trainer,
            logging_policies,
            result,
            serve_as_configured,
            retriever.set_canary,
        )
    elif cfg.gate_rule not in ("window", "sequences"):
        raise ValueError(f"gate_rule must be 'window' or 'sequences', not {cfg.gate_rule!r}")

    for _ in range(scenario.total_queries):
        q = env.next_query()
        for step in range(q.steps):
            st = env.step_features(q, step)
            now = st.ts
            res = serve(retriever, st, with_texts=False)
            event = required_only(res.event) if cfg.minimal_client else res.event
            true_u, nll_with, nll_without, nll_without_slot = env.feedback(q.intent, res.slots)
            u = nll_without - nll_with
            q.utilities.append(u)
            # Canary requests are not the serving policy as served: measured apart, like exploration.
            on_canary = bool(res.event.canary)
            explore = on_canary or res.event.temperature != retriever.temperature
            served = retriever.policy.version if retriever.policy is not None else 0
            result.tally.record(env, q.intent, res.slots, true_u, st.ts, served, explore)
            if on_canary:
                result.canary_utility.append(true_u)
            if not event.fallback:
                effects = {m: v - nll_with for m, v in (nll_without_slot or {}).items()} or None
                pending.append(Experience(event.event_id, "feedback", event, u, slot_effects=effects))
            if len(pending) >= cfg.batch_size:
                if sequences is not None:
                    # The rule's tests are on queries the trainer never learns from.
                    kept = [e for e in pending if not promotion.held_out(e.event.query_id, cfg.gate_holdout)]
                    sequences.held.extend(e for e in pending if e not in kept)
                    sequences.table.add(kept)
                else:
                    kept = pending
                if cfg.learn and kept:
                    trainer.update(kept)
                replay.extend(pending)
                pending = []
            steps += 1
            if steps % cfg.refresh_every == 0:
                result.alpha.append((st.ts, float(trainer.net.alpha.detach()[0])))
                version += 1
                candidate = snapshot(serving_params)
                result.refreshes.append((steps, version, retriever.policy.version if retriever.policy else 0))
                if sequences is not None:
                    sequences.refresh(candidate, steps)
                else:
                    refresh(candidate)

        rating = env.rating(q.intent)
        if rating is not None:
            t = q.ts
            result.pairs.append((t, float(np.mean(q.utilities)), rating))
            fired = monitor.update(t, float(np.mean(q.utilities)), rating)
            result.corr.append((t, monitor.window.get(), monitor.window.pairs))
            if fired and cfg.reset:
                # As the learner does on a reset command (pipeline/learner/control.py): warm up on
                # the kept experiences since the drift began, then publish a "reset" checkpoint,
                # which the promotion decision serves at once (ending any canary).
                warm = replay.after_drift(monitor.trigger.change_t)
                trainer.reset(
                    warm, epochs=cfg.warmup_epochs, batch_size=cfg.batch_size, half_life_s=cfg.warmup_half_life_s
                )
                result.resets.append(t)
                version += 1
                if sequences is not None:
                    sequences.refresh(snapshot(serving_params, "reset"), steps)
                else:
                    refresh(snapshot(serving_params, "reset"))
        if progress is not None:
            progress()
    result.served = retriever.policy
    return result


class SequenceGate:
    """gate_rule "sequences": the promotion rule (:func:`pipeline.learner.promotion.decide`) as the
    learner carries it out, on the held-out decisions (:mod:`pipeline.learner.evidence`).

    Carries each action out on the loop's retriever and trainer: ``promote`` and ``rollback``
    serve a version, ``refuse`` (the candidate shown worse) sends training back to the serving
    weights; while a full candidate's trial waits and clients serve canaries, it is the canary.
    """

    def __init__(
        self,
        rule: promotion.Rule,
        first: LoadedPolicy,
        params: ServingParams,
        canary_rate: float,
        trainer: PolicyTrainer,
        logging_policies: LoggingPolicies,
        result: OfflineResult,
        serve: Callable[[LoadedPolicy], None],
        set_canary: Callable[[LoadedPolicy | None], None],
    ) -> None:
        self.rule = rule
        self.state = promotion.State.start(first.version)
        self.nets: dict[int, LoadedPolicy] = {first.version: first}
        self.params = params
        self.canary_rate = canary_rate
        self.canary: int | None = None
        self.trainer = trainer
        self.logging_policies = logging_policies
        self.result = result
        self.serve = serve
        self.set_canary = set_canary
        self.held: list[Experience] = []
        self.table = gate_evidence.RewardTable()  # as the learner's gate: the gain terms' direct model

    def refresh(self, candidate: LoadedPolicy, step: int) -> None:
        """A checkpoint: a look at the decisions logged so far, then a candidate starts a trial
        (anything else is served at once)."""
        v = candidate.version
        self.look(step)  # the decisions logged before it are evidence on the trials already open
        self.nets[v] = candidate
        if is_candidate(candidate.manifest.reason, True):
            self.state, actions = promotion.decide(self.state, promotion.Candidate(v), self.rule)
        else:
            event = promotion.ServedAtOnce(v, reanchor=candidate.manifest.reason == "reset")
            self.state, actions = promotion.decide(self.state, event, self.rule)
            self.serve(candidate)
        self._carry(actions, step)

    def look(self, step: int) -> None:
        """The held-out decisions since the last look, as evidence."""
        held, self.held = self.logging_policies.complete(self.held), []
        versions = {
            v: (self.nets[v].net, ServingParams.from_wire(self.nets[v].manifest.serving))
            for v in self.state.versions()
            if v != promotion.SIMILARITY
        }
        usable = gate_evidence.usable(held)
        ev = gate_evidence.build(usable, versions, self.params, self.table)
        self.table.add(usable)
        self.state, actions = promotion.decide(self.state, ev, self.rule)
        self._carry(actions, step)

    def _carry(self, actions: list[promotion.Action], step: int) -> None:
        for a in actions:
            self.result.actions.append((step, a.kind, a.version, a.path))
            if a.kind in ("promote", "refuse", "wait", "superseded"):
                self.result.gate.append({"promote": "promoted", "refuse": "refused"}.get(a.kind, "insufficient"))
            if a.kind == "promote":
                self.serve(self.nets[a.version])
            elif a.kind == "rollback" and a.to is not None:
                self.serve(self.nets[a.to])
            elif a.kind == "refuse":
                self.trainer.resume_from(self.nets[self.state.serving].net.tensors())
        # The newest waiting full candidate is the canary, where clients serve canaries.
        waiting = [t.version for t in self.state.trials]
        canary = waiting[-1] if waiting and self.canary_rate > 0 else None
        if canary != self.canary:
            self.canary = canary
            self.set_canary(self.nets[canary] if canary is not None else None)
            if canary is not None:
                self.logging_policies.hold(self.nets[canary].manifest, self.nets[canary].net)
        keep = self.state.versions() | {self.state.first}
        self.nets = {v: p for v, p in self.nets.items() if v in keep}
