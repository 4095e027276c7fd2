"""The operator verbs' commands and the learner's answers (``rollback``, ``suppress``, ``unsuppress``).

The learner is the single writer of the policy, so these verbs ask it over ``control``, with a
command id of their own (the command's ``id``), and the learner answers every command it reads:

- done: the checkpoint the command forced, on the model topic, carries the id (in its metrics:
  ``control`` for a rollback, reset or cut-over, ``suppression`` for a suppression);
- refused: the command is on ``dead-letter``, its ``original`` holding the id, with the reason
  (``rate_limited``, ``too_many_slots``, ``out_of_range`` for a version the learner no longer
  keeps or a slot outside the policy, …) and a detail saying why.

:func:`send_and_wait` watches both topics from just before it sends, so the verb reports either
answer within seconds, and says only after ``timeout`` that nothing answered (no learner runs).
Matching a dead letter to its command is pure (:func:`refusal_in`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiokafka import TopicPartition

from pipeline import kafka
from pipeline.config import Connection
from pipeline.labeling.queue import labeler_identity, principal
from pipeline.modeltopic import ModelTopicIndex
from topics.fields import encode
from topics.internal import Control
from topics.manifest import Manifest
from topics.signing import Key


@dataclass(frozen=True)
class Refusal:
    """The learner refused a command: the dead letter's ``reason`` and ``detail``."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Answer:
    """What came of a command: ``done`` (with the checkpoint that carries it), ``refused`` (with
    why) or ``silent`` (nothing answered within the timeout)."""

    outcome: Literal["done", "refused", "silent"]
    manifest: Manifest | None = None
    refusal: Refusal | None = None


def refusal_in(value: bytes | None, command_id: str, control_topic: str) -> Refusal | None:
    """The refusal a ``dead-letter`` value holds for the command ``command_id`` sent on ``control_topic``;
    None for any other record (another command's, another topic's, one that does not parse)."""
    if not value or not command_id:
        return None
    try:
        record = orjson.loads(value)
        source = record.get("source") if isinstance(record, dict) else None
        if not isinstance(source, dict) or source.get("topic") != control_topic:
            return None
        original = record.get("original")
        command = orjson.loads(original) if isinstance(original, str) else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(command, dict) or command.get("id") != command_id:
        return None
    return Refusal(str(record.get("reason") or "unknown"), str(record.get("detail") or ""))


def who_asks(conn: Connection, asked: str | None) -> str:
    """Who the command says asked (``by``): the SASL user on an authenticated connection (naming
    someone else is refused: ValueError), else ``asked``, else ``$USER``; "" when none is known.

    The learner records it as the sender's claim unless the command is signed with that
    operator's key (``operator_key_file``; contract 1.16, docs/operations.md, "Security").
    """
    if asked is None and principal(conn) is None:
        asked = os.environ.get("USER")
    return labeler_identity(conn, asked)


def add_command_options(p: argparse.ArgumentParser, *, reason: str = "", recorded_in: str = "the audit trail") -> None:
    """The options every operator command shares: why, who asks, how long to wait for the answer."""
    p.add_argument("--reason", default=reason, help=f"why: recorded in {recorded_in} (checkpoint metrics)")
    p.add_argument("--by", default=None, help=f"who asks ({recorded_in}); the SASL user when authenticated, else $USER")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the learner's answer")


def asker(conn: Connection, asked: str | None, verb: str) -> str | None:
    """:func:`who_asks`, or None after saying on stderr why no one can be named (the verb exits 2)."""
    try:
        by = who_asks(conn, asked)  # an authenticated operator cannot name someone else
    except ValueError as exc:
        print(f"causalmem {verb}: {exc}", file=sys.stderr)
        return None
    if not by:
        print(f"causalmem {verb}: who asks is required: pass --by NAME (or set USER)", file=sys.stderr)
        return None
    return by


async def send_and_wait(
    bootstrap: str,
    conn: Connection,
    ctl: Control,
    index: ModelTopicIndex,
    done: Callable[[Manifest], bool],
    timeout: float,
    key: Key | None = None,
) -> Answer:
    """Send ``ctl`` (which must carry an ``id``) and wait for the learner's answer.

    ``index``: the model topic as read before sending (the watch goes on from its end);
    ``done``: whether a manifest that arrives is the command's checkpoint; ``key``: the
    operator's key, whose signature of the command proves its ``by`` (contract 1.16).
    """
    assert ctl.id, "a command the verb waits for needs an id"
    topics = conn.topics
    dead, model = TopicPartition(topics.dead_letter.name, 0), TopicPartition(topics.policy_checkpoints.name, 0)
    consumer = kafka.consumer(bootstrap, conn, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([dead, model])
        # From the end as the broker reports it (on the embedded broker: inside the last batch, so
        # a few older records come again; they name other commands).
        await consumer.seek_to_end(dead)
        await consumer.position(dead)
        consumer.seek(model, index.end_offset)
        await kafka.send_control(bootstrap, conn, encode(ctl.to_dict()), key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            batch = await consumer.getmany(dead, model, timeout_ms=500)
            for tp, msgs in batch.items():
                for msg in msgs:
                    if tp == model:
                        manifest = index.observe(msg.offset, msg.key, msg.value, msg.headers)[1]
                        if manifest is not None and done(manifest):
                            return Answer("done", manifest=manifest)
                    elif (refusal := refusal_in(msg.value, ctl.id, topics.control.name)) is not None:
                        return Answer("refused", refusal=refusal)
        return Answer("silent")
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


def carries(manifest: Manifest, key: str, command_id: str) -> bool:
    """Whether ``manifest`` is the checkpoint of the command ``command_id`` (its audit entry under ``key``)."""
    entry: Any = manifest.metrics.get(key)
    return isinstance(entry, dict) and entry.get("id") == command_id


def silent(verb: str, timeout: float, policy: str) -> str:
    """What a verb says when nothing answered."""
    return (
        f"{verb}: no answer from the learner within {timeout:.0f} s: is a learner for policy {policy!r} running "
        "(and reading this deployment's control topic)?"
    )
