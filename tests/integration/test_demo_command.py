"""`causalmem demo`, the README's first command, through the installed entry point: a short
run on its own embedded broker ends with the summary and leaves nothing behind in the
temporary directory (each run's logs and state are ~70 MB; they filled the disk before)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.broker, pytest.mark.slow]

CAUSALMEM = Path(sys.executable).with_name("causalmem")


def demo(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [str(CAUSALMEM), "demo", "--days", "0.05", "--queries-per-day", "400", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_demo_prints_its_summary_and_removes_its_temporary_logs(tmp_path: Path) -> None:
    out = demo(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "causalmem demo: summary" in out.stdout
    assert "removed after a successful run" in out.stderr
    assert not list(tmp_path.glob("causalmem-demo-*")), "the temporary log directory was left behind"
