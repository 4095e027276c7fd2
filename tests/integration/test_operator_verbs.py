"""The operator verbs end to end on a real broker: ``evaluate`` and ``rollback`` through the CLI, and
``suppress`` / ``unsuppress`` / ``rollback`` through the installed ``causalmem`` command (a child
process) against a running learner, which answers each command: done, or refused and why."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

import pipeline.cli as cli
from pipeline import kafka
from pipeline.config import Settings
from pipeline.learner.loop import Learner
from pipeline.metrics import Metrics
from pipeline.modeltopic import scan_model_topic
from tests.conftest import settings_env
from tests.helpers import experience, running, until
from topics.fields import encode
from topics.internal import Control
from topics.signing import generate_pem

pytestmark = pytest.mark.broker

CAUSALMEM = Path(sys.executable).with_name("causalmem")  # the venv's entry point, as operators run it


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


async def _verb(
    s: Settings, verb: str, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``causalmem VERB`` in a child process with these settings (and ``env``); (the result, seconds it took)."""
    env = {**os.environ, **settings_env(s), **(env or {})}
    argv = [str(CAUSALMEM), verb, "--bootstrap", s.bootstrap or "", *args]
    t0 = time.monotonic()
    done = await asyncio.to_thread(
        subprocess.run, argv, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
    )
    return done, time.monotonic() - t0


@contextlib.asynccontextmanager
async def _learner(s: Settings) -> AsyncIterator[Learner]:
    async with running(Learner(s.learner(), s.bootstrap or "", Metrics())) as learner:
        await until(lambda: learner.active.is_set() and learner.version >= 1, 60, "the learner's first checkpoint")
        yield learner


async def _produce(s: Settings, topic: str, values: list[bytes]) -> None:
    p = kafka.producer(s.bootstrap or "", s)
    await p.start()
    try:
        for value in values:
            await p.send(topic, value, partition=0)
        await p.flush()
    finally:
        await p.stop()


async def _train(s: Settings, learner: Learner, start: int, n: int = 16) -> None:
    """Some experiences, and the periodic checkpoint that follows them."""
    before = learner.version
    values = [encode(experience(s, i).to_dict()) for i in range(start, start + n)]
    await _produce(s, s.topics().experiences.name, values)
    await until(lambda: learner.version > before, 60, "a periodic checkpoint")


def _out(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr[-3000:]}"


@pytest.mark.slow
async def test_suppress_and_unsuppress_through_the_installed_command(topics_ready: Settings) -> None:
    """Every call of the verbs crashed (their ``--slots`` list overwrote Settings.slots)."""
    s = topics_ready
    async with _learner(s) as learner:
        done, _ = await _verb(s, "suppress", "--slots", "4", "9", "--reason", "leaks", "--by", "ops-ann")
        assert done.returncode == 0, _out(done)
        assert learner.progress.suppressed == [4, 9]
        assert float(learner.trainer.net.out.bias[4].detach()) < -20
        newest = (await scan_model_topic(s.bootstrap or "", s)).newest(s.policy)
        assert newest is not None and newest.reason == "suppress" and newest.metrics["suppressed"] == [4, 9]
        entry = newest.metrics["suppression"]
        assert (entry["by"], entry["by_verified"]) == ("ops-ann", False)  # what the sender claims, unverified
        done, _ = await _verb(s, "unsuppress", "--slots", "9", "--reason", "a mistake", "--by", "ops-ann")
        assert done.returncode == 0, _out(done)
        assert learner.progress.suppressed == [4]
        assert f"serving v{learner.version}" in done.stdout


