"""``causalmem broker``: the embedded (memory-only) Tansu broker in the foreground.

SIGINT (Ctrl-C), SIGTERM and SIGHUP stop it: the verb terminates its Tansu child, waits
for it and exits 0. The signals only set a flag that the verb's loop reads, so one
arriving at any moment (even while the child starts) cannot leave the child running.
On Linux the child also asks the kernel for SIGTERM when the verb dies without a chance
to stop it (SIGKILL), so it never outlives the verb.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from pipeline.broker import (
    DEFAULT_PORT,
    HOST,
    _state_file,
    broker_command,
    port_open,
    recorded_broker,
    stop_recorded_broker,
)
from pipeline.cli.common import settings_from

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0  # after SIGTERM, the child is killed
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=None, help="loopback port (default 19092)")
    p.add_argument("--stop", action="store_true", help="stop the shared embedded broker started by another verb")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if args.stop:
        print(stop_recorded_broker(settings.state_path()))
        return 0
    return run_foreground(settings.state_path(), args.port or DEFAULT_PORT)


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
    """Run the broker until a stop signal (exit 0) or until it exits by itself (its status)."""
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
