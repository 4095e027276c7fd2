"""``causalmem rollback``: serve an earlier checkpoint again (republished under a new version, reason rollback).

``--to VERSION`` asks the learner, over ``control``, to republish the weights of VERSION as a new
serving version and to continue training from them. The weights come from the model topic (a
delta version is rebuilt from its chain) or, once the topic has tombstoned that version, from
the learner's local directory. The verb reports the learner's answer (:mod:`pipeline.cli.answers`):
the rollback's checkpoint, or the refusal and why (a version the learner no longer keeps,
``control_checkpoints_per_hour`` reached), exiting 1 then.

``--list`` prints the versions a rollback can serve: the earlier ones whose chunks the model topic
still holds, and those in the learner's local directory when it is on this machine (same
``state_dir``, bootstrap and topic prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline import kafka
from pipeline.cli.answers import carries, send_and_wait, silent, who_asks
from pipeline.cli.common import resolve_bootstrap, settings_from
from pipeline.config import Connection, Settings
from pipeline.learner.publishing import is_promotion_copy
from pipeline.learner.store import LOCAL_VERSIONS, LocalStore, local_dir
from pipeline.modeltopic import scan_model_topic
from topics.internal import Control
from topics.manifest import Manifest
from topics.signing import Key

TOPIC, LOCAL = "model topic", "local directory"


def add_options(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--to", dest="to_version", type=int, help="the checkpoint version to serve again")
    what.add_argument("--list", action="store_true", help="list the versions a rollback can serve, and exit")
    p.add_argument("--reason", default="operator rollback", help="recorded in the checkpoint's metrics")
    p.add_argument(
        "--by", default=None, help="who asks (the audit trail); the SASL user when authenticated, else $USER"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the learner's answer")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    conn = settings.connection()
    try:
        by = who_asks(conn, args.by)
    except ValueError as exc:
        print(f"causalmem rollback: {exc}")
        return 2
    bootstrap = resolve_bootstrap(settings)
    if args.list:
        return asyncio.run(list_versions(bootstrap, settings))
    key = settings.operator_key()
    return asyncio.run(rollback(bootstrap, conn, args.to_version, args.reason, args.timeout, by=by, key=key))


@dataclass(frozen=True)
class Target:
    """A version a rollback can serve: its checkpoint's reason, where its weights are, whether it serves now."""

    version: int
    reason: str
    where: tuple[str, ...]
    serving: bool


def rollback_targets(topic: dict[int, str], local: dict[int, str], newest: int, serving: int | None) -> list[Target]:
    """The versions before ``newest`` that the model topic (``topic``: version → reason, those it can
    rebuild) or the learner's local directory (``local``) keeps, newest first."""
    versions = sorted({v for v in (*topic, *local) if 1 <= v < newest}, reverse=True)
    return [
        Target(
            v,
            topic.get(v) or local.get(v) or "?",
            tuple(where for where, kept in ((TOPIC, topic), (LOCAL, local)) if v in kept),
            v == serving,
        )
        for v in versions
    ]


def local_versions(root: Path) -> dict[int, str] | None:
    """Version → reason of the learner's local directory ``root``; None when it is not on this machine."""
    if not (root / "versions").is_dir():
        return None
    store = LocalStore(root)
    found = {}
    for v in store.versions():
        meta = store.manifest_of(v)
        found[v] = str(meta["manifest"].get("reason") or "?") if meta else "?"
    return found


async def list_versions(bootstrap: str, settings: Settings) -> int:
    """Print what ``rollback --to`` can serve; returns the exit status."""
    conn = settings.connection()
    await kafka.wait_for_broker(bootstrap, conn)
    index = await scan_model_topic(bootstrap, conn)
    policy = conn.policy
    newest = index.newest(policy)
    if newest is None:
        print(f"no checkpoint of policy {policy!r} on the model topic: nothing to roll back to")
        return 1
    serving = index.serving_head(policy)
    topic = {m.version: m.reason for m in index.links(policy) if index.rebuildable(m)}
    root = local_dir(settings.state_path(), bootstrap, conn.topics.prefix, policy)
    local = local_versions(root)
    targets = rollback_targets(topic, local or {}, newest.version, serving.version if serving else None)
    print(
        f"policy {policy!r}: newest v{newest.version}"
        + (f", serving v{serving.version}" if serving is not None else "")
        + f"; {len(targets)} earlier versions to roll back to (newest first)"
    )
    for t in targets:
        print(f"  v{t.version}  {t.reason}  {', '.join(t.where)}{'  (serving)' if t.serving else ''}")
    if local is None:
        print(
            f"the learner's local directory is not on this machine ({root}): it may keep more versions "
            f"(its last {LOCAL_VERSIONS}); the learner refuses a version it has not"
        )
    return 0


RULES_COPIES = ("guardrail:", "promoted v")  # how a learner before 1.26 names the copies its rule asked for


def answers(m: Manifest, *, control_id: str, version: int, after: int) -> bool:
    """Whether ``m`` is the learner's answer to the rollback command ``control_id`` (to
    ``version``, sent when ``after`` was the newest version): it carries the command's id in
    its audit entry, or, from a learner before that entry, it is a rollback to ``version``
    published since. Never a copy the promotion rule asked for, which may republish the same
    version's weights at any time: marked since contract 1.26, and by its reason before
    (``guardrail: …``, ``promoted vN: …``).

    >>> def v9(**metrics):
    ...     return Manifest("p", 9, 0.0, "rollback", {}, 0.5, 0.0, "a" * 64, 1, 1, metrics=metrics)
    >>> answers(v9(rolled_back_to=4), control_id="c", version=4, after=8)
    True
    >>> answers(v9(rolled_back_to=4, promotion_copy=True), control_id="c", version=4, after=8)
    False
    >>> answers(v9(rolled_back_to=4, rollback_reason="guardrail: v8 below"), control_id="c", version=4, after=8)
    False
    """
    if carries(m, "control", control_id):
        return True
    older = m.reason == "rollback" and m.metrics.get("rolled_back_to") == version and "control" not in m.metrics
    reason = m.metrics.get("rollback_reason")
    rules = is_promotion_copy(m.metrics) or (isinstance(reason, str) and reason.startswith(RULES_COPIES))
    return older and m.version > after and not rules


async def rollback(
    bootstrap: str,
    conn: Connection | Settings,
    version: int,
    reason: str,
    timeout: float,
    by: str = "",
    key: Key | None = None,
) -> int:
    """Ask the learner to serve ``version`` again and report its answer; returns the exit status."""
    conn = Connection.of(conn)
    await kafka.wait_for_broker(bootstrap, conn)
    index = await scan_model_topic(bootstrap, conn)
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
    details: dict[str, object] = {"to_version": version}
    if by:
        details["by"] = by
    ctl = Control(command="rollback", ts=time.time(), reason=reason, details=details, id=f"rollback-{uuid.uuid4().hex}")

    def done(m: Manifest) -> bool:
        return answers(m, control_id=ctl.id, version=version, after=newest.version)

    answer = await send_and_wait(bootstrap, conn, ctl, index, done, timeout, key)
    if answer.manifest is not None:
        print(f"serving v{answer.manifest.version}: the weights of v{version}")
        return 0
    if answer.refusal is not None:
        print(f"rollback refused by the learner: {answer.refusal.reason}: {answer.refusal.detail}")
        return 1
    print(silent("rollback", timeout, policy))
    return 1
