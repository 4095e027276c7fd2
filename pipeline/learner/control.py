"""Commands on the ``control`` topic: drift reset, rollback, shadow mode's cut-over, an
operator's "do not use" (``suppress``, undone by ``unsuppress``) and "do not learn from" for a
principal (``quarantine``, undone by ``unquarantine``; contract 1.15) (docs/operations.md).

Commands apply between micro-batches, in offset order with the experiences. The codec
(``topics.internal.decode_control``) checks each command's ``details``; a message it
rejects, or a command that still cannot be carried out, goes to ``dead-letter`` with its
reason and its offset is passed: a bad command never stops training (docs/architecture.md,
"Failure model"). Every command that forces a checkpoint past the promotion gate is bounded
(:mod:`pipeline.learner.suppression`): a rollback, reset or cut-over beyond
``control_checkpoints_per_hour`` is refused (``rate_limited``), and so is a rollback to a
version the learner no longer keeps (``out_of_range``); the operator's verb reads that answer
from ``dead-letter`` by the command's ``id``, or the checkpoint that carries the id.

:class:`ControlHandler` carries the commands out for the learner
(:class:`pipeline.learner.loop.Learner`), which builds it and hands it what the commands
read and change: the trainer, the memory bank, the replay, the checkpoints' counters, and
callables for the rest (apply the experiences read before a command, find a version's
weights, publish the changed policy, dead-letter a message). It never imports the loop.
Which weights a cut-over serves, and whether a command is carried out at all, are pure
decisions (:func:`cutover_version`; :func:`~pipeline.learner.suppression.decide` and
:func:`~pipeline.learner.suppression.decide_command`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from models.policy.trainer import PolicyTrainer
from pipeline.config import LearnerConfig
from pipeline.learner.inbox import Inbox
from pipeline.learner.memories import MemoryBank
from pipeline.learner.principals import PrincipalBook
from pipeline.learner.publishing import Progress
from pipeline.learner.replay import Replay
from pipeline.learner.suppression import (
    AUDIT_KEEP,
    RATE_WINDOW_S,
    audit_entry,
    command_entry,
    decide,
    decide_command,
    read_commands,
)
from pipeline.metrics import Metrics
from topics.fields import Rejected
from topics.internal import (
    CUTOVER_COMMAND,
    QUARANTINE_COMMAND,
    SUPPRESS_COMMAND,
    UNQUARANTINE_COMMAND,
    UNSUPPRESS_COMMAND,
    Control,
    decode_control,
)
from topics.principal import Keyring

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
MAX_QUARANTINED = 256  # principals quarantined at once (contract 1.15); the set travels in every checkpoint


def cutover_version(details: dict[str, Any], gated: bool) -> int | None:
    """The version whose weights a cut-over serves; None: the current weights.

    With the promotion gate on, the cut-over serves the version whose gain shadow mode
    estimated (``details["serving_version"]``), never weights the gate has not judged;
    without the gate every checkpoint serves anyway, so the current weights go out.

    >>> cutover_version({"serving_version": 7}, gated=True), cutover_version({"serving_version": 7}, gated=False)
    (7, None)
    >>> cutover_version({"serving_version": None}, gated=True) is None  # no estimate named a version
    True
    """
    version = details.get("serving_version")
    return version if gated and isinstance(version, int) else None


class ControlHandler:
    """The learner's command handling: :meth:`handle` one ``control`` message.

    Parameters
    ----------
    config
        The learner's configuration (limits, warm-up, whether the promotion gate is on).
    trainer
        The policy the commands change (the learner's own trainer, shared).
    memories
        The memory bank: memories given a slot after a loaded version get fresh rows.
    replay
        The kept experiences a drift reset warms up on.
    progress
        The counters checkpoints carry (resets, the suppressed memories).
    inbox
        Where command ids are remembered, so that a command delivered twice applies once.
    metrics
        The learner's metrics (``resets``, ``suppressions``).
    apply_pending
        Applies every experience read before the command (commands apply between batches).
    find_version
        A version's weights, from the model topic or else the local directory; None when neither has it.
    local_dir
        The local checkpoint directory (named when a rollback finds no weights).
    publish_change
        Marks the policy changed and publishes a checkpoint of that reason at once, with
        these extra manifest metrics; returns the version published.
    dead_letter
        Sends a message to ``dead-letter`` with a reason and a detail.
    clock
        The learner's clock (seconds since the epoch): the audit's times and the rate limits.
    principals
        The learner's book of principals: a drift reset's warm-up weighs each principal's
        experiences by its capped share of them (None: by age only).
    """

    def __init__(
        self,
        config: LearnerConfig,
        *,
        trainer: PolicyTrainer,
        memories: MemoryBank,
        replay: Replay,
        progress: Progress,
        inbox: Inbox,
        metrics: Metrics,
        apply_pending: Callable[[], Awaitable[None]],
        find_version: Callable[[int], Awaitable[Tensors | None]],
        local_dir: Path,
        publish_change: Callable[[str, dict[str, Any]], Awaitable[int]],
        dead_letter: Callable[[Any, str, str], None],
        clock: Callable[[], float] = time.time,
        principals: PrincipalBook | None = None,
    ) -> None:
        self.config = config
        self.trainer = trainer
        self.memories = memories
        self.replay = replay
        self.progress = progress
        self.inbox = inbox
        self.metrics = metrics
        self.apply_pending = apply_pending
        self.find_version = find_version
        self.local_dir = local_dir
        self.publish_change = publish_change
        self.dead_letter = dead_letter
        self.clock = clock
        self.principals = principals
        # Contract 1.16: the operators whose signatures prove ``by`` (None: ``by`` is a claim).
        self.operators = Keyring.load(config.operator_keys, "operator_keys") if config.operator_keys else None
        # The rollbacks, resets and cut-overs carried out in the last hour (their audit entries,
        # which their checkpoints carry as ``control``): what control_checkpoints_per_hour counts.
        self.recent: list[dict[str, Any]] = []

    def recall(self, metrics: Iterable[Any], now: float | None = None) -> None:
        """After a restore: the commands the model topic's checkpoints carry (each manifest's
        ``metrics``) count against the hourly limit as if this learner had carried them out."""
        now = self.clock() if now is None else now
        known = {(e["command"], e["id"], e["ts"]) for e in self.recent}
        found = [e for e in read_commands(metrics) if (e["command"], e["id"], e["ts"]) not in known]
        self.recent = sorted([*self.recent, *found], key=lambda e: float(e["ts"]))
        self.recent = [e for e in self.recent if now - RATE_WINDOW_S < float(e["ts"])]

    async def handle(self, msg: Any) -> None:
        """Carry out the command in ``msg`` (a consumer record), or dead-letter it."""
        try:
            ctl = decode_control(msg.value, self.config.connection.limits)
            verified = self.proven(ctl, msg)
        except Rejected as rej:
            self.dead_letter(msg, rej.reason, rej.detail)
            return
        if ctl.id and self.inbox.seen_before(ctl.id):
            return
        if ctl.id:
            self.inbox.mark_seen(ctl.id)
        try:
            if ctl.command in (SUPPRESS_COMMAND, UNSUPPRESS_COMMAND):
                await self.change_suppression(ctl, msg, verified)
            elif ctl.command in (QUARANTINE_COMMAND, UNQUARANTINE_COMMAND):
                await self.change_quarantine(ctl, msg, verified)
            else:
                await self.bypass_gate(ctl, msg, verified)
        except (ValueError, TypeError, KeyError) as exc:
            # The codec checks details; a command it let through and that still cannot be
            # carried out is dead-lettered, and its offset passed like any other.
            log.error("learner: control command %s at offset %d failed: %r", ctl.command, msg.offset, exc)
            self.dead_letter(msg, "inconsistent", f"{ctl.command} failed: {exc!r}")

    def proven(self, ctl: Control, msg: Any) -> bool:
        """Whether the command's ``by`` is proven by its record ``msg`` (contract 1.16). With
        ``operator_keys``, an operator's command (every one but the worker's drift ``reset``)
        must carry the signature of a keyed operator named in ``by``; otherwise
        :class:`~topics.fields.Rejected` (``bad_signature``). Without them, nothing is proven
        and nothing is refused."""
        if self.operators is None:
            return False
        by = str(ctl.details.get("by") or "") or None
        if self.operators.proven(by, msg.value, msg.headers) is not None:
            return True
        if ctl.command == "reset":
            return False  # the worker's drift stage asks without a key: capped like any reset
        raise Rejected(
            "bad_signature",
            f"{ctl.command} by {by!r}: an operator's command must be signed with a key in operator_keys",
        )

    async def bypass_gate(self, ctl: Control, msg: Any = None, verified: bool = False) -> bool:
        """A ``rollback``, ``reset`` or ``cutover`` command: carried out (True) when
        :func:`~pipeline.learner.suppression.decide_command` allows it, else refused and dead-lettered
        (``msg`` being the control record) with nothing applied; a rollback to a version the learner no
        longer keeps is refused too (``out_of_range``). The checkpoint it forces carries its audit entry
        (``control``: the command, who the sender says asked, when, why and the command's id)."""
        now = self.clock()
        by = str(ctl.details.get("by") or "")
        decision = decide_command(ctl.command, self.recent, now, per_hour=self.config.control_checkpoints_per_hour)
        if decision.verdict == "refused":
            log.error("learner: %s by %r (as the sender claims): %s", ctl.command, by, decision.detail)
            if msg is not None:
                self.dead_letter(msg, decision.reason, decision.detail)
            return False
        entry = command_entry(ctl.command, by, ctl.reason, ctl.id, now, verified)
        if ctl.command == "reset":
            await self.reset(ctl.reason, ctl.details, entry=entry)
        elif ctl.command == CUTOVER_COMMAND:
            await self.cutover(ctl.reason, ctl.details, entry=entry)
        else:
            version = int(ctl.details["to_version"])
            if not await self.rollback(version, ctl.reason, entry=entry):
                if msg is not None:
                    why = (
                        f"rollback to v{version} refused: neither the model topic nor the learner's local directory "
                        f"({self.local_dir}) keeps v{version}; causalmem rollback --list shows the versions kept"
                    )
                    self.dead_letter(msg, "out_of_range", why)
                return False
        self.recent = [e for e in self.recent if now - RATE_WINDOW_S < float(e["ts"])] + [entry]
        return True

    async def cutover(self, reason: str, details: dict[str, Any], entry: dict[str, Any] | None = None) -> None:
        """Shadow mode's switch to the policy (docs/byo-retriever.md): a checkpoint of reason ``cutover``.

        It serves the weights :func:`cutover_version` names, when they are found, else the current ones.
        ``entry``: the command's audit entry, carried in the checkpoint's metrics (``control``).
        """
        await self.apply_pending()
        version = cutover_version(details, gated=self.config.gate is not None)
        if version is not None:
            tensors = await self.find_version(version)
            if tensors is not None:
                self.trainer.load(tensors, self.trainer.baseline.state())
                self.memories.rows_from(version, self.trainer)
                self._keep_suppressed()
        await self.publish_change(CUTOVER_COMMAND, {"cutover_reason": reason, "cutover": details, **_carried(entry)})

    async def change_suppression(self, ctl: Control, msg: Any = None, verified: bool = False) -> str:
        """An operator's ``suppress`` (pin the memories' masks near 0) or ``unsuppress`` (neutral
        rows again), served at once in a checkpoint of reason ``suppress``; returns the verdict.

        :func:`pipeline.learner.suppression.decide` rules: a command over ``suppress_max_slots``
        or beyond ``suppress_checkpoints_per_hour`` is refused (dead-lettered with its reason,
        ``msg`` being the control record) and changes nothing; one that changes nothing forces
        no checkpoint. The set and the audit trail (who, when, which slots, why) are kept in the
        checkpoints' metrics; the set is applied again after a drift reset, a rollback or a
        cut-over, which load other weights.
        """
        now = self.clock()
        by = str(ctl.details.get("by") or "")
        decision = decide(
            ctl.command,
            [int(s) for s in ctl.details["slots"]],
            self.progress.suppressed,
            self.progress.suppression_audit,
            now,
            max_slots=self.config.suppress_max_slots,
            per_hour=self.config.suppress_checkpoints_per_hour,
        )
        self.metrics.suppressions.labels(command=ctl.command, verdict=decision.verdict).inc()
        if decision.verdict == "refused":
            log.error(
                "learner: %s %s by %r (as the sender claims) refused: %s",
                ctl.command,
                ctl.details["slots"],
                by,
                decision.reason,
            )
            if msg is not None:
                self.dead_letter(msg, decision.reason.split(":")[0], f"{ctl.command} by {by!r}: {decision.reason}")
            return decision.verdict
        if decision.verdict == "unchanged":
            log.info("learner: %s %s by %r changes nothing", ctl.command, ctl.details["slots"], by)
            return decision.verdict
        await self.apply_pending()
        changed = list(decision.changed)
        if ctl.command == SUPPRESS_COMMAND:
            self.trainer.net.suppress(changed)
        else:
            self.trainer.unsuppress(changed)
        self.progress.suppressed = list(decision.suppressed)
        entry = audit_entry(ctl.command, changed, by, ctl.reason, ctl.id, now, verified)
        self.progress.suppression_audit = [*self.progress.suppression_audit, entry][-AUDIT_KEEP:]
        version = await self.publish_change(SUPPRESS_COMMAND, {"suppression": entry})
        log.warning(
            "learner: %s of memories %s by %r (as the sender claims) (%s), now serving as v%d; suppressed: %s",
            ctl.command,
            changed,
            by,
            ctl.reason,
            version,
            self.progress.suppressed,
        )
        return decision.verdict

    async def change_quarantine(self, ctl: Control, msg: Any = None, verified: bool = False) -> str:
        """An operator's ``quarantine`` (the principal's experiences weigh 0 from now on: left out of
        the updates, the gate's evidence and the replay) or ``unquarantine`` (full weight again, within
        ``influence_cap``); returns the verdict: ``apply``, ``unchanged`` or ``refused``.

        The set is kept in the checkpoints' metrics (``quarantined``); the change is answered by a
        checkpoint (reason ``periodic``: the weights are as trained, and pass the gate as usual)
        whose metrics carry its audit entry (``quarantine``: the command, the principal, who the
        sender says asked, when, why, the command's id). More than :data:`MAX_QUARANTINED`
        principals at once is refused (``out_of_range``); a change that changes nothing forces no
        checkpoint.
        """
        now = self.clock()
        by = str(ctl.details.get("by") or "")
        name = str(ctl.details["principal"])
        now_set = list(self.progress.quarantined)
        if ctl.command == QUARANTINE_COMMAND:
            after = now_set if name in now_set else [*now_set, name]
        else:
            after = [p for p in now_set if p != name]
        if after == now_set:
            self.metrics.quarantines.labels(command=ctl.command, verdict="unchanged").inc()
            log.info("learner: %s %r by %r changes nothing (quarantined: %s)", ctl.command, name, by, now_set)
            return "unchanged"
        if len(after) > MAX_QUARANTINED:
            self.metrics.quarantines.labels(command=ctl.command, verdict="refused").inc()
            detail = (
                f"{ctl.command} {name!r} by {by!r}: {len(now_set)} principals quarantined, at most {MAX_QUARANTINED}"
            )
            log.error("learner: %s", detail)
            if msg is not None:
                self.dead_letter(msg, "out_of_range", detail)
            return "refused"
        await self.apply_pending()  # what was read before the command is weighed as before it
        self.progress.quarantined = after
        self.metrics.quarantines.labels(command=ctl.command, verdict="apply").inc()
        entry = {
            "command": ctl.command,
            "principal": name,
            "by": by,
            "by_verified": verified,  # contract 1.16: proven by an operator's signature (operator_keys)
            "ts": now,
            "reason": ctl.reason,
            "id": ctl.id,
        }
        version = await self.publish_change("periodic", {"quarantine": entry})
        log.warning(
            "learner: %s of principal %r by %r (as the sender claims) (%s), in v%d; quarantined: %s",
            ctl.command,
            name,
            by,
            ctl.reason,
            version,
            after,
        )
        return "apply"

    def forget_removed(self) -> None:
        """Memories removed from the store leave the suppressed set: their slots may go to other
        memories, which a later rollback, reset or cut-over must not suppress in their place."""
        gone = set(self.memories.take_removed())
        kept = [s for s in self.progress.suppressed if s not in gone]
        if len(kept) != len(self.progress.suppressed):
            released = sorted(set(self.progress.suppressed) - set(kept))
            log.info("learner: suppressed memories at slots %s were removed; no longer suppressed", released)
            self.progress.suppressed = kept

    def _keep_suppressed(self) -> None:
        """Other weights were loaded: the memories operators suppressed stay suppressed."""
        if self.progress.suppressed:
            self.trainer.net.suppress(self.progress.suppressed)

    async def rollback(self, version: int, reason: str = "", entry: dict[str, Any] | None = None) -> bool:
        """Serve (and continue from) an earlier checkpoint, republished under a new version.

        The weights come from the model topic when its chunks are still there, else from
        the local directory (which keeps more versions than the topic). Training goes on
        from them with a fresh optimizer: the policy that was rolled back is abandoned.
        Memories given a slot after ``version`` get fresh rows (they would otherwise serve
        the rows of the slot's earlier owner). ``entry``: the command's audit entry, carried in
        the checkpoint's metrics (``control``).
        """
        tensors = await self.find_version(version)
        if tensors is None:
            log.error(
                "learner: rollback to v%d impossible: neither the model topic nor %s has it", version, self.local_dir
            )
            return False
        await self.apply_pending()
        self.trainer.load(tensors, self.trainer.baseline.state())
        self.memories.rows_from(version, self.trainer)
        self._keep_suppressed()
        extra = {"rolled_back_to": version, "rollback_reason": reason, **_carried(entry)}
        published = await self.publish_change("rollback", extra)
        log.warning(
            "learner: rolled back to the weights of v%d, now serving as v%d%s", version, published, _asked_by(entry)
        )
        return True

    async def reset(
        self, reason: str = "", details: dict[str, Any] | None = None, entry: dict[str, Any] | None = None
    ) -> None:
        """Drift reset: a re-initialised policy (``reset_scope``), warm-up on the kept experiences, publish ``reset``.

        The warm-up uses the kept experiences from the detector's estimate of when the
        drift began (``since_ts``) on: what came before teaches the world that changed.
        ``entry``: the command's audit entry, carried in the checkpoint's metrics (``control``).
        """
        since = (details or {}).get("since_ts")
        warm = self.replay.after_drift(float(since) if since is not None else None)
        # Contract 1.15: no principal carries more than its bound of the warm-up, a quarantined one none.
        weights = None if self.principals is None else self.principals.warm_up_weights(warm, self.progress.quarantined)
        t0 = time.perf_counter()
        # Off the event loop: a warm-up over a full replay takes seconds, longer than the
        # group's session timeout, and a blocked loop would lose the election mid-publish.
        stats = await asyncio.to_thread(
            self.trainer.reset,
            warm,
            epochs=self.config.warmup_epochs,
            batch_size=self.config.batch_size,
            half_life_s=self.config.warmup_half_life_s,
            sample_weights=weights,
        )
        self._keep_suppressed()  # the fresh last layer must not bring them back
        self.progress.resets += 1
        self.metrics.resets.inc()
        log.warning(
            "learner: drift reset (%s): policy re-initialised, warmed up on %d experiences in %.1f s%s",
            reason or "requested",
            len(warm),
            time.perf_counter() - t0,
            _asked_by(entry),
        )
        extra = {"warmup_experiences": stats.applied, "reset_details": details or {}, **_carried(entry)}
        await self.publish_change("reset", extra)


def _carried(entry: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest metrics that carry a command's audit entry (none without one)."""
    return {"control": entry} if entry is not None else {}


def _asked_by(entry: dict[str, Any] | None) -> str:
    """For the log: who the sender says asked (never verified: docs/operations.md, "Security")."""
    if entry is None:
        return ""
    return f"; asked by {entry['by']!r} (as the sender claims), command {entry['id'] or '(no id)'}"
