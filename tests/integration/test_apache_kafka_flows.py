"""The product's flows on Apache Kafka itself: three KRaft nodes, secured as deployed (tests/kafka_cluster.py).

Every process runs as in compose, as its own role's SCRAM user, with the ACLs of
deploy/kafka/acls.sh: ``causalmem init-topics`` (the operator), a ``causalmem worker`` and a
``causalmem learner`` in child processes (the worker's and the learner's users; the learner signs
its checkpoints), a service's :class:`EventPublisher` and, started late, its
:class:`PolicySubscriber` (the service user, verifying the signatures). Skipped, with the reason,
where Java, Maven or the jars are missing.

- the core loop: the worker joins every published event with its feedback and the learner
  learns each joined pair once, then publishes a serving checkpoint that says so;
- a subscriber that starts after all of that loads the serving policy from the model topic;
- the operator's verbs through the installed ``causalmem`` command: ``status`` (the serving
  checkpoint, the live worker and learner), ``rollback --list``, ``suppress`` and ``unsuppress``
  (answered by the learner with checkpoints that the running subscriber loads);
- faust's own topics (changelogs, the assignor's) get the deployment's three replicas;
- compaction: after ``rollback --to``, the learner's tombstones of old chunks let Apache Kafka's
  cleaner drop their values, and a reader that starts afterwards still loads the serving policy;
- the write gate: a memory a service proposes passes a ``causalmem writes`` process (its own user)
  to ``memory-lifecycle``, the learner gives it a slot, and the service's subscriber learns the slot;
- ``causalmem publish FILE.jsonl`` with the service's user feeds the same loop;
- the evaluator: a ``causalmem evaluator`` process (its own user, the default local model) scores
  events that carry texts, and the worker joins its feedback, which the learner learns;
- the UI's app, as its own user: a labeler logs in, the health page shows the serving version,
  the memories page the memories read, the queue page the labelers' group;
- every process's producer is idempotent (Apache Kafka grants producer ids): every record batch
  on disk names its producer;
- the service user cannot send an operator's command (the broker refuses its write to ``control``);
- failures, last: while a service publishes a steady stream and a subscriber follows the policy,
  the node leading ``experiences``, then the one leading ``policy-checkpoints``, then the active
  controller are SIGKILLed and started again; every pair is joined and learnt exactly once, the
  same worker and learner go on, the subscriber loads newer verified checkpoints, and the
  learner's pause per failover goes to the log and to ``failover.json`` in the test's directory.

One cluster for the module (the ``kafka_cluster`` fixture); the file takes ~4 min on two cores:
~35-70 s the cluster's start, ~40 s the evaluator (its model loads in the process), ~1 min the
failovers (each waits for the broker to fence the killed node: ``broker.session.timeout.ms``, 9 s).

Settings: a small model (``SMALL``) and the promotion gate off, so that each periodic checkpoint
serves; partitions, replication (3) and ``min.insync.replicas`` (2) as deployed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from causalmem_lab.procs import Child

from models.memory.write_gate import memory_id_for
from models.policy.network import Arch, init_policy
from models.serving.params import ServingParams
from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.modeltopic import CheckpointPublisher, scan_model_topic
from pipeline.promtext import metric
from tests.helpers import feedback, form_field, publish_tensors, retrieval_event, until, wait_metric
from tests.kafka_cluster import KafkaCluster
from topics.feedback import decode_llm_feedback
from topics.fields import encode
from topics.internal import decode_experience
from topics.lifecycle import decode_memory_record
from topics.manifest import parse_key
from topics.writes import MemoryWrite

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

log = logging.getLogger(__name__)

CAUSALMEM = Path(sys.executable).with_name("causalmem")  # the venv's entry point, as operators run it
PAIRS = 40
RUN = f"flow-{uuid.uuid4().hex[:8]}"  # in every query id this file publishes
# A small model and a fast cadence (the rest as deployed); the gate off: every periodic checkpoint serves.
SMALL = {
    "CAUSALMEM_EMBEDDING_DIM": "8",
    "CAUSALMEM_SLOTS": "32",
    "CAUSALMEM_HIDDEN": "16",
    "CAUSALMEM_CHECKPOINT_INTERVAL_S": "1",
    "CAUSALMEM_BATCH_SIZE": "8",
    "CAUSALMEM_GATE": "0",
}


@dataclass
class Roles:
    """Each role's ``CAUSALMEM_*`` environment on the cluster: its SCRAM user, compose's settings."""

    cluster: KafkaCluster
    signing_key: str
    tmp: Path

    def env(self, role: str) -> dict[str, str]:
        env = {**self.cluster.env(role), **SMALL, "CAUSALMEM_STATE_DIR": str(self.tmp / role)}
        if role in ("learner", "service"):  # the learner signs; clients verify (compose's shared key)
            env["CAUSALMEM_CHECKPOINT_SIGNING_KEY"] = self.signing_key
        return env

    def settings(self, role: str) -> Settings:
        return Settings.from_env(self.env(role))


@dataclass
class Deployment:
    roles: Roles
    worker: Child
    learner: Child

    @property
    def cluster(self) -> KafkaCluster:
        return self.roles.cluster

    def env(self, role: str) -> dict[str, str]:
        return self.roles.env(role)

    def settings(self, role: str) -> Settings:
        return self.roles.settings(role)

    def logs(self) -> str:
        return f"--- worker:\n{self.worker.log_tail(3000)}\n--- learner:\n{self.learner.log_tail(3000)}"


def causalmem(dep: Deployment | Roles, role: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``causalmem ARGS`` through the installed entry point, as ``role`` (its environment only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAUSALMEM_")}
    env.update(dep.env(role))
    argv = [str(CAUSALMEM), args[0], "--bootstrap", dep.cluster.bootstrap, *args[1:]]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _out(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def deployment(kafka_cluster: KafkaCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """init-topics as the operator, then a worker and a learner, each as its own user, until both work."""
    tmp = tmp_path_factory.mktemp("flows")
    roles = Roles(kafka_cluster, secrets.token_hex(16), tmp)
    done = causalmem(roles, "operator", "init-topics")
    assert done.returncode == 0, _out(done)
    assert "policy-checkpoints" in done.stdout, _out(done)
    dep = Deployment(
        roles,
        Child("worker", kafka_cluster.bootstrap, roles.env("worker"), log_path=tmp / "worker.log"),
        Child("learner", kafka_cluster.bootstrap, roles.env("learner"), log_path=tmp / "learner.log"),
    )
    try:
        wait_metric(dep.learner, "causalmem_checkpoint_version", 1, 120, role="serving")
        wait_metric(dep.worker, "causalmem_partitions_owned", 1, 120, stage="join")
        yield dep
    finally:
        for child in (dep.worker, dep.learner):
            child.stop()


@pytest.fixture(scope="module")
def learnt(deployment: Deployment) -> int:
    """A service publishes PAIRS events and their feedback; the serving version that has learnt them all."""
    dep = deployment
    service = dep.settings("service")

    async def publish() -> None:
        async with EventPublisher(dep.cluster.bootstrap, service) as pub:
            for i in range(PAIRS):
                qid = f"{RUN}-{i}"
                await pub.publish(retrieval_event(service, qid))
                await pub.publish(feedback(qid, utility=0.1 + 0.8 * (i % 2)))
            assert await pub.flush(60.0)

    asyncio.run(publish())
    wait_metric(dep.worker, "causalmem_joins_total", PAIRS, 120)
    wait_metric(dep.learner, "causalmem_learner_experiences_total", PAIRS, 120, kind="feedback")
    time.sleep(2.0)  # nothing more comes: each pair is joined once and learnt once
    assert metric(dep.worker.metrics(), "causalmem_joins_total") == PAIRS, dep.logs()
    assert metric(dep.learner.metrics(), "causalmem_learner_experiences_total", kind="feedback") == PAIRS

    async def serving_after_learning() -> int:
        operator = dep.settings("operator")
        for _ in range(120):
            head = (await scan_model_topic(dep.cluster.bootstrap, operator)).serving_head(operator.policy)
            if head is not None and head.metrics.get("experiences") == PAIRS:
                return head.version
            await asyncio.sleep(0.5)
        raise AssertionError("no serving checkpoint with every pair learnt\n" + dep.logs())

    return asyncio.run(serving_after_learning())


def test_the_core_loop_learns_every_joined_pair_once(deployment: Deployment, learnt: int) -> None:
    assert learnt >= 2  # the learner's first checkpoint, then one after the pairs
    assert deployment.worker.alive() and deployment.learner.alive(), deployment.logs()
    # none of the events and feedback was rejected (other tests on a cluster may leave dead letters of theirs)
    operator = deployment.settings("operator")
    dead = asyncio.run(kafka.read_all(deployment.cluster.bootstrap, operator, operator.topics().dead_letter.name))
    assert not [r.value for r in dead if RUN.encode() in (r.value or b"")], deployment.logs()
    # and learnt: the serving checkpoint carries the gradient steps of every batch of pairs
    index = asyncio.run(scan_model_topic(deployment.cluster.bootstrap, operator))
    serving = index.version(operator.policy, learnt)
    assert serving is not None and serving.metrics["updates"] >= PAIRS // int(SMALL["CAUSALMEM_BATCH_SIZE"])


async def test_the_workers_own_topics_are_replicated_as_deployed(deployment: Deployment, learnt: int) -> None:
    """faust makes its changelogs and its assignor's topic itself (the worker's ACLs let it, under its
    prefix): with the deployment's replication factor, not the broker's default or one copy."""
    admin = AIOKafkaAdminClient(**deployment.cluster.admin_kwargs())  # the super user inspects
    await admin.start()
    try:
        own = sorted(t for t in await admin.list_topics() if t.startswith("causalmem-worker"))
        described = await admin.describe_topics(own)
    finally:
        await admin.close()
    assert any(t.endswith("-changelog") for t in own) and "causalmem-worker-__assignor-__leader" in own, own
    for topic in described:
        assert topic["error_code"] == 0, topic
        assert {len(p["replicas"]) for p in topic["partitions"]} == {3}, topic


async def test_a_late_subscriber_loads_the_serving_policy_and_follows_the_operators_verbs(
    deployment: Deployment, learnt: int
) -> None:
    dep = deployment
    service = dep.settings("service")
    assert service.verify_key() is not None  # it verifies the learner's signatures
    async with PolicySubscriber(dep.cluster.bootstrap, service.policy, service) as sub:
        loaded = await sub.wait_for_policy(min_version=learnt, timeout=60)
        assert loaded.manifest.metrics["experiences"] == PAIRS
        assert loaded.manifest.signature, "the learner signs what clients load"
        assert sub.health() == "ok"

        # status, as the operator: the serving checkpoint, and the live worker and learner
        done = await asyncio.to_thread(
            causalmem,
            dep,
            "operator",
            "status",
            "--json",
            "--worker",
            dep.worker.url,
            "--learner",
            dep.learner.url,
        )
        assert done.returncode == 0, _out(done)
        snap = json.loads(done.stdout.strip().splitlines()[-1])
        assert snap["errors"] == [], snap["errors"]
        assert snap["checkpoints"]["serving"]["version"] >= learnt
        assert snap["learner_lag"]["lag"] == 0, snap["learner_lag"]
        (worker,) = snap["workers"]
        assert worker["up"] and worker["partitions_owned"] >= 1, worker
        (learner,) = snap["learners"]
        assert learner["checkpoint_version"]["serving"] >= learnt, learner

        # rollback --list: the earlier versions, newest first, that a rollback can serve
        done = await asyncio.to_thread(causalmem, dep, "operator", "rollback", "--list")
        assert done.returncode == 0, _out(done)
        header = f"policy '{service.policy}': newest v"
        assert header in done.stdout, _out(done)
        newest = int(done.stdout.split(header)[1].split(",")[0].split(";")[0])
        assert newest >= learnt, _out(done)
        versions = [int(line.split()[0][1:]) for line in done.stdout.splitlines() if line.startswith("  v")]
        assert versions and versions == sorted(versions, reverse=True), _out(done)
        assert all(1 <= v < newest for v in versions), _out(done)

        # suppress, then unsuppress: the learner answers with checkpoints the subscriber loads
        done = await asyncio.to_thread(causalmem, dep, "operator", "suppress", "--slots", "3", "--reason", "trial")
        assert done.returncode == 0, _out(done)
        assert "sent by 'causalmem-operator'" in done.stdout, _out(done)  # the SASL user asks
        assert "serving v" in done.stdout and "suppressed now [3]" in done.stdout, _out(done)
        suppressed_in = int(done.stdout.split("serving v")[1].split(":")[0])
        await until(lambda: sub.current is not None and sub.current.version >= suppressed_in, 60, "the suppression")
        assert sub.current is not None and sub.current.manifest.metrics["suppressed"] == [3]
        assert float(sub.current.net.out.bias[3].detach()) < -20  # slot 3's mask pinned near 0

        done = await asyncio.to_thread(causalmem, dep, "operator", "unsuppress", "--slots", "3", "--reason", "trial")
        assert done.returncode == 0, _out(done)
        assert "suppressed now none" in done.stdout, _out(done)
        undone_in = int(done.stdout.split("serving v")[1].split(":")[0])
        await until(lambda: sub.current is not None and sub.current.version >= undone_in, 60, "the undo")
        assert not sub.current.manifest.metrics.get("suppressed")


def _segments_roll_fast(dep: Deployment, topic: str) -> None:
    """``topic``'s segments roll after 1 s (instead of 7 days), so that the cleaner (every 15 s)
    compacts what was written more than a second before the newest record."""
    tool = subprocess.run(
        [
            str(dep.cluster.bin / "kafka-configs.sh"),
            "--bootstrap-server",
            dep.cluster.bootstrap,
            "--command-config",
            str(dep.cluster.admin_config),
            "--alter",
            "--entity-type",
            "topics",
            "--entity-name",
            topic,
            "--add-config",
            "segment.ms=1000,min.cleanable.dirty.ratio=0.01",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert tool.returncode == 0, tool.stdout + tool.stderr


async def test_compaction_drops_old_chunks_and_a_late_reader_still_loads_the_policy(
    deployment: Deployment, learnt: int
) -> None:
    """The model topic relies on compaction (docs/contract.md §7): the learner tombstones the chunks
    of old versions, Apache Kafka's cleaner drops their values, and a reader that starts afterwards
    still loads the serving policy. The topic's segments roll after 1 s here (instead of 7 days), so
    that the cleaner (every 15 s) gets to them."""
    dep = deployment
    operator = dep.settings("operator")
    topic = operator.topics().policy_checkpoints.name
    _segments_roll_fast(dep, topic)

    def chunks(records: list[Any]) -> tuple[set[str], set[str]]:
        """The chunk keys of ``records`` that have a value, and those that have a tombstone."""
        mine = [r for r in records if parse_key(r.key.decode())[0] in ("chunk", "delta_chunk")]
        return {r.key.decode() for r in mine if r.value is not None}, {r.key.decode() for r in mine if r.value is None}

    # rollback --to: a full snapshot that serves at once, so the learner tombstones the versions
    # (or the deltas) before it
    await asyncio.sleep(1.5)
    before, _ = chunks(await kafka.read_all(dep.cluster.bootstrap, operator, topic))
    done = await asyncio.to_thread(causalmem, dep, "operator", "rollback", "--to", "1", "--reason", "trial")
    assert done.returncode == 0, _out(done)
    assert "the weights of v1" in done.stdout, _out(done)
    values, tombstoned = chunks(await kafka.read_all(dep.cluster.bootstrap, operator, topic))
    # (the cleaner may already have dropped some of those values: it runs every 15 s)
    assert tombstoned and tombstoned <= before | values, "the learner tombstones the chunks of old versions"
    # one more checkpoint, so that the segment holding those tombstones rolls and can be cleaned
    await asyncio.sleep(1.5)
    done = await asyncio.to_thread(causalmem, dep, "operator", "suppress", "--slots", "5", "--reason", "trial")
    assert done.returncode == 0, _out(done)
    newest = int(done.stdout.split("serving v")[1].split(":")[0])

    deadline = time.monotonic() + 90
    while (left := values & tombstoned) and time.monotonic() < deadline:
        await asyncio.sleep(2.0)
        values, _ = chunks(await kafka.read_all(dep.cluster.bootstrap, operator, topic))
    assert not left, f"the cleaner left the values of {sorted(left)}"
    assert values, "the chunks of the versions kept are still there"

    service = dep.settings("service")
    async with PolicySubscriber(dep.cluster.bootstrap, service.policy, service) as sub:
        loaded = await sub.wait_for_policy(min_version=newest, timeout=60)
        assert loaded.manifest.metrics["suppressed"] == [5]
        assert sub.health() == "ok"


async def test_compaction_keeps_the_version_probes_name_under_the_base_key(deployment: Deployment) -> None:
    """Contract 1.25, against Apache Kafka's cleaner: once probes over a certified version follow
    it on the serving key, compaction drops that version's own serving manifest, and a client
    started then served nothing (it could not load the version a probe is served with). The
    version's copy under ``"{policy}/base"`` stays, and a late client loads it, then the probe.
    (A policy of its own on the deployment's model topic, written as the learner's user.)"""
    dep = deployment
    writer = dep.settings("learner").replace(policy="probed")
    topic = writer.topics().policy_checkpoints.name
    _segments_roll_fast(dep, topic)
    producer = await kafka.start_producer(dep.cluster.bootstrap, writer)  # idempotent, as the learner's
    try:
        pub = CheckpointPublisher(producer, topic, writer.policy, signing_key=writer.signing_key())
        arch = Arch(writer.embedding_dim, writer.slots, writer.hidden)
        for version, reason, params in [(1, "init", None), (2, "periodic", None), (3, "probe", 2), (4, "probe", 2)]:
            tensors = init_policy(writer.embedding_dim, writer.slots, writer.hidden, seed=version).tensors()
            serving = ServingParams(base=params).to_wire()
            published = await publish_tensors(pub, tensors, arch=arch, reason=reason, baseline=0.0, serving=serving)
            if version == 2:
                await pub.set_base(published)  # before the first probe over it, as the learner does
            await asyncio.sleep(1.5)  # each in a segment of its own: the cleaner may take those before
    finally:
        await producer.stop()

    def serving_versions(records: list[Any]) -> list[int]:
        mine = [r for r in records if r.key is not None and r.key.decode() == writer.policy and r.value is not None]
        return [int(json.loads(r.value)["version"]) for r in mine]

    deadline = time.monotonic() + 90
    while 2 in (left := serving_versions(await kafka.read_all(dep.cluster.bootstrap, writer, topic))):
        assert time.monotonic() < deadline, f"the cleaner kept the serving manifests of {left}"
        await asyncio.sleep(2.0)
    service = dep.settings("service").replace(policy="probed")
    loaded: list[int] = []
    async with PolicySubscriber(
        dep.cluster.bootstrap, service.policy, service, on_update=lambda p: loaded.append(p.version)
    ) as sub:
        await sub.wait_for_policy(min_version=4, timeout=60)
    assert loaded == [2, 4]  # the version the probe names, from the base key, then the probe


async def test_a_proposed_memory_passes_the_write_gate_and_reaches_the_clients_slot_map(
    deployment: Deployment, learnt: int
) -> None:
    """A service proposes a memory (``memory-writes``); the write gate, a ``causalmem writes``
    process as its own user, admits it to ``memory-lifecycle``; the learner gives it a slot and
    publishes the id → slot map; the service's subscriber then knows the memory's slot."""
    dep = deployment
    service = dep.settings("service")
    write_id = f"{RUN}-write"
    memory_id = memory_id_for(write_id)
    gate = Child("writes", dep.cluster.bootstrap, dep.env("writes"), log_path=dep.roles.tmp / "writes.log")
    try:
        async with PolicySubscriber(dep.cluster.bootstrap, service.policy, service) as sub:
            await sub.wait_for_policy(min_version=learnt, timeout=60)
            assert sub.current is not None and sub.current.slot_of(memory_id) is None
            # reward 1.0 where the gate expects 0.0 (its prior): a surprise, admitted as a success
            emb = np.ones(service.embedding_dim, np.float32) / np.sqrt(service.embedding_dim)
            proposal = MemoryWrite(
                write_id, time.time(), "retry with a smaller page", f"{RUN}-w", 0, 1.0, embedding=emb
            )
            producer = await kafka.start_producer(dep.cluster.bootstrap, service)
            try:
                await producer.send_and_wait(service.topics().memory_writes.name, proposal.to_bytes(), key=proposal.key)
            finally:
                await producer.stop()

            def known() -> bool:
                assert gate.alive(), gate.log_tail()
                return sub.current is not None and sub.current.slot_of(memory_id) is not None

            try:
                await until(known, 90, "the memory's slot at the client")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- writes:\n{gate.log_tail(3000)}\n{dep.logs()}") from None
            slot = sub.current.slot_of(memory_id) if sub.current is not None else None
            assert slot is not None and 0 <= slot < service.slots
    finally:
        gate.stop()
    operator = dep.settings("operator")
    lifecycle = await kafka.read_all(dep.cluster.bootstrap, operator, operator.topics().memory_lifecycle.name)
    adds = [decode_memory_record(m.value, operator.limits(), m.key) for m in lifecycle if m.value is not None]
    mine = [r for r in adds if r.memory_id == memory_id]
    assert [(r.op, r.kind, r.source) for r in mine] == [("add", "success", "write-gate")], mine


def test_causalmem_publish_as_the_service_feeds_the_loop(deployment: Deployment, learnt: int) -> None:
    """``causalmem publish FILE.jsonl`` with the service's user: its events and feedback are joined
    and learnt like the publisher's (the verb checks the topics first: a service may describe them,
    not create them)."""
    dep = deployment
    service = dep.settings("service")
    n = 8
    joins0 = metric(dep.worker.metrics(), "causalmem_joins_total")
    learnt0 = metric(dep.learner.metrics(), "causalmem_learner_experiences_total", kind="feedback")
    lines = []
    for i in range(n):
        qid = f"{RUN}-file-{i}"
        lines += [encode(retrieval_event(service, qid).to_dict()), encode(feedback(qid).to_dict())]
    path = dep.roles.tmp / "events.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    done = causalmem(dep, "service", "publish", str(path))
    assert done.returncode == 0, _out(done)
    assert f"published {2 * n} line(s): {n} to llm-feedback, {n} to retrieval-events; rejected 0" in done.stdout
    wait_metric(dep.worker, "causalmem_joins_total", joins0 + n, 120)
    wait_metric(dep.learner, "causalmem_learner_experiences_total", learnt0 + n, 120, kind="feedback")
    time.sleep(2.0)
    assert metric(dep.worker.metrics(), "causalmem_joins_total") == joins0 + n, dep.logs()
    assert metric(dep.learner.metrics(), "causalmem_learner_experiences_total", kind="feedback") == learnt0 + n


def test_the_evaluators_feedback_is_joined_and_learnt(deployment: Deployment, learnt: int) -> None:
    """A service sends events with their texts and no feedback; a ``causalmem evaluator`` process
    (its own user, the default local model) scores them and publishes LLM feedback, which the
    worker joins with the events and the learner learns."""
    dep = deployment
    service = dep.settings("service")
    facts = {3: "The staging broker of Acme listens on port 19092.", 7: "Acme's office cat is called Biscuit."}
    events = []
    for i in range(2):
        event = retrieval_event(service, f"{RUN}-eval-{i}", selected=[7, 3])
        event.candidates = sorted(set(event.candidates) | {3, 7})
        event.scores = np.full(len(event.candidates), 0.5)
        event.query_text = "Which port does the Acme staging broker listen on?"
        event.memory_texts = dict(facts)
        event.answer_text = "19092"
        events.append(event)
    joins0 = metric(dep.worker.metrics(), "causalmem_joins_total")
    learnt0 = metric(dep.learner.metrics(), "causalmem_learner_experiences_total", kind="feedback")
    env = {**dep.env("evaluator"), "CAUSALMEM_EVALUATOR_ATTRIBUTION_RATE": "0", "CAUSALMEM_EVALUATOR_THREADS": "1"}
    evaluator = Child("evaluator", dep.cluster.bootstrap, env, log_path=dep.roles.tmp / "evaluator.log")
    try:

        async def publish() -> None:
            async with EventPublisher(dep.cluster.bootstrap, service) as pub:
                for event in events:
                    await pub.publish(event)
                assert await pub.flush(60.0)

        asyncio.run(publish())
        try:
            wait_metric(dep.worker, "causalmem_joins_total", joins0 + len(events), 180)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- evaluator:\n{evaluator.log_tail(3000)}") from None
        wait_metric(dep.learner, "causalmem_learner_experiences_total", learnt0 + len(events), 120, kind="feedback")
        assert evaluator.alive(), evaluator.log_tail()
    finally:
        evaluator.stop()
    operator = dep.settings("operator")
    records = asyncio.run(kafka.read_all(dep.cluster.bootstrap, operator, operator.topics().llm_feedback.name))
    mine = {f.event_id: f for f in (decode_llm_feedback(m.value, operator.limits(), m.key) for m in records)}
    for event in events:
        fb = mine[f"fb-{event.event_id}"]
        assert fb.query_id == event.query_id and fb.nll_with is not None and fb.nll_without is not None
    time.sleep(2.0)
    assert metric(dep.worker.metrics(), "causalmem_joins_total") == joins0 + len(events), dep.logs()


def test_the_ui_serves_its_pages_from_the_cluster_as_its_own_user(deployment: Deployment, learnt: int) -> None:
    """``causalmem ui``'s app as compose's ``ui`` service runs it: as the ``ui`` role of
    deploy/kafka/acls.sh, with no labelers file. A labeler logs in with the labeler role's Kafka
    user (the broker checks the password; a wrong one is refused), and the pages show what the
    app reads from the cluster: the serving version the learner published (health), the memories
    the joined steps read (memories), the labelers' queue (its group)."""
    from starlette.testclient import TestClient

    from pipeline.ui.app import create_app

    dep = deployment
    ui = dep.settings("ui")
    labeler = dep.cluster.users["labeler"]
    app = create_app(ui.ui(refresh_s=1.0), dep.cluster.bootstrap)
    with TestClient(app, base_url="http://127.0.0.1") as c:

        def login(password: str) -> int:
            csrf = form_field(c.get("/login").text, "csrf")
            data = {"csrf": csrf, "name": labeler.username, "secret": password, "next": "/queue"}
            return c.post("/login", data=data, follow_redirects=False).status_code

        assert login(labeler.password + "-wrong") != 303
        assert login(labeler.password) == 303
        deadline = time.monotonic() + 60
        serving = None
        while time.monotonic() < deadline:
            health = c.get("/health/data").json()
            serving = ((health.get("checkpoints") or {}).get("serving") or {}).get("version")
            if serving is not None and serving >= learnt:
                break
            time.sleep(0.5)
        assert serving is not None and serving >= learnt, health
        assert not [e for e in health.get("errors") or [] if "Authorization" in str(e)], health["errors"]
        assert c.get("/queue").status_code == 200
        memories = c.get("/memories")
        assert memories.status_code == 200 and 'href="/memories/' in memories.text


