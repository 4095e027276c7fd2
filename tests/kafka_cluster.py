"""A real Apache Kafka cluster on loopback for the tests: three KRaft nodes, secured as deployed.

The jars of a pinned Apache Kafka come from Maven (a generated pom, ``mvn
dependency:copy-dependencies``) into a cache outside the repository,
``~/.cache/causalmem/kafka/<version>/libs`` (``CAUSALMEM_KAFKA_CACHE`` moves it), fetched once
and reused. :class:`KafkaCluster` then, in a fresh temporary directory:

- writes three nodes' ``server.properties``, each node both broker and controller (a static
  quorum of the three), every port a free loopback port;
- secures them as ``docker-compose.yml`` does: one ``SASL_PLAINTEXT`` listener for clients and
  between brokers, a ``CONTROLLER`` listener; clients authenticate with SCRAM-SHA-512, the
  nodes themselves and the ``admin`` super user with PLAIN (from a JAAS file, like compose's);
  the ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``; no topic
  auto-creation; replication factor 3 and ``min.insync.replicas`` 2 by default;
- formats each node's storage (``kafka-storage format``), starts the nodes and waits until
  every node lists all three brokers;
- creates one SCRAM user per role (``kafka-configs --alter --add-config-file``, each password
  in a file only this user can read, as compose's ``kafka-setup``) and applies the ACLs by
  running ``deploy/kafka/acls.sh`` itself, whose ``kafka-acls.sh`` is a wrapper here that runs
  the tool's main class on the cached classpath.

For the failover tests, :meth:`KafkaCluster.partition_leader` says which node leads a topic's
partition, :meth:`KafkaCluster.active_controller` which one is the KRaft quorum's leader
(``kafka-metadata-quorum describe --status``), :meth:`KafkaCluster.kill_node` SIGKILLs a node by
its PID, :meth:`KafkaCluster.restart_node` starts it again with its own ``server.properties``
and data, and :meth:`KafkaCluster.wait_in_sync` waits until every partition has all its
replicas in sync again.

:meth:`KafkaCluster.stop` sends SIGTERM to each node it started (by its PID), SIGKILL after a
deadline, and deletes the directory: nothing is left behind (``CAUSALMEM_KAFKA_KEEP=1`` keeps
it, with each node's ``server.log``). Without Java or Maven, or when the
jars cannot be fetched, :class:`KafkaUnavailable` says why (the tests skip with that reason).

As a script::

    python -m tests.kafka_cluster fetch   # only resolve the jars into the cache
    python -m tests.kafka_cluster check   # start the cluster, print the timings, stop it
    python -m tests.kafka_cluster run     # start it and keep it until Ctrl-C (prints how to connect)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

KAFKA_VERSION = "4.1.1"
# The SLF4J 1.x binding to log4j 2 that Apache Kafka's own distribution ships (its jars name none).
LOG4J_VERSION = "2.24.3"
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[1]
ACLS_SCRIPT = REPO_ROOT / "deploy" / "kafka" / "acls.sh"

# The product's roles and their SCRAM users, as deploy/kafka/acls.sh and docker-compose.yml name them.
ROLES: dict[str, str] = {
    "operator": "causalmem-operator",
    "worker": "causalmem-worker",
    "learner": "causalmem-learner",
    "service": "causalmem-service",
    "labeler": "labeler",
    "evaluator": "causalmem-evaluator",
    "writes": "causalmem-writes",
    "ui": "causalmem-ui",
}
ADMIN_USER = "admin"  # the super user (PLAIN, as in compose)

# --------------------------------------------------------------------------- the settings
# What the cluster runs, declared once: the deployment files must say the same
# (tests/unit/project/test_kafka_deploy_drift.py compares docker-compose.yml and deploy/k8s/ with these).

# Every node's security: SASL on every listener (SCRAM-SHA-512 for clients, PLAIN for the nodes
# and the admin super user), the StandardAuthorizer refusing what no ACL grants, no auto-creation.
BROKER_SECURITY: dict[str, str] = {
    "process.roles": "broker,controller",
    "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "SASL_PLAINTEXT",
    "sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
    "sasl.mechanism.inter.broker.protocol": "PLAIN",
    "sasl.mechanism.controller.protocol": "PLAIN",
    "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
    "super.users": f"User:{ADMIN_USER}",
    "allow.everyone.if.no.acl.found": "false",
    "auto.create.topics.enable": "false",
}
# The clients' side of it (the CAUSALMEM_* environment of every role).
CLIENT_SECURITY: dict[str, str] = {
    "CAUSALMEM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
    "CAUSALMEM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
}
# Durability: three copies of every partition, a write acknowledged once two have it.
REPLICATION_FACTOR = 3
MIN_INSYNC_REPLICAS = 2


def broker_durability(
    replication_factor: int = REPLICATION_FACTOR, min_insync: int = MIN_INSYNC_REPLICAS
) -> dict[str, str]:
    """The broker settings that give every topic, the brokers' own included, these copies."""
    rf, isr = str(replication_factor), str(min_insync)
    return {
        "default.replication.factor": rf,
        "min.insync.replicas": isr,
        "offsets.topic.replication.factor": rf,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": isr,
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": isr,
    }


