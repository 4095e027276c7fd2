"""``causalmem quarantine`` / ``causalmem unquarantine``: an operator's "do not learn from" for a
principal (contract 1.15), and its undo.

The verb asks the learner over ``control`` (which only operators may write: docs/operations.md,
"Security") to give the principal's experiences weight 0 from now on (left out of the updates,
the promotion gate's evidence and the replay), or full weight again (within ``influence_cap``).
``causalmem status`` shows which principals are flagged, that is whose utilities disagree with the
others' (docs/learning.md, "Influence per principal"); the learner holds a flagged one at weight
0 only while it disagrees, a quarantined one whatever it reports. The verb checks the newest checkpoint's set
first (nothing to change: exit 0, nothing sent), then reports the learner's answer
(:mod:`pipeline.cli.answers`): the checkpoint that carries the command, or the refusal and why,
exiting 1 then.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from pipeline import kafka
from pipeline.cli.answers import add_command_options, asker, carries, send_and_wait, silent
from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.config import Connection, Settings
from pipeline.modeltopic import scan_model_topic
from topics.fields import Rejected
from topics.internal import QUARANTINE_COMMAND, Control
from topics.manifest import Manifest
from topics.principal import check_principal
from topics.signing import Key


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--principal", required=True, help="the principal, as its events and feedback name it")
    add_command_options(p, recorded_in="the audit entry")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    conn = settings.connection()
    try:
        check_principal(args.principal)
    except Rejected as rej:
        print(f"causalmem {args.verb}: --principal: {rej.detail}", file=sys.stderr)
        return 2
    by = asker(conn, args.by, args.verb)
    if by is None:
        return 2
    bootstrap = resolve_bootstrap(settings)
    return asyncio.run(
        change_quarantine(
            bootstrap,
            conn,
            args.verb,
            args.principal,
            by=by,
            reason=args.reason,
            timeout=args.timeout,
            key=settings.operator_key(),
        )
    )


async def change_quarantine(
    bootstrap: str,
    conn: Connection | Settings,
    command: str,
    principal: str,
    *,
    by: str,
    reason: str,
    timeout: float,
    key: Key | None = None,
) -> int:
    """Send one ``quarantine`` / ``unquarantine`` command and report the learner's answer; returns the exit
    status (0 done or nothing to change, 1 refused or no answer)."""
    conn = Connection.of(conn)
    await kafka.wait_for_broker(bootstrap, conn)
    index = await scan_model_topic(bootstrap, conn)
    newest = index.newest(conn.policy)
    if newest is None:
        print(f"no checkpoint of policy {conn.policy!r} on the model topic: is a learner running?")
        return 1
    quarantined = [str(p) for p in newest.metrics.get("quarantined") or []]
    wanted = command == QUARANTINE_COMMAND
    if (principal in quarantined) == wanted:
        print(f"{command} {principal!r}: nothing to change (quarantined now: {', '.join(quarantined) or 'none'})")
        return 0
    ctl = Control(
        command=command,
        ts=time.time(),
        reason=reason,
        id=f"{command}-{uuid.uuid4().hex}",
        details={"principal": principal, "by": by},
    )

    def reached(m: Manifest) -> bool:
        # Another command made the change first: ours then changes nothing and forces no checkpoint.
        return (principal in (m.metrics.get("quarantined") or [])) == wanted

    print(f"{command} {principal!r} sent by {by!r}; waiting for the learner's answer")
    answer = await send_and_wait(
        bootstrap, conn, ctl, index, lambda m: carries(m, "quarantine", ctl.id) or reached(m), timeout, key
    )
    if answer.manifest is not None:
        m = answer.manifest
        how = "done in" if carries(m, "quarantine", ctl.id) else "another command did it first; seen in"
        now = ", ".join(m.metrics.get("quarantined") or []) or "none"
        print(f"{how} v{m.version}: quarantined now {now}")
        return 0
    if answer.refusal is not None:
        print(f"{command} refused by the learner: {answer.refusal.reason}: {answer.refusal.detail}")
        return 1
    print(silent(command, timeout, conn.policy))
    return 1
