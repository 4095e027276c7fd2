"""The client library's surface: what it imports, what it takes, and the torch-free model topic.

No broker: CheckpointPublisher runs against a recording producer, and the index is fed
the recorded messages.
"""

from __future__ import annotations

import asyncio
import doctest
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import pipeline.client
import pipeline.config
import pipeline.modeltopic
import pipeline.modeltopic.reader
from models.policy.network import init_policy
from models.policy.weights import to_safetensors, verify_and_load
from pipeline.client import CausalRetriever, EventPublisher, PolicySubscriber
from pipeline.client.subscriber import arch_of
from pipeline.config import Connection, Settings
from pipeline.kafka import ClusterWatch
from pipeline.modeltopic import CheckpointPublisher, ModelTopicIndex, check_blob
from pipeline.service import Service
from tests.paths import REPO_ROOT
from topics.fields import SCHEMA_MANIFEST, encode
from topics.manifest import MAX_CHUNK_BYTES, CheckpointError, decode_manifest, sha256_hex

ROOT = REPO_ROOT


def _modules_after(statement: str, watched: list[str]) -> list[str]:
    """The watched top-level modules present after running ``statement`` in a fresh interpreter."""
    code = f"import sys\n{statement}\nprint(sorted(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    return list(eval(out.strip().splitlines()[-1]))  # a printed list of str


def test_service_api_needs_no_faust_matplotlib_rich_or_yaml() -> None:
    heavy = ["faust", "matplotlib", "rich", "yaml"]
    statement = "from pipeline.client import CausalRetriever, EventPublisher, SyncEventPublisher, PolicySubscriber"
    assert _modules_after(statement, heavy) == []
    assert _modules_after("import faust, yaml", heavy) == ["faust", "yaml"]  # the check itself can fail


