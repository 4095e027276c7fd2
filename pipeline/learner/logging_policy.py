"""The logging probabilities of the promotion rule's evidence, computed by the learner itself.

The rule's evidence needs, for each decision, the logging policy's first-draw
probabilities over its candidates (``candidate_probs``). ``CausalRetriever`` logs them; a
client written from docs/contract.md that fills only the required fields does not. The learner
published every version a client may serve, so it can compute them itself:
:class:`LoggingPolicies` keeps the networks of the versions clients may be serving and, before
the gate builds its logged decisions, gives each event the probabilities its ``policy_version``
served it with: the masks over the event's candidates (its own ``candidate_masks`` where it
sends them, else that version's by the client's own function,
:func:`pipeline.client.serving.policy_masks`, from the event's query embedding,
``last_step_loss`` and ``last_step_entropy``), then the serving rule's
(:func:`models.offpolicy.logging_policy.recompute`) with that version's α at the event's logged
temperature.

Where an event carries its own ``logprob`` (every event does) or ``candidate_probs`` and they
disagree with the recomputation beyond tolerance, the event is left out of the rule's evidence
(never out of training), counted in ``causalmem_gate_logging_mismatch_total{field}``, logged,
and handed to the gate (:meth:`LoggingPolicies.take_mismatched`), which writes a copy to
``dead-letter`` with reason ``logging_mismatch`` (contract 1.8): the rule must not decide on
propensities that one side or the other has wrong, and the client's operator must be able to
see which events and why. The consumer record is long gone by then, so the copy is the
experience as the learner holds it, without a position.

Which versions are held: the serving version and the ones served before it, at most
:data:`HELD_VERSIONS` (clients move to a new version seconds after it is promoted, so the
events are of the newest few), and the newest :data:`CANARIES_HELD` canaries, apart: the
learner names a new canary with each trial whether or not clients serve canaries, and a run of
them must not push out what clients serve (a client without ``candidate_probs`` would then log
no evidence at all).
An event of a version no longer (or never) held — after a learner restart — keeps what it
carries: with ``candidate_probs`` it is valued on them, without them it is no evidence
(:func:`pipeline.learner.evidence.usable`). So does an event of
version 0 whose fields are not those of a client without a policy (m = 0): ``policy_version``
is optional, and a client may serve a policy without naming its version.
``causalmem_gate_logging_probs_total{source}`` says how many events went which way. Each event
is looked at once (by its id).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from models.offpolicy.logged import LoggedDecisions
from models.offpolicy.logging_policy import disagreement, recompute
from models.policy.network import PolicyNetwork
from pipeline.client.serving import policy_masks
from pipeline.client.subscriber import LoadedPolicy
from pipeline.metrics import Metrics
from topics.internal import Experience
from topics.manifest import Manifest

log = logging.getLogger(__name__)

HELD_VERSIONS = 3  # the serving version and the two served before it (each a full network in memory)
CANARIES_HELD = 2  # the canary and the one before it, whose requests may still be arriving
# the metric's labels; "incumbent": a client's own ranking under an incumbent (contract 1.17), checked
SOURCES = ("client", "recomputed", "version_not_held", "unversioned", "unrecomputable", "incumbent")
MISMATCH = "mismatch"
WARN_EVERY_S = 10.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the gate uses for one event: ``source`` (one of :data:`SOURCES` or ``"mismatch"``)
    and the recomputed probabilities where the event lacks its own."""

    source: str
    probs: np.ndarray | None = None


