"""Contract 1.15 end to end on a real broker: ``causalmem quarantine`` / ``unquarantine`` through the
installed command against a running learner, which answers each (the checkpoint carrying the
command); a quarantined principal's experiences then weigh 0 and are counted."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import Settings
from pipeline.modeltopic import scan_model_topic
from tests.helpers import experience, until
from tests.integration.test_operator_verbs import _learner, _out, _produce, _verb
from topics.fields import encode

pytestmark = pytest.mark.broker


@pytest.mark.slow
async def test_quarantine_and_unquarantine_through_the_installed_command(topics_ready: Settings) -> None:
    s = topics_ready
    async with _learner(s) as learner:
        done, took = await _verb(s, "quarantine", "--principal", "bot-9", "--by", "ops-ann", "--reason", "flagged")
        assert done.returncode == 0 and took < 60, _out(done)
        assert learner.progress.quarantined == ["bot-9"] and "quarantined now bot-9" in done.stdout, _out(done)
        newest = (await scan_model_topic(s.bootstrap or "", s)).newest(s.policy)
        assert newest is not None and newest.metrics["quarantined"] == ["bot-9"]
        # The quarantined principal's experiences weigh 0 from now on; the others' count.
        values = [
            encode(dataclasses.replace(experience(s, i), feedback_principal="bot-9" if i % 2 else "svc-a").to_dict())
            for i in range(1000, 1016)
        ]
        await _produce(s, s.topics().experiences.name, values)
        counted = learner.metrics.quarantined_experiences.labels(principal="bot-9")
        await until(lambda: counted._value.get() == 8, 60, "the quarantined experiences")
        again, _ = await _verb(s, "quarantine", "--principal", "bot-9", "--by", "ops-ann")
        assert again.returncode == 0 and "nothing to change" in again.stdout, _out(again)
        done, _ = await _verb(s, "unquarantine", "--principal", "bot-9", "--by", "ops-ann")
        assert done.returncode == 0, _out(done)
        assert learner.progress.quarantined == [] and "quarantined now none" in done.stdout, _out(done)
        bad, _ = await _verb(s, "quarantine", "--principal", "two words", "--by", "ops-ann")
        assert bad.returncode == 2 and "--principal" in bad.stderr, _out(bad)
