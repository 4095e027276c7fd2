"""Client side: publish events to the input topics (docs/contract.md).

:class:`EventPublisher` (async methods) and :class:`SyncEventPublisher` (blocking methods)
validate each value as the pipeline will, so a service learns of a malformed event at once
instead of finding it in ``dead-letter``, and hand it to a :class:`~pipeline.client.sender.Sender`:
a bounded buffer sent by a thread of its own. Publishing never waits on the broker and never
fails because of it: with the broker away, both start, events wait in the buffer (the
oldest dropped and counted once it is full) and go out when it is back; ``flush`` and
``close`` take a deadline (docs/byo-retriever.md, "When the broker is away").

    async with EventPublisher("127.0.0.1:19092") as pub:
        await pub.publish(event)            # a RetrievalEvent, LLMFeedback or HumanLabel
        await pub.publish_dict(obj)         # or a JSON-ready dict with a "schema"
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline import kafka
from pipeline.client.sender import MAX_BYTES, MAX_EVENTS, Sender
from pipeline.config import Connection, Settings
from pipeline.service import Service
from topics.events import RetrievalEvent, decode_retrieval_event
from topics.feedback import LLMFeedback, decode_llm_feedback
from topics.fields import SCHEMA_FEEDBACK, SCHEMA_LABEL, SCHEMA_RETRIEVAL, Rejected, encode
from topics.labels import HumanLabel, decode_human_label
from topics.principal import check_principal, principal_signature
from topics.signing import Key

SCHEMA_TOPIC = {SCHEMA_RETRIEVAL: "retrieval-events", SCHEMA_FEEDBACK: "llm-feedback", SCHEMA_LABEL: "human-labels"}
DECODE = {
    SCHEMA_RETRIEVAL: decode_retrieval_event,
    SCHEMA_FEEDBACK: decode_llm_feedback,
    SCHEMA_LABEL: decode_human_label,
}
STAMPED = (SCHEMA_RETRIEVAL, SCHEMA_FEEDBACK)  # the values that carry a principal (contract 1.15)
FLUSH_TIMEOUT_S = 30.0  # flush's default deadline
CLOSE_TIMEOUT_S = 10.0  # how long stop/close flush before they give up what is left


class _Publishing:
    """What both publishers share: validation, the topic and key of each value, the sender."""

    def __init__(
        self,
        bootstrap: str,
        conn: Connection | Settings | None,
        validate: bool,
        max_events: int,
        max_bytes: int,
        producer_kwargs: dict[str, Any],
        principal: str | None = None,
        principal_key: Key | None = None,
    ) -> None:
        try:
            self.principal = None if principal is None else check_principal(principal)
        except Rejected as rej:
            raise ValueError(f"principal: {rej.detail}") from None
        if principal_key is not None and self.principal is None:
            raise ValueError("principal_key signs for a principal: give principal too")
        if principal_key is not None:
            principal_signature(b"", principal_key)  # ValueError now for a key that cannot sign
        self.principal_key = principal_key
        self.conn = Connection.of(conn)
        self.bootstrap = bootstrap
        self.validate = validate
        self.topics = self.conn.topics
        self.limits = self.conn.limits
        self.sender = Sender(
            bootstrap,
            self.conn,
            max_events=max_events,
            max_bytes=max_bytes,
            producer_kwargs={"linger_ms": kafka.BULK_LINGER_MS, **producer_kwargs},
        )

    @property
    def sent(self) -> int:
        """Events the broker acknowledged."""
        return self.sender.sent

    @property
    def dropped(self) -> int:
        """Events dropped, never handed to the broker: out of a full buffer, or unsent at close."""
        return self.sender.dropped

    @property
    def in_doubt(self) -> int:
        """Events given up like ``dropped`` after the broker was handed them without acknowledging
        them (it may have written them)."""
        return self.sender.in_doubt

    def health(self) -> str:
        """``"ok"``, or ``"degraded: no broker since …"``."""
        return self.sender.health()

    def put(self, obj: dict[str, Any]) -> None:
        """Validate (unless disabled) and buffer; raises :class:`Rejected` for bad values only.

        With a ``principal``, RetrievalEvents and LLMFeedback are stamped with it (contract 1.15);
        one that names another principal is refused (``inconsistent``).
        """
        schema = obj.get("schema")
        if schema not in SCHEMA_TOPIC:
            raise Rejected("unknown_schema", f"{schema!r}")
        if self.principal is not None and schema in STAMPED:
            claimed = obj.get("principal")
            if claimed is not None and claimed != self.principal:
                raise Rejected("inconsistent", f"principal {str(claimed)[:64]!r} is not the publisher's")
            obj = {**obj, "principal": self.principal}
        raw = encode(obj)
        if self.validate:
            DECODE[schema](raw, self.limits)
        # Contract 1.16: the principal's signature of the bytes sent, in a record header.
        key = self.principal_key if schema in STAMPED else None
        headers = (principal_signature(raw, key),) if key is not None else ()
        self.put_raw(SCHEMA_TOPIC[schema], raw, str(obj.get("query_id", "")), headers)

    def put_raw(
        self, short_topic: str, raw: bytes | None, query_id: str | None, headers: tuple[tuple[str, bytes], ...] = ()
    ) -> None:
        topic = self.topics.by_short_name(short_topic).name
        self.sender.put(topic, raw, query_id.encode("utf-8") if query_id else None, headers)


class EventPublisher(_Publishing, Service):
    """Async publisher of RetrievalEvent, LLMFeedback and HumanLabel values, keyed by query_id.

    ``start`` returns at once, broker or not; the sender connects in the background.

    Parameters
    ----------
    bootstrap
        The Kafka bootstrap address.
    conn
        Topic names, limits and SASL/TLS (a :class:`~pipeline.config.Connection`, or
        ``Settings``, whose part is taken); default: the product's defaults.
    validate
        Decode every value as the pipeline will before sending it.
    max_events, max_bytes
        The buffer's bounds (:class:`~pipeline.client.sender.Sender`).
    principal
        Keyword only (contract 1.15): the name this client's RetrievalEvents and LLMFeedback
        carry (``[A-Za-z0-9._:@-]``, at most 128 characters; ``ValueError`` otherwise). The
        learner bounds each principal's influence (docs/learning.md); None sends none
        (the values count as ``"anonymous"``).
    principal_key
        Keyword only (contract 1.16): the key that proves ``principal`` (an Ed25519 private
        key, whose public half the operator puts in the worker's ``principal_keys``
        directory as ``<principal>.pem``, or a shared secret; ``topics.signing.load_key``
        reads either). Each RetrievalEvent and LLMFeedback then carries its signature in a
        record header. Without it, a worker with a keyring counts the values as
        ``"anonymous"``, or rejects them where the keyring holds the name.
    producer_kwargs
        Passed on to the aiokafka producer.
    """

    def __init__(
        self,
        bootstrap: str,
        conn: Connection | Settings | None = None,
        validate: bool = True,
        *,
        max_events: int = MAX_EVENTS,
        max_bytes: int = MAX_BYTES,
        principal: str | None = None,
        principal_key: Key | None = None,
        **producer_kwargs: Any,
    ) -> None:
        Service.__init__(self)
        _Publishing.__init__(
            self, bootstrap, conn, validate, max_events, max_bytes, producer_kwargs, principal, principal_key
        )

    async def _start(self) -> None:
        self.sender.start()

    async def _stop(self) -> None:
        await asyncio.to_thread(self.sender.close, CLOSE_TIMEOUT_S)

    async def publish(self, value: RetrievalEvent | LLMFeedback | HumanLabel) -> None:
        """Validate and buffer ``value`` (never waits on the broker)."""
        self.put(value.to_dict())

    async def publish_dict(self, obj: dict[str, Any]) -> None:
        """Validate (unless disabled) and buffer; raises :class:`Rejected` for bad values."""
        self.put(obj)

    async def send_raw(self, short_topic: str, raw: bytes | None, query_id: str | None) -> None:
        """Send bytes unvalidated to an input topic (tests use it to send bad input on purpose)."""
        self.put_raw(short_topic, raw, query_id)

    async def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait up to ``timeout`` s until everything published so far was acknowledged (True) or not (False)."""
        return await asyncio.to_thread(self.sender.flush, timeout)