class LoggingPolicies:
    """The networks of the versions clients may be serving, and the logging probabilities they give.

    ``hold`` is called on the event loop (a version becomes the serving one, or the canary), ``complete``
    in the gate's worker thread: ``hold`` replaces the table of networks, never changes it
    in place, so a judgement reads one consistent table. ``remember``: how many events'
    verdicts are kept (a few batches of evidence), so that each is computed and counted once.
    """

    def __init__(self, metrics: Metrics, *, held: int = HELD_VERSIONS, remember: int = 20_000) -> None:
        self.metrics = metrics
        self.held = held
        self.remember = remember
        self._nets: dict[int, LoadedPolicy] = {}  # what complete() reads: the two tables below, merged
        self._served: dict[int, LoadedPolicy] = {}
        self._canaries: dict[int, LoadedPolicy] = {}
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()
        self._last_warning = -WARN_EVERY_S
        self._unwarned = 0
        # (event, what disagreed) since the last take_mismatched: appended in the gate's worker
        # thread, taken on the event loop after complete() has returned.
        self._mismatched: list[tuple[Experience, str]] = []

    @property
    def versions(self) -> list[int]:
        """The versions held, in version order."""
        return sorted(self._nets)

    def hold(self, manifest: Manifest, net: PolicyNetwork, *, canary: bool = False) -> None:
        """``manifest``'s version is served by clients from now on (``canary``: on the canary's
        share of requests): keep its network, and the most recently held others of its kind."""
        version = manifest.version
        table = self._canaries if canary else self._served
        nets = {v: n for v, n in table.items() if v != version}
        nets[version] = LoadedPolicy(manifest, net)  # as a client holds it
        # The most recently served, not the highest versions: a rollback serves an older one.
        kept = dict(list(nets.items())[-(CANARIES_HELD if canary else self.held) :])
        # A probe over a certified version (contract 1.23) logs most of its requests as drawn by that
        # version: it stays held while the probe is.
        bases = {p.serving.base for p in kept.values() if p.serving is not None and p.serving.base is not None}
        kept = {**{b: nets[b] for b in sorted(bases) if b in nets and b not in kept}, **kept}
        if canary:
            self._canaries = kept
        else:
            self._served = kept
        self._nets = {**self._canaries, **self._served}

    def complete(self, window: Sequence[Experience]) -> list[Experience]:
        """``window`` with each feedback event's logging probabilities: its own where they agree with
        the recomputation, the recomputed ones where it has none, and without the events that disagree."""
        nets = self._nets  # one table for the whole window
        todo: dict[int, list[Experience]] = {}
        for e in window:
            if e.kind == "feedback" and not e.event.fallback and e.id not in self._verdicts:
                todo.setdefault(drew(e, nets), []).append(e)
        for version, exps in todo.items():
            self._judge(version, exps, nets)
        out: list[Experience] = []
        for e in window:
            verdict = self._verdicts.get(e.id)
            if verdict is not None and verdict.source == MISMATCH:
                continue
            if verdict is not None and verdict.probs is not None and e.event.candidate_probs is None:
                e = dataclasses.replace(e, event=dataclasses.replace(e.event, candidate_probs=verdict.probs))
            out.append(e)
        while len(self._verdicts) > self.remember:
            self._verdicts.popitem(last=False)
        return out

    def _judge(self, version: int, exps: list[Experience], nets: dict[int, LoadedPolicy]) -> None:
        """Verdicts for the not yet seen events of one version."""
        count = self.metrics.gate_logging_probs
        # version 0: no policy, m = 0 (contract §6 step 2); a request drawn under a probe's base is
        # judged under the base (drew)
        if version != 0 and version not in nets:
            self._set(exps, Verdict("version_not_held"))
            count.labels(source="version_not_held").inc(len(exps))
            return
        policy = nets.get(version)
        own = [e for e in exps if e.event.incumbent]
        if own:
            self._judge_incumbent(version, own)
            exps = [e for e in exps if not e.event.incumbent]
            if not exps:
                return
        try:
            decisions = LoggedDecisions.from_experiences(exps)
            rec = recompute(decisions, masks_of(policy, exps, decisions.slots.shape), policy.alpha if policy else 0.0)
        except (ValueError, RuntimeError) as exc:  # e.g. a slot beyond that version's network, another dimension
            log.warning("gate: cannot recompute the logging probabilities of v%d: %s", version, exc)
            self._set(exps, Verdict("unrecomputable"))
            count.labels(source="unrecomputable").inc(len(exps))
            return
        for e, probs, logprob in zip(exps, rec.probs, rec.logprob.tolist(), strict=True):
            ev = e.event
            field = disagreement(ev.candidate_probs, ev.logprob, probs, logprob)
            if field is not None and version == 0:
                # policy_version is optional (default 0): a client that serves a policy without
                # naming its version is not a client without a policy. It keeps what it carries.
                self._verdicts[e.id] = Verdict("unversioned")
                count.labels(source="unversioned").inc()
            elif field is not None:
                self._verdicts[e.id] = Verdict(MISMATCH)
                self.metrics.gate_logging_mismatch.labels(field=field).inc()
                self._warn(version, field, ev.logprob, logprob)
                detail = (
                    f"{field} disagrees with the serving rule of v{version} recomputed by the learner "
                    f"(logprob {ev.logprob:.6g} logged, {logprob:.6g} recomputed); left out of the promotion gate"
                )
                self._mismatched.append((e, detail))
            elif ev.candidate_probs is None:
                self._verdicts[e.id] = Verdict("recomputed", probs)
                count.labels(source="recomputed").inc()
            else:
                self._verdicts[e.id] = Verdict("client")
                count.labels(source="client").inc()

    def _judge_incumbent(self, version: int, exps: list[Experience]) -> None:
        """Requests served the client's own first k under an incumbent (contract 1.17): the rule
        values them as plain top-k by score on the share not explored, so the set read must be
        the k candidates of highest score (ties aside). A client whose own ranking orders by
        something else disagrees, and is left out of the rule's evidence as any other."""
        for e in exps:
            ev = e.event
            scores, k = np.asarray(ev.scores, np.float64), len(ev.selected)
            # The decoder checked that the k read are the first k candidates (and k ≥ 1).
            if bool(np.all(scores[:k] >= np.sort(scores)[-k])):
                self._verdicts[e.id] = Verdict("incumbent")
                self.metrics.gate_logging_probs.labels(source="incumbent").inc()
                continue
            self._verdicts[e.id] = Verdict(MISMATCH)
            self.metrics.gate_logging_mismatch.labels(field="selected").inc()
            self._warn(version, "selected", ev.logprob, math.nan)
            detail = (
                f"an incumbent request of v{version} read {k} memories that are not the {k} of highest score: "
                "its own ranking is not plain top-k; left out of the promotion gate"
            )
            self._mismatched.append((e, detail))

    def take_mismatched(self) -> list[tuple[Experience, str]]:
        """The events found to disagree since the last call, each once, with what disagreed."""
        out, self._mismatched = self._mismatched, []
        return out

    def _set(self, exps: list[Experience], verdict: Verdict) -> None:
        for e in exps:
            self._verdicts[e.id] = verdict

    def _warn(self, version: int, field: str, logged: float, recomputed: float) -> None:
        """A rate-limited warning (a misconfigured client disagrees on every event)."""
        now = time.monotonic()
        if now - self._last_warning < WARN_EVERY_S:
            self._unwarned += 1
            return
        more = f" (+{self._unwarned} more since)" if self._unwarned else ""
        log.warning(
            "gate: logging_mismatch: an event of v%d disagrees with the serving rule recomputed by the learner "
            "on %s (logprob %.6g logged, %.6g recomputed); left out of the promotion gate%s",
            version,
            field,
            logged,
            recomputed,
            more,
        )
        self._last_warning, self._unwarned = now, 0


