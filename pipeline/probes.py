"""Liveness and readiness of a process, served with its metrics (docs/operations.md, "Health endpoints").

Every long-running process (worker, learner) serves three paths on its metrics port:

- ``/metrics`` — the Prometheus exposition of its registry;
- ``/healthz`` — *alive*: the event loop's heartbeat is recent (a task on the loop calls
  :meth:`Probes.beat` every ``interval_s``; the HTTP thread answers 503 once the last beat
  is older than ``heartbeat_timeout_s``) and no task the process cannot live without has
  ended;
- ``/readyz`` — *ready*: alive, and every readiness check of the role passes.

The checks run on the event loop at each beat (they read loop-owned state), and the HTTP
thread only reads their last result: a stalled loop cannot report a stale "ready".
Both answers are JSON (``{"status": "ok"|"fail", "problems": [...]}``), 200 or 503.

>>> t = [0.0]
>>> p = Probes(heartbeat_timeout_s=10, clock=lambda: t[0])
>>> p.alive()  # no beat yet
['no heartbeat yet']
>>> p.beat()
>>> t[0] = 1.0; p.alive(), p.ready()
([], [])
>>> t[0] = 100.0; p.alive()
['event loop heartbeat is 100 s old (limit 10 s)']
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

# A check returns None when it passes, else why not (one line).
Check = Callable[[], str | None]

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 30.0
MAX_LAG = 10_000  # messages behind the input's end that still count as caught up
STALE_AFTER_S = 120.0  # input waiting and no progress for this long: stale


class Probes:
    """A process's heartbeat, its vital tasks and its readiness checks.

    Parameters
    ----------
    heartbeat_timeout_s
        ``/healthz`` fails once the last beat is older than this.
    clock
        Monotonic seconds (tests pass a fake one).
    on_beat
        Called with the readiness result (problems) at each beat: e.g. to set a gauge.
    """

    def __init__(
        self,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        on_beat: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.on_beat = on_beat
        self._last_beat: float | None = None
        self._tasks: dict[str, asyncio.Future[Any]] = {}
        self._checks: list[Check] = []
        self._dead: list[str] = []  # vital tasks found ended at the last beat
        self._not_ready: list[str] = ["no readiness evaluated yet"]
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ registration (loop side)
    def vital(self, name: str, task: asyncio.Future[Any]) -> None:
        """A task the process cannot live without: once it ends, the process is neither alive nor ready."""
        self._tasks[name] = task

    def check(self, check: Check) -> None:
        """Add a readiness check (run on the event loop at each beat)."""
        self._checks.append(check)

    def beat(self) -> None:
        """Record a heartbeat and evaluate the vital tasks and the readiness checks (call on the loop)."""
        dead = [f"{name} task ended: {_ending(t)}" for name, t in self._tasks.items() if t.done()]
        problems: list[str] = []
        for c in self._checks:
            try:
                why = c()
            except Exception as exc:  # a failing check is a not-ready answer, not a dead heartbeat
                why = f"readiness check failed: {exc!r}"
            if why:
                problems.append(why)
        with self._lock:
            self._last_beat = self.clock()
            self._dead = dead
            self._not_ready = problems
        if self.on_beat is not None:
            self.on_beat(dead + problems)

    async def run(self, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Beat every ``interval_s`` until cancelled (a background task on the process's loop)."""
        while True:
            self.beat()
            await asyncio.sleep(interval_s)

    # ------------------------------------------------------------------ answers (any thread)
    def alive(self) -> list[str]:
        """Why the process is not alive (empty: alive)."""
        with self._lock:
            last, dead = self._last_beat, list(self._dead)
        if last is None:
            return ["no heartbeat yet"]
        age = self.clock() - last
        if age > self.heartbeat_timeout_s:
            return [f"event loop heartbeat is {age:.0f} s old (limit {self.heartbeat_timeout_s:.0f} s)", *dead]
        return dead

    def ready(self) -> list[str]:
        """Why the process is not ready (empty: ready); not alive is not ready."""
        problems = self.alive()
        with self._lock:
            return problems + [p for p in self._not_ready if p not in problems]


def _ending(task: asyncio.Future[Any]) -> str:
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return "returned" if exc is None else repr(exc)


@dataclass
class Progress:
    """Readiness of a consumer: caught up within ``max_lag`` and not stale.

    ``lag()`` is the input waiting (messages); ``done()`` a count that grows with the work
    done (messages read, experiences applied). Stale: input waits and ``done()`` has not
    changed for ``stale_after_s``.

    >>> t = [0.0]
    >>> lag, done = [5.0], [0.0]
    >>> p = Progress("join", lambda: lag[0], lambda: done[0], max_lag=100, stale_after_s=60, clock=lambda: t[0])
    >>> p() is None
    True
    >>> t[0] = 61.0; p()
    'join: 5 messages waiting and no progress for 61 s'
    >>> done[0] = 3.0; p() is None
    True
    >>> lag[0] = 500.0; p()
    'join: 500 messages behind (bound 100)'
    """

    name: str
    lag: Callable[[], float]
    done: Callable[[], float]
    max_lag: float = MAX_LAG
    stale_after_s: float = STALE_AFTER_S
    clock: Callable[[], float] = time.monotonic
    _last_done: float | None = None
    _since: float = 0.0

    def __call__(self) -> str | None:
        now, done, lag = self.clock(), self.done(), self.lag()
        if self._last_done is None or done != self._last_done:
            self._last_done, self._since = done, now
        if lag > self.max_lag:
            return f"{self.name}: {lag:.0f} messages behind (bound {self.max_lag:.0f})"
        if lag > 0 and now - self._since > self.stale_after_s:
            return f"{self.name}: {lag:.0f} messages waiting and no progress for {now - self._since:.0f} s"
        return None


def total(metric: Any, **labels: str) -> float:
    """Sum of a metric's samples (those with ``labels``), read through its public ``collect()``."""
    out = 0.0
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if all(s.labels.get(k) == v for k, v in labels.items()):
                out += float(s.value)
    return out


# --------------------------------------------------------------------------- HTTP


class ProbeServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one port, served by a daemon thread."""

    def __init__(self, registry: CollectorRegistry, probes: Probes, port: int, host: str = "127.0.0.1") -> None:
        handler = type("Handler", (_Handler,), {"registry": registry, "probes": probes})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.host = host
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    probes: Probes

    def do_GET(self) -> None:  # the name http.server dispatches to
        path = urlsplit(self.path).path
        if path == "/metrics":
            self._send(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/readyz"):
            problems = self.probes.alive() if path == "/healthz" else self.probes.ready()
            body = orjson.dumps({"status": "fail" if problems else "ok", "problems": problems})
            self._send(503 if problems else 200, body, "application/json")
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # the stdlib's name
        """Probes every few seconds would flood stderr: requests are not logged."""
