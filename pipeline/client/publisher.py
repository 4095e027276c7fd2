"""Client side: publish events to the input topics (docs/contract.md).

:class:`EventPublisher` is async (aiokafka); :class:`SyncEventPublisher` wraps it for
code without an event loop. Values are validated before they are sent, so a service
learns of a malformed event at once instead of finding it in ``dead-letter``.

    async with EventPublisher("127.0.0.1:19092") as pub:
        await pub.publish(event)            # a RetrievalEvent, LLMFeedback or HumanLabel
        await pub.publish_dict(obj)         # or a JSON-ready dict with a "schema"
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

from pipeline import kafka
from pipeline.config import Connection, Settings
from pipeline.service import Service
from topics.events import RetrievalEvent, decode_retrieval_event
from topics.feedback import LLMFeedback, decode_llm_feedback
from topics.fields import SCHEMA_FEEDBACK, SCHEMA_LABEL, SCHEMA_RETRIEVAL, Rejected, encode
from topics.labels import HumanLabel, decode_human_label

SCHEMA_TOPIC = {SCHEMA_RETRIEVAL: "retrieval-events", SCHEMA_FEEDBACK: "llm-feedback", SCHEMA_LABEL: "human-labels"}
DECODE = {
    SCHEMA_RETRIEVAL: decode_retrieval_event,
    SCHEMA_FEEDBACK: decode_llm_feedback,
    SCHEMA_LABEL: decode_human_label,
}


class EventPublisher(Service):
    """Async publisher of RetrievalEvent, LLMFeedback and HumanLabel values, keyed by query_id.

    Parameters
    ----------
    bootstrap
        The Kafka bootstrap address.
    conn
        Topic names, limits and SASL/TLS (a :class:`~pipeline.config.Connection`, or
        ``Settings``, whose part is taken); default: the product's defaults.
    validate
        Decode every value as the pipeline will before sending it.
    producer_kwargs
        Passed on to the aiokafka producer.
    """

    def __init__(
        self,
        bootstrap: str,
        conn: Connection | Settings | None = None,
        validate: bool = True,
        **producer_kwargs: Any,
    ) -> None:
        super().__init__()
        self.conn = Connection.of(conn)
        self.bootstrap = bootstrap
        self.validate = validate
        self.topics = self.conn.topics
        self.limits = self.conn.limits
        self._producer_kwargs = {"linger_ms": 10, **producer_kwargs}
        self._producer: Any = None
        self._inflight: list[asyncio.Future[Any]] = []
        self.sent = 0

    async def _start(self) -> None:
        self._producer = kafka.producer(self.bootstrap, self.conn, **self._producer_kwargs)
        await self._producer.start()

    async def _stop(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self.flush()
            await self._producer.stop()
            self._producer = None

    async def publish(self, value: RetrievalEvent | LLMFeedback | HumanLabel) -> None:
        await self.publish_dict(value.to_dict())

    async def publish_dict(self, obj: dict[str, Any]) -> None:
        """Validate (unless disabled) and send; raises :class:`Rejected` for bad values."""
        raw = encode(obj)
        schema = obj.get("schema")
        if schema not in SCHEMA_TOPIC:
            raise Rejected("unknown_schema", f"{schema!r}")
        if self.validate:
            DECODE[schema](raw, self.limits)
        await self.send_raw(SCHEMA_TOPIC[schema], raw, str(obj.get("query_id", "")))

    async def send_raw(self, short_topic: str, raw: bytes, query_id: str | None) -> None:
        """Send bytes unvalidated to an input topic (tests use it to send bad input on purpose)."""
        topic = self.topics.by_short_name(short_topic).name
        key = query_id.encode("utf-8") if query_id else None
        self._inflight.append(await self._producer.send(topic, raw, key=key))
        self.sent += 1
        if len(self._inflight) >= 10_000:
            await self.flush()

    async def flush(self) -> None:
        """Wait until everything sent so far is acknowledged by the broker."""
        inflight, self._inflight = self._inflight, []
        if inflight:
            await asyncio.gather(*inflight)


class SyncEventPublisher:
    """Blocking wrapper around :class:`EventPublisher` (runs its own loop in a thread).

    >>> pub = SyncEventPublisher("127.0.0.1:19092")  # doctest: +SKIP
    >>> pub.publish(event); pub.flush(); pub.close()  # doctest: +SKIP
    """

    def __init__(self, bootstrap: str, conn: Connection | Settings | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="causalmem-publisher", daemon=True)
        self._thread.start()
        self._pub = EventPublisher(bootstrap, conn, **kwargs)
        try:
            self._call(self._pub.start())
        except BaseException:
            self._shutdown_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def publish(self, value: RetrievalEvent | LLMFeedback | HumanLabel) -> None:
        self._call(self._pub.publish(value))

    def publish_dict(self, obj: dict[str, Any]) -> None:
        self._call(self._pub.publish_dict(obj))

    def flush(self) -> None:
        self._call(self._pub.flush())

    def close(self) -> None:
        try:
            self._call(self._pub.stop())
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> SyncEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