# The tools' main classes (what bin/kafka-*.sh of the distribution run).
TOOLS: dict[str, str] = {
    "kafka-storage.sh": "kafka.tools.StorageTool",
    "kafka-configs.sh": "kafka.admin.ConfigCommand",
    "kafka-acls.sh": "org.apache.kafka.tools.AclCommand",
    "kafka-topics.sh": "org.apache.kafka.tools.TopicCommand",
    "kafka-metadata-quorum.sh": "org.apache.kafka.tools.MetadataQuorumCommand",
    "kafka-dump-log.sh": "kafka.tools.DumpLogSegments",
}
# A short-lived tool JVM: start fast, little memory.
TOOL_JVM = ["-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"]
STOP_TIMEOUT_S = 10.0


class KafkaUnavailable(RuntimeError):
    """Apache Kafka cannot run here (no Java or Maven, or the jars could not be fetched)."""


# --------------------------------------------------------------------------- the jars


def cache_dir(version: str = KAFKA_VERSION) -> Path:
    base = os.environ.get("CAUSALMEM_KAFKA_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "causalmem" / "kafka"
    )
    return Path(base) / version


def tools_archive(libs: Path) -> Path:
    """The tools' class-data archive (JVM AppCDS) beside the jars, one per Java runtime: a tool
    starts in ~0.8 s with it instead of ~1.5 s (acls.sh runs the ACL tool two dozen times)."""
    java = Path(os.path.realpath(java_binary()))
    key = hashlib.sha1(f"{java}:{java.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    return libs.parent / f"tools-{key}.jsa"


def _pom(version: str) -> str:
    return f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.causalmem</groupId>
  <artifactId>apache-kafka-classpath</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>{version}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId><version>{version}</version>
      <exclusions>
        <!-- Connect's worker (Jetty, Jersey): none of the tools used here needs it -->
        <exclusion><groupId>org.apache.kafka</groupId><artifactId>connect-runtime</artifactId></exclusion>
      </exclusions>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId>
      <version>{LOG4J_VERSION}</version>
    </dependency>
  </dependencies>
</project>
"""


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` or the ``java`` on PATH, checked to be Java 17 or later."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        found: str | None = str(Path(home) / "bin" / "java")
    else:
        found = shutil.which("java")
    if not found:
        raise KafkaUnavailable("no Java runtime (java not on PATH, JAVA_HOME unset): Apache Kafka needs Java 17+")
    major = _java_major(found)
    if major < 17:
        raise KafkaUnavailable(f"{found} is Java {major or '?'}: Apache Kafka 4 needs Java 17+")
    return found


@functools.cache
def _java_major(java: str) -> int:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        return 0
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not match:
        return 0
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def resolve_jars(version: str = KAFKA_VERSION, quiet: bool = True) -> Path:
    """The folder of Apache Kafka ``version``'s jars, fetched with Maven into the cache on first use."""
    java_binary()
    root = cache_dir(version)
    libs = root / "libs"
    done = libs / ".complete"
    if done.exists():
        return libs
    mvn = shutil.which("mvn")
    if not mvn:
        raise KafkaUnavailable(f"Maven (mvn) is not on PATH: it fetches Apache Kafka {version}'s jars into {root}")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be fetching the same version
        if done.exists():
            return libs
        work = Path(tempfile.mkdtemp(prefix="fetch-", dir=root))
        try:
            (work / "pom.xml").write_text(_pom(version))
            cmd = [
                mvn,
                "-B",
                *(["-q"] if quiet else []),
                "-f",
                str(work / "pom.xml"),
                f"{DEPENDENCY_PLUGIN}:copy-dependencies",
                f"-DoutputDirectory={work / 'libs'}",
                "-DincludeScope=runtime",
            ]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired as exc:
                raise KafkaUnavailable(f"Maven did not fetch Apache Kafka {version} within 15 min") from exc
            jars = sorted(p.name for p in (work / "libs").glob("*.jar")) if (work / "libs").is_dir() else []
            if out.returncode != 0 or f"kafka_2.13-{version}.jar" not in jars:
                tail = (out.stdout + out.stderr).strip()[-1500:]
                raise KafkaUnavailable(f"Maven could not fetch Apache Kafka {version} (exit {out.returncode}): {tail}")
            (work / "libs" / ".complete").write_text("\n".join(jars) + "\n")
            shutil.rmtree(libs, ignore_errors=True)
            os.replace(work / "libs", libs)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return libs


# --------------------------------------------------------------------------- the cluster


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together, so none is handed out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _cluster_id() -> str:
    """A random cluster id as Apache Kafka's ``Uuid.randomUuid`` makes one: never starting with
    ``-``, which ``kafka-storage format -t`` would take for an option (1 start in 64 failed so)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


@contextlib.contextmanager
def _quiet_clients() -> Iterator[None]:
    """No client warnings while a node is expected to refuse (not listening yet, users not known yet)."""
    logger = logging.getLogger("aiokafka")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _die_with_parent() -> Any:
    from pipeline.broker import _die_with_parent as preexec

    return preexec()


@dataclass
class Node:
    node_id: int
    port: int  # SASL_PLAINTEXT: clients and the other brokers
    controller_port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.dir / "server.log"


@dataclass
class Credentials:
    username: str
    password: str = field(repr=False)


LOG4J2 = """status = warn
appender.out.type = Console
appender.out.name = out
appender.out.target = SYSTEM_OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.out.ref = out
logger.kafka.name = kafka
logger.kafka.level = {level}
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.clients.name = org.apache.kafka.clients
logger.clients.level = WARN
"""


class KafkaCluster:
    """Three KRaft nodes (broker + controller each) on loopback, SASL/SCRAM and ACLs as deployed.

    >>> with KafkaCluster() as cluster:  # doctest: +SKIP
    ...     settings = Settings.from_env(cluster.env("operator"))
    """

    def __init__(
        self,
        nodes: int = 3,
        version: str = KAFKA_VERSION,
        heap: str = "256m",
        replication_factor: int = REPLICATION_FACTOR,
        min_insync_replicas: int = MIN_INSYNC_REPLICAS,
        topic_prefix: str = "",
        workdir: str | Path | None = None,
    ) -> None:
        self.version = version
        self.heap = heap
        self.replication_factor = replication_factor
        self.min_insync_replicas = min_insync_replicas
        self.topic_prefix = topic_prefix
        self._workdir_parent = Path(workdir) if workdir else None
        self.dir: Path | None = None
        self.nodes: list[Node] = []
        self.node_count = nodes
        self.admin = Credentials(ADMIN_USER, secrets.token_hex(16))
        self.users = {role: Credentials(name, secrets.token_hex(16)) for role, name in ROLES.items()}
        self.libs: Path | None = None
        self.timings: dict[str, float] = {}

    # -- connection info -------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def env(self, role: str) -> dict[str, str]:
        """The ``CAUSALMEM_*`` environment of a process of ``role``, as compose gives it (with 3/2 durability)."""
        user = self.users[role]
        return {
            "CAUSALMEM_BOOTSTRAP": self.bootstrap,
            "CAUSALMEM_TOPIC_PREFIX": self.topic_prefix,
            "CAUSALMEM_REPLICATION_FACTOR": str(self.replication_factor),
            "CAUSALMEM_MIN_INSYNC_REPLICAS": str(self.min_insync_replicas),
            **CLIENT_SECURITY,
            "CAUSALMEM_KAFKA_SASL_USERNAME": user.username,
            "CAUSALMEM_KAFKA_SASL_PASSWORD": user.password,
        }

    def admin_kwargs(self) -> dict[str, Any]:
        """aiokafka keyword arguments of the super user (PLAIN, as compose's admin.properties)."""
        return {
            "bootstrap_servers": self.bootstrap,
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "PLAIN",
            "sasl_plain_username": self.admin.username,
            "sasl_plain_password": self.admin.password,
        }

    @property
    def bin(self) -> Path:
        assert self.dir is not None
        return self.dir / "bin"

    @property
    def admin_config(self) -> Path:
        assert self.dir is not None
        return self.dir / "admin.properties"

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> KafkaCluster:
        t0 = time.monotonic()
        self.libs = resolve_jars(self.version)
        self.timings["jars_s"] = time.monotonic() - t0
        if not ACLS_SCRIPT.is_file():
            raise FileNotFoundError(ACLS_SCRIPT)
        self.dir = Path(tempfile.mkdtemp(prefix="causalmem-kafka-", dir=self._workdir_parent))
        try:
            self._write_files()
            t1 = time.monotonic()
            self._format()
            self.timings["format_s"] = time.monotonic() - t1
            t2 = time.monotonic()
            for node in self.nodes:
                self._start_node(node)
            self._wait_ready(t2 + timeout)
            self.timings["nodes_ready_s"] = time.monotonic() - t2
            self._ensure_tools_archive()
            t3 = time.monotonic()
            self._create_users()
            self.timings["users_s"] = time.monotonic() - t3
            t4 = time.monotonic()
            self._apply_acls()
            self._wait_authenticates(time.monotonic() + 60)
            self.timings["acls_s"] = time.monotonic() - t4
        except BaseException:
            self.stop()
            raise
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM each node started here, SIGKILL after ``timeout``; then delete the directory."""
        t0 = time.monotonic()
        procs = [n.proc for n in self.nodes if n.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        for n in self.nodes:
            n.proc = None
        if self.dir is not None and os.environ.get("CAUSALMEM_KAFKA_KEEP") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        self.timings["stop_s"] = time.monotonic() - t0

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- failures (the failover tests) -----------------------------------------------------
    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no node {node_id} (nodes {[n.node_id for n in self.nodes]})")

    def kill_node(self, node_id: int) -> None:
        """SIGKILL node ``node_id`` by its PID (no clean shutdown: its leaderships and its controller
        role are lost as in a crash), and reap it. Its directory and data stay for :meth:`restart_node`."""
        node = self.node(node_id)
        if node.proc is None or node.proc.poll() is not None:
            raise RuntimeError(f"Kafka node {node_id} is not running")
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait(30)

    def restart_node(self, node_id: int, timeout: float = 120.0) -> float:
        """Start node ``node_id`` again, with the same ``server.properties`` and data directory, and
        wait until it answers listing every broker; the seconds that took."""
        node = self.node(node_id)
        if node.proc is not None and node.proc.poll() is None:
            raise RuntimeError(f"Kafka node {node_id} is still running (pid {node.proc.pid})")
        t0 = time.monotonic()
        self._start_node(node)
        self._wait_ready(t0 + timeout, [node])
        return time.monotonic() - t0

    def running(self) -> list[int]:
        """The ids of the nodes whose processes run."""
        return [n.node_id for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    async def describe_partitions(self, topics: list[str] | None = None) -> dict[tuple[str, int], dict[str, Any]]:
        """``{(topic, partition): {"leader", "replicas", "isr"}}`` from the metadata the super user
        gets (every topic when ``topics`` is None); a leader of -1 means none right now."""
        from aiokafka.admin import AIOKafkaAdminClient

        client = AIOKafkaAdminClient(**self.admin_kwargs(), request_timeout_ms=5000)
        await asyncio.wait_for(client.start(), 15)
        try:
            described = await asyncio.wait_for(client.describe_topics(topics), 15)
        finally:
            await client.close()
        out: dict[tuple[str, int], dict[str, Any]] = {}
        for topic in described:
            for p in topic["partitions"]:
                out[(topic["topic"], int(p["partition"]))] = {
                    "leader": int(p["leader"]),
                    "replicas": sorted(int(r) for r in p["replicas"]),
                    "isr": sorted(int(r) for r in p["isr"]),
                    "error_code": int(p["error_code"]),
                }
        return out

    async def partition_leader(self, topic: str, partition: int = 0, timeout: float = 60.0) -> int:
        """The node id leading ``topic``'s ``partition`` (waits while it has none, e.g. mid-election)."""
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            try:
                with _quiet_clients():
                    described = await self.describe_partitions([topic])
                last = described.get((topic, partition))
                if last is not None and last["leader"] >= 0 and last["leader"] in self.running():
                    return int(last["leader"])
            except Exception as exc:
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"no leader of {topic}-{partition} within {timeout:.0f} s ({last!r})")
            await asyncio.sleep(0.5)

    async def wait_in_sync(self, timeout: float = 120.0) -> float:
        """Until every partition of every topic has a leader and all its replicas in sync (a node
        restarted has caught up); the seconds that took."""
        t0 = time.monotonic()
        last: object = None
        while True:
            try:
                with _quiet_clients():
                    described = await self.describe_partitions()
                behind = {f"{t}-{p}": d["isr"] for (t, p), d in described.items() if d["isr"] != d["replicas"]}
                behind.update({f"{t}-{p}": "no leader" for (t, p), d in described.items() if d["leader"] < 0})
                if described and not behind:
                    return time.monotonic() - t0
                last = dict(sorted(behind.items())[:5])
            except Exception as exc:
                last = exc
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"partitions not in sync within {timeout:.0f} s: {last!r}")
            await asyncio.sleep(0.5)

    def active_controller(self, timeout: float = 60.0) -> int:
        """The node id of the KRaft quorum's leader, the active controller (``kafka-metadata-quorum
        describe --status``: brokers report some live broker as the "controller" to clients, not it)."""
        deadline = time.monotonic() + timeout
        while True:
            out = subprocess.run(
                [
                    str(self.bin / "kafka-metadata-quorum.sh"),
                    "--bootstrap-server",
                    ",".join(f"{HOST}:{self.node(i).port}" for i in self.running()),
                    "--command-config",
                    str(self.admin_config),
                    "describe",
                    "--status",
                ],
                capture_output=True,
                text=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
            )
            match = re.search(r"^LeaderId:\s*(-?\d+)", out.stdout, re.M)
            if out.returncode == 0 and match and int(match.group(1)) in self.running():
                return int(match.group(1))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no active controller within {timeout:.0f} s: {(out.stdout + out.stderr)[-2000:]}")
            time.sleep(0.5)

    def producer_ids(self, topic: str) -> dict[int, int]:
        """How many record batches of ``topic`` each producer id wrote (-1: a producer that was not
        idempotent), from the log segments of every partition on disk (Kafka's dump tool)."""
        node = self.nodes[0]
        logs = sorted(str(f) for f in (node.dir / "data").glob(f"{topic}-[0-9]*/*.log"))
        if not logs:
            return {}
        out = subprocess.run(
            [str(self.bin / "kafka-dump-log.sh"), "--files", ",".join(logs)],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        if out.returncode != 0:
            raise RuntimeError(f"kafka-dump-log.sh failed: {(out.stdout + out.stderr)[-2000:]}")
        counts: dict[int, int] = {}
        for pid in re.findall(r"producerId: (-?\d+)", out.stdout):
            counts[int(pid)] = counts.get(int(pid), 0) + 1
        return counts

    # -- steps -----------------------------------------------------------------------------
    def server_properties(self, node: Node) -> dict[str, str]:
        """``node``'s ``server.properties``: :data:`BROKER_SECURITY` and :func:`broker_durability`
        (as many copies as there are nodes, at most), its listeners, and sizes for a small machine."""
        voters = ",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in self.nodes)
        rf = min(self.replication_factor, self.node_count)
        isr = min(self.min_insync_replicas, rf)
        props: dict[str, object] = {
            "node.id": node.node_id,
            "listeners": f"SASL_PLAINTEXT://{HOST}:{node.port},CONTROLLER://{HOST}:{node.controller_port}",
            "advertised.listeners": f"SASL_PLAINTEXT://{HOST}:{node.port}",
            "controller.quorum.voters": voters,
            **BROKER_SECURITY,
            "log.dirs": str(node.dir / "data"),
            **broker_durability(rf, isr),
            "offsets.topic.num.partitions": 8,
            "transaction.state.log.num.partitions": 4,
            "group.initial.rebalance.delay.ms": 0,
            # a small machine: few threads, a small cleaner buffer (the default takes 128 MiB of heap)
            "num.network.threads": 2,
            "num.io.threads": 2,
            "background.threads": 2,
            "num.replica.fetchers": 1,
            "log.cleaner.threads": 1,
            "log.cleaner.dedupe.buffer.size": 8 * 1024 * 1024,
            "num.recovery.threads.per.data.dir": 1,
        }
        return {k: str(v) for k, v in props.items()}

    def _write_files(self) -> None:
        assert self.dir is not None and self.libs is not None
        old = os.umask(0o077)  # the passwords below: readable by this user only
        try:
            ports = _free_ports(2 * self.node_count)
            self.nodes = [
                Node(i + 1, ports[2 * i], ports[2 * i + 1], self.dir / f"node{i + 1}") for i in range(self.node_count)
            ]
            (self.dir / "log4j2-server.properties").write_text(LOG4J2.format(level="INFO"))
            (self.dir / "log4j2-tools.properties").write_text(LOG4J2.format(level="WARN"))
            # The brokers' JAAS file, as compose's: SCRAM for clients, PLAIN for the nodes and the admin.
            pw = self.admin.password
            (self.dir / "kafka_server_jaas.conf").write_text(
                "KafkaServer {\n"
                "  org.apache.kafka.common.security.scram.ScramLoginModule required;\n"
                "  org.apache.kafka.common.security.plain.PlainLoginModule required "
                f'username="{ADMIN_USER}" password="{pw}" user_{ADMIN_USER}="{pw}";\n'
                "};\n"
            )
            self.admin_config.write_text(
                "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=PLAIN\n"
                "sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required "
                f'username="{ADMIN_USER}" password="{pw}";\n'
            )
            for n in self.nodes:
                n.dir.mkdir()
                props = self.server_properties(n)
                (n.dir / "server.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
            self.bin.mkdir()
            for name, main in TOOLS.items():
                wrapper = self.bin / name
                wrapper.write_text(
                    "#!/bin/sh\n# Apache Kafka's tool, from the cached jars (tests/kafka_cluster.py)\n"
                    f"jsa={shlex.quote(str(tools_archive(self.libs)))}\n"
                    'share=; [ -f "$jsa" ] && share="-XX:SharedArchiveFile=$jsa"\n'
                    f"exec {' '.join(shlex.quote(a) for a in self._tool_command(main))} $share "
                    f"-cp {shlex.quote(str(self.libs))}/'*' {main} \"$@\"\n"
                )
                wrapper.chmod(0o700)
        finally:
            os.umask(old)

    def _tool_command(self, main: str) -> list[str]:
        """``java`` and its options for a tool (the classpath and main class follow)."""
        assert self.dir is not None
        return [java_binary(), *TOOL_JVM, f"-Dlog4j2.configurationFile={self.dir / 'log4j2-tools.properties'}"]

    def _ensure_tools_archive(self) -> None:
        """Record the tools' class-data archive once per cache, from a run of the ACL tool (best effort)."""
        assert self.libs is not None
        jsa = tools_archive(self.libs)
        if jsa.exists():
            return
        tmp = jsa.with_name(f"{jsa.stem}.{os.getpid()}.tmp")
        main = TOOLS["kafka-acls.sh"]
        cmd = [
            *self._tool_command(main),
            f"-XX:ArchiveClassesAtExit={tmp}",
            "-cp",
            f"{self.libs}/*",
            main,
            "--bootstrap-server",
            self.bootstrap,
            "--command-config",
            str(self.admin_config),
            "--list",
        ]
        try:
            subprocess.run(cmd, capture_output=True, timeout=120, stdin=subprocess.DEVNULL, check=True)
            if tmp.exists():
                os.replace(tmp, jsa)
        except (OSError, subprocess.SubprocessError):
            pass  # the tools just start slower
        finally:
            tmp.unlink(missing_ok=True)

    def _format(self) -> None:
        cluster_id = _cluster_id()
        # The nodes' formats are independent: run them together.
        procs = [
            subprocess.Popen(
                [
                    str(self.bin / "kafka-storage.sh"),
                    "format",
                    "-t",
                    cluster_id,
                    "-c",
                    str(n.dir / "server.properties"),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            for n in self.nodes
        ]
        for n, proc in zip(self.nodes, procs, strict=True):
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"kafka-storage format of node {n.node_id} exited {proc.returncode}: {out[-2000:]}")

    def _start_node(self, node: Node) -> None:
        assert self.dir is not None and self.libs is not None
        cmd = [
            java_binary(),
            f"-Xmx{self.heap}",
            "-Xms64m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2-server.properties'}",
            f"-Djava.security.auth.login.config={self.dir / 'kafka_server_jaas.conf'}",
            "-cp",
            f"{self.libs}/*",
            "kafka.Kafka",
            str(node.dir / "server.properties"),
        ]
        with open(node.log, "ab") as out:
            node.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent()
            )

    def _log_tail(self, node: Node, chars: int = 3000) -> str:
        try:
            return node.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _check_alive(self) -> None:
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is not None:
                raise RuntimeError(f"Kafka node {n.node_id} exited with {n.proc.returncode}:\n{self._log_tail(n)}")

    def _wait_ready(self, deadline: float, nodes: list[Node] | None = None) -> None:
        """Until every node (of ``nodes``) answers the admin's metadata request listing every broker."""
        pending = list(self.nodes if nodes is None else nodes)
        last: object = None
        while pending:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Kafka nodes {[n.node_id for n in pending]} not ready ({last!r}):\n{self._log_tail(pending[0])}"
                )
            node = pending[0]
            try:
                with _quiet_clients():
                    brokers = asyncio.run(self._brokers_seen(f"{HOST}:{node.port}"))
                last = brokers
                if len(brokers) == self.node_count:
                    pending.pop(0)
                    continue
            except Exception as exc:
                last = exc
            time.sleep(0.5)

    async def _brokers_seen(self, bootstrap: str) -> list[int]:
        from aiokafka.admin import AIOKafkaAdminClient

        client = AIOKafkaAdminClient(**{**self.admin_kwargs(), "bootstrap_servers": bootstrap}, request_timeout_ms=5000)
        await asyncio.wait_for(client.start(), 10)
        try:
            described = await asyncio.wait_for(client.describe_cluster(), 10)
            return sorted(int(b["node_id"]) for b in described["brokers"])
        finally:
            await client.close()

    def _create_users(self, parallel: int = 3) -> None:
        """One SCRAM-SHA-512 user per role, as compose's kafka-setup makes them: ``kafka-configs
        --add-config-file``, the password in a file only this user can read, never on a command line.

        The file holds ``SCRAM-SHA-512=password=...``: the tool reads a file's values as they are,
        so the brackets that ``--add-config`` needs (``SCRAM-SHA-512=[password=...]``) would be
        part of the value there, and it refuses that ("Invalid credential property").
        """
        assert self.dir is not None
        old = os.umask(0o077)
        files: list[Path] = []
        try:
            pending = list(self.users.values())
            running: list[tuple[Credentials, subprocess.Popen[str]]] = []
            while pending or running:
                while pending and len(running) < parallel:
                    user = pending.pop(0)
                    scram = self.dir / f"scram-{user.username}.properties"
                    scram.write_text(f"SCRAM-SHA-512=password={user.password}\n")
                    files.append(scram)
                    cmd = [
                        str(self.bin / "kafka-configs.sh"),
                        "--bootstrap-server",
                        self.bootstrap,
                        "--command-config",
                        str(self.admin_config),
                        "--alter",
                        "--entity-type",
                        "users",
                        "--entity-name",
                        user.username,
                        "--add-config-file",
                        str(scram),
                    ]
                    proc = subprocess.Popen(
                        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
                    )
                    running.append((user, proc))
                user, proc = running.pop(0)
                out, _ = proc.communicate(timeout=120)
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"kafka-configs for user {user.username} exited {proc.returncode}: {out[-2000:]}"
                    )
        finally:
            for _user, proc in running:
                proc.kill()
                proc.wait()
            for f in files:
                f.unlink(missing_ok=True)
            os.umask(old)

    def _apply_acls(self) -> None:
        """deploy/kafka/acls.sh, run as the super user against this cluster."""
        env = {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "KAFKA_ACLS": str(self.bin / "kafka-acls.sh"),
            "KAFKA_BOOTSTRAP": self.bootstrap,
            "KAFKA_ADMIN_CONFIG": str(self.admin_config),
            "CAUSALMEM_TOPIC_PREFIX": self.topic_prefix,
            "LABELER_PRINCIPALS": f"User:{self.users['labeler'].username}",
        }
        out = subprocess.run(
            ["bash", str(ACLS_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
        if out.returncode != 0:
            raise RuntimeError(f"deploy/kafka/acls.sh exited {out.returncode}: {out.stderr[-2000:]}")

    def _wait_authenticates(self, deadline: float) -> None:
        """Until every role's SCRAM user logs in on every node (the users reach the brokers asynchronously)."""
        from aiokafka.admin import AIOKafkaAdminClient

        async def login(bootstrap: str, user: Credentials) -> None:
            client = AIOKafkaAdminClient(
                bootstrap_servers=bootstrap,
                security_protocol="SASL_PLAINTEXT",
                sasl_mechanism="SCRAM-SHA-512",
                sasl_plain_username=user.username,
                sasl_plain_password=user.password,
                request_timeout_ms=5000,
            )
            await asyncio.wait_for(client.start(), 10)
            await client.close()

        async def all_logins() -> None:
            for n in self.nodes:
                for user in self.users.values():
                    await login(f"{HOST}:{n.port}", user)

        while True:
            try:
                with _quiet_clients():
                    asyncio.run(all_logins())
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the SCRAM users cannot log in: {exc!r}") from exc
                self._check_alive()
                time.sleep(0.5)


# --------------------------------------------------------------------------- the script


def write_env_files(cluster: KafkaCluster) -> Path:
    """One ``<role>.env`` per role in the cluster's directory (readable by this user only): the
    ``CAUSALMEM_*`` settings that process runs with, its SCRAM user and password included."""
    assert cluster.dir is not None
    env_dir = cluster.dir / "env"
    env_dir.mkdir(mode=0o700, exist_ok=True)
    for role in ROLES:
        path = env_dir / f"{role}.env"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"# {role} ({cluster.users[role].username})\n")
            f.write("".join(f"{k}={v}\n" for k, v in cluster.env(role).items()))
    return env_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kafka_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["fetch", "check", "run"], nargs="?", default="check")
    parser.add_argument("--version", default=KAFKA_VERSION, help="Apache Kafka version (default %(default)s)")
    parser.add_argument("--heap", default="256m", help="each node's JVM heap (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.action == "fetch":
            t0 = time.monotonic()
            libs = resolve_jars(args.version, quiet=False)
            print(f"Apache Kafka {args.version}: {libs} ({time.monotonic() - t0:.1f} s)")
            return 0
        cluster = KafkaCluster(version=args.version, heap=args.heap)
        with cluster:
            timings = {k: round(v, 1) for k, v in cluster.timings.items()}
            print(
                f"Apache Kafka {args.version}, 3 KRaft nodes on {cluster.bootstrap}: started in {timings}", flush=True
            )
            if args.action == "run":
                env_dir = write_env_files(cluster)
                print(f"each role's CAUSALMEM_* settings: {env_dir}/<role>.env ({', '.join(ROLES)})", flush=True)
                print(f"  e.g. set -a; . {env_dir}/operator.env; set +a; causalmem init-topics", flush=True)
                print(f"the tools: {cluster.bin}; super user: --command-config {cluster.admin_config}", flush=True)
                print("Ctrl-C stops it and deletes every file it wrote", flush=True)
                stop: list[int] = []
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, lambda s, _f: stop.append(s))
                while not stop:
                    cluster._check_alive()
                    time.sleep(0.5)
        print(json.dumps({k: round(v, 1) for k, v in cluster.timings.items()}))
        return 0
    except KafkaUnavailable as exc:
        print(f"Apache Kafka unavailable: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
