"""Who may write what: the ACLs shipped in deploy/kafka/acls.sh, SASL/SCRAM in compose, no
default Grafana password, one Kafka user per role in compose and Kubernetes.

The ACL script is run with ``--dry-run`` (it prints the kafka-acls.sh commands) and the
commands are parsed, so the test reads what an operator would apply.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import Settings
from pipeline.labeling.queue import labeler_group
from pipeline.learner.election import group_id as learner_group
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
ACLS = ROOT / "deploy" / "kafka" / "acls.sh"
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
ROLES = {
    "service": "User:causalmem-service",
    "labeler": "User:labeler",
    "operator": "User:causalmem-operator",
    "worker": "User:causalmem-worker",
    "learner": "User:causalmem-learner",
    "evaluator": "User:causalmem-evaluator",
    "writes": "User:causalmem-writes",
    "ui": "User:causalmem-ui",
}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

Grant = tuple[str, str, str]  # (resource kind, pattern type, name)


def acls(prefix: str, policy: str = "default") -> dict[str, dict[str, set[Grant]]]:
    """``{principal: {operation: {(kind, pattern, name)}}}`` from the script's dry run."""
    env = {"PATH": os.environ["PATH"], "CAUSALMEM_TOPIC_PREFIX": prefix, "CAUSALMEM_POLICY": policy}
    out = subprocess.run(["bash", str(ACLS), "--dry-run"], env=env, capture_output=True, text=True, check=True)
    grants: dict[str, dict[str, set[Grant]]] = defaultdict(lambda: defaultdict(set))
    for line in out.stdout.splitlines():
        words = line.split()
        assert words[0].endswith("kafka-acls.sh") and "--add" in words, line
        opts: dict[str, list[str]] = defaultdict(list)
        for flag, value in itertools.pairwise(words):
            if flag.startswith("--"):
                opts[flag[2:]].append(value)
        (pattern,) = opts["resource-pattern-type"]
        resources = [("topic", t) for t in opts["topic"]] + [("group", g) for g in opts["group"]]
        assert resources and opts["allow-principal"] and opts["operation"], line
        for who in opts["allow-principal"]:
            for op in opts["operation"]:
                for kind, name in resources:
                    grants[who][op].add((kind, pattern, name))
    return grants


def topics_with(grants: dict[str, set[Grant]], *ops: str) -> set[str]:
    return {
        name for op in ops for kind, pattern, name in grants.get(op, set()) if kind == "topic" and pattern == "literal"
    }


def writers(g: dict[str, dict[str, set[Grant]]], topic: str) -> set[str]:
    return {who for who, ops in g.items() if topic in topics_with(ops, "Write", "All")}


@pytest.mark.parametrize("prefix", ["", "dev."])
def test_acls_name_every_topic_with_the_prefix_and_nothing_else(prefix: str) -> None:
    g = acls(prefix)
    t = Settings(topic_prefix=prefix).topics()
    names = {spec.name for spec in t.all()}
    assert set(g) == set(ROLES.values()), "one principal per role"
    for who, ops in g.items():
        literal = topics_with(ops, *ops)
        assert literal <= names, f"{who}: ACLs for topics the product does not have: {literal - names}"
        assert topics_with(ops, "Describe") == names, f"{who} must describe every product topic"
        assert t.epoch.name in topics_with(ops, "Read"), f"{who} must read the epoch marker (cluster watch)"


@pytest.mark.parametrize("prefix", ["", "dev."])
def test_who_may_write_what(prefix: str) -> None:
    g = acls(prefix)
    t = Settings(topic_prefix=prefix).topics()
    r = ROLES
    assert writers(g, t.retrieval_events.name) == {r["service"]}
    # feedback: the services' own scoring, or causalmem evaluator's
    assert writers(g, t.llm_feedback.name) == {r["service"], r["evaluator"]}
    # labelers, or causalmem ui's own principal for them (with a labelers file)
    assert writers(g, t.human_labels.name) == {r["labeler"], r["ui"]}
    assert writers(g, t.policy_checkpoints.name) == {r["learner"]}, "only the learner writes the model topic"
    # resets and rollbacks bypass the gate: operators, and the worker's drift stage
    assert writers(g, t.control.name) == {r["operator"], r["worker"]}
    assert writers(g, t.epoch.name) == {r["operator"]}
    for internal in (t.outcomes, t.experiences, t.active_learning, t.rating_pairs):
        assert writers(g, internal.name) == {r["worker"]}, internal.name
    assert writers(g, t.dead_letter.name) == {r["worker"], r["learner"], r["evaluator"], r["writes"]}
    # agents propose memories; only the write gate keeps the rejected ones
    assert writers(g, t.memory_writes.name) == {r["service"]}
    assert writers(g, t.memory_writes_rejected.name) == {r["writes"]}
    assert writers(g, t.memory_lifecycle.name) == {r["service"], r["writes"]}, "memory stores and the write gate"
    # topics are created by operators (init-topics) only
    creators = {who for who, ops in g.items() if topics_with(ops, "Create")}
    assert creators == {r["operator"]}


