"""The thin operator verbs (``evaluate``, ``rollback``) end to end through the CLI, on a real broker."""

from __future__ import annotations

import json

import pytest

import pipeline.cli as cli

pytestmark = pytest.mark.broker


def test_evaluate_and_rollback_on_a_deployment_without_traffic(topics_ready, capsys) -> None:
    s = topics_ready
    common = ["--bootstrap", s.bootstrap, "--prefix", s.topic_prefix, "--policy", "verbs"]
    rc = cli.main(["evaluate", *common, "--json", "--window", "50"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1  # nothing logged yet: no estimate to report
    assert report == {"policy": "verbs", "decisions": 0, "versions": {}, "estimates": {}}

    rc = cli.main(["rollback", *common, "--to", "1", "--timeout", "1"])
    assert rc == 1
    assert "no checkpoint of policy 'verbs' on the model topic" in capsys.readouterr().out
