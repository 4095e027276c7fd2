"""Publish events from a JSONL file, line by line (``causalmem publish FILE.jsonl``).

Each line is one JSON object whose ``schema`` says where it goes (retrieval_event/v1 →
retrieval-events, llm_feedback/v1 → llm-feedback, human_label/v1 → human-labels). Lines
are validated as the pipeline would; rejected lines are reported with their reason and
not sent (unless ``--no-validate``, which sends every line as-is).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

from pipeline.client.publisher import DECODE, SCHEMA_TOPIC, EventPublisher
from pipeline.config import Connection, Settings
from topics.fields import Rejected, loads_object

MAX_REPORTED = 50
FLUSH_EVERY = 2_000  # lines put between waits for the broker (the buffer holds 10,000)


async def publish_file(path: str, bootstrap: str, conn: Connection | Settings, validate: bool = True) -> int:
    """Returns 0 when every line was published, 1 when some were rejected."""
    from pipeline import kafka

    conn = Connection.of(conn)
    limits = conn.limits
    await kafka.wait_for_broker(bootstrap, conn)
    await kafka.create_topics(bootstrap, conn)
    sent = rejected = 0
    counts: dict[str, int] = {}
    reasons: dict[str, int] = {}
    async with EventPublisher(bootstrap, conn, validate=False) as pub:
        with Path(path).open("rb") as fh:
            for lineno, line in enumerate(fh, 1):
                raw = line.rstrip(b"\r\n")
                if not raw.strip():
                    continue
                topic, query_id = "retrieval-events", None
                try:
                    obj = loads_object(raw, limits)
                    query_id = obj.get("query_id") if isinstance(obj.get("query_id"), str) else None
                    schema = obj.get("schema")
                    if schema not in SCHEMA_TOPIC:
                        raise Rejected("unknown_schema", f"{schema!r}")
                    topic = SCHEMA_TOPIC[schema]
                    if validate:
                        DECODE[schema](raw, limits)
                except Rejected as rej:
                    if validate:
                        rejected += 1
                        reasons[rej.reason] = reasons.get(rej.reason, 0) + 1
                        if rejected <= MAX_REPORTED:
                            print(f"line {lineno}: rejected ({rej.reason}: {rej.detail})", file=sys.stderr)
                        continue
                await pub.send_raw(topic, raw, query_id)
                sent += 1
                counts[topic] = counts.get(topic, 0) + 1
                if sent % FLUSH_EVERY == 0:  # a file is not a request path: wait rather than drop
                    await pub.flush()
        delivered = await pub.flush()
    if not delivered or pub.dropped:
        print(f"the broker acknowledged {pub.sent} of {sent} line(s); {pub.dropped} dropped", file=sys.stderr)
    summary = ", ".join(f"{n} to {t}" for t, n in sorted(counts.items())) or "nothing"
    if rejected > MAX_REPORTED:
        print(f"... {rejected - MAX_REPORTED} more rejected lines not shown", file=sys.stderr)
    why = f" ({', '.join(f'{r}: {n}' for r, n in sorted(reasons.items()))})" if reasons else ""
    print(f"published {sent} line(s): {summary}; rejected {rejected}{why}")
    return 1 if rejected or not delivered or pub.dropped else 0


def dumps_line(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