def test_each_role_reads_what_it_needs_under_the_names_the_code_uses() -> None:
    prefix = "dev."
    s = Settings(topic_prefix=prefix, policy="p1")
    t, conn = s.topics(), s.connection()
    g = acls(prefix, policy="p1")
    r = ROLES

    def reads(role: str) -> set[str]:
        return topics_with(g[r[role]], "Read")

    def groups(role: str) -> set[tuple[str, str]]:
        return {(pattern, name) for kind, pattern, name in g[r[role]]["Read"] if kind == "group"}

    assert {t.retrieval_events.name, t.llm_feedback.name, t.human_labels.name, t.outcomes.name} <= reads("worker")
    assert {t.experiences.name, t.control.name, t.policy_checkpoints.name} <= reads("learner")
    assert {t.active_learning.name, t.human_labels.name} <= reads("labeler")
    assert t.policy_checkpoints.name in reads("service")
    assert {spec.name for spec in t.all()} == reads("operator")
    worker = s.worker()
    assert groups("worker") == {("literal", worker.join.group_id), ("literal", worker.app_id)}
    assert ("prefixed", worker.app_id) in {(p, n) for k, p, n in g[r["worker"]]["All"] if k == "topic"}, (
        "faust's changelog topics start with the app id"
    )
    assert groups("learner") == {("literal", learner_group(conn))}
    assert reads("evaluator") == {t.retrieval_events.name, t.epoch.name}
    assert groups("evaluator") == {("literal", s.evaluator().group_id)}
    assert reads("writes") == {t.memory_writes.name, t.epoch.name}
    assert groups("writes") == {("literal", s.writes().group_id)}
    assert groups("labeler") == {("prefixed", labeler_group(conn))}
    assert groups("ui") == {("prefixed", labeler_group(conn))}
    shown = [t.retrieval_events, t.experiences, t.human_labels, t.active_learning, t.policy_checkpoints]
    assert reads("ui") == {spec.name for spec in shown} | {t.dead_letter.name, t.epoch.name}
    assert all(not topics_with(ops, "All") for who, ops in g.items()), "no role gets All on a product topic"


# --------------------------------------------------------------------------- compose


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_kafka_requires_sasl_scram_and_the_authorizer() -> None:
    services = _compose()["services"]
    env = {k: str(v) for k, v in services["kafka"]["environment"].items()}
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(protocols.values()) == {"SASL_PLAINTEXT"}, "no listener without authentication"
    assert "SCRAM-SHA-512" in env["KAFKA_SASL_ENABLED_MECHANISMS"].split(",")
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"].endswith("StandardAuthorizer")
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    setup = services["kafka-setup"]
    # --add-config-file takes "SCRAM-SHA-512=password=…" (the bracketed form is --add-config's; in
    # a file it is refused as "Invalid credential property", as tests/kafka_cluster.py found on Kafka).
    assert "acls.sh" in setup["command"][0] and "SCRAM-SHA-512=password=" in setup["command"][0]
    shared = _compose()["x-causalmem-env"]
    assert shared["CAUSALMEM_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
    assert shared["CAUSALMEM_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    users = {}
    for name in ("init-topics", "worker", "learner", "evaluator", "writes"):
        svc_env = services[name]["environment"]
        users[name] = svc_env["CAUSALMEM_KAFKA_SASL_USERNAME"]
        assert re.fullmatch(r"\$\{KAFKA_[A-Z]+_PASSWORD:\?[^}]+\}", svc_env["CAUSALMEM_KAFKA_SASL_PASSWORD"]), name
    assert users == {
        "init-topics": "causalmem-operator",
        "worker": "causalmem-worker",
        "learner": "causalmem-learner",
        "evaluator": "causalmem-evaluator",
        "writes": "causalmem-writes",
    }
    assert services["init-topics"]["depends_on"]["kafka-setup"]["condition"] == "service_completed_successfully"


def test_compose_shell_commands_parse() -> None:
    """The broker's and the setup's start-up scripts, as the container's bash gets them."""
    for name in ("kafka", "kafka-setup"):
        svc = _compose()["services"][name]
        assert svc["entrypoint"] == ["/bin/bash", "-c"], name
        script = svc["command"][0].replace("$$", "$")  # compose's escape for a literal $
        subprocess.run(["bash", "-n", "-c", script], check=True)


def test_scram_passwords_never_go_on_a_command_line() -> None:
    """kafka-setup hands each SCRAM password to kafka-configs.sh in a file, not as an argument:
    a command line is readable by every process of the host (ps, /proc/PID/cmdline)."""
    script = _compose()["services"]["kafka-setup"]["command"][0].replace("$$", "$")
    calls = [c for c in re.split(r"[;&|]", script) if "kafka-configs.sh" in c]
    assert calls, "kafka-setup creates the SCRAM users with kafka-configs.sh"
    for call in calls:
        assert "--add-config-file" in call and "password=" not in call, call
    assert "umask 077" in script  # the file is readable by its owner only


def test_no_password_is_written_in_compose() -> None:
    text = COMPOSE.read_text()
    services = _compose()["services"]
    grafana = services["grafana"]["environment"]
    # ${VAR:?message}: compose refuses to start without it; no admin/admin fallback
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", grafana["GF_SECURITY_ADMIN_PASSWORD"])
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            if "PASSWORD" in key:
                assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]+\}", str(value)), (
                    f"{name}: {key} must come from the environment"
                )
    assert "password=admin" not in text.replace(" ", "").lower()


