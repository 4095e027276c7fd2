"""Running the product's processes (worker, learner) as children, and reading their metrics.

Used by the demo, the benchmarks and the integration tests, so that each of them runs
the real ``causalmem worker`` / ``causalmem learner`` processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.broker import free_port
from pipeline.promtext import scrape


class Child:
    """A ``causalmem`` verb in a child process, with its metrics endpoint."""

    def __init__(
        self,
        verb: str,
        bootstrap: str,
        env: dict[str, str],
        args: list[str] | None = None,
        log_path: Path | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.verb = verb
        self.metrics_port = metrics_port or free_port()
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-P",  # the installed package, never a ``pipeline/`` that happens to be in the cwd
            "-m",
            "pipeline.cli",
            verb,
            "--bootstrap",
            bootstrap,
            "--metrics-port",
            str(self.metrics_port),
            *(args or []),
        ]
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> dict[str, float]:
        """Scrape ``/metrics``: ``{"name{label=value,...}": value}`` (empty if unreachable)."""
        return scrape(self.url)

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if hasattr(self._log, "close"):
            self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(timeout=5, sig=signal.SIGKILL)

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-n:]
        return ""


def wait_until(pred: Any, timeout: float, interval: float = 0.2, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
