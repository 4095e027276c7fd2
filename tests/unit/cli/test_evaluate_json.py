"""``causalmem evaluate --json`` writes strict JSON: an estimate that cannot be computed is ``null``.

A log without ``candidate_probs`` whose selections are not the similarity top-k gives the
self-normalised set estimator no weight on any decision (0/0): its value and interval are NaN.
Python's ``json`` wrote those as the literal ``NaN``, which ``jq`` and orjson reject.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, NoReturn

import orjson
import pytest

import pipeline.cli as cli
from pipeline.config import Settings
from pipeline.modeltopic import ModelTopicIndex
from pipeline.policy_evaluation import evaluate
from tests.helpers import experience


def reject_constant(name: str) -> NoReturn:
    raise ValueError(f"not JSON: {name}")


def strict_loads(text: str) -> Any:
    """Parse as jq and orjson do: ``NaN``/``Infinity`` are errors."""
    parsed = json.loads(text, parse_constant=reject_constant)
    assert parsed == orjson.loads(text)
    return parsed


@pytest.fixture
def unweighted_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """No checkpoint on the model topic; 40 logged steps that each read the two lowest-scored candidates."""
    s = Settings(embedding_dim=4, slots=16)
    exps = []
    for i in range(40):
        e = experience(s, i)
        ev = dataclasses.replace(e.event, selected=e.event.candidates[-2:], candidate_probs=None)
        exps.append(dataclasses.replace(e, event=ev))

    async def scan(*args: Any, **kw: Any) -> ModelTopicIndex:
        return ModelTopicIndex()

    async def tail(*args: Any, **kw: Any) -> list[Any]:
        return exps

    monkeypatch.setattr(evaluate, "scan_model_topic", scan)
    monkeypatch.setattr(evaluate, "experiences_tail", tail)


def test_evaluate_json_writes_null_for_an_estimate_that_cannot_be_computed(
    unweighted_log: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["evaluate", "--bootstrap", "127.0.0.1:1", "--json", "--method", "set-snips"])
    out = capsys.readouterr().out
    assert rc == 0
    report = strict_loads(out)  # before: ValueError("not JSON: NaN")
    assert report["decisions"] == 40
    est = report["estimates"]["similarity-only"]["set-snips"]
    assert est["value"] is None and est["low"] is None and est["high"] is None
    assert est["ess"] == 0.0  # finite numbers stay numbers


def test_evaluate_table_shows_a_dash_for_an_estimate_that_cannot_be_computed(
    unweighted_log: None, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["evaluate", "--bootstrap", "127.0.0.1:1", "--method", "set-snips"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "similarity-only" in out and "– [–, –]" in out and "nan" not in out.lower()


def test_shadow_json_writes_null_for_a_gain_that_cannot_be_computed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    nan = float("nan")
    report = {"policy": "default", "mode": "shadow", "cutover_version": None, "serving_version": 3, "decisions": 0}
    report["gain"] = {"value": nan, "low": -math.inf, "high": math.inf, "level": 0.95, "ess": 0.0, "n": 0}

    async def shadow_report(*args: Any, **kw: Any) -> dict[str, Any]:
        return report

    monkeypatch.setattr("pipeline.cli.evaluate.shadow_report", shadow_report)
    cli.main(["evaluate", "--bootstrap", "127.0.0.1:1", "--shadow", "--json"])
    gain = strict_loads(capsys.readouterr().out)["gain"]
    assert gain == {"value": None, "low": None, "high": None, "level": 0.95, "ess": 0.0, "n": 0}
