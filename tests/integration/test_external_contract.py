"""The wire contract as an outside team meets it (docs/contract.md).

``examples/contract_publisher.py`` and ``examples/contract_consumer.py`` import nothing
from this project. Here they run as separate processes, the way a new user would run
them: the consumer's numpy math against the contract vectors (no broker), the consumer
against crafted model-topic contents (tampered chunk, candidate, tombstone), and both
programs end to end against a real worker and learner.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from causalmem_lab.procs import Child, wait_until

from models.policy.network import PolicyNetwork, init_policy
from pipeline import kafka
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.modeltopic import CheckpointPublisher, scan_model_topic
from pipeline.promtext import metric
from tests.conftest import TEST_CONTRACT, settings_env
from tests.helpers import publish_tensors, wait_metric
from tests.paths import REPO_ROOT
from topics.manifest import chunk_key

ROOT = REPO_ROOT
PUBLISHER = ROOT / "examples" / "contract_publisher.py"
CONSUMER = ROOT / "examples" / "contract_consumer.py"
EVENTS = 40


def run_example(script: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT)
    )


def last_json_line(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("contract", [TEST_CONTRACT, TEST_CONTRACT / "vectors.json"], ids=["dir", "json"])
def test_consumer_numpy_math_matches_contract_vectors(contract: Path) -> None:
    report = last_json_line(run_example(CONSUMER, "--vectors", str(contract)))
    assert report["ok"] is True
    assert report["kept_ok"] is True
    assert report["max_rel_err"] <= 1e-5
    assert report["cases"] >= 3


def test_consumer_rejects_wrong_math(tmp_path: Path) -> None:
    """The vector check is sharp: a changed expected mask fails it (exit 1)."""
    spec = json.loads((TEST_CONTRACT / "vectors.json").read_text())
    spec["cases"][0]["expected_mask"][0] *= 1.0001
    (tmp_path / "vectors.json").write_text(json.dumps(spec))
    (tmp_path / "vectors.safetensors").write_bytes((TEST_CONTRACT / "vectors.safetensors").read_bytes())
    proc = run_example(CONSUMER, "--vectors", str(tmp_path))
    assert proc.returncode == 1
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is False


@pytest.mark.broker
def test_consumer_follows_only_verified_serving_manifests(topics_ready) -> None:
    """A tampered newest serving checkpoint is refused; a candidate is never followed."""
    s = topics_ready
    nets = [init_policy(s.embedding_dim, s.slots, s.hidden, seed=i) for i in range(3)]
    arch = nets[0].arch

    async def publish() -> None:
        producer = kafka.producer(s.bootstrap or "", s)
        await producer.start()
        try:
            pub = CheckpointPublisher(producer, s.topics().policy_checkpoints.name, s.policy)
            await publish_tensors(pub, nets[0].tensors(), reason="init", arch=arch, baseline=0.0)  # v1, serving
            await publish_tensors(pub, nets[1].tensors(), reason="periodic", arch=arch, baseline=0.0)  # v2, serving
            # v2's only chunk is overwritten by other bytes (as a bad compaction or a rogue writer would).
            key = chunk_key(s.policy, 2, 0).encode()
            await (await producer.send(s.topics().policy_checkpoints.name, b"garbage", key=key, partition=0))
            await publish_tensors(
                pub, nets[2].tensors(), reason="periodic", arch=arch, baseline=0.0, candidate=True
            )  # v3
        finally:
            await producer.stop()

    asyncio.run(publish())
    proc = run_example(CONSUMER, "--bootstrap", s.bootstrap or "", "--prefix", s.topic_prefix, "--timeout", "20")
    out = last_json_line(proc)
    assert out["version"] == 1 and out["reason"] == "init"
    assert "version 2" in proc.stderr
    q = [np.sin(i + 1.0) for i in range(s.embedding_dim)]  # the consumer's default query
    with torch.no_grad():
        expected = nets[0](torch.tensor([q], dtype=torch.float32), torch.zeros(1), torch.zeros(1))[0]
    np.testing.assert_allclose(np.asarray(out["mask"]), expected.double().numpy(), rtol=1e-5, atol=0)

    async def tombstone_v1() -> None:
        producer = kafka.producer(s.bootstrap or "", s)
        await producer.start()
        try:
            key = chunk_key(s.policy, 1, 0).encode()
            await (await producer.send(s.topics().policy_checkpoints.name, None, key=key, partition=0))
        finally:
            await producer.stop()

    asyncio.run(tombstone_v1())
    proc = run_example(CONSUMER, "--bootstrap", s.bootstrap or "", "--prefix", s.topic_prefix, "--timeout", "20")
    assert proc.returncode == 1, proc.stdout
    assert "no verifiable serving checkpoint" in proc.stderr and proc.stdout == ""


@pytest.mark.broker
def test_outside_team_publisher_and_consumer_end_to_end(broker, settings, tmp_path: Path) -> None:
    bootstrap = broker.bootstrap
    created = asyncio.run(kafka.create_topics(bootstrap, settings))
    assert all(v in ("created", "exists") for v in created.values()), created
    env = settings_env(settings)
    worker = learner = None
    try:
        worker = Child("worker", bootstrap, env, log_path=tmp_path / "worker.log")
        learner = Child("learner", bootstrap, env, log_path=tmp_path / "learner.log")
        wait_metric(worker, "causalmem_partitions_owned", 1, 45, stage="join")
        # The learner's metrics answer, and it has published its initial policy.
        wait_metric(learner, "causalmem_checkpoint_version", 1, 30, role="serving")

        pub = run_example(
            PUBLISHER,
            "--bootstrap",
            bootstrap,
            "--prefix",
            settings.topic_prefix,
            "--dim",
            str(settings.embedding_dim),
            "--slots",
            str(settings.slots),
            "--events",
            str(EVENTS),
            "--seed",
            "7",
        )
        summary = last_json_line(pub)
        assert summary["events"] == EVENTS and summary["sent"] == 2 * EVENTS
        assert summary["bad"] >= 3

        wait_metric(learner, "causalmem_learner_experiences_total", EVENTS, 60, kind="feedback")
        wait_metric(learner, "causalmem_checkpoint_version", 2, 30, role="serving")
        # A checkpoint published after every experience was applied is on the topic.
        newest: dict = {}

        def trained_checkpoint_published() -> bool:
            index = asyncio.run(scan_model_topic(bootstrap, settings))
            m = index.serving.get(settings.policy)
            newest["m"] = m
            return m is not None and m.version >= 2 and m.metrics.get("experiences", 0) >= EVENTS

        wait_until(trained_checkpoint_published, 30, interval=0.5, what="a checkpoint with every experience")
        trained_version = newest["m"].version

        rng = np.random.default_rng(3)
        query = [float(v) for v in rng.normal(size=settings.embedding_dim)]
        loss, entropy = 0.7, 1.9
        out = last_json_line(
            run_example(
                CONSUMER,
                "--bootstrap",
                bootstrap,
                "--prefix",
                settings.topic_prefix,
                "--query-json",
                json.dumps(query),
                "--loss",
                str(loss),
                "--entropy",
                str(entropy),
            )
        )
        assert out["sha256_ok"] is True
        assert out["policy"] == settings.policy
        assert out["version"] >= max(2, trained_version)
        assert len(out["mask"]) == settings.slots

        # The project's own reader, for the same manifest and query.
        index = asyncio.run(scan_model_topic(bootstrap, settings))
        manifest = index.manifests[(settings.policy, out["version"])]
        assert out["sha256"] == manifest.sha256 and out["reason"] == manifest.reason
        tensors = asyncio.run(fetch_checkpoint(bootstrap, settings, index, manifest))
        net = PolicyNetwork.from_tensors(tensors).eval()
        with torch.no_grad():
            expected = net(torch.tensor([query]), torch.tensor([loss]), torch.tensor([entropy]))[0]
        np.testing.assert_allclose(np.asarray(out["mask"]), expected.double().numpy(), rtol=1e-5, atol=0)

        # Every deliberately bad message went to dead-letter, and nothing else did.
        rejected = wait_metric(worker, "causalmem_events_rejected_total", summary["bad"], 20)
        assert rejected == summary["bad"], worker.metrics()
        reasons = {
            r: metric(worker.metrics(), "causalmem_events_rejected_total", reason=r)
            for r in set(summary["bad_reasons"])
        }
        assert reasons == {r: float(summary["bad_reasons"].count(r)) for r in reasons}
        records = asyncio.run(kafka.read_all(bootstrap, settings, settings.topics().dead_letter.name, partitions=[0]))
        values = [json.loads(r.value) for r in records]
        assert sorted(v["reason"] for v in values) == sorted(summary["bad_reasons"])
        assert all(
            v["schema"] == "dead_letter/v1" and v["source"]["topic"].startswith(settings.topic_prefix) for v in values
        )
        assert all(r.key is not None and r.key.decode().startswith(summary["run_id"]) for r in records)
    finally:
        for child in (learner, worker):
            if child is not None:
                child.stop()
