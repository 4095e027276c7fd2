"""The Prometheus alert rules that ship (deploy/prometheus/alerts.yml; docs/operations.md, "Alerts").

- ``promtool check rules`` accepts them and ``promtool test rules`` runs their unit tests
  (``deploy/prometheus/alerts_test.yml``): each alert fires on a trouble series and stays
  quiet on a healthy one. Skipped when promtool is missing (``make promtool`` installs
  Debian's prometheus package);
- they cover what operations needs: a stalled learner, growing lag, a gate refusing for
  hours, serving frozen while candidates keep coming, the dead-letter rate and the memory
  health bands of models/memory/health.py;
- every metric they name is one the processes export, and the Prometheus configuration
  of docker-compose loads them.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from models.memory.health import band
from pipeline.metrics import HEALTH_BANDS, Metrics
from tests.paths import REPO_ROOT

PROM = REPO_ROOT / "deploy" / "prometheus"
RULES = PROM / "alerts.yml"
RULE_TESTS = PROM / "alerts_test.yml"
METRIC_RE = re.compile(r"causalmem_[a-z0-9_]+")
REQUIRED = {
    "CausalmemLearnerStalled",
    "CausalmemLearnerNotApplying",
    "CausalmemLearnerTrainingDead",
    "CausalmemConsumerLagGrowing",
    "CausalmemGateRefusing",
    "CausalmemServingFrozen",
    "CausalmemDeadLetterRate",
    "CausalmemMemoryHealthWarning",
    "CausalmemMemoryHealthCritical",
}


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (`make promtool` installs Debian's prometheus package)")
    return path


def test_promtool_check_rules() -> None:
    res = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in res.stdout


def test_promtool_unit_tests_of_the_rules() -> None:
    res = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=PROM,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr


def test_every_required_alert_ships_and_is_unit_tested() -> None:
    names = {r["alert"] for r in _rules()}
    assert names >= REQUIRED, REQUIRED - names
    tested = {
        t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"] for t in case["alert_rule_test"]
    }
    assert tested == names, names ^ tested
    for r in _rules():
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"], r["alert"]


def test_health_alerts_follow_the_bands_of_models_health() -> None:
    """The warning and critical bands the alerts watch are those the worker exports."""
    exprs = {r["alert"]: r["expr"] for r in _rules()}
    assert set(HEALTH_BANDS) == {band(s) for s in (95, 80, 60, 10)}
    assert 'band="warning"' in exprs["CausalmemMemoryHealthWarning"] and band(55) == "warning"
    assert 'band="critical"' in exprs["CausalmemMemoryHealthCritical"] and band(45) == "critical"


def test_alerts_name_only_exported_metrics() -> None:
    exported: set[str] = set()
    for family in Metrics().registry.collect():
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    used = {m for r in _rules() for m in METRIC_RE.findall(r["expr"])}
    assert used and used <= exported, used - exported


def test_prometheus_loads_the_rules_in_compose() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    compose = yaml.safe_load((PROM.parents[1] / "docker-compose.yml").read_text())
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
