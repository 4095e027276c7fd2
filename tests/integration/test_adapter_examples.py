"""The adapters' runnable examples (examples/langchain_example.py, llamaindex_example.py) on the test broker."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT

pytestmark = pytest.mark.broker


def run_example(name: str, broker: object, *args: str) -> dict:
    prefix = f"ex{uuid.uuid4().hex[:8]}."
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), "--bootstrap", broker.bootstrap, "--prefix", prefix, *args],  # type: ignore[attr-defined]
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["langchain_example.py", "llamaindex_example.py"])
def test_the_example_serves_and_publishes_every_question(name: str, broker: object) -> None:
    pytest.importorskip("langchain_core" if name.startswith("langchain") else "llama_index.core")
    report = run_example(name, broker, *(["--shadow"] if name.startswith("llama") else []))
    assert report["events"] == report["feedback"] == len(report["served"]) == 4
    assert all(len(s["memories"]) == 2 for s in report["served"])
    assert report["mode"] == ("shadow" if name.startswith("llama") else "policy")
