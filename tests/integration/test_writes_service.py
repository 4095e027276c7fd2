"""The write gate service on a real broker, its readiness and its metrics."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest

from models.memory.write_gate import memory_id_for
from pipeline.config import Settings
from pipeline.metrics import Metrics
from pipeline.probes import total
from pipeline.writes.service import WriteGateService
from tests.helpers import until
from topics.lifecycle import decode_memory_record
from topics.names import TopicSpec
from topics.writes import MemoryWrite, decode_rejected_write

BASE_TS = 1_767_225_600.0


@pytest.mark.broker
def test_proposals_in_admissions_out_rejections_kept_bad_ones_dead_lettered(topics_ready: Settings) -> None:
    from pipeline import kafka

    s = topics_ready.replace(writes_theta=0.3, writes_prior=0.5)
    config = s.writes()
    topics, limits, bootstrap = s.topics(), s.limits(), s.bootstrap or ""
    emb = np.ones(s.embedding_dim, np.float32) / np.sqrt(s.embedding_dim)
    # Judged in this order against the gate's own estimate (the global mean here: prior 0.5,
    # then 1.0, then 0.5); the producers' claimed expectations decide nothing.
    proposals = [
        # 1.0 against the prior 0.5: a success (its claim agrees: within θ of 0.5)
        MemoryWrite(
            "w-good", BASE_TS, "retry with a smaller page", "q1", 0, reward=1.0, expected_reward=0.6, embedding=emb
        ),
        # 0.0 against 1.0: a pitfall, although its producer claims it expected 0.0
        MemoryWrite("w-bad", BASE_TS + 1, "the v1 endpoint times out", "q2", 1, reward=0.0, expected_reward=0.0),
        # 0.5 against 0.5: no surprise, although its producer claims it expected −5
        MemoryWrite("w-meh", BASE_TS + 2, "nothing new", "q3", 0, reward=0.5, expected_reward=-5.0),
    ]
    no_reward = orjson.loads(proposals[2].to_bytes())
    no_reward.update(write_id="w-noreward")
    del no_reward["reward"]
    wrong_size = dict(orjson.loads(proposals[0].to_bytes()), write_id="w-size", embedding=[0.1, 0.2])

    async def main() -> dict[str, list[Any]]:
        if not hasattr(topics, "memory_lifecycle"):  # until the product's topics include it
            await kafka.create_topics(bootstrap, s, [TopicSpec(config.lifecycle_topic, 1)])
        producer = kafka.producer(bootstrap, s)
        await producer.start()
        metrics = Metrics(role="writes")
        gate = WriteGateService(config, bootstrap, metrics)
        outputs = [config.lifecycle_topic, topics.memory_writes_rejected.name, topics.dead_letter.name]

        def judged(n: int) -> Callable[[], bool]:
            return lambda: gate.judged == n

        got: dict[str, list[Any]] = {t: [] for t in outputs}
        try:
            async with gate:
                task = asyncio.create_task(gate.run())
                for i, w in enumerate(proposals, 1):  # one at a time: each is judged by the estimate of the moment
                    await producer.send_and_wait(topics.memory_writes.name, w.to_bytes(), key=w.key)
                    await until(judged(i), 10, f"proposal {i} judged")
                for bad in (no_reward, wrong_size):
                    await producer.send_and_wait(
                        topics.memory_writes.name, orjson.dumps(bad), key=bad["write_id"].encode()
                    )
                consumer = kafka.consumer(bootstrap, s, *outputs, group_id=uuid.uuid4().hex)
                await consumer.start()
                try:

                    async def poll() -> bool:
                        for tp, msgs in (await consumer.getmany(timeout_ms=200)).items():
                            got[tp.topic].extend(msgs)
                        return [len(got[t]) for t in outputs] == [2, 1, 2]

                    deadline = asyncio.get_running_loop().time() + 15
                    while not await poll():
                        assert asyncio.get_running_loop().time() < deadline, f"timed out: {got}"
                    await until(lambda: gate.judged == 3, 5, "decisions counted")
                finally:
                    await consumer.stop()
                assert not task.done(), "the gate keeps running after bad input"
                committed = {tp.partition: await gate._consumer.committed(tp) for tp in gate._consumer.assignment()}
                assert sum(v or 0 for v in committed.values()) == 5, "offsets committed after the outputs"
                task.cancel()
        finally:
            await producer.stop()
        for name in ("admitted_success", "admitted_pitfall", "rejected", "invalid"):
            assert total(gate.own.decisions, decision=name) == {"invalid": 2, "rejected": 1}.get(name, 1), name
        assert total(gate.own.claims, claim="agrees") == 1 and total(gate.own.claims, claim="disagrees") == 2
        assert total(gate.own.estimates, estimate="producer") == 0
        assert total(metrics.rejected, reason="missing_field") == 1
        assert total(metrics.rejected, reason="embedding_length") == 1
        return got

    got = asyncio.run(main())
    adds = {
        r.memory_id: r for r in (decode_memory_record(m.value, s.limits(), m.key) for m in got[config.lifecycle_topic])
    }
    good, bad = adds[memory_id_for("w-good")], adds[memory_id_for("w-bad")]
    assert (good.op, good.kind, good.delta, good.source) == ("add", "success", 0.5, "write-gate")
    assert good.embedding is not None and good.text == "retry with a smaller page"
    assert (bad.kind, bad.embedding) == ("pitfall", None) and bad.delta == pytest.approx(-1.0)
    (kept,) = [decode_rejected_write(m.value, limits, m.key) for m in got[topics.memory_writes_rejected.name]]
    assert kept.write_id == "w-meh" and kept.rpe == pytest.approx(0.0)
    assert kept.expected_reward == pytest.approx(0.5) and kept.estimate == "global"
    assert kept.write.expected_reward == -5.0, "the claim is kept as received, for review"
    reasons = sorted(orjson.loads(m.value)["reason"] for m in got[topics.dead_letter.name])
    assert reasons == ["embedding_length", "missing_field"]


def test_readiness_needs_partitions_and_the_exposition_is_the_gates() -> None:
    from aiokafka import TopicPartition
    from prometheus_client import generate_latest

    from pipeline.cli.writes import watch_writes
    from pipeline.probes import Probes

    s = Settings()
    metrics = Metrics(role="writes")
    gate = WriteGateService(s.writes(), "127.0.0.1:1", metrics)
    probes = Probes()
    watch_writes(probes, metrics, gate)
    probes.beat()
    assert any("no memory-writes partitions" in p for p in probes.ready())
    gate.on_assigned({TopicPartition(s.topics().memory_writes.name, 0)})
    probes.beat()
    assert probes.ready() == []
    text = generate_latest(metrics.registry).decode()
    for decision in ("admitted_success", "admitted_pitfall", "rejected", "invalid"):
        assert f'causalmem_writes_decisions_total{{decision="{decision}"}} 0.0' in text
    for name in ("rpe_bucket", "partitions_owned", "batch_seconds_bucket", "topics", "claims_total"):
        assert f"causalmem_writes_{name}" in text, name
    assert "causalmem_joins_total" not in text and "causalmem_learner_loss" not in text


def test_the_verb_parses_its_flags_into_the_gates_configuration() -> None:
    from pipeline.cli import build_parser
    from pipeline.cli.common import DEFAULT_METRICS_PORTS, settings_from
    from pipeline.cli.writes import WRITES_KEYS

    argv = ["writes", "--theta", "0.5", "--prior", "0.2", "--rejected-retention-days", "1"]
    args = build_parser(argv).parse_args(argv)
    s = settings_from(args, **{k: getattr(args, k) for k in WRITES_KEYS})
    config = s.writes()
    assert (config.theta, config.prior) == (0.5, 0.2)
    assert s.topics().memory_writes_rejected.configs["retention.ms"] == str(86_400_000)
    assert config.lifecycle_topic == "memory-lifecycle" and DEFAULT_METRICS_PORTS["writes"] == 9103
