"""Through a real broker (contract 1.16): with a keyring (``principal_keys``), the worker's join
records a principal only where the value proves it, so one client cannot pass as another, nor
split itself into many.

- a service and an evaluator that sign with their keys are recorded under their names;
- a value that claims a keyed principal without its signature (none, or another key's) is
  rejected, ``bad_signature``, and never joined;
- a name the keyring does not hold is accepted and counts as anonymous.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import orjson
import pytest

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from pipeline.metrics import Metrics
from pipeline.worker.join import JoinStage
from tests.helpers import feedback, retrieval_event, running, until
from topics.internal import decode_experience
from topics.signing import generate_pem, load_key

pytestmark = pytest.mark.broker


async def test_the_join_records_a_principal_only_where_its_signature_proves_it(
    topics_ready: Settings, tmp_path: Path
) -> None:
    private_pem, public_pem = generate_pem()
    keys = tmp_path / "principal-keys"
    keys.mkdir()
    (keys / "svc-a.pem").write_bytes(public_pem)
    (keys / "evaluator.pem").write_text("evaluator-secret\n")
    s = dataclasses.replace(topics_ready, principal_keys=str(keys))
    t = s.topics()
    metrics = Metrics()
    now = time.time()
    events = [retrieval_event(s, f"sig-{i}", step=0, ts=now - 30 + i) for i in range(4)]
    other_private = load_key(generate_pem()[0])
    async with (
        running(JoinStage(s.join(), s.bootstrap or "", metrics)) as stage,
        EventPublisher(s.bootstrap or "", s, principal="svc-a", principal_key=load_key(private_pem)) as service,
        EventPublisher(s.bootstrap or "", s, principal="evaluator", principal_key=b"evaluator-secret") as evaluator,
        EventPublisher(s.bootstrap or "", s, principal="svc-x") as unkeyed,
        EventPublisher(s.bootstrap or "", s, principal="svc-a") as unsigned_forger,
        EventPublisher(s.bootstrap or "", s, principal="svc-a", principal_key=other_private) as keyed_forger,
    ):
        await service.publish(events[0])
        await unkeyed.publish(events[1])
        await unsigned_forger.publish(events[2])
        await keyed_forger.publish(events[3])
        for ev in events:
            await evaluator.publish(feedback(ev.query_id, ev.step, ts=ev.ts + 1))
        for pub in (service, evaluator, unkeyed, unsigned_forger, keyed_forger):
            assert await pub.flush()
        await until(lambda: stage.joined_total == 2, 30, "two joins")
        await until(lambda: metrics.dead_letters._value.get() >= 2, 30, "two dead letters")
    records = await kafka.read_all(s.bootstrap or "", s, t.experiences.name)
    exps = [decode_experience(m.value, s.limits()) for m in records]
    got = {e.event.query_id: (e.event_principal, e.feedback_principal, e.principal) for e in exps}
    assert got == {"sig-0": ("svc-a", "evaluator", "evaluator"), "sig-1": (None, "evaluator", "evaluator")}
    dead = [orjson.loads(m.value) for m in await kafka.read_all(s.bootstrap or "", s, t.dead_letter.name)]
    assert sorted(d["reason"] for d in dead) == ["bad_signature", "bad_signature"]
    assert {d["detail"] for d in dead} == {
        "principal 'svc-a': no signature in header causalmem-principal-signature",
        "principal 'svc-a': a wrong signature in header causalmem-principal-signature",
    }