def test_every_process_writes_with_an_idempotent_producer(deployment: Deployment, learnt: int) -> None:
    """At the default ``kafka_idempotence = auto`` Apache Kafka grants each producer an id, so a
    retried send is written once. Every record batch on disk names the producer that wrote it:
    the service's, the worker's (the join's and faust's, its changelogs), the learner's, the
    evaluator's, the write gate's and the operator's."""
    cluster, t = deployment.cluster, deployment.settings("operator").topics()
    data = cluster.nodes[0].dir / "data"
    changelogs = sorted({d.name.rsplit("-", 1)[0] for d in data.glob("causalmem-worker-*-changelog-*")})
    written = {
        "the service's": [t.retrieval_events.name],
        "the service's and the evaluator's": [t.llm_feedback.name],
        "the worker's join": [t.experiences.name, t.outcomes.name],
        "faust's (the worker's tables)": changelogs,  # some tables may not have been written yet
        "the learner's": [t.policy_checkpoints.name],
        "the operator's and the learner's": [t.control.name],
        "the write gate's": [t.memory_lifecycle.name],
    }
    for who, topics in written.items():
        ids: dict[int, int] = {}
        for topic in topics:
            for pid, n in cluster.producer_ids(topic).items():
                ids[pid] = ids.get(pid, 0) + n
        assert ids, f"{who} {topics}: no record batch on disk"
        assert -1 not in ids, f"{who} {topics}: {ids[-1]} batches from a producer that was not idempotent ({ids})"