def test_compose_learner_signs_checkpoints_with_a_key_from_the_environment() -> None:
    text = COMPOSE.read_text()
    learner = _compose()["services"]["learner"]["environment"]
    value = str(learner["CAUSALMEM_CHECKPOINT_SIGNING_KEY"])
    # ${VAR:?message}: compose refuses to start the learner unsigned
    assert re.fullmatch(r"\$\{CAUSALMEM_CHECKPOINT_SIGNING_KEY:\?[^}]+\}", value)
    assert "CAUSALMEM_CHECKPOINT_SIGNING_KEY; do echo" in text  # the .env recipe generates it
    # With the key compose substitutes, the learner's configuration signs.
    env = {k: str(v) for k, v in {**_compose()["x-causalmem-env"], **learner}.items()}
    env["CAUSALMEM_CHECKPOINT_SIGNING_KEY"] = "from-dot-env"
    assert Settings.from_env({k: v for k, v in env.items() if "${" not in v}).learner().signing_key == b"from-dot-env"


# --------------------------------------------------------------------------- kubernetes


def _k8s() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_k8s_replicates_every_topic_three_times() -> None:
    (cm,) = [d for d in _k8s() if d["kind"] == "ConfigMap"]
    s = Settings.from_env(cm["data"])
    assert (s.replication_factor, s.min_insync_replicas) == (3, 2)
    assert all(spec.replication == 3 and spec.configs["min.insync.replicas"] == "2" for spec in s.topics().all())


def test_k8s_each_role_reads_its_own_kafka_user_from_a_secret() -> None:
    expected = {"worker": "causalmem-kafka-worker", "learner": "causalmem-kafka-learner"}
    expected["evaluator"] = "causalmem-kafka-evaluator"
    expected["writes"] = "causalmem-kafka-writes"
    expected["init-topics"] = "causalmem-kafka-operator"
    expected["ui"] = "causalmem-kafka-ui"
    seen = {}
    for doc in _k8s():
        if doc["kind"] not in ("Deployment", "Job", "StatefulSet"):
            continue
        component = doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        secrets = [e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e]
        seen[component] = secrets
    assert seen == {k: [v] for k, v in expected.items()}


def test_k8s_learner_signs_checkpoints_with_a_key_from_a_required_secret() -> None:
    (learner,) = [
        d
        for d in _k8s()
        if d["kind"] == "Deployment"
        and d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "learner"
    ]
    pod = learner["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    path = Path(env["CAUSALMEM_CHECKPOINT_SIGNING_KEY_FILE"])
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "causalmem-checkpoint-signing"
    assert volume["secret"].get("optional", False) is False  # no key, no learner: never unsigned
    (cm,) = [d for d in _k8s() if d["kind"] == "ConfigMap"]
    assert "CAUSALMEM_CHECKPOINT_SIGNING_KEY" not in cm["data"]  # a secret, never in the ConfigMap
    assert "create secret generic causalmem-checkpoint-signing" in (K8S / "configmap.yaml").read_text()
