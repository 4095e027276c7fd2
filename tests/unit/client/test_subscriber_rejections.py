"""The client's :class:`PolicySubscriber` against hostile model-topic messages, fed directly
(no broker): a message it cannot parse is a rejection, never the end of the subscriber, and a
forged manifest's claimed size reserves nothing before its chunks arrive."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from collections.abc import Callable

import orjson
import pytest

from pipeline.client.subscriber import PolicySubscriber
from topics.manifest import Manifest, max_blob_bytes, max_chunks

GIB = 1024**3
# An architecture whose tensors could need 4 GiB, so the decoder's bounds let the claim through.
ARCH = {"input_dim": 10, "hidden": 1024, "slots": 2**20, "embedding_dim": 8}


def peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_without_expected_arch_a_4_gib_claim_is_rejected_without_reserving_it() -> None:
    assert max_blob_bytes(ARCH) >= 4 * GIB
    forged = Manifest("default", 5, 1.0, "periodic", ARCH, 0.5, 0.0, "0" * 64, 4 * GIB, max_chunks(4 * GIB))
    sub = PolicySubscriber("127.0.0.1:1", policy="default")  # never started: the plan fails before any read
    asyncio.run(sub.handle(0, b"default/5/0", b"x" * 1024))
    value = orjson.dumps(forged.to_dict())
    peak = peak_bytes(lambda: asyncio.run(sub.handle(1, b"default", value)))
    assert sub.current is None
    assert sub.rejections and "missing_chunk" in sub.rejections[-1][1]
    assert peak < 8 * 1024 * 1024  # the old plan listed four million missing indices first (~160 MB)


class _Msg:
    def __init__(self, offset: int, key: bytes, value: bytes) -> None:
        self.offset, self.key, self.value, self.headers = offset, key, value, ()


class _FakeConsumer:
    """A model topic of ``msgs`` (none: an empty topic), answered in one batch, then idle."""

    def __init__(self, msgs: list[_Msg] | None = None) -> None:
        self.msgs = msgs or []
        self.end = len(self.msgs)
        self.read = 0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def assign(self, tps: object) -> None:
        return None

    async def seek_to_beginning(self, tp: object) -> None:
        return None

    async def position(self, tp: object) -> int:
        return self.read

    def highwater(self, tp: object) -> int:
        return self.end

    async def getmany(self, timeout_ms: int = 0) -> dict[str, list[_Msg]]:
        if not self.msgs:
            await asyncio.sleep(timeout_ms / 1000)
            return {}
        msgs, self.msgs = self.msgs, []
        self.read = self.end
        return {"tp": msgs}


def test_any_exception_while_handling_a_message_is_a_rejection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pipeline import kafka

    topic = [_Msg(0, "default/²/0".encode(), b"x"), _Msg(1, b"default/1/0", b"y")]
    monkeypatch.setattr(kafka, "consumer", lambda *a, **kw: _FakeConsumer(topic))
    sub = PolicySubscriber("127.0.0.1:1", policy="default")
    seen: list[int] = []

    async def handle(offset: int, key: bytes | None, value: bytes | None, headers: object = None) -> None:
        seen.append(offset)
        if offset == 0:
            raise ValueError("invalid literal for int() with base 10: '²'")

    sub.handle = handle  # type: ignore[method-assign]  # whatever a parse raises, the loop goes on

    async def follow() -> None:
        async with sub:
            for _ in range(500):
                if len(seen) == 2:
                    break
                await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING):
        asyncio.run(follow())
    assert seen == [0, 1]  # the message after the bad one was handled
    assert sub.rejections == [(0, "unparseable message: ValueError(\"invalid literal for int() with base 10: '²'\")")]
    assert "rejected checkpoint at offset 0" in caplog.text


@pytest.mark.parametrize(
    ("bootstrap", "protocol", "signing_key", "warns"),
    [
        ("kafka:9092", "SASL_PLAINTEXT", None, True),
        ("10.0.0.5:9092,10.0.0.6:9092", "PLAINTEXT", None, True),
        ("127.0.0.1:9092", "SASL_SSL", None, True),  # loopback, but not the embedded broker (it has no SASL/TLS)
        ("127.0.0.1:19092", "PLAINTEXT", None, False),  # the embedded broker: a local trial
        ("kafka:9092", "SASL_PLAINTEXT", b"k", False),
    ],
)
def test_an_unsigned_client_outside_the_embedded_broker_warns_at_start(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    bootstrap: str,
    protocol: str,
    signing_key: bytes | None,
    warns: bool,
) -> None:
    from pipeline import kafka
    from pipeline.config import Settings

    monkeypatch.setattr(kafka, "consumer", lambda *a, **kw: _FakeConsumer())
    conn = Settings().connection()
    conn.security.security_protocol = protocol
    sub = PolicySubscriber(bootstrap, conn=conn, signing_key=signing_key)

    async def start_stop() -> None:
        await sub.start()
        await sub.stop()

    with caplog.at_level(logging.WARNING, logger="pipeline.client.subscriber"):
        asyncio.run(start_stop())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) == warns
    if warns:
        assert "checkpoints are NOT signed" in warnings[0] and "CAUSALMEM_CHECKPOINT_SIGNING_KEY" in warnings[0]
