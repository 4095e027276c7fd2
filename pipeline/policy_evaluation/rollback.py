"""``causalmem rollback --to VERSION``: serve an earlier checkpoint again.

The learner is the single writer of the policy, so the verb asks it, over the ``control``
topic, to republish the weights of VERSION as a new serving version (reason
``rollback``; serving versions only grow, so clients take it like any other update) and
to continue training from them. The weights come from the model topic (a delta version is
rebuilt from its chain) or, once the topic has tombstoned that version, from the learner's
local directory. The verb waits until the
rollback checkpoint is on the model topic.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from pipeline import kafka
from pipeline.config import Connection, Settings
from pipeline.modeltopic import scan_model_topic
from topics.fields import encode
from topics.internal import Control


async def rollback(bootstrap: str, conn: Connection | Settings, version: int, reason: str, timeout: float) -> int:
    """Ask the learner to serve ``version`` again and wait for it; prints what happens, returns the exit status."""
    conn = Connection.of(conn)
    topic = conn.topics.policy_checkpoints.name
    await kafka.wait_for_broker(bootstrap, conn)
    index = await scan_model_topic(bootstrap, conn, topic)
    policy = conn.policy
    newest = index.newest(policy)
    if newest is None:
        print(f"no checkpoint of policy {policy!r} on the model topic: nothing to roll back")
        return 1
    if version >= newest.version or version < 1:
        print(f"version {version} is not an earlier checkpoint (newest is v{newest.version})")
        return 1
    known = index.version(policy, version)  # a full snapshot or a delta (rebuilt from its chain)
    rebuildable = known is not None and index.rebuildable(known)
    where = "on the model topic" if rebuildable else "not on the model topic any more"
    print(f"rolling policy {policy!r} back to v{version} ({where}; the learner also keeps recent versions locally)")
    ctl = Control(
        command="rollback",
        ts=time.time(),
        reason=reason,
        id=f"rollback-{uuid.uuid4().hex}",
        details={"to_version": version},
    )
    producer = kafka.producer(bootstrap, conn)
    await producer.start()
    try:
        await (await producer.send(conn.topics.control.name, encode(ctl.to_dict()), partition=0))
    finally:
        await producer.stop()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        index = await scan_model_topic(bootstrap, conn, topic)
        serving = index.serving_head(policy)
        if (
            serving is not None
            and serving.reason == "rollback"
            and serving.version > newest.version
            and serving.metrics.get("rolled_back_to") == version
        ):
            print(f"serving v{serving.version}: the weights of v{version}")
            return 0
    print(
        f"no rollback checkpoint within {timeout:.0f} s: is a learner for policy {policy!r} running? "
        "(its log says why if it could not find the version)"
    )
    return 1
