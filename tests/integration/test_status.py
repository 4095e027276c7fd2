"""``causalmem status`` through a real broker: checkpoints, queue depth, dead letters, live metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
import time

import orjson
import pytest

from models.policy.network import init_policy
from models.serving.params import ServingParams
from pipeline import cli, kafka
from pipeline.labeling.queue import LabelQueue
from pipeline.metrics import Metrics, serve
from pipeline.modeltopic import CheckpointPublisher
from pipeline.status.collect import StatusCollector, manifest_rate
from pipeline.status.render import fmt_age, render
from tests.helpers import publish_tensors, retrieval_event
from tests.paths import REPO_ROOT
from topics.fields import encode
from topics.internal import dead_letter_value
from topics.manifest import Manifest

pytestmark = pytest.mark.broker

DEAD_REASONS = ["bad_json", "bad_json", "embedding_length", "missing_field", "bad_json"]
AL_SAMPLES = 5
ANSWERED = 2


async def _populate(s) -> list:
    """Two serving checkpoints and a candidate, dead letters, and a partly labelled queue."""
    t = s.topics()
    producer = kafka.producer(s.bootstrap, s)
    await producer.start()
    try:
        pub = CheckpointPublisher(producer, t.policy_checkpoints.name, s.policy)
        net = init_policy(8, 32, 16)
        m1 = await publish_tensors(
            pub, net.tensors(), reason="init", arch=net.arch, baseline=0.0, metrics={"updates": 0, "experiences": 0}
        )
        await asyncio.sleep(0.3)
        m2 = await publish_tensors(
            pub,
            net.tensors(),
            reason="periodic",
            arch=net.arch,
            baseline=0.125,
            metrics={"updates": 40, "experiences": 320, "baseline_state": {"mean": 0.125}},
        )
        await asyncio.sleep(0.2)
        m3 = await publish_tensors(
            pub,
            net.tensors(),
            reason="label",
            arch=net.arch,
            baseline=0.25,
            metrics={"updates": 46, "experiences": 350},
            candidate=True,
        )
        futures = []
        for i, reason in enumerate(DEAD_REASONS):
            value = dead_letter_value(b"{oops", reason, "test", t.retrieval_events.name, 0, i, time.time())
            futures.append(await producer.send(t.dead_letter.name, encode(value), key=b"q", partition=0))
        futures.append(await producer.send(t.dead_letter.name, b"not json at all", partition=0))
        # a labeler's "do not use": a proposal that status lists for an operator
        from topics.labels import DO_NOT_USE_PREFIX, HumanLabel

        mark = HumanLabel("dnu-1", "q-dnu", time.time(), "ann", "memory_choice", sample_id=f"{DO_NOT_USE_PREFIX}5")
        mark.correct_memories, mark.harmful_memories = [], [5]
        futures.append(await producer.send(t.human_labels.name, encode(mark.to_dict()), key=b"q-dnu"))
        from topics.convert import make_sample

        for i in range(AL_SAMPLES):
            ev = retrieval_event(s, f"al{i}", step=0)
            sample = make_sample(ev, -0.8, "error", ev.ts)
            futures.append(
                await producer.send(t.active_learning.name, encode(sample.to_dict()), key=ev.query_id.encode())
            )
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    # A labeler answers some of the queue: the group commits their offsets.
    async with LabelQueue(s.bootstrap, s, "tester") as queue:
        for _ in range(ANSWERED):
            item = await queue.next(timeout=20)
            assert item is not None
            await queue.answer(item, item.sample.candidates[:1])
    return [m1, m2, m3]


def _bump(counter, stop: threading.Event) -> None:
    while not stop.is_set():
        counter.inc()
        time.sleep(0.02)


def test_status_json_reports_checkpoints_queue_and_dead_letters(topics_ready, capsys) -> None:
    s = topics_ready
    m1, m2, m3 = asyncio.run(_populate(s))

    # Live endpoints: a worker and a learner registry served on loopback.
    wm, lm = Metrics(role="worker"), Metrics(role="learner")
    wm.set_health(72.5, "healthy")
    wm.correlation.set(0.61)
    wm.correlation_pairs.set(123)
    wm.partitions_owned.labels(stage="join").set(4)
    wm.consumer_lag.labels(topic=s.topics().retrieval_events.name).set(7)
    lm.baseline.set(0.2)
    lm.checkpoint_version.labels(role="serving").set(2)
    wport, lport = serve(wm, 0), serve(lm, 0)
    stop = threading.Event()
    bumper = threading.Thread(target=_bump, args=(lm.updates.labels(kind="feedback"), stop), daemon=True)
    bumper.start()
    try:
        t0 = time.time()
        rc = cli.main(
            [
                "status",
                "--bootstrap",
                s.bootstrap,
                "--prefix",
                s.topic_prefix,
                "--json",
                "--worker",
                f"127.0.0.1:{wport}",
                "--learner",
                f"http://127.0.0.1:{lport}/metrics",
            ]
        )
        elapsed = time.time() - t0
    finally:
        stop.set()
        bumper.join()
    out = capsys.readouterr().out
    assert rc == 0, out
    snap = orjson.loads(out.strip().splitlines()[-1])
    assert snap["errors"] == []

    ck = snap["checkpoints"]
    assert m1.version == 1 and m1.reason == "init"
    assert ck["serving"]["version"] == m2.version == 2
    assert ck["serving"]["reason"] == "periodic"
    assert ck["serving"]["baseline"] == pytest.approx(0.125)
    assert ck["serving"]["metrics"]["updates"] == 40
    assert "baseline_state" not in ck["serving"]["metrics"]  # nested state left out
    assert 0 <= ck["serving"]["age_s"] <= elapsed + (time.time() - m2.created_ts)
    assert ck["serving"]["age_s"] == pytest.approx(snap["ts"] - m2.created_ts, abs=1e-3)
    assert ck["candidate"]["version"] == 3 and ck["candidate"]["reason"] == "label"
    assert ck["manifests_seen"] == 3
    rate = ck["update_rate"]
    assert (rate["from_version"], rate["to_version"]) == (2, 3)
    assert rate["updates_per_s"] == pytest.approx(6 / (m3.created_ts - m2.created_ts), rel=1e-3)
    assert rate["experiences_per_s"] == pytest.approx(30 / (m3.created_ts - m2.created_ts), rel=1e-3)

    al = snap["active_learning"]
    assert al["depth"] == AL_SAMPLES - ANSWERED
    assert al["queued_total"] == AL_SAMPLES
    assert al["group"] == f"{s.topic_prefix}causalmem-labelers"
    assert len(al["partitions"]) == s.partitions

    dnu = snap["do_not_use"]
    assert dnu["suppressed"] == [] and dnu["audit"] == []
    assert dnu["proposals"]["open"] == 1 and dnu["proposals"]["memories"][0]["slot"] == 5

    dl = snap["dead_letter"]
    assert dl["total"] == len(DEAD_REASONS) + 1
    assert dl["by_reason"] == {"bad_json": 3, "embedding_length": 1, "missing_field": 1, "unreadable": 1}
    assert dl["by_topic"]["retrieval-events"] == len(DEAD_REASONS)

    health = snap["health"]
    assert health["score"] == pytest.approx(72.5) and health["band"] == "healthy"
    assert health["correlation"] == pytest.approx(0.61) and health["correlation_pairs"] == 123
    (worker,) = snap["workers"]
    assert worker["up"] and worker["partitions_owned"] == 4
    assert worker["consumer_lag"] == {"retrieval-events": 7}
    (learner,) = snap["learners"]
    assert learner["baseline"] == pytest.approx(0.2)
    assert learner["checkpoint_version"] == {"serving": 2}
    assert learner["updates_per_s"] is not None and learner["updates_per_s"] > 5  # ~50/s bumped

    # The table view renders the same snapshot.
    from rich.console import Console

    console = Console(width=140, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "periodic" in text and "healthy" in text and "bad_json" in text


def test_status_table_on_an_empty_deployment(topics_ready, capsys, monkeypatch) -> None:
    s = topics_ready
    monkeypatch.setenv("COLUMNS", "160")
    rc = cli.main(["status", "--bootstrap", s.bootstrap, "--prefix", s.topic_prefix, "--worker", "127.0.0.1:1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "no checkpoint yet" in out
    assert "unreachable" in out


def test_status_says_when_the_first_policy_is_the_incumbent() -> None:
    """Contract 1.17: until a candidate is promoted, clients serve their own ranking; status says so."""
    from rich.console import Console

    from pipeline.learner.publishing import first_serving
    from pipeline.status.collect import manifest_view

    m = Manifest("default", 1, time.time(), "init", {}, 0.5, 0.0, "0" * 64, 1, 1)
    fresh = dataclasses.replace(m, serving=first_serving(ServingParams(), True, "init", 0).to_wire())
    views = [manifest_view(x, time.time()) for x in (fresh, m)]
    assert [v["incumbent"] for v in views] == [True, False]
    console = Console(width=140, record=True)
    head = {"bootstrap": "127.0.0.1:1", "prefix": "", "policy": "default", "ts": time.time()}
    console.print(render({**head, "checkpoints": {"serving": views[0]}}))
    assert "init, incumbent" in console.export_text()
    # Contract 1.23: a probe over a certified version says which version clients serve but on the explored share.
    probe = dataclasses.replace(m, version=5, reason="probe", serving=ServingParams(base=4).to_wire())
    view = manifest_view(probe, time.time())
    assert view["base"] == 4 and not view["incumbent"]
    console.print(render({**head, "checkpoints": {"serving": view}}))
    assert "probe over v4" in console.export_text()


def test_manifest_rate_and_age_format() -> None:
    class M:
        def __init__(self, version: int, ts: float, updates: int) -> None:
            self.version, self.created_ts, self.metrics = version, ts, {"updates": updates, "experiences": updates * 8}

    r = manifest_rate([M(1, 100.0, 0), M(3, 110.0, 50), M(2, 105.0, 20)])
    assert (r["from_version"], r["to_version"], r["updates_per_s"]) == (2, 3, 6.0)
    assert manifest_rate([M(1, 100.0, 0)]) is None
    assert manifest_rate([M(4, 100.0, 90), M(5, 110.0, 10)])["updates_per_s"] is None  # rollback
    assert [fmt_age(x) for x in (5, 75, 7300, 90000)] == ["5s", "1m 15s", "2h 01m", "1d 01h"]


def test_status_as_a_subprocess(topics_ready) -> None:
    """``python -m pipeline.cli status`` (how procs.Child runs verbs) runs the verb."""
    s = topics_ready
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "status",
            "--bootstrap",
            s.bootstrap,
            "--prefix",
            s.topic_prefix,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    snap = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert snap["prefix"] == s.topic_prefix
    assert snap["checkpoints"]["serving"] is None and snap["dead_letter"]["total"] == 0
    assert snap["active_learning"]["depth"] == 0


async def test_watch_refresh_reads_only_what_is_new(topics_ready) -> None:
    """A collector reused across refreshes (``--watch``) counts new records once, and rates come
    from the counters' change between refreshes."""
    s = topics_ready
    t = s.topics()
    wm = Metrics(role="worker")
    wm.set_health(95.0, "efficient")
    wport = serve(wm, 0)
    collector = StatusCollector(s.bootstrap, s, worker_urls=[f"http://127.0.0.1:{wport}/metrics"], rate_interval=0.2)
    producer = kafka.producer(s.bootstrap, s)
    await producer.start()
    try:
        pub = CheckpointPublisher(producer, t.policy_checkpoints.name, s.policy)
        net = init_policy(8, 32, 16)
        await publish_tensors(pub, net.tensors(), reason="init", arch=net.arch, baseline=0.0, metrics={"updates": 0})
        value = dead_letter_value(b"x", "bad_json", "", t.llm_feedback.name, 0, 0, time.time())
        await (await producer.send(t.dead_letter.name, encode(value), partition=0))
        first = await collector.snapshot()
        assert first["checkpoints"]["serving"]["version"] == 1
        assert first["dead_letter"]["by_reason"] == {"bad_json": 1}

        wm.joins.inc(50)
        await publish_tensors(
            pub, net.tensors(), reason="periodic", arch=net.arch, baseline=0.1, metrics={"updates": 10}
        )
        value = dead_letter_value(b"y", "nan_or_inf", "", t.retrieval_events.name, 0, 1, time.time())
        await (await producer.send(t.dead_letter.name, encode(value), partition=0))
        second = await collector.snapshot()
    finally:
        await producer.stop()
    assert second["checkpoints"]["serving"]["version"] == 2
    assert second["checkpoints"]["manifests_seen"] == 2
    assert second["dead_letter"]["total"] == 2
    assert second["dead_letter"]["by_reason"] == {"bad_json": 1, "nan_or_inf": 1}
    assert second["dead_letter"]["by_topic"] == {"llm-feedback": 1, "retrieval-events": 1}
    (worker,) = second["workers"]
    assert worker["joins_per_s"] is not None and worker["joins_per_s"] > 0
    assert second["health"]["band"] == "efficient"
