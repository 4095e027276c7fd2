"""``causalmem broker`` in the foreground: a stop signal ends its Tansu child too.

The verb runs as a real child process on a free port; its own children are found
through /proc (by parent pid) before the signal, and followed by pid and start time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.broker import HOST, free_port, port_open

pytestmark = pytest.mark.broker

START_S = 30.0  # the verb's port accepts connections within this
STOP_S = 10.0  # after the signal: the verb gone, the port closed, no child left


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: pid -> start time (to tell a reused pid apart)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[1] == str(pid):
                found[int(entry.name)] = fields[19]
    return found


def _alive(pid: int, started: str) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[19] == started and fields[0] != "Z"


def _start_verb(tmp_path: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CAUSALMEM_STATE_DIR": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "verb.log", "ab") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "pipeline.cli", "broker", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _wait_listening(verb: subprocess.Popen[bytes], port: int, tmp_path: Path) -> None:
    deadline = time.monotonic() + START_S
    while not port_open(HOST, port):
        log = (tmp_path / "verb.log").read_text(errors="replace")[-2000:]
        assert verb.poll() is None, f"causalmem broker exited with {verb.returncode}: {log}"
        assert time.monotonic() < deadline, f"causalmem broker did not listen on {port} within {START_S} s: {log}"
        time.sleep(0.05)


def _gone_within(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _stop_and_check(tmp_path: Path, sig: signal.Signals) -> tuple[int | None, bool, dict[int, str]]:
    """Start the verb, send it ``sig``; return (its exit status, port closed, children left)."""
    port = free_port()
    verb = _start_verb(tmp_path, port)
    children: dict[int, str] = {}
    try:
        _wait_listening(verb, port, tmp_path)
        children = _children(verb.pid)
        assert children, "causalmem broker listens but has no child process"
        verb.send_signal(sig)
        try:
            rc: int | None = verb.wait(STOP_S)
        except subprocess.TimeoutExpired:
            rc = None
        closed = _gone_within(lambda: not port_open(HOST, port), STOP_S)
        left = {pid: t for pid, t in children.items() if _alive(pid, t)}
        if left:  # give a child that is on its way out the rest of the deadline
            _gone_within(lambda: not any(_alive(p, t) for p, t in children.items()), STOP_S)
            left = {pid: t for pid, t in children.items() if _alive(pid, t)}
        return rc, closed, left
    finally:
        # Only what this test started: the verb, and the children found under it above.
        if verb.poll() is None:
            verb.kill()
            verb.wait(5)
        for pid, started in children.items():
            if _alive(pid, started):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_stops_the_broker_child_and_the_verb_exits_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    rc, closed, left = _stop_and_check(tmp_path, sig)
    log = (tmp_path / "verb.log").read_text(errors="replace")[-2000:]
    assert rc is not None, f"causalmem broker still running {STOP_S} s after {sig.name}: {log}"
    assert closed, f"the broker's port still accepts connections {STOP_S} s after {sig.name}"
    assert not left, f"child process(es) {sorted(left)} outlived causalmem broker after {sig.name}"
    assert rc == 0, f"causalmem broker exited with {rc} after {sig.name}: {log}"
    assert not (tmp_path / "state" / "broker.json").exists(), "the stopped broker is still recorded"


def test_the_broker_child_does_not_outlive_a_killed_verb(tmp_path: Path) -> None:
    """SIGKILL cannot be handled: the child still goes when its parent does."""
    rc, closed, left = _stop_and_check(tmp_path, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert closed, f"the broker's port still accepts connections {STOP_S} s after the verb was killed"
    assert not left, f"child process(es) {sorted(left)} outlived the killed causalmem broker"
