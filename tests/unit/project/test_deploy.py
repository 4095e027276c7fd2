"""Deployment files (README.md, docs/operations.md), checked without a Docker engine or a cluster.

- ``docker-compose.yml`` validates against the Compose Specification JSON schema
  (``tests/data/compose-spec.json``, copied verbatim from compose-spec/compose-spec
  ``schema/compose-spec.json``), and its build contexts and bind mounts exist;
- ``deploy/prometheus/prometheus.yml`` passes ``promtool check config`` (skipped when
  promtool is missing; ``make promtool`` installs Debian's prometheus package);
- every metric the Grafana dashboard queries is exported by ``pipeline.metrics.Metrics``;
- the Kubernetes manifests parse, the learner is a single instance that never overlaps
  with its successor, and every container runs a real ``causalmem`` verb;
- compose and k8s only set ``CAUSALMEM_*`` variables that ``pipeline.config`` reads.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kafka_cluster import KAFKA_VERSION
from tests.paths import REPO_ROOT, TEST_DATA

ROOT = REPO_ROOT
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_SCHEMA = TEST_DATA / "compose-spec.json"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "causalmem.json"
K8S = ROOT / "deploy" / "k8s"

CAUSALMEM_SERVICES = ("init-topics", "worker", "learner", "evaluator", "writes", "ui")
EXPECTED_SERVICES = {"kafka", "kafka-setup", *CAUSALMEM_SERVICES, "prometheus", "grafana"}
METRIC_RE = re.compile(r"causalmem_[a-z0-9_]+")
# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}: Compose interpolation.
INTERPOLATION_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}")


# --------------------------------------------------------------------------- helpers


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _verbs() -> set[str]:
    import pipeline.cli as c

    return set(c.VERBS)


def _valid_env_names() -> set[str]:
    from pipeline.config import KafkaSecurity, Settings

    names = {"CAUSALMEM_" + f.name.upper() for f in fields(Settings) if f.name != "security"}
    names |= {"CAUSALMEM_KAFKA_" + f.name.upper() for f in fields(KafkaSecurity)}
    return names


def _check_cli(argv: list[str], where: str) -> None:
    """``argv`` (after the image's ENTRYPOINT ``causalmem``) is a verb its parser accepts."""
    import pipeline.cli as c

    assert argv, f"{where}: empty command (the image's ENTRYPOINT needs a verb)"
    if argv[0] == "causalmem":
        argv = argv[1:]
    assert argv and argv[0] in _verbs(), f"{where}: {argv[:1]} is not a causalmem verb ({sorted(_verbs())})"
    # k8s $(VAR) references are expanded by the kubelet: any value will do for parsing.
    concrete = [re.sub(r"\$\(([A-Z0-9_]+)\)", "x", a) for a in argv]
    try:
        c.build_parser(concrete).parse_args(concrete)
    except SystemExit as exc:  # argparse reports unknown flags by exiting 2
        pytest.fail(f"{where}: `causalmem {' '.join(argv)}` is rejected by the CLI parser ({exc})")


def _check_env_names(names: set[str], where: str) -> None:
    valid = _valid_env_names()
    unknown = sorted(n for n in names if n.startswith("CAUSALMEM_") and n not in valid)
    assert not unknown, f"{where}: {unknown} are not read by pipeline.config (Settings / KafkaSecurity)"


def _compose_env(service: dict[str, Any]) -> dict[str, Any]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=VALUE", ...]
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return dict(env)


def _default_of(value: Any) -> Any:
    """The value Compose gives a ``${VAR:-default}`` when VAR is unset."""
    if not isinstance(value, str):
        return value
    return INTERPOLATION_RE.sub(lambda m: (m.group(3) or "") if m.group(2) in (":-", "-") else "", value)


def _k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def _workloads(kind: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    kinds = {"Deployment", "StatefulSet", "Job", "DaemonSet"} if kind is None else {kind}
    return [(f, d) for f, d in _k8s_docs() if d.get("kind") in kinds]


def _by_component(component: str) -> list[dict[str, Any]]:
    out = []
    for _f, doc in _workloads():
        labels = doc["spec"]["template"]["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/component") == component:
            out.append(doc)
    return out


# --------------------------------------------------------------------------- compose


def test_compose_schema_file_is_the_compose_spec() -> None:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    assert schema["title"] == "Compose Specification"
    assert "draft-07" in schema["$schema"]
    assert {"service", "deployment", "healthcheck", "volume"} <= set(schema["definitions"])


def test_compose_validates_against_compose_spec() -> None:
    import jsonschema  # a declared test dependency (pyproject [test])

    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(_compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_compose_services() -> None:
    services = _compose()["services"]
    assert set(services) == EXPECTED_SERVICES

    kafka = services["kafka"]
    assert kafka["image"] == f"apache/kafka:{KAFKA_VERSION}"  # the version the cluster tests run
    env = {k: str(v) for k, v in _compose_env(kafka).items()}
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    # SASL on every listener (tests/unit/project/test_security_deploy.py checks the rest of it)
    assert env["KAFKA_LISTENERS"] == "SASL_PLAINTEXT://:9092,CONTROLLER://:9093"
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "SASL_PLAINTEXT://kafka:9092"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert "kafka-topics.sh --bootstrap-server localhost:9092 --list" in " ".join(kafka["healthcheck"]["test"])

    for name in CAUSALMEM_SERVICES:
        svc = services[name]
        assert svc["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}, name
        assert svc["image"] == "causal-memory-pipeline:latest", name
        assert "--bootstrap" in svc["command"] and "kafka:9092" in svc["command"], name

    assert services["init-topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in ("worker", "learner", "evaluator", "writes"):
        svc = services[name]
        assert svc["depends_on"]["init-topics"]["condition"] == "service_completed_successfully", name
        env = _compose_env(svc)
        # Prometheus scrapes from another container: the loopback default would hide /metrics.
        assert env["CAUSALMEM_METRICS_HOST"] == "0.0.0.0", name
        assert svc["command"][svc["command"].index("--metrics-port") + 1] == "9100", name
        assert _default_of(env["CAUSALMEM_EMBEDDING_DIM"]) == "384", name
        assert _default_of(env["CAUSALMEM_SLOTS"]) == "1024", name

    assert services["worker"]["deploy"]["replicas"] == 2
    evaluator = services["evaluator"]
    assert evaluator["command"][0] == "evaluator"
    assert 1 <= evaluator["deploy"]["replicas"] <= 8, "evaluators share the input partitions"
    writes = services["writes"]
    assert writes["command"][0] == "writes"
    assert 1 <= writes["deploy"]["replicas"] <= 8, "write gates share the partitions of memory-writes"
    ui = services["ui"]
    assert ui["command"][0] == "ui"
    assert ui["depends_on"]["init-topics"]["condition"] == "service_completed_successfully"
    ui_env = _compose_env(ui)
    assert ui_env["CAUSALMEM_KAFKA_SASL_USERNAME"] == "causalmem-ui", "the ui role of deploy/kafka/acls.sh"
    port = ui["command"][ui["command"].index("--port") + 1] if "--port" in ui["command"] else "8765"
    assert ui["ports"] == [f"127.0.0.1:{port}:{port}"]
    # the session key survives a restart: a named volume at the state dir
    assert f"ui-state:{ui_env['CAUSALMEM_STATE_DIR']}" in ui["volumes"]
    # The learner is the single writer of the policy.
    assert services["learner"].get("deploy", {}).get("replicas", 1) == 1
    assert "scale" not in services["learner"]
    learner_env = _compose_env(services["learner"])
    state_dir = learner_env["CAUSALMEM_STATE_DIR"]
    named_volumes = set(_compose().get("volumes") or {})
    mounts = [v.split(":") for v in services["learner"]["volumes"] if isinstance(v, str)]
    assert any(src in named_volumes and dst == state_dir for src, dst, *_ in mounts), (
        "the learner's state dir must be a named volume"
    )
    assert services["prometheus"]["image"].startswith("prom/prometheus")
    assert services["grafana"]["image"].startswith("grafana/grafana")


def test_compose_paths_exist() -> None:
    compose = _compose()
    named_volumes = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: build context {context} is missing"
            if isinstance(build, dict) and "dockerfile" in build:
                assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} is missing"
        for vol in svc.get("volumes") or []:
            if isinstance(vol, dict):
                source, kind = vol.get("source", ""), vol.get("type", "volume")
            else:
                source = vol.split(":", 1)[0]
                kind = "bind" if source.startswith((".", "/", "~")) else "volume"
            if kind == "bind":
                assert (ROOT / source).exists(), f"{name}: bind mount source {source} is missing"
            elif kind == "volume":
                assert source in named_volumes, f"{name}: volume {source!r} is not declared"


def test_compose_ports_bind_loopback_only() -> None:
    published = 0
    for name, svc in _compose()["services"].items():
        for port in svc.get("ports") or []:
            published += 1
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", f"{name}: {port}"
            else:
                assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name}: {port!r}"
                assert port.count(":") == 2, f"{name}: {port!r} (want 127.0.0.1:HOST:CONTAINER)"
    assert published, "Prometheus and Grafana should be reachable from the host"


def test_compose_commands_and_env() -> None:
    for name, svc in _compose()["services"].items():
        env = _compose_env(svc)
        _check_env_names(set(env), f"docker-compose.yml {name}")
        if name in CAUSALMEM_SERVICES:
            command = svc["command"]
            assert isinstance(command, list), f"{name}: use the exec form"
            _check_cli(command, f"docker-compose.yml {name}")
            # ${VAR:-default} must leave a value Settings can parse.
            from pipeline.config import Settings

            Settings.from_env({k: str(_default_of(v)) for k, v in env.items() if v is not None})


def test_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    torch_at = next(i for i, ln in enumerate(lines) if "torch==2.13.0" in ln)
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[torch_at]
    project = [
        (i, m) for i, ln in enumerate(lines) if (m := re.search(r"pip install\b.* '?\.(\[[a-z,]+\])?'?(\s|$)", ln))
    ]
    assert project, "the image installs the project"
    project_at, m = project[0]
    assert "cli" in (m.group(1) or ""), "the image runs the operator verbs (status, label): the cli extra"
    assert "ui" in (m.group(1) or ""), "the image runs causalmem ui: the ui extra"
    assert torch_at < project_at, "install CPU torch before the project"
    user = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert user and user[-1].split(":")[0] not in ("root", "0"), "run as a non-root user"
    entrypoint = next(ln for ln in lines if ln.startswith("ENTRYPOINT"))
    assert json.loads(entrypoint[len("ENTRYPOINT") :]) == ["causalmem"]
    for ln in lines:
        if ln.startswith("COPY ") and "--from" not in ln:
            for src in ln.split()[1:-1]:
                assert src == "." or (ROOT / src).exists(), f"COPY source {src} is missing"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "runs/"} <= set(ignored)
    assert "pyproject.toml" not in ignored and "pipeline" not in ignored


# --------------------------------------------------------------------------- prometheus


def test_prometheus_config_shape() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    worker = next(j for j in jobs.values() if "dns_sd_configs" in j)
    (sd,) = worker["dns_sd_configs"]
    assert sd["names"] == ["worker"] and sd["type"] == "A" and sd["port"] == 9100
    targets = [t for j in jobs.values() for sc in j.get("static_configs", []) for t in sc["targets"]]
    assert "learner:9100" in targets


def test_promtool_check_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (`make promtool` installs Debian's prometheus package)")
    result = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- grafana


def _exported_metric_names() -> set[str]:
    """Every sample name ``Metrics`` can expose, labelled families included.

    Labelled metrics have no samples until a label set is used, so the names are derived
    from each family's name and type (prometheus_client drops ``_total`` from counter
    family names).
    """
    from pipeline.metrics import Metrics

    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
        "stateset": ("",),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "unknown": ("",),
    }
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.update(family.name + s for s in suffixes[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def _dashboard_exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in _dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _dashboard_exprs(v)]
    return []


def test_dashboard_uses_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _dashboard_exprs(dashboard)
    assert exprs, "the dashboard has no PromQL targets"
    used = {m for e in exprs for m in METRIC_RE.findall(e)}
    exported = _exported_metric_names()
    missing = sorted(used - exported)
    assert not missing, f"dashboard queries metrics that pipeline.metrics.Metrics does not export: {missing}"
    # The panels the operators rely on (docs/operations.md, Metrics).
    for needed in (
        "causalmem_memory_health_score",
        "causalmem_memory_health_band",
        "causalmem_utility_rating_correlation",
        "causalmem_utility_rating_correlation_reference",
        "causalmem_learner_updates_total",
        "causalmem_learner_experiences_total",
        "causalmem_consumer_lag_messages",
        "causalmem_intervention_rate",
        "causalmem_fallback_rate",
        "causalmem_fallbacks_total",
        "causalmem_checkpoint_timestamp_seconds",
        "causalmem_checkpoint_version",
        "causalmem_events_rejected_total",
        "causalmem_joins_total",
        "causalmem_join_expired_total",
        "causalmem_al_samples_total",
        "causalmem_labels_total",
        "causalmem_gate_decisions_total",
    ):
        assert needed in used, f"no dashboard panel shows {needed}"
    assert any("time() - causalmem_checkpoint_timestamp_seconds" in e for e in exprs)


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """promtool parses every dashboard expression (as recording rules)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (`make promtool` installs Debian's prometheus package)")
    exprs = _dashboard_exprs(json.loads(DASHBOARD.read_text()))
    assert not any("$" in e for e in exprs), "Grafana variables would need substituting before parsing"
    recording = [{"record": f"dashboard:expr{i}", "expr": e} for i, e in enumerate(exprs)]
    rules = {"groups": [{"name": "dashboard", "rules": recording}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_panels_and_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (prom,) = [d for d in datasources["datasources"] if d["type"] == "prometheus"]
    assert prom["url"] == "http://prometheus:9090"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == prom["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == prom["uid"], panel["title"]
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "causalmem.yml").read_text())
    (provider,) = providers["providers"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in _compose()["services"]["grafana"]["volumes"]}
    host_dir = mounts[provider["options"]["path"]]
    assert (ROOT / host_dir / DASHBOARD.name).is_file(), "the provider path must hold the dashboard"


# --------------------------------------------------------------------------- kubernetes


def test_k8s_manifests_parse_and_kustomization_lists_them() -> None:
    docs = _k8s_docs()
    assert docs
    for name, doc in docs:
        assert {"apiVersion", "kind"} <= set(doc), name
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"], name
    (kustomization,) = [d for _f, d in docs if d["kind"] == "Kustomization"]
    listed = set(kustomization["resources"])
    for resource in listed:
        assert (K8S / resource).is_file(), f"kustomization lists missing {resource}"
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert files == listed, f"not in kustomization: {sorted(files - listed)}"
    kinds = {d["kind"] for _f, d in docs}
    assert {"Namespace", "ConfigMap", "Deployment", "Job", "Service", "PersistentVolumeClaim"} <= kinds


def test_k8s_learner_is_a_single_writer() -> None:
    (learner,) = _by_component("learner")
    assert learner["spec"]["replicas"] == 1
    if learner["kind"] == "Deployment":
        # RollingUpdate would briefly run two learners: two writers of the policy.
        assert learner["spec"]["strategy"]["type"] == "Recreate"
    else:
        assert learner["kind"] == "StatefulSet"
    # The state dir survives restarts: a PersistentVolumeClaim (or a claim template).
    pod = learner["spec"]["template"]["spec"]
    pvcs = {d["metadata"]["name"] for _f, d in _k8s_docs() if d["kind"] == "PersistentVolumeClaim"}
    persistent = {t["metadata"]["name"] for t in learner["spec"].get("volumeClaimTemplates", [])}
    for volume in pod.get("volumes", []):
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["claimName"] in pvcs, volume
            persistent.add(volume["name"])
    (container,) = pod["containers"]
    mounted = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in persistent}
    assert "/var/lib/causalmem" in mounted, "the learner's state dir must be on a persistent volume"


def test_k8s_worker_deployment() -> None:
    (worker,) = _by_component("worker")
    assert worker["kind"] == "Deployment"
    assert worker["spec"]["replicas"] == 2
    partitions = 8
    for _f, doc in _k8s_docs():
        if doc["kind"] == "ConfigMap" and "CAUSALMEM_PARTITIONS" in doc.get("data", {}):
            partitions = int(doc["data"]["CAUSALMEM_PARTITIONS"])
    assert worker["spec"]["replicas"] <= partitions, "more workers than input partitions sit idle"
    template = worker["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9100"
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 9100
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    services = [d for _f, d in _k8s_docs() if d["kind"] == "Service"]
    metrics = [s for s in services if s["metadata"]["name"].endswith("-metrics")]
    assert all(s["spec"].get("clusterIP") == "None" for s in metrics), "metrics services are headless"
    assert any(s["spec"]["selector"] == worker["spec"]["selector"]["matchLabels"] for s in services)


def test_k8s_evaluator_deployment() -> None:
    (evaluator,) = _by_component("evaluator")
    assert evaluator["kind"] == "Deployment"
    assert 1 <= evaluator["spec"]["replicas"] <= 8, "more evaluators than input partitions sit idle"
    template = evaluator["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    (container,) = template["spec"]["containers"]
    assert container["args"][0] == "evaluator"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == 9100
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    services = [d for _f, d in _k8s_docs() if d["kind"] == "Service"]
    assert any(s["spec"]["selector"] == evaluator["spec"]["selector"]["matchLabels"] for s in services)


def test_k8s_write_gate_deployment() -> None:
    (gate,) = _by_component("writes")
    assert gate["kind"] == "Deployment"
    assert 1 <= gate["spec"]["replicas"] <= 8, "more write gates than partitions of memory-writes sit idle"
    template = gate["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    (container,) = template["spec"]["containers"]
    assert container["args"][0] == "writes"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == 9100
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    services = [d for _f, d in _k8s_docs() if d["kind"] == "Service"]
    assert any(s["spec"]["selector"] == gate["spec"]["selector"]["matchLabels"] for s in services)


def test_k8s_ui_deployment() -> None:
    (ui,) = _by_component("ui")
    assert ui["kind"] == "Deployment"
    assert ui["spec"]["replicas"] == 1, "one app holds the labelers' leases"
    (container,) = ui["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "ui"
    assert args[args.index("--host") + 1] == "0.0.0.0", "reachable through its Service"
    assert "--no-secure-cookie" not in args, "exposed through TLS: the cookie stays Secure"
    port = int(args[args.index("--port") + 1])
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    services = [d for _f, d in _k8s_docs() if d["kind"] == "Service"]
    assert any(s["spec"]["selector"] == ui["spec"]["selector"]["matchLabels"] for s in services)


def test_k8s_containers_run_causalmem_verbs_with_known_env() -> None:
    configmaps = {d["metadata"]["name"]: d for _f, d in _k8s_docs() if d["kind"] == "ConfigMap"}
    for cm_name, cm in configmaps.items():
        _check_env_names(set(cm.get("data", {})), f"ConfigMap {cm_name}")
    workloads = _workloads()
    assert {d["kind"] for _f, d in workloads} >= {"Deployment", "Job"}
    for file, doc in workloads:
        pod = doc["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"{file} {doc['metadata']['name']}/{container['name']}"
            argv = list(container.get("command", [])) + list(container.get("args", []))
            _check_cli(argv, where)
            _check_env_names({e["name"] for e in container.get("env", [])}, where)
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef")
                if ref:
                    assert ref["name"] in configmaps, f"{where}: ConfigMap {ref['name']} is not defined"
            if "metrics-port" in " ".join(argv):
                env = dict(configmaps.get("causalmem-config", {}).get("data", {}))
                env.update({e["name"]: e.get("value") for e in container.get("env", [])})
                assert env.get("CAUSALMEM_METRICS_HOST") == "0.0.0.0", f"{where}: metrics only on loopback"