def test_a_service_may_not_run_the_operators_verbs(deployment: Deployment, learnt: int) -> None:
    """suppress as the service user: the broker refuses its write to ``control``."""
    done = causalmem(deployment, "service", "suppress", "--slots", "4", "--timeout", "20")
    assert done.returncode != 0, _out(done)
    assert "TopicAuthorizationFailedError: control" in done.stderr, _out(done)


# --------------------------------------------------------------------------- failures
# Run last (they follow the tests above in this module, on the same cluster and processes) and
# leave every node running: each node killed is started again, with its own data.

FAILOVER_RATE = 8.0  # pairs a second the service publishes while nodes are killed
FAILOVER_DOWN_S = 2.0  # how long a killed node stays down once its role has moved to another node
SAMPLE_S = 0.25  # how often the learner's metrics are read (the pauses' resolution)


@dataclass
class Sample:
    t: float  # wall time (the learner's timestamps are wall times too)
    last_update: float  # causalmem_learner_last_update_timestamp_seconds
    updates: float
    publishes: float  # checkpoints published, every reason
    serving: float  # the learner's serving version
    joins: float  # the worker's joins (where the learner's input comes from)


@dataclass
class Failover:
    what: str
    node: int
    killed: float = 0.0  # wall time of the SIGKILL
    moved_s: float = 0.0  # from the kill until another node leads the partition (or the quorum)
    restarted_s: float = 0.0  # from the restart to the node answering with every broker
    in_sync_s: float = 0.0  # then until every partition had all its replicas in sync again
    restarted: float = 0.0  # wall time: the node answers again
    recovered: float = 0.0  # wall time: back in sync, the learner updated since the restart and the
    # subscriber loaded a checkpoint newer than at the kill
    loaded_before: int = 0  # the subscriber's version at the kill
    led: dict[str, int] = field(default_factory=dict)  # the partitions it led at the kill, per topic
    loaded_after: int = 0


