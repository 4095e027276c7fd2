"""Commands on the ``control`` topic: drift reset, rollback, shadow mode's cut-over and "do not
use" (``suppress``) (docs/operations.md).

Commands apply between micro-batches, in offset order with the experiences. The codec
(``topics.internal.decode_control``) checks each command's ``details``; a message it
rejects, or a command that still cannot be carried out, goes to ``dead-letter`` with its
reason and its offset is passed: a bad command never stops training (docs/architecture.md,
"Failure model").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from models.policy import Arch
from models.trainer import PolicyTrainer
from pipeline.config import LearnerConfig
from pipeline.deadletter import DeadLetterWriter
from pipeline.learner.gate import PromotionGate
from pipeline.learner.inbox import Inbox
from pipeline.learner.memories import MemoryBank
from pipeline.learner.publishing import Progress
from pipeline.learner.replay import Replay
from pipeline.learner.restore import find_version
from pipeline.learner.store import LocalStore
from pipeline.metrics import Metrics
from topics.fields import Rejected
from topics.internal import CUTOVER_COMMAND, SUPPRESS_COMMAND, decode_control
from topics.manifest import Manifest

log = logging.getLogger(__name__)


class ControlCommands:
    """The learner's command handling (a part of :class:`pipeline.learner.loop.Learner`)."""

    config: LearnerConfig
    bootstrap: str
    metrics: Metrics
    trainer: PolicyTrainer
    arch: Arch
    store: LocalStore
    inbox: Inbox
    replay: Replay
    progress: Progress
    version: int
    dirty: bool
    memories: MemoryBank | None
    _dead: DeadLetterWriter | None

    if TYPE_CHECKING:  # what the learner provides (declared for the type checker only)

        @property
        def gate(self) -> PromotionGate | None: ...

        async def _apply_pending(self, force: bool = False) -> None: ...

        async def publish(self, reason: str, extra: dict[str, Any] | None = None) -> Manifest | None: ...

    async def _handle_control(self, msg: Any) -> None:
        try:
            ctl = decode_control(msg.value, self.config.connection.limits)
        except Rejected as rej:
            assert self._dead is not None
            self._dead.send(msg, rej.reason, rej.detail)
            return
        if ctl.id and self.inbox.seen_before(ctl.id):
            return
        if ctl.id:
            self.inbox.mark_seen(ctl.id)
        try:
            if ctl.command == "reset":
                await self.reset(ctl.reason, ctl.details)
            elif ctl.command == "rollback":
                await self.rollback(int(ctl.details["to_version"]), ctl.reason)
            elif ctl.command == CUTOVER_COMMAND:
                await self.cutover(ctl.reason, ctl.details)
            elif ctl.command == SUPPRESS_COMMAND:
                await self.suppress([int(s) for s in ctl.details["slots"]], ctl.reason)
        except (ValueError, TypeError, KeyError) as exc:
            # The codec checks details; a command it let through and that still cannot be
            # carried out is dead-lettered, and its offset passed like any other.
            log.error("learner: control command %s at offset %d failed: %r", ctl.command, msg.offset, exc)
            assert self._dead is not None
            self._dead.send(msg, "inconsistent", f"{ctl.command} failed: {exc!r}")

    async def cutover(self, reason: str, details: dict[str, Any]) -> None:
        """Shadow mode's switch to the policy (docs/byo-retriever.md): a checkpoint of reason ``cutover``.

        With the gate on, it serves the version whose gain was estimated (``serving_version``),
        never weights the gate has not judged; without it every checkpoint serves anyway, so the
        current weights go out.
        """
        await self._apply_pending(force=True)
        version = details.get("serving_version")
        if self.gate is not None and isinstance(version, int):
            conn = self.config.connection
            tensors = await find_version(self.bootstrap, conn, self.store, self.arch, version, self.config.signing_key)
            if tensors is not None:
                self.trainer.load(tensors, self.trainer.baseline.state())
                self._rows_of(version)
        self.dirty = True
        await self.publish(CUTOVER_COMMAND, extra={"cutover_reason": reason, "cutover": details})

    async def suppress(self, slots: list[int], reason: str = "") -> None:
        """A labeler's "do not use": pin these memories' masks near 0 and serve that at once.

        The set is kept in the checkpoints' metrics and applied again after a drift reset,
        which re-initialises the last layer.
        """
        await self._apply_pending(force=True)
        self.progress.suppressed = sorted(set(self.progress.suppressed) | set(slots))
        self.trainer.net.suppress(slots)
        self.dirty = True
        now = sorted(set(slots))
        await self.publish(SUPPRESS_COMMAND, extra={"suppress_reason": reason, "suppressed_now": now})
        log.warning("learner: memories %s suppressed (%s), now serving as v%d", now, reason, self.version)

    def _rows_of(self, version: int) -> None:
        """The trainer now holds the weights of ``version``: memories given a slot later get fresh rows."""
        if self.memories is not None:
            self.memories.rows_from(version, self.trainer)

    async def rollback(self, version: int, reason: str = "") -> bool:
        """Serve (and continue from) an earlier checkpoint, republished under a new version.

        The weights come from the model topic when its chunks are still there, else from
        the local directory (which keeps more versions than the topic). Training goes on
        from them with a fresh optimizer: the policy that was rolled back is abandoned.
        """
        conn = self.config.connection
        tensors = await find_version(self.bootstrap, conn, self.store, self.arch, version, self.config.signing_key)
        if tensors is None:
            log.error(
                "learner: rollback to v%d impossible: neither the model topic nor %s has it", version, self.store.root
            )
            return False
        await self._apply_pending(force=True)
        self.trainer.load(tensors, self.trainer.baseline.state())
        self._rows_of(version)
        self.dirty = True
        await self.publish("rollback", extra={"rolled_back_to": version, "rollback_reason": reason})
        log.warning("learner: rolled back to the weights of v%d, now serving as v%d", version, self.version)
        return True

    async def reset(self, reason: str = "", details: dict[str, Any] | None = None) -> None:
        """Drift reset: a re-initialised policy (``reset_scope``), warm-up on the kept experiences, publish ``reset``.

        The warm-up uses the kept experiences from the detector's estimate of when the
        drift began (``since_ts``) on: what came before teaches the world that changed.
        """
        since = (details or {}).get("since_ts")
        warm = self.replay.after_drift(float(since) if since is not None else None)
        t0 = time.perf_counter()
        # Off the event loop: a warm-up over a full replay takes seconds, longer than the
        # group's session timeout, and a blocked loop would lose the election mid-publish.
        stats = await asyncio.to_thread(
            self.trainer.reset,
            warm,
            epochs=self.config.warmup_epochs,
            batch_size=self.config.batch_size,
            half_life_s=self.config.warmup_half_life_s,
        )
        if self.progress.suppressed:  # the fresh last layer must not bring them back
            self.trainer.net.suppress(self.progress.suppressed)
        self.progress.resets += 1
        self.metrics.resets.inc()
        log.warning(
            "learner: drift reset (%s): policy re-initialised, warmed up on %d experiences in %.1f s",
            reason or "requested",
            len(warm),
            time.perf_counter() - t0,
        )
        self.dirty = True
        await self.publish("reset", extra={"warmup_experiences": stats.applied, "reset_details": details or {}})
