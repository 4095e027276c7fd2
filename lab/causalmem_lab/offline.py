"""The learning loop in one process, without Kafka: for tuning and quick experiments.

It wires the same pieces as the running system (Environment, CausalRetriever,
PolicyTrainer, DriftMonitor) with the pipeline's delays emulated: the learner publishes a
checkpoint every ``refresh_every`` steps (the checkpoint cadence), and applies micro-batches
in arrival order. The learner's own parts decide what it keeps, judges and serves:
:class:`~pipeline.learner.replay.Replay` (the drift warm-up), :func:`pipeline.learner.promotion.decide`
(the promotion rule) on the evidence :mod:`pipeline.learner.evidence` builds, and
:class:`~pipeline.learner.logging_policy.LoggingPolicies` (the logging probabilities of events
that lack them, computed from the versions served, as the learner's gate does before every
look). ``minimal_client`` serves as a client written from docs/contract.md that fills only the
required fields: its events carry no ``candidate_probs``, ``candidate_masks``, ``dropped`` or
other optional field, and it serves no canary. This loop only holds the networks and tells the
retriever what to serve. ``causalmem bench learning`` runs the real pipeline; this is where its
settings were explored first (docs/learning.md).
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
from pipeline.learner.gate import certified, copy_of, incumbent_of, resume
from pipeline.learner.logging_policy import LoggingPolicies
from pipeline.learner.promotion import is_candidate
from pipeline.learner.publishing import first_serving
from pipeline.learner.replay import Replay
from pipeline.metrics import Metrics
from topics.fields import PROBE
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
    gate_epsilon: float = PRODUCT.gate_epsilon
    gate_delta: float = PRODUCT.gate_delta  # the run's error rate
    canary_rate: float = PRODUCT.serve_canary_rate  # share of requests that serve the canary (gated; 0: none)
    canary_coupled: bool = PRODUCT.serve_canary_coupled  # contract 1.5: canary requests draw both slates
    # A client that sends only the contract's required fields (required_only) and serves no canary.
    minimal_client: bool = False
    # A learner restart after this many steps (0: none): the rule's state is rebuilt from the
    # serving manifest, as a restarted learner's gate does (RuleGate.set_serving), in epoch 2.
    restart_at: int = 0
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
        """The learner's promotion rule (``Settings.gate_config()``) with this loop's settings; None ungated."""
        if not self.gate:
            return None
        return PRODUCT.replace(gate_epsilon=self.gate_epsilon, gate_delta=self.gate_delta).gate_config()


@dataclass
class OfflineResult:
    tally: Tally
    resets: list[float] = field(default_factory=list)
    corr: list[tuple[float, float, int]] = field(default_factory=list)
    alpha: list[tuple[float, float]] = field(default_factory=list)  # (event time, α) at each refresh
    pairs: list[tuple[float, float, int]] = field(default_factory=list)  # (t, U_query, rating)
    gate: list[str] = field(default_factory=list)  # the rule's decisions: promoted, refused, insufficient
    served: LoadedPolicy | None = None  # the policy the retriever serves at the end
    canary_utility: list[float] = field(default_factory=list)  # true utility of each canary request
    # Each policy version: the step whose experiences it has learnt from (all steps before
    # it), and its true value where run_offline was given a ``value`` function.
    created: dict[int, int] = field(default_factory=dict)
    values: dict[int, float] = field(default_factory=dict)
    # At each refresh: (step, the candidate's version, the version served before its judgement).
    refreshes: list[tuple[int, int, int]] = field(default_factory=list)
    # Every action of the promotion rule, (step, kind, version, path)
    actions: list[tuple[int, str, int, str]] = field(default_factory=list)
    # Every bound the rule looked at: (step, candidate, its anchor, the gain's lower and upper bound)
    looks: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    # Every candidate that started a trial, by version (its value can be measured afterwards).
    trialled: dict[int, LoadedPolicy] = field(default_factory=dict)
    # Every version clients were told to serve, by version (its value can be measured afterwards).
    served_versions: dict[int, LoadedPolicy] = field(default_factory=dict)
    # (step, version) of the version an operator's cut-over served (run_offline's ``operator``).
    operator: tuple[int, int] | None = None
    restarted: int | None = None  # the step of the learner restart (``OfflineConfig.restart_at``)
    # (step, version) of each promotion clients refused: older than a version they were served
    # since (a probe published after its trial began), as a client's subscriber refuses it (§7).
    refused_older: list[tuple[int, int]] = field(default_factory=list)


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
    operator: tuple[int, Callable[[PolicyNetwork], None]] | None = None,
) -> OfflineResult:
    """Run ``scenario``'s traffic through the loop; ``env`` (optional) is a world with the
    simulator Environment's interface (e.g. :class:`causalmem_lab.lmworld.LMWorld` over an
    :class:`~causalmem_lab.lmworld.LMScenario`), else ``Environment(scenario)``. ``value``
    (optional): a policy's true value, recorded for every version (``OfflineResult.values``).
    ``operator`` (optional), ``(step, change)``: at the first checkpoint from that step on, an
    operator's cut-over serves the learner's weights as ``change`` alters them (in place): at
    once, as configured, without a trial (``OfflineResult.operator``)."""
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
    serving_params = ServingParams(
        temperature=retriever.temperature,
        explore_rate=retriever.explore_rate,
        explore_temperature=retriever.explore_temperature,
        drop="fixed" if isinstance(cfg.drop, float) else cfg.drop,
        drop_ratio=cfg.drop if isinstance(cfg.drop, float) else PRODUCT.serve_drop_ratio,
        canary_rate=canary_rate,  # clients' share is set explicitly; the manifest says it too
        canary_coupled=cfg.canary_coupled,
    )
    current = serving_params  # how the policy clients hold is served
    if gate is not None:
        # As the learner publishes a fresh first policy under the gate (first_serving).
        current = first_serving(serving_params, True, "init", 0)
    version = 1
    pending: list[Experience] = []
    result = OfflineResult(Tally())
    steps = 0

    def snapshot(
        serving: ServingParams, reason: str = "periodic", change: Callable[[PolicyNetwork], None] | None = None
    ) -> LoadedPolicy:
        """The trainer's policy as version ``version`` (``change`` alters it), its step and value recorded."""
        policy = _snapshot(trainer, version, serving, reason)
        if change is not None:
            change(policy.net)
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

    def serve_as_published(policy: LoadedPolicy) -> None:
        """Clients serve ``policy`` as its manifest says (an incumbent's temperature is the fresh one)."""
        retriever.temperature = ServingParams.from_wire(policy.manifest.serving).temperature
        retriever.set_policy(policy)
        result.served_versions[policy.version] = policy
        logging_policies.hold(policy.manifest, policy.net)  # as the learner's gate on promote / set_serving

    def republish(policy: LoadedPolicy, reason: str) -> LoadedPolicy:
        """As the learner publishes a promoted version again (``Action.republish``), or a
        guardrail's rollback: its weights and manifest under the next version, reason
        ``rollback``, ``rolled_back_to`` it. The trainer goes on as it is, as the learner's."""
        nonlocal version
        version += 1
        metrics = {**policy.manifest.metrics, "rolled_back_to": policy.version, "rollback_reason": reason}
        result.created[version] = result.created[policy.version]
        if policy.version in result.values:
            result.values[version] = result.values[policy.version]
        manifest = replace(policy.manifest, version=version, reason="rollback", metrics=metrics)
        return LoadedPolicy(manifest=manifest, net=policy.net)

    sequences: SequenceGate | None = None
    if gate is not None:
        sequences = SequenceGate(
            promotion.Rule(delta=gate.delta, epsilon=gate.epsilon, trial_decisions=gate.trial_decisions),
            first,
            serving_params,
            # The learner names a canary as its setting says, whether or not clients serve it (a
            # minimal client does not): as the learner's gate.
            cfg.canary_rate,
            logging_policies,
            result,
            serve_as_published,
            retriever.set_canary,
            republish,
        )

    def refresh(candidate: LoadedPolicy) -> None:
        """A checkpoint: served at once ungated; gated, the promotion rule's."""
        if sequences is None:
            serve_as_published(candidate)
        else:
            sequences.refresh(candidate, steps)

    for _ in range(scenario.total_queries):
        q = env.next_query()
        for step in range(q.steps):
            st = env.step_features(q, step)
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
                    sequences.observe(pending)  # as the learner: evidence on the trials open now
                if cfg.learn:
                    trainer.update(pending)
                replay.extend(pending)
                pending = []
            steps += 1
            if steps % cfg.refresh_every == 0:
                result.alpha.append((st.ts, float(trainer.net.alpha.detach()[0])))
                if sequences is not None:
                    sequences.look(steps)  # what was logged so far is evidence on the trials already open
                if sequences is not None and sequences.wants_probe():
                    # As the learner (contract 1.19): the weights first served as a probe, under a lower
                    # version (1.23: over the certified version, which clients serve on the rest).
                    version += 1
                    params = first_serving(serving_params, True, PROBE, 1, base=promotion.probe_base(sequences.state))
                    sequences.probe(snapshot(params, PROBE), steps)
                version += 1
                candidate = snapshot(serving_params)
                result.refreshes.append((steps, version, retriever.policy.version if retriever.policy else 0))
                refresh(candidate)
                if sequences is not None and cfg.restart_at and result.restarted is None and steps >= cfg.restart_at:
                    sequences.restart(epoch=2)
                    result.restarted = steps
                if operator is not None and result.operator is None and steps >= operator[0]:
                    version += 1
                    result.operator = (steps, version)
                    refresh(snapshot(serving_params, "cutover", operator[1]))

        rating = env.rating(q.intent)
        if rating is not None:
            t = q.ts
            result.pairs.append((t, float(np.mean(q.utilities)), rating))
            fired = monitor.update(t, float(np.mean(q.utilities)), rating)
            result.corr.append((t, monitor.window.get(), monitor.window.pairs))
            if fired and cfg.reset:
                # As the learner does on a reset command (pipeline/learner/control.py): warm up on
                # the kept experiences since the drift began, then publish a "reset" checkpoint,
                # which the promotion decision serves at once (ending any canary), as an
                # incumbent under the gate (first_serving).
                warm = replay.after_drift(monitor.trigger.change_t)
                trainer.reset(
                    warm, epochs=cfg.warmup_epochs, batch_size=cfg.batch_size, half_life_s=cfg.warmup_half_life_s
                )
                result.resets.append(t)
                version += 1
                refresh(snapshot(first_serving(serving_params, gate is not None, "reset", 1), "reset"))
        if progress is not None:
            progress()
    result.served = retriever.policy
    return result


