import asyncio
import signal
import time

import pytest

from tests.test_labeling import CLI, REPO, al_sample, cli_env, queue_samples


@pytest.mark.broker
async def test_sigint(topics_ready):
    s = topics_ready
    await queue_samples(s, [al_sample(s, "i-1", "qi1")])
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "label",
        "--bootstrap",
        s.bootstrap,
        "--labeler",
        "x",
        cwd=REPO,
        env=cli_env(s),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    buf = b""
    while b"label> " not in buf:
        buf += await asyncio.wait_for(proc.stdout.read(4096), 20)
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = await asyncio.wait_for(proc.wait(), 20)
    rest = await proc.stdout.read()
    print("rc", rc, "in", time.monotonic() - t, rest.decode()[-800:])
    # after quitting, EOF handling: run again with closed stdin
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "label",
        "--bootstrap",
        s.bootstrap,
        "--labeler",
        "x",
        "--timeout",
        "15",
        cwd=REPO,
        env=cli_env(s),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    t = time.monotonic()
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    print("EOF rc", proc.returncode, "in", time.monotonic() - t, out.decode()[-300:])