def drew(e: Experience, nets: dict[int, LoadedPolicy]) -> int:
    """The version whose weights drew ``e``: its ``policy_version``, or, for a request drawn under
    the certified version a probe names (contract 1.23, ``base``), that version (−1: not known
    here, so not recomputable)."""
    version = e.event.policy_version
    if not e.event.base:
        return version
    policy = nets.get(version)
    base = policy.serving.base if policy is not None and policy.serving is not None else None
    return base if base is not None else -1


def masks_of(policy: LoadedPolicy | None, exps: list[Experience], shape: tuple[int, ...]) -> np.ndarray:
    """[N, C] masks of each event's candidates: the event's own ``candidate_masks`` where it sends
    them (what its draw used: by id, a memory its version held no row for has the neutral mask
    there, which the learner's slot for it need not give), else computed under ``policy`` (None:
    no policy, m = 0) one query at a time as the client computes them, the client's bit for bit.

    Raises ``ValueError`` when a candidate slot is outside the policy's network.
    """
    out = np.zeros(shape, np.float64)
    for i, e in enumerate(exps):
        ev = e.event
        cands = np.asarray(ev.candidates, np.int64)
        if ev.candidate_masks is not None and len(ev.candidate_masks) == len(cands):
            out[i, : len(cands)] = ev.candidate_masks
            continue
        if policy is None:
            continue
        slots = policy.net.arch.slots
        if len(cands) and int(cands.max()) >= slots:
            raise ValueError(f"candidate slot {int(cands.max())} is outside v{policy.version}'s {slots} slots")
        f = ev.features
        out[i, : len(cands)] = policy_masks(policy, f.query_embedding, f.last_step_loss, f.last_step_entropy, cands)
    return out
