"""``causalmem suppress`` / ``causalmem unsuppress``: an operator's "do not use" for memories, and its undo.

The learner is the single writer of the policy, so the verb asks it over the ``control``
topic (which only operators, and the worker's drift stage, may write: docs/operations.md,
"Security") to pin the memories' masks near 0, or to give them neutral rows again, and to
serve that at once (a checkpoint of reason ``suppress``, past the promotion gate). The verb
checks the same rules as the learner first (:func:`pipeline.learner.suppression.decide`,
against the newest checkpoint's set and audit trail): a command over ``suppress_max_slots``
or beyond ``suppress_checkpoints_per_hour`` is refused before anything is sent. It then
waits until the checkpoint that carries its command is on the model topic.

Labelers' "do not use" marks are proposals: ``causalmem status`` lists them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

from pipeline import kafka
from pipeline.config import Connection, Settings
from pipeline.learner.suppression import decide, read_audit
from pipeline.modeltopic import scan_model_topic
from topics.fields import encode
from topics.internal import SUPPRESS_COMMAND, Control


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
) -> int:
    """Send one ``suppress`` / ``unsuppress`` command and wait for its checkpoint; prints what
    happens, returns the exit status (0 done or nothing to change, 1 refused or no answer, 2 bad request)."""
    conn = Connection.of(conn)
    wanted = sorted({int(s) for s in slots})
    if not wanted:
        print(f"{command}: name at least one memory (--slots)")
        return 2
    if len(wanted) > max_slots:
        print(f"{command} refused: {len(wanted)} memories, at most {max_slots} per command (suppress_max_slots)")
        return 2
    topic = conn.topics.policy_checkpoints.name
    await kafka.wait_for_broker(bootstrap, conn)
    index = await scan_model_topic(bootstrap, conn, topic)
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
    producer = kafka.producer(bootstrap, conn)
    await producer.start()
    try:
        await (await producer.send(conn.topics.control.name, encode(ctl.to_dict()), partition=0))
    finally:
        await producer.stop()
    print(f"{command} {list(pre.changed)} sent by {by!r}; waiting for the learner's checkpoint")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        index = await scan_model_topic(bootstrap, conn, topic)
        for m in reversed(index.links(conn.policy)):
            entry = m.metrics.get("suppression")
            if m.reason == SUPPRESS_COMMAND and isinstance(entry, dict) and entry.get("id") == ctl.id:
                print(f"serving v{m.version}: suppressed now {m.metrics.get('suppressed') or 'none'}")
                return 0
    print(
        f"no checkpoint for the command within {timeout:.0f} s: is a learner for policy {conn.policy!r} running? "
        "A refused command is in dead-letter with its reason (causalmem status)."
    )
    return 1
