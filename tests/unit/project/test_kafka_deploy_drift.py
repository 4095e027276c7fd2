"""The deployment files name the Apache Kafka the tests ran (issue 41, "Deployment files that were run").

tests/kafka_cluster.py declares what its three-node cluster runs: the version
(``KAFKA_VERSION``), every node's security (``BROKER_SECURITY``), the clients' side of it
(``CLIENT_SECURITY``) and the durability (``REPLICATION_FACTOR``, ``MIN_INSYNC_REPLICAS``, the
broker settings of ``broker_durability``). Here, without Java or a cluster:

- the cluster's own ``server.properties`` are made from those declarations;
- ``docker-compose.yml`` runs that version (broker and setup), its broker has that security
  (the image's ``KAFKA_*`` variables, read as the image reads them) and its processes the
  clients' security; being one broker it keeps one copy of everything, consistently (broker
  and ``CAUSALMEM_*``), and says why next to the setting;
- ``deploy/k8s/`` gives its processes the clients' security and the cluster's durability, and
  its ConfigMap names the version and the broker settings that its (external) cluster needs;
- no deployment file names another Apache Kafka version.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.kafka_cluster import (
    BROKER_SECURITY,
    CLIENT_SECURITY,
    KAFKA_VERSION,
    MIN_INSYNC_REPLICAS,
    REPLICATION_FACTOR,
    KafkaCluster,
    Node,
    broker_durability,
)
from tests.paths import REPO_ROOT

COMPOSE = REPO_ROOT / "docker-compose.yml"
K8S = REPO_ROOT / "deploy" / "k8s"
CONFIGMAP = K8S / "configmap.yaml"
# The ConfigMap's annotations that name the cluster deploy/k8s/ expects (Kafka runs outside it).
VERSION_ANNOTATION = "causal-memory-pipeline/kafka-version"
BROKER_ANNOTATION = "causal-memory-pipeline/kafka-broker-settings"
# "apache/kafka:4.1.1", "Apache Kafka 4.1.1", "kafka_2.13-4.1.1": a version of Apache Kafka named in a file.
VERSION_RE = re.compile(
    r"apache/kafka:(?P<a>[\w.-]+)|apache kafka (?P<b>\d+\.\d+(?:\.\d+)?)|kafka_2\.1\d-(?P<c>\d+\.\d+\.\d+)", re.I
)


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return compose


def _image_properties(env: dict[str, Any]) -> dict[str, str]:
    """The broker properties the apache/kafka image makes of its ``KAFKA_*`` variables: the
    prefix dropped, lower case, ``___`` → ``-``, ``__`` → ``_``, ``_`` → ``.``."""
    props = {}
    for key, value in env.items():
        if not key.startswith("KAFKA_") or key == "KAFKA_OPTS":
            continue
        name = key[len("KAFKA_") :].lower().replace("___", "-").replace("__", "\0").replace("_", ".")
        props[name.replace("\0", "_")] = str(value)
    return props


def _configmap() -> dict[str, Any]:
    cms: list[dict[str, Any]] = [d for d in yaml.safe_load_all(CONFIGMAP.read_text()) if d and d["kind"] == "ConfigMap"]
    (cm,) = cms
    return cm


def _parse_properties(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_image_properties_reads_the_variables_as_the_image_does() -> None:
    assert _image_properties(
        {"KAFKA_MIN_INSYNC_REPLICAS": 2, "KAFKA_LOG4J___X": "a", "KAFKA_A__B_C": "b", "KAFKA_OPTS": "-D", "X": 1}
    ) == {"min.insync.replicas": "2", "log4j-x": "a", "a_b.c": "b"}


def test_the_cluster_runs_the_declared_settings(tmp_path: Path) -> None:
    cluster = KafkaCluster()
    cluster.nodes = [Node(i, 9000 + 2 * i, 9001 + 2 * i, tmp_path / f"node{i}") for i in (1, 2, 3)]
    for node in cluster.nodes:
        props = cluster.server_properties(node)
        assert {k: props[k] for k in BROKER_SECURITY} == BROKER_SECURITY
        assert {k: props[k] for k in broker_durability()} == broker_durability(3, 2)
        assert props["controller.quorum.voters"].count("@") == 3
    assert (REPLICATION_FACTOR, MIN_INSYNC_REPLICAS) == (3, 2)  # what docs/operations.md says deployments run
    env = cluster.env("worker")
    assert {k: env[k] for k in CLIENT_SECURITY} == CLIENT_SECURITY
    assert (env["CAUSALMEM_REPLICATION_FACTOR"], env["CAUSALMEM_MIN_INSYNC_REPLICAS"]) == ("3", "2")


# --------------------------------------------------------------------------- compose


def test_compose_runs_the_tested_kafka_version() -> None:
    services = _compose()["services"]
    images = {name: svc["image"] for name, svc in services.items() if "kafka" in str(svc.get("image", ""))}
    assert images == {"kafka": f"apache/kafka:{KAFKA_VERSION}", "kafka-setup": f"apache/kafka:{KAFKA_VERSION}"}


def test_compose_broker_has_the_clusters_security() -> None:
    props = _image_properties(_compose()["services"]["kafka"]["environment"])
    assert {k: props.get(k) for k in BROKER_SECURITY} == BROKER_SECURITY


def test_compose_processes_have_the_clients_security() -> None:
    shared = _compose()["x-causalmem-env"]
    assert {k: shared.get(k) for k in CLIENT_SECURITY} == CLIENT_SECURITY


def test_compose_keeps_one_copy_on_its_one_broker_and_says_why() -> None:
    """One node can hold one copy: RF 1 everywhere (broker and processes), never a mix, and the
    file says that the tested cluster (and deploy/k8s/) run more."""
    compose = _compose()
    brokers = [
        name
        for name, svc in compose["services"].items()
        if "broker" in str((svc.get("environment") or {}).get("KAFKA_PROCESS_ROLES", ""))
    ]
    assert brokers == ["kafka"], "more brokers: give compose the cluster's replication (tests/kafka_cluster.py)"
    props = _image_properties(compose["services"]["kafka"]["environment"])
    assert {k: props.get(k) for k in broker_durability()} == broker_durability(1, 1)
    shared = compose["x-causalmem-env"]
    assert (shared["CAUSALMEM_REPLICATION_FACTOR"], shared["CAUSALMEM_MIN_INSYNC_REPLICAS"]) == ("1", "1")
    text = " ".join(COMPOSE.read_text().replace("#", " ").split())  # the comments, as prose
    why = f"replication factor {REPLICATION_FACTOR} and min.insync.replicas {MIN_INSYNC_REPLICAS}"
    assert why in text, f"docker-compose.yml must say that the tested cluster runs {why}"


# --------------------------------------------------------------------------- kubernetes


def test_k8s_processes_have_the_clients_security_and_the_clusters_durability() -> None:
    data = _configmap()["data"]
    assert {k: data.get(k) for k in CLIENT_SECURITY} == CLIENT_SECURITY
    assert (data["CAUSALMEM_REPLICATION_FACTOR"], data["CAUSALMEM_MIN_INSYNC_REPLICAS"]) == (
        str(REPLICATION_FACTOR),
        str(MIN_INSYNC_REPLICAS),
    )


def test_k8s_names_the_kafka_version_and_broker_settings_it_needs() -> None:
    annotations = _configmap()["metadata"].get("annotations") or {}
    assert annotations.get(VERSION_ANNOTATION) == KAFKA_VERSION
    broker = _parse_properties(annotations.get(BROKER_ANNOTATION, ""))
    assert broker == {**BROKER_SECURITY, **broker_durability()}


# --------------------------------------------------------------------------- every file


def test_no_deployment_file_names_another_kafka_version() -> None:
    files = [COMPOSE, *sorted(K8S.glob("*.yaml")), *sorted((REPO_ROOT / "deploy" / "kafka").iterdir())]
    named: dict[str, set[str]] = {}
    for path in files:
        for match in VERSION_RE.finditer(path.read_text()):
            version = next(v for v in match.groups() if v)
            named.setdefault(version, set()).add(str(path.relative_to(REPO_ROOT)))
    assert set(named) == {KAFKA_VERSION}, named
