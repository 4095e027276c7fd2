"""``causalmem suppress`` / ``causalmem unsuppress``: an operator's "do not use" for memories, and its undo.

The verb asks the learner over ``control`` (which only operators, and the worker's drift stage,
may write: docs/operations.md, "Security") to pin the memories' masks near 0, or to give them
neutral rows again, and to serve that at once (a checkpoint of reason ``suppress``, past the
promotion gate). It checks the learner's rules first (:func:`pipeline.learner.suppression.decide`,
against the newest checkpoint's set and audit trail) and refuses before sending a command over
``suppress_max_slots`` (exit 2) or beyond ``suppress_checkpoints_per_hour`` (exit 1; an
``unsuppress`` is never limited). It then reports the learner's answer
(:mod:`pipeline.cli.answers`): the checkpoint that carries the command, or the refusal and why
(e.g. ``out_of_range``: a slot outside the learner's policy), exiting 1 then.

Labelers' "do not use" marks are proposals: ``causalmem status`` lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Sequence

from pipeline import kafka
from pipeline.cli.answers import add_command_options, asker, carries, send_and_wait, silent
from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.config import Connection, Settings
from pipeline.learner.suppression import decide, read_audit
from pipeline.modeltopic import scan_model_topic
from topics.internal import SUPPRESS_COMMAND, Control
from topics.manifest import Manifest
from topics.signing import Key


def add_options(p: argparse.ArgumentParser) -> None:
    # Not ``dest="slots"``: that is the setting S (Settings.slots), which settings_from() reads from the
    # namespace; the memories a command names are another thing and must not overwrite it.
    p.add_argument(
        "--slots",
        dest="memory_slots",
        metavar="SLOT",
        type=int,
        nargs="+",
        required=True,
        help="the memories (slots); at most suppress_max_slots",
    )
    add_command_options(p)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    conn = settings.connection()
    by = asker(conn, args.by, args.verb)
    if by is None:
        return 2
    bootstrap = resolve_bootstrap(settings)
    return asyncio.run(
        change_suppression(
            bootstrap,
            conn,
            args.verb,
            args.memory_slots,
            by=by,
            reason=args.reason,
            timeout=args.timeout,
            max_slots=settings.suppress_max_slots,
            per_hour=settings.suppress_checkpoints_per_hour,
            key=settings.operator_key(),
        )
    )


async def change_suppression(
    bootstrap: str,
    conn: Connection | Settings,
    command: str,
    slots: Sequence[int],
    *,
    by: str,
    reason: str,
    timeout: float,
    max_slots: int,
    per_hour: int,
    key: Key | None = None,
) -> int:
    """Send one ``suppress`` / ``unsuppress`` command and report the learner's answer; returns the exit
    status (0 done or nothing to change, 1 refused or no answer, 2 bad request)."""
    conn = Connection.of(conn)
    wanted = sorted({int(s) for s in slots})
    if len(wanted) > max_slots:
        print(f"{command} refused: {len(wanted)} memories, at most {max_slots} per command (suppress_max_slots)")
        return 2
    await kafka.wait_for_broker(bootstrap, conn)
    index = await scan_model_topic(bootstrap, conn)
    newest = index.newest(conn.policy)
    if newest is None:
        print(f"no checkpoint of policy {conn.policy!r} on the model topic: is a learner running?")
        return 1
    suppressed = [int(s) for s in newest.metrics.get("suppressed") or []]
    audit = read_audit(newest.metrics.get("suppression_audit"))
    pre = decide(command, wanted, suppressed, audit, time.time(), max_slots=max_slots, per_hour=per_hour)
    if pre.verdict == "refused":
        print(f"{command} refused: {pre.reason} (suppress_checkpoints_per_hour)")
        return 1
    if pre.verdict == "unchanged":
        print(f"{command} {wanted}: nothing to change (suppressed now: {suppressed or 'none'})")
        return 0
    ctl = Control(
        command=command,
        ts=time.time(),
        reason=reason,
        id=f"{command}-{uuid.uuid4().hex}",
        details={"slots": wanted, "by": by},
    )

    def reached(m: Manifest) -> bool:
        # Another command made the change first: ours then changes nothing and forces no checkpoint.
        now = set(m.metrics.get("suppressed") or [])
        return set(wanted) <= now if command == SUPPRESS_COMMAND else not set(wanted) & now

    print(f"{command} {list(pre.changed)} sent by {by!r}; waiting for the learner's answer")
    answer = await send_and_wait(
        bootstrap, conn, ctl, index, lambda m: carries(m, "suppression", ctl.id) or reached(m), timeout, key
    )
    if answer.manifest is not None:
        m = answer.manifest
        how = "serving" if carries(m, "suppression", ctl.id) else "another command did it first; serving"
        print(f"{how} v{m.version}: suppressed now {m.metrics.get('suppressed') or 'none'}")
        return 0
    if answer.refusal is not None:
        print(f"{command} refused by the learner: {answer.refusal.reason}: {answer.refusal.detail}")
        return 1
    print(silent(command, timeout, conn.policy))
    return 1