class SequenceGate:
    """The promotion rule (:func:`pipeline.learner.promotion.decide`) as the learner carries it
    out, on the decisions applied after each trial started (:mod:`pipeline.learner.evidence`).

    Carries each action out on the loop's retriever: ``promote`` serves a version, or, where
    clients hold a newer one, a copy of it under a new version, as does ``rollback``; ``refuse``
    (the candidate shown worse) ends its trial; while a full candidate's trial waits and clients
    serve canaries, it is the canary.
    """

    def __init__(
        self,
        rule: promotion.Rule,
        first: LoadedPolicy,
        params: ServingParams,
        canary_rate: float,
        logging_policies: LoggingPolicies,
        result: OfflineResult,
        serve: Callable[[LoadedPolicy], None],
        set_canary: Callable[[LoadedPolicy | None], None],
        republish: Callable[[LoadedPolicy, str], LoadedPolicy],
    ) -> None:
        self.rule = rule
        self.state = resume(first.manifest, rule, epoch=1)  # as the learner's gate starts
        self.nets: dict[int, LoadedPolicy] = {first.version: first}
        self.params = params
        self.canary_rate = canary_rate
        self.canary: int | None = None
        self.logging_policies = logging_policies
        self.result = result
        self.serve = serve
        self.set_canary = set_canary
        self.republish = republish
        self.gathered: list[Experience] = []
        self.table = gate_evidence.RewardTable()  # as the learner's gate: the gain terms' direct model
        # The versions whose weights the learner publishes again, after the checkpoint being judged
        # (a rollback's target, a promotion after a newer probe: promotion.State.awaiting).
        self.copies: list[tuple[int, str]] = []
        self.clients_serve = first.version  # the newest version published under the serving key

    def observe(self, experiences: list[Experience]) -> None:
        """Decisions about to be trained on: evidence for the trials open now (:meth:`RuleGate.observe`)."""
        self.gathered.extend(experiences)

    def restart(self, epoch: int) -> None:
        """As a learner restarted in ``epoch`` (:meth:`RuleGate.set_serving` on the serving
        manifest): the trials and the guardrail start again; the served version is the anchor
        where its promotion recorded a certified margin, and the guardrail goes on with the
        measure of similarity-only it recorded beside it. Under a probe the learner
        also holds the incumbent before it (the rule values what that one logged); here the probe
        is restarted from as an incumbent of its own. Under a probe over a certified version
        (1.23) it reads that version first, then the probe, as the learner's restore does."""
        base, serving = self.state.base, self.state.serving
        if base is None:
            self.state = resume(self.nets[serving].manifest, self.rule, epoch)
        else:
            self.state = resume(self.nets[base].manifest, self.rule, epoch)
            probe = promotion.Probe(serving, incumbent_of(self.nets[serving].manifest))
            self.state, _ = promotion.decide(self.state, probe, self.rule)
        self.table = gate_evidence.RewardTable()  # the learner's is in its memory: learnt again

    def wants_probe(self) -> bool:
        """As the check at the start of :meth:`RuleGate.probe`: the next candidate is preceded by a probe."""
        return promotion.probes(self.state, self.rule)

    def probe(self, policy: LoadedPolicy, step: int) -> None:
        """As :meth:`RuleGate.probe` once published: the probe is served, the trials go on."""
        self.nets[policy.version] = policy
        probe = promotion.Probe(policy.version, incumbent_of(policy.manifest))
        self.state, actions = promotion.decide(self.state, probe, self.rule)
        self.serve(policy)
        self.clients_serve = policy.version
        self._carry(actions, step)

    def refresh(self, candidate: LoadedPolicy, step: int) -> None:
        """A checkpoint: a look at the decisions logged so far, then a candidate starts a trial
        (anything else is served at once)."""
        v = candidate.version
        self.look(step)  # the decisions logged before it are evidence on the trials already open
        if is_candidate(candidate.manifest.reason, True):
            self.nets[v] = candidate
            self.state, actions = promotion.decide(self.state, promotion.Candidate(v), self.rule)
        else:
            self.nets[v] = candidate
            reanchor = candidate.manifest.reason == "reset"
            event = promotion.ServedAtOnce(v, reanchor, incumbent_of(candidate.manifest), copy_of(candidate.manifest))
            self.state, actions = promotion.decide(self.state, event, self.rule)
            self.serve(candidate)
            self.clients_serve = v
        self._carry(actions, step)
        # Published once the checkpoint was judged, as the learner's; only while the rule still waits
        # for it (a drift reset served meanwhile ends the wait, and the learner publishes no copy).
        copies, self.copies = self.copies, []
        for version, reason in copies:
            if version == self.state.awaiting:
                self.refresh(self.republish(self.nets[version], reason), step)

    def look(self, step: int) -> None:
        """The decisions since the last look, as evidence (none: nothing to look at, as the learner's)."""
        gathered, self.gathered = self.gathered, []
        if not gathered:
            return
        versions = {
            v: (self.nets[v].net, ServingParams.from_wire(self.nets[v].manifest.serving))
            for v in self.state.versions()
            if v != promotion.SIMILARITY
        }
        ev = gate_evidence.of_look(gathered, versions, self.params, self.table, self.logging_policies.complete)
        anchors = {t.version: t.anchor for t in self.state.trials}
        self.state, actions = promotion.decide(self.state, ev, self.rule)
        for a in actions:
            if a.interval is not None:
                self.result.looks.append((step, a.version, anchors[a.version], *a.interval))
        self._carry(actions, step)

    def _carry(self, actions: list[promotion.Action], step: int) -> None:
        for a in actions:
            self.result.actions.append((step, a.kind, a.version, a.path))
            if a.kind == "trial":
                self.result.trialled[a.version] = self.nets[a.version]
            if a.kind in ("promote", "refuse", "wait", "superseded"):
                self.result.gate.append({"promote": "promoted", "refuse": "refused"}.get(a.kind, "insufficient"))
            if a.kind == "promote":  # published with its certified margin, as the learner's gate does
                promoted = self.nets[a.version]
                self.nets[a.version] = replace(promoted, manifest=certified(promoted.manifest, self.state))
                if a.republish:  # as the learner: its weights again under a new version, served at once
                    self.copies.append((a.version, f"promoted v{a.version}: {a.reason}"))
                elif a.version < self.clients_serve:  # versions only grow on the serving key (contract §7)
                    self.result.refused_older.append((step, a.version))
                else:
                    self.serve(self.nets[a.version])
                    self.clients_serve = a.version
            elif a.kind == "rollback" and a.to is not None:  # as the learner: a copy under a new version
                self.copies.append((a.to, f"guardrail: {a.reason}"))
            elif a.kind == "copy":  # a promotion's copy asked for again (never here: every copy is published)
                self.copies.append((a.version, a.reason))
        canary = promotion.canary(self.state, self.canary_rate)  # every snapshot here is full
        if canary != self.canary:
            self.canary = canary
            self.set_canary(self.nets[canary] if canary is not None else None)
            if canary is not None:
                self.logging_policies.hold(self.nets[canary].manifest, self.nets[canary].net, canary=True)
        keep = self.state.versions() | {self.state.first}
        self.nets = {v: p for v, p in self.nets.items() if v in keep}