def test_model_topic_module_imports_no_torch() -> None:
    subprocess.run(
        [sys.executable, "-c", "import pipeline.modeltopic, sys; assert 'torch' not in sys.modules"],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    assert _modules_after("import pipeline.modeltopic", ["torch"]) == []
    assert _modules_after("import pipeline.client.subscriber", ["torch"]) == ["torch"]


def test_readme_example_imports_and_defines_serve() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it from a service\s+```python\n(.*?)```", readme, re.S)
    assert block is not None, "the README has a service example"
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    assert asyncio.iscoroutinefunction(namespace["serve"])
    assert namespace["PolicySubscriber"] is PolicySubscriber


class _Recorder:
    """Stands in for ``PolicySubscriber`` and ``EventPublisher`` in the README's example."""

    published: ClassVar[list[Any]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def __aenter__(self) -> _Recorder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def publish(self, value: Any) -> None:
        self.published.append(value)


def test_readme_example_ids_stay_unique_across_a_restart() -> None:
    """A service restarted within the join window must not reuse its ids (the join drops
    an id it has seen): two runs of the README's ``serve`` share no query or event id."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it from a service\s+```python\n(.*?)```", readme, re.S)
    assert block is not None
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    namespace["PolicySubscriber"] = namespace["EventPublisher"] = _Recorder
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((6, 8)).astype(np.float32)

    def run() -> tuple[set[str], set[str]]:
        _Recorder.published = []
        asyncio.run(
            namespace["serve"](
                vectors,
                [f"m{i}" for i in range(6)],
                ["a", "b", "c"],
                lambda text: rng.standard_normal(8).astype(np.float32),
                lambda question, texts: ("answer", 1.0, 1.5),
            )
        )
        queries = {v.query_id for v in _Recorder.published}
        ids = {v.event_id for v in _Recorder.published}
        assert len(ids) == len(_Recorder.published) == 6 and len(queries) == 3
        return queries, ids

    first, second = run(), run()  # the second run is the same service after a restart
    assert not first[0] & second[0], "query ids repeat after a restart"
    assert not first[1] & second[1], "event ids repeat after a restart"


@pytest.mark.parametrize("module", [pipeline.modeltopic.reader, pipeline.config, pipeline.client])
def test_doctests(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.failed == 0
    assert result.attempted > 0


# --------------------------------------------------------------------------- configuration


def test_clients_take_a_connection_or_settings() -> None:
    s = Settings(topic_prefix="t-", policy="p1", embedding_dim=8, slots=32, hidden=16)
    conn = s.connection()
    for source in (s, conn):
        pub = EventPublisher("127.0.0.1:1", source)
        assert pub.conn == conn
        assert pub.topics.retrieval_events.name == "t-retrieval-events"
        assert pub.limits.embedding_dim == 8
        sub = PolicySubscriber("127.0.0.1:1", None, source)
        assert (sub.policy, sub.topic) == ("p1", "t-policy-checkpoints")
    assert PolicySubscriber("127.0.0.1:1", "other", conn).policy == "other"
    assert PolicySubscriber("127.0.0.1:1").conn == Settings().connection()


def test_retriever_checks_memories_against_the_connection() -> None:
    conn = Settings(embedding_dim=8, slots=32, policy="p1").connection()
    memories = np.eye(8, dtype=np.float32)
    assert CausalRetriever(memories, conn=conn).policy_name == "p1"
    assert CausalRetriever(memories, conn=conn, policy="mine").policy_name == "mine"
    assert CausalRetriever(memories).policy_name == "default"
    with pytest.raises(ValueError, match="dimension 8"):
        CausalRetriever(memories, conn=Settings(embedding_dim=16).connection())
    with pytest.raises(ValueError, match="slots"):
        CausalRetriever(memories, conn=Settings(embedding_dim=8, slots=4).connection())


def test_connection_of() -> None:
    conn = Connection.of(Settings(policy="x"))
    assert Connection.of(conn) is conn
    assert conn.policy == "x"


# --------------------------------------------------------------------------- lifecycle


def test_components_share_the_service_lifecycle() -> None:
    for cls in (EventPublisher, PolicySubscriber, ClusterWatch):
        assert issubclass(cls, Service)
        assert "start" not in vars(cls) and "stop" not in vars(cls)  # the base's guard, not a copy


async def test_cluster_watch_double_start_is_refused() -> None:
    watch = ClusterWatch("127.0.0.1:1", Settings(), [], on_reset=lambda missing: None, interval=3600)
    async with watch:
        assert watch.running
        with pytest.raises(RuntimeError, match="already started"):
            await watch.start()
    assert not watch.running and watch._task is None
    await watch.stop()  # a second stop does nothing


# --------------------------------------------------------------------------- model topic


class RecordingProducer:
    """Records ``send`` calls as (offset, key, value); every send is acknowledged at once."""

    def __init__(self) -> None:
        self.log: list[tuple[int, bytes | None, bytes | None]] = []

    async def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int = 0) -> Any:
        self.log.append((len(self.log), key, value))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def test_publisher_takes_bytes_and_the_index_finds_them() -> None:
    net = init_policy(8, 32, 16)
    blob = to_safetensors(net.tensors())
    producer = RecordingProducer()
    pub = CheckpointPublisher(producer, "policy-checkpoints", "default", keep_versions=1)
    m1 = await pub.publish(blob, alpha=0.25, reason="init", arch=net.arch.to_dict(), baseline=0.5)
    assert (m1.version, m1.alpha, m1.baseline, m1.size, m1.chunks) == (1, 0.25, 0.5, len(blob), 1)
    assert arch_of(m1) == net.arch

    big = bytes(range(256)) * (MAX_CHUNK_BYTES // 128 + 3)  # three chunks
    m2 = await pub.publish(big, alpha=0.0, reason="periodic", arch=net.arch.to_dict(), baseline=0.0, candidate=True)
    assert m2.chunks == 3

    index = ModelTopicIndex()
    for offset, key, value in producer.log:
        index.observe(offset, key, value)
    assert index.serving["default"].version == 1 and index.candidate["default"].version == 2
    assert decode_manifest(producer.log[1][2] or b"") == m1
    # v1 is serving: protected from tombstoning even though keep_versions=1.
    assert sorted(index.chunk_offsets) == [("default", 1), ("default", 2)]
    parts = {i: producer.log[o][2] for i, o in index.chunk_offsets[("default", 2)].items()}
    assert check_blob(b"".join(parts[i] or b"" for i in range(3)), m2) == big
    # The first checkpoint round-trips into the same tensors.
    served = producer.log[index.chunk_offsets[("default", 1)][0]][2] or b""
    tensors = verify_and_load(check_blob(served, m1), m1.sha256, m1.size, arch_of(m1))
    assert all(bool((tensors[n] == t).all()) for n, t in net.tensors().items())

    with pytest.raises(ValueError, match="not above"):
        await pub.publish(blob, alpha=0.0, reason="periodic", arch=net.arch.to_dict(), baseline=0.0, version=2)


def test_check_blob_rejects_other_bytes() -> None:
    blob = b"x" * 10
    manifest = decode_manifest(
        encode(
            {
                "schema": SCHEMA_MANIFEST,
                "policy": "default",
                "version": 1,
                "created_ts": 1.0,
                "reason": "init",
                "arch": {"input_dim": 10, "hidden": 4, "slots": 4, "embedding_dim": 8},
                "alpha": 0.0,
                "baseline": 0.0,
                "sha256": sha256_hex(blob),
                "size": 10,
                "chunks": 1,
            }
        )
    )
    assert check_blob(blob, manifest) == blob
    with pytest.raises(CheckpointError) as short:
        check_blob(blob[:9], manifest)
    assert short.value.reason == "size_mismatch"
    with pytest.raises(CheckpointError) as other:
        check_blob(b"y" * 10, manifest)
    assert other.value.reason == "sha256_mismatch"


# --------------------------------------------------------------------------- with a broker


@pytest.mark.broker
async def test_publish_file_and_fetch_with_a_connection(settings: Settings, tmp_path: Path, capsys: Any) -> None:
    from pipeline import kafka
    from pipeline.client.publish_file import dumps_line, publish_file
    from pipeline.client.subscriber import fetch_checkpoint
    from pipeline.modeltopic import fetch_blob, scan_model_topic
    from tests.helpers import feedback, retrieval_event

    conn = settings.connection()
    ev = retrieval_event(settings, "q1")
    path = tmp_path / "events.jsonl"
    path.write_bytes(dumps_line(ev.to_dict()) + dumps_line(feedback("q1").to_dict()) + b'{"schema": "nope"}\n')
    assert await publish_file(str(path), settings.bootstrap or "", conn) == 1
    assert "published 2 line(s): 1 to llm-feedback, 1 to retrieval-events; rejected 1" in capsys.readouterr().out
    got = await kafka.read_all(settings.bootstrap or "", conn, conn.topics.retrieval_events.name)
    assert [m.key for m in got] == [b"q1"]

    net = init_policy(8, 32, 16)
    blob = to_safetensors(net.tensors())
    producer = kafka.producer(settings.bootstrap or "", conn)
    await producer.start()
    try:
        pub = CheckpointPublisher(producer, conn.topics.policy_checkpoints.name, conn.policy)
        manifest = await pub.publish(blob, alpha=0.0, reason="init", arch=net.arch.to_dict(), baseline=0.0)
    finally:
        await producer.stop()
    index = await scan_model_topic(settings.bootstrap or "", conn)
    assert index.serving[conn.policy] == manifest
    assert await fetch_blob(settings.bootstrap or "", conn, index, manifest) == blob
    tensors = await fetch_checkpoint(settings.bootstrap or "", conn, index, manifest)
    assert all(bool((tensors[n] == t).all()) for n, t in net.tensors().items())
    index.chunk_offsets.clear()
    with pytest.raises(CheckpointError) as missing:
        await fetch_blob(settings.bootstrap or "", conn, index, manifest)
    assert missing.value.reason == "missing_chunk"