def _longest_gap(times: list[float], killed: float, restarted: float) -> float | None:
    """The longest interval between consecutive ``times`` that ends after the kill and begins before
    the node was back (None: none seen): the pause while the node was down, whenever it ended."""
    gaps = [b - a for a, b in itertools.pairwise(times) if b > killed and a < restarted]
    return max(gaps) if gaps else None


def _change_times(samples: list[Sample], name: str) -> list[float]:
    """The sample times at which the field ``name`` changed (a counter went up)."""
    out = []
    for prev, cur in itertools.pairwise(samples):
        if getattr(cur, name) != getattr(prev, name):
            out.append(cur.t)
    return out


def pauses(samples: list[Sample], failovers: list[Failover], started: float) -> dict[str, Any]:
    """The learner's pause per failover: the longest gap between its updates (the wall times it
    reports for them) and between its checkpoints (when the count of publishes went up, to within
    SAMPLE_S) that span the kill or begin while the node is down; the worker's longest gap between
    joins likewise (whether the learner waited for its input); and the learner's gaps from the start
    of the stream (``started``) to the first kill, the steady state they compare with."""
    updates = sorted({s.last_update for s in samples if s.last_update > 0})
    checkpoints = _change_times(samples, "publishes")
    joins = _change_times(samples, "joins")
    first = failovers[0].killed
    steady_updates = [b - a for a, b in itertools.pairwise(updates) if a >= started and b < first]
    steady_checkpoints = [b - a for a, b in itertools.pairwise(checkpoints) if a >= started and b < first]
    out: dict[str, Any] = {
        "steady": {
            "update_gap_median_s": float(np.median(steady_updates)) if steady_updates else None,
            "update_gap_max_s": max(steady_updates, default=None),
            "checkpoint_gap_median_s": float(np.median(steady_checkpoints)) if steady_checkpoints else None,
            "checkpoint_gap_max_s": max(steady_checkpoints, default=None),
        },
        "failovers": [],
    }
    for f in failovers:
        out["failovers"].append(
            {
                "what": f.what,
                "node": f.node,
                "moved_s": round(f.moved_s, 2),
                "down_s": round(f.restarted - f.restarted_s - f.killed, 2),
                "restart_s": round(f.restarted_s, 2),
                "back_in_sync_s": round(f.in_sync_s, 2),
                "led": f.led,
                "learner_update_pause_s": _longest_gap(updates, f.killed, f.restarted),
                "learner_checkpoint_pause_s": _longest_gap(checkpoints, f.killed, f.restarted),
                "worker_join_pause_s": _longest_gap(joins, f.killed, f.restarted),
                "subscriber_versions": [f.loaded_before, f.loaded_after],
            }
        )
    return out