class SyncEventPublisher(_Publishing):
    """The same publisher for code without an event loop; nothing here blocks on the broker
    (the same arguments, ``principal`` and ``principal_key`` included).

    >>> pub = SyncEventPublisher("127.0.0.1:19092")  # doctest: +SKIP
    >>> pub.publish(event); pub.flush(); pub.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        bootstrap: str,
        conn: Connection | Settings | None = None,
        validate: bool = True,
        *,
        max_events: int = MAX_EVENTS,
        max_bytes: int = MAX_BYTES,
        principal: str | None = None,
        principal_key: Key | None = None,
        **producer_kwargs: Any,
    ) -> None:
        super().__init__(bootstrap, conn, validate, max_events, max_bytes, producer_kwargs, principal, principal_key)
        self.sender.start()

    def publish(self, value: RetrievalEvent | LLMFeedback | HumanLabel) -> None:
        self.put(value.to_dict())

    def publish_dict(self, obj: dict[str, Any]) -> None:
        self.put(obj)

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait up to ``timeout`` s until everything published so far was acknowledged (True) or not (False)."""
        return self.sender.flush(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Flush for up to ``timeout`` s and stop; what is left is counted in ``dropped`` (or
        ``in_doubt``). Idempotent."""
        self.sender.close(timeout)

    def __enter__(self) -> SyncEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