@pytest.mark.slow
async def test_with_operator_keys_only_a_signed_operator_is_obeyed_and_named_as_proven(
    topics_ready: Settings, tmp_path: Path
) -> None:
    """Contract 1.16. ``by`` was free text: a forged ``by='ops-bob'`` reached the audit trail, and anyone
    who could write ``control`` was obeyed. With ``operator_keys`` the learner carries out an operator's
    command only when its signature proves its ``by``; the drift stage's unsigned ``reset`` still counts."""
    private_pem, public_pem = generate_pem()
    keys = tmp_path / "operators"
    keys.mkdir()
    (keys / "ops-ann.pem").write_bytes(public_pem)
    key_file = tmp_path / "ops-ann.key"
    key_file.write_bytes(private_pem)
    signed = {"CAUSALMEM_OPERATOR_KEY_FILE": str(key_file)}
    s = topics_ready.replace(operator_keys=str(keys))
    async with _learner(s) as learner:
        done, _ = await _verb(s, "suppress", "--slots", "4", "--reason", "leaks", "--by", "ops-ann", env=signed)
        assert done.returncode == 0, _out(done)
        newest = (await scan_model_topic(s.bootstrap or "", s)).newest(s.policy)
        assert newest is not None and newest.metrics["suppression"]["by_verified"] is True
        for by, env in (("ops-ann", None), ("ops-bob", signed), ("ops-bob", None)):  # no key; ann's key, bob's name
            done, took = await _verb(s, "suppress", "--slots", "5", "--by", by, "--timeout", "90", env=env)
            assert done.returncode == 1 and took < 45, f"{by} {env}: {took:.0f} s\n{_out(done)}"
            assert "refused by the learner: bad_signature" in done.stdout, _out(done)
        assert learner.progress.suppressed == [4]
        resets = learner.progress.resets
        await _produce(s, s.topics().control.name, [encode(Control("reset", time.time(), "drift").to_dict())])
        await until(lambda: learner.progress.resets > resets, 60, "the drift stage's reset")


@pytest.mark.slow
async def test_the_learners_refusals_reach_the_operator_within_seconds(topics_ready: Settings) -> None:
    """``rollback --to`` a version no longer kept and a suppression of slot 5000 (S = 32) were refused by
    the learner at once, while the verb waited its whole timeout and then asked whether a learner ran."""
    s = topics_ready.replace(keep_versions=1, checkpoint_full_every=1)
    async with _learner(s) as learner:
        for start in (0, 100, 200):
            await _train(s, learner, start)
        for copy in (learner.store.root / "versions").glob("1.*"):
            copy.unlink()  # v1: off the model topic (keep_versions=1) and out of the learner's directory
        done, took = await _verb(s, "rollback", "--to", "1", "--timeout", "90")
        assert done.returncode == 1 and took < 45, f"{took:.0f} s\n{_out(done)}"
        assert "refused" in done.stdout and "out_of_range" in done.stdout and "v1" in done.stdout, _out(done)
        done, took = await _verb(s, "suppress", "--slots", "5000", "--by", "ops", "--timeout", "90")
        assert done.returncode == 1 and took < 45, f"{took:.0f} s\n{_out(done)}"
        assert "refused" in done.stdout and "out_of_range" in done.stdout, _out(done)
        # what can be rolled back to: the earlier versions the topic or the learner's directory still has
        listed, _ = await _verb(s, "rollback", "--list")
        assert listed.returncode == 0, _out(listed)
        lines = [line.split() for line in listed.stdout.splitlines() if line.startswith("  v")]
        versions = [int(words[0][1:]) for words in lines]
        assert versions == sorted(range(2, learner.version), reverse=True), listed.stdout
        done, _ = await _verb(s, "rollback", "--to", str(versions[-1]), "--timeout", "90")
        assert done.returncode == 0, _out(done)
        assert f"the weights of v{versions[-1]}" in done.stdout


@pytest.mark.slow
async def test_a_flood_of_rollbacks_and_resets_is_capped(topics_ready: Settings) -> None:
    """The report: 10 rollbacks and 3 resets gave 13 checkpoints past the gate in 20 s."""
    s = topics_ready.replace(gate=True)
    async with _learner(s) as learner:
        await _train(s, learner, 0)
        first = learner.version
        commands = [Control("rollback", time.time(), "flood", {"to_version": 1}, f"rb-{i}") for i in range(10)]
        commands += [Control("reset", time.time(), "flood", {}, f"rs-{i}") for i in range(3)]
        await _produce(s, s.topics().control.name, [encode(c.to_dict()) for c in commands])
        await until(lambda: learner.inbox.control_position >= len(commands), 120, "the commands handled")
        index = await scan_model_topic(s.bootstrap or "", s)
        forced = [m.reason for m in index.links(s.policy) if m.version > first]
        refused = [
            record["reason"]
            for msg in await kafka.read_all(s.bootstrap or "", s, s.topics().dead_letter.name)
            if (record := orjson.loads(msg.value))["source"]["topic"] == s.topics().control.name
        ]
        assert refused, f"{len(forced)} checkpoints past the gate, none refused: {forced}"
        assert len(forced) == s.control_checkpoints_per_hour < len(commands), forced
        assert refused == ["rate_limited"] * (len(commands) - len(forced))
        # the operator's verb hears the refusal at once
        done, took = await _verb(s, "rollback", "--to", "1", "--by", "ops", "--timeout", "90")
        assert done.returncode == 1 and took < 45 and "rate_limited" in done.stdout, f"{took:.0f} s\n{_out(done)}"
