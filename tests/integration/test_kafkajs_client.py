"""The wire contract from another language: the kafkajs reference client in ``examples/kafkajs``.

The client is written from docs/contract.md alone (Node.js, kafkajs 2, nothing from this
repository). Its math runs against the contract's test vectors without a broker; end to end it
follows a model topic written by the learner's own publishing (a full snapshot, two deltas and a
candidate it must not follow), serves by the loaded manifest's ``serving``, and publishes
RetrievalEvents and LLMFeedback with only the required fields, which a real worker decodes and
joins: no dead letters, every key on the partition Java's murmur2 partitioner gives it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aiokafka.partitioner import DefaultPartitioner
from causalmem_lab.procs import Child

from models.policy.network import init_policy
from pipeline import kafka
from pipeline.config import Settings
from pipeline.modeltopic import CheckpointPublisher
from pipeline.promtext import metric
from tests.conftest import TEST_CONTRACT, settings_env
from tests.helpers import publish_tensors, wait_metric
from tests.integration.test_delta_checkpoints import ARCH, delta_publishing, publish, train
from tests.paths import REPO_ROOT
from topics.delta import DeltaManifest
from topics.events import decode_retrieval_event
from topics.feedback import decode_llm_feedback

CLIENT = REPO_ROOT / "examples" / "kafkajs"
NODE, NPM = shutil.which("node"), shutil.which("npm")
pytestmark = pytest.mark.skipif(
    NODE is None or NPM is None, reason="the kafkajs reference client needs Node.js (node and npm on PATH)"
)
NETWORK_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "ENETUNREACH")
QUERIES, STEPS = 8, 2


def node(cwd: Path, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NODE or "node", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def summary(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the client with its locked dependencies installed (``npm ci``, from npm's cache when it has them)."""
    where = tmp_path_factory.mktemp("kafkajs")
    for f in CLIENT.iterdir():
        if f.is_file():
            shutil.copy(f, where / f.name)
    done = subprocess.run(
        [NPM or "npm", "ci", "--prefer-offline", "--no-audit", "--no-fund"],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if done.returncode != 0 and any(e in done.stderr for e in NETWORK_ERRORS):
        pytest.skip(f"npm ci could not reach the npm registry and kafkajs is not in npm's cache: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr
    return where


def test_client_math_matches_the_contract_vectors() -> None:
    """Mask, hard drop, revival, logprob and the delta's state_sha256 (the full snapshot's byte layout)."""
    report = summary(node(CLIENT, "vectors.js", str(TEST_CONTRACT)))
    assert report == {**report, "ok": True, "kept_ok": True, "state_sha256_ok": True, "full_snapshot_bytes_ok": True}
    assert report["max_rel_err"] <= 1e-5 and report["cases"] >= 4


def test_client_vector_check_is_sharp(tmp_path: Path) -> None:
    for f in TEST_CONTRACT.iterdir():
        shutil.copy(f, tmp_path / f.name)
    spec = json.loads((TEST_CONTRACT / "delta.json").read_text())
    spec["manifest"]["state_sha256"] = "0" * 64
    (tmp_path / "delta.json").write_text(json.dumps(spec))
    proc = node(CLIENT, "vectors.js", str(tmp_path))
    assert proc.returncode == 1 and json.loads(proc.stdout)["state_sha256_ok"] is False


async def publish_model_topic(s: Settings, tmp_path: Path) -> dict[int, Any]:
    """The learner's publishing: v1 full (``init``), v2 and v3 deltas served at once, then a v4 candidate."""
    manifests = {}
    async with delta_publishing(s, tmp_path, full_every=10) as (p, t):
        manifests[1] = await publish(p, t, "init")
        for rows in ([1], [2, 3]):
            train(t, rows)
            m = await publish(p, t)
            assert isinstance(m, DeltaManifest)
            manifests[m.version] = m
        other = init_policy(ARCH.embedding_dim, ARCH.slots, ARCH.hidden, seed=5).tensors()
        manifests[4] = await publish_tensors(
            p.publisher, other, arch=ARCH, reason="periodic", baseline=0.0, candidate=True
        )
    return manifests


@pytest.mark.broker
def test_kafkajs_client_end_to_end(installed: Path, topics_ready: Settings, tmp_path: Path) -> None:
    s = topics_ready
    assert (s.embedding_dim, s.slots, s.hidden) == (ARCH.embedding_dim, ARCH.slots, ARCH.hidden)
    manifests = asyncio.run(publish_model_topic(s, tmp_path / "learner"))
    bootstrap = s.bootstrap or ""
    worker = Child("worker", bootstrap, settings_env(s), log_path=tmp_path / "worker.log")
    try:
        wait_metric(worker, "causalmem_partitions_owned", 1, 45, stage="join")
        out = summary(
            node(
                installed,
                "client.js",
                *("--bootstrap", bootstrap, "--prefix", s.topic_prefix, "--dim", str(s.embedding_dim)),
                *("--slots", str(s.slots), "--queries", str(QUERIES), "--steps", str(STEPS), "--timeout", "30"),
            )
        )
        # It loaded the newest serving version through its delta chain, never the candidate.
        v3 = manifests[3]
        assert (out["version"], out["first_version"], out["deltas_loaded"]) == (3, 3, 2)
        assert out["sha256"] == v3.sha256 and out["sha256_ok"] is True
        assert out["serving"]["temperature"] == v3.serving["temperature"]
        n = QUERIES * STEPS
        assert out["events"] == n and out["feedback"] == n

        joined = wait_metric(worker, "causalmem_joins_total", n, 30)
        assert joined == n
        assert metric(worker.metrics(), "causalmem_events_rejected_total") == 0.0
    finally:
        worker.stop()

    # What the worker accepted, checked field by field: the contract's decoders, the key, the partition.
    conn = s.connection()
    java = DefaultPartitioner()
    partitions = list(range(s.partitions))
    by_query: dict[str, set[tuple[str, int]]] = {}
    for topic, decode in (
        (conn.topics.retrieval_events.name, decode_retrieval_event),
        (conn.topics.llm_feedback.name, decode_llm_feedback),
    ):
        records = asyncio.run(kafka.read_all(bootstrap, conn, topic))
        assert len(records) == n
        for r in records:
            value = decode(r.value, conn.limits, key=r.key)
            assert r.partition == java(r.key, partitions, partitions)  # murmur2, as Java and aiokafka
            by_query.setdefault(value.query_id, set()).add((topic, r.partition))
            if topic == conn.topics.retrieval_events.name:
                assert value.policy_version == 3 and value.logprob <= 0.0
                assert value.temperature in (v3.serving["temperature"], v3.serving["explore_temperature"])
                assert value.candidate_probs is None  # required fields only
    assert len(by_query) == QUERIES
    assert all(len({p for _, p in seen}) == 1 for seen in by_query.values())  # co-partitioned


@pytest.mark.broker
def test_kafkajs_client_creates_no_topic(installed: Path, settings: Settings) -> None:
    """Started before ``init-topics``, the client fails instead of auto-creating a topic with the broker's
    partition count: first without the model topic (its consumer), then without the input topics (its producer)."""
    s, bootstrap = settings, settings.bootstrap or ""

    def run_client() -> subprocess.CompletedProcess[str]:
        return node(installed, "client.js", "--bootstrap", bootstrap, "--prefix", s.topic_prefix, "--timeout", "10")

    async def ours() -> set[str]:
        client = kafka.admin(bootstrap, s)
        await client.start()
        try:
            return {t for t in await client.list_topics() if t.startswith(s.topic_prefix)}
        finally:
            await client.close()

    proc = run_client()
    assert proc.returncode == 1 and "does not host this topic-partition" in proc.stderr, proc.stderr
    assert asyncio.run(ours()) == set()

    model_topic = s.topics().policy_checkpoints

    async def model_topic_with_a_policy() -> None:
        await kafka.create_topics(bootstrap, s, [model_topic])
        producer = kafka.producer(bootstrap, s)
        await producer.start()
        try:
            pub = CheckpointPublisher(producer, model_topic.name, s.policy)
            net = init_policy(s.embedding_dim, s.slots, s.hidden, seed=1)
            await publish_tensors(pub, net.tensors(), arch=net.arch, reason="init", baseline=0.0)
        finally:
            await producer.stop()

    asyncio.run(model_topic_with_a_policy())
    proc = run_client()
    assert proc.returncode == 1 and "serving policy default v1" in proc.stderr, proc.stderr
    assert asyncio.run(ours()) == {model_topic.name}