@pytest.mark.timeout(600)
async def test_failover_of_the_experiences_leader_the_checkpoints_leader_and_the_controller_loses_nothing(
    deployment: Deployment, learnt: int
) -> None:
    """While a service publishes a steady stream of pairs and a subscriber follows the policy,
    SIGKILL the node leading ``experiences``, then the one leading ``policy-checkpoints``, then the
    active controller, each started again with its data FAILOVER_DOWN_S after another node took its
    role. The worker and the
    learner (never restarted) join every pair and learn each exactly once, and the subscriber loads
    newer verified checkpoints after each failover. The learner's pauses are logged and written to
    ``failover.json`` beside the processes' logs (measured, not asserted)."""
    dep = deployment
    cluster = dep.cluster
    service, operator = dep.settings("service"), dep.settings("operator")
    topics = operator.topics()
    run = f"{RUN}-failover"
    worker_pid, learner_pid = dep.worker.proc.pid, dep.learner.proc.pid
    await cluster.wait_in_sync()
    w0 = await asyncio.to_thread(dep.worker.metrics)
    l0 = await asyncio.to_thread(dep.learner.metrics)
    joins0 = metric(w0, "causalmem_joins_total")
    learnt0 = metric(l0, "causalmem_learner_experiences_total", kind="feedback")
    dups0 = metric(l0, "causalmem_learner_skipped_total", reason="duplicate")

    samples: list[Sample] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            m = await asyncio.to_thread(dep.learner.metrics)
            w = await asyncio.to_thread(dep.worker.metrics)
            if m and w:
                samples.append(
                    Sample(
                        time.time(),
                        metric(m, "causalmem_learner_last_update_timestamp_seconds"),
                        metric(m, "causalmem_learner_updates_total"),
                        metric(m, "causalmem_checkpoint_publishes_total"),
                        metric(m, "causalmem_checkpoint_version", role="serving"),
                        metric(w, "causalmem_joins_total"),
                    )
                )
            await asyncio.sleep(SAMPLE_S)

    published: list[str] = []  # the events' ids

    async def stream(pub: EventPublisher) -> None:
        while not stop.is_set():
            qid = f"{run}-{len(published)}"
            event = retrieval_event(service, qid)
            await pub.publish(event)
            await pub.publish(feedback(qid, utility=0.1 + 0.8 * (len(published) % 2)))
            published.append(event.event_id)
            await asyncio.sleep(1.0 / FAILOVER_RATE)

    async def holder(what: str) -> int:
        """The running node that has the role now (waits while none has it, e.g. after a kill)."""
        if what == "active controller":
            return await asyncio.to_thread(cluster.active_controller, 90)
        topic = topics.experiences if what == "experiences leader" else topics.policy_checkpoints
        return await cluster.partition_leader(topic.name, timeout=90)

    failovers = [
        Failover("experiences leader", 0),
        Failover("policy-checkpoints leader", 0),
        Failover("active controller", 0),
    ]
    try:
        async with (
            EventPublisher(cluster.bootstrap, service) as pub,
            PolicySubscriber(cluster.bootstrap, service.policy, service) as sub,
        ):
            # what the serving checkpoint had learnt before the stream (the pipeline is idle now)
            serving0 = int(metric(l0, "causalmem_checkpoint_version", role="serving"))
            e0 = (await sub.wait_for_policy(min_version=serving0, timeout=60)).manifest.metrics["experiences"]

            def newer_than(version: int) -> Callable[[], bool]:
                return lambda: sub.current is not None and sub.current.version > version

            def updated_since(t: float) -> Callable[[], bool]:
                return lambda: bool(samples) and samples[-1].last_update > t

            started = time.time()
            tasks = [asyncio.create_task(sample()), asyncio.create_task(stream(pub))]
            try:
                await asyncio.sleep(8.0)  # the steady state, before any failure
                for f in failovers:
                    await cluster.wait_in_sync()
                    f.node = await holder(f.what)
                    for (topic, _), d in (await cluster.describe_partitions()).items():
                        if d["leader"] == f.node:
                            f.led[topic] = f.led.get(topic, 0) + 1
                    assert sub.current is not None
                    f.loaded_before = sub.current.version
                    log.info("failover: SIGKILL node %d, the %s", f.node, f.what)
                    f.killed = time.time()
                    await asyncio.to_thread(cluster.kill_node, f.node)
                    # the failover itself: another node takes the role (the killed one is fenced
                    # once its broker session times out; a new quorum leader is elected sooner)
                    await holder(f.what)
                    f.moved_s = time.time() - f.killed
                    await asyncio.sleep(FAILOVER_DOWN_S)
                    f.restarted_s = await asyncio.to_thread(cluster.restart_node, f.node)
                    f.restarted = time.time()
                    f.in_sync_s = await cluster.wait_in_sync()
                    await until(
                        updated_since(f.restarted),
                        90,
                        f"the learner's updates after the {f.what} failed",
                    )
                    # the clients keep loading verified checkpoints: a newer one than at the kill
                    await until(
                        newer_than(f.loaded_before),
                        90,
                        f"a checkpoint newer than v{f.loaded_before} after the {f.what} failed",
                    )
                    assert sub.health() == "ok", sub.health()
                    assert sub.current is not None and sub.current.manifest.signature
                    f.loaded_after = sub.current.version
                    f.recovered = time.time()
                    assert dep.worker.alive() and dep.learner.alive(), dep.logs()
                await asyncio.sleep(3.0)  # the stream goes on a little after the last failover
            finally:
                stop.set()
                for result in await asyncio.gather(*tasks, return_exceptions=True):
                    if isinstance(result, Exception):
                        raise result
            assert await pub.flush(120.0), "the service's events not all acknowledged"
            assert (pub.dropped, pub.in_doubt) == (0, 0)
            n = len(published)

            # nothing lost: the worker joined every pair (at least once: it may join a pair again
            # after a failover, at-least-once with the ids deduplicated downstream) ...
            await asyncio.to_thread(wait_metric, dep.worker, "causalmem_joins_total", joins0 + n, 180)
            # ... and the learner learnt every one, exactly once
            await asyncio.to_thread(
                wait_metric, dep.learner, "causalmem_learner_experiences_total", learnt0 + n, 180, kind="feedback"
            )
            await asyncio.sleep(3.0)
            w1 = await asyncio.to_thread(dep.worker.metrics)
            l1 = await asyncio.to_thread(dep.learner.metrics)
            assert metric(l1, "causalmem_learner_experiences_total", kind="feedback") == learnt0 + n, dep.logs()
            joins = metric(w1, "causalmem_joins_total") - joins0
            dups = metric(l1, "causalmem_learner_skipped_total", reason="duplicate") - dups0

            # every pair's experience is on the topic, under its event's id
            records = await kafka.read_all(cluster.bootstrap, operator, topics.experiences.name)
            ids = [
                exp.id
                for exp in (decode_experience(r.value, operator.limits()) for r in records if r.value is not None)
                if exp.event.query_id.startswith(f"{run}-")
            ]
            assert set(ids) == set(published), f"{len(set(published) - set(ids))} pair(s) missing"

            # the clients still load what the learner serves, with every pair learnt once
            await until(
                lambda: sub.current is not None and sub.current.manifest.metrics.get("experiences") == e0 + n,
                60,
                f"a checkpoint with the {n} pairs learnt on top of {e0}",
            )
            assert sub.health() == "ok" and sub.current is not None and sub.current.manifest.signature
    finally:
        for node in cluster.nodes:  # every node running again, whatever failed above
            if node.node_id not in cluster.running():
                await asyncio.to_thread(cluster.restart_node, node.node_id)

    # the same processes all along: the worker and the learner were never restarted
    assert (dep.worker.proc.pid, dep.learner.proc.pid) == (worker_pid, learner_pid)
    assert dep.worker.alive() and dep.learner.alive(), dep.logs()
    assert metric(l1, "causalmem_learner_training_alive") == 1

    report = {
        "pairs": n,
        "rate_per_s": FAILOVER_RATE,
        "worker_joins": joins,
        "worker_joins_again": joins - n,
        "learner_duplicates_skipped": dups,
        "experience_records": len(ids),
        **pauses(samples, failovers, started),
        # the raw series, relative to the stream's start: [t, last update, updates, checkpoints, joins]
        "kills": [round(f.killed - started, 2) for f in failovers],
        "samples": [
            [round(x.t - started, 2), round(x.last_update - started, 2), x.updates, x.publishes, x.joins]
            for x in samples
        ],
    }
    (dep.roles.tmp / "failover.json").write_text(json.dumps(report, indent=2))
    log.warning("failover: %s", json.dumps({k: v for k, v in report.items() if k != "samples"}))
    assert sorted(cluster.running()) == [n.node_id for n in cluster.nodes]
