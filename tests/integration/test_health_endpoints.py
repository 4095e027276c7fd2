"""Health that tells the truth (docs/operations.md, "Health endpoints"; issue: honest health).

- every process's metrics port answers ``/healthz`` (the event loop's heartbeat is recent,
  no vital task ended) and ``/readyz`` (the role's checks pass), 503 otherwise; before,
  any path answered 200 with the metrics text, and the k8s probes only opened a TCP port;
- metrics are served by default on a per-role port, fall back to a free port when it is
  taken, and ``--metrics-port none`` turns them off;
- a learner whose training task died reports neither alive nor ready, and ``status``
  computes its lag from the topics against the newest manifest and shows it stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import urllib.error
import urllib.request
from typing import Any

import orjson
import pytest
import yaml

from pipeline import kafka
from pipeline.cli import common
from pipeline.cli.worker import watch_worker
from pipeline.config import Settings
from pipeline.metrics import Metrics, serve
from pipeline.probes import MAX_LAG, Probes, ProbeServer
from tests.helpers import experience, until
from tests.paths import REPO_ROOT
from topics.fields import encode

K8S = REPO_ROOT / "deploy" / "k8s"


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# --------------------------------------------------------------------------- the endpoints


def test_healthz_follows_the_heartbeat_and_readyz_the_checks() -> None:
    clock = Clock()
    probes = Probes(heartbeat_timeout_s=30, clock=clock)
    waiting = ["no input partitions assigned"]
    probes.check(lambda: waiting[0] if waiting else None)
    metrics = Metrics(role="worker")
    server = ProbeServer(metrics.registry, probes, 0)
    try:
        # Serving, but the loop has not beaten yet: neither alive nor ready.
        code, body = get(server.port, "/healthz")
        assert code == 503 and orjson.loads(body)["problems"] == ["no heartbeat yet"]
        assert get(server.port, "/readyz")[0] == 503

        probes.beat()
        clock.t += 5
        code, body = get(server.port, "/healthz")
        assert (code, orjson.loads(body)) == (200, {"status": "ok", "problems": []})
        code, body = get(server.port, "/readyz")
        assert code == 503 and orjson.loads(body)["problems"] == ["no input partitions assigned"]

        waiting.clear()
        probes.beat()
        assert get(server.port, "/readyz")[0] == 200

        # The loop stalls: the HTTP thread still answers, and says so.
        clock.t += 31
        code, body = get(server.port, "/healthz")
        assert code == 503 and "heartbeat is 31 s old" in orjson.loads(body)["problems"][0]
        assert get(server.port, "/readyz")[0] == 503

        code, body = get(server.port, "/metrics")
        assert code == 200 and b"causalmem_joins_total" in body
        assert get(server.port, "/nothing")[0] == 404
    finally:
        server.close()


def test_serve_without_probes_never_answers_healthy() -> None:
    """Before, every path of the metrics port answered 200: a probe could not tell anything."""
    port = serve(Metrics(role="learner"), 0)
    assert port is not None
    assert get(port, "/healthz")[0] == 503
    assert get(port, "/readyz")[0] == 503
    assert b"causalmem_learner_updates_total" in get(port, "/metrics")[1]


def test_a_vital_task_that_ended_fails_liveness_and_readiness() -> None:
    async def main() -> tuple[list[str], list[str], list[str]]:
        probes = Probes()

        async def train() -> None:
            raise RuntimeError("boom")

        task = asyncio.create_task(train())
        probes.vital("training", task)
        probes.beat()
        before = probes.alive()
        with contextlib.suppress(RuntimeError):
            await task
        probes.beat()
        return before, probes.alive(), probes.ready()

    before, alive, ready = asyncio.run(main())
    assert before == []
    assert alive == ["training task ended: RuntimeError('boom')"]
    assert ready == alive


def test_worker_readiness_needs_partitions_and_a_bounded_lag() -> None:
    metrics = Metrics(role="worker")
    probes = Probes()
    watch_worker(probes, metrics)
    probes.beat()
    assert any("no input partitions" in p for p in probes.ready())
    metrics.partitions_owned.labels(stage="join").set(2)
    metrics.consumer_lag.labels(topic="retrieval-events").set(3)
    probes.beat()
    assert probes.ready() == []
    metrics.consumer_lag.labels(topic="llm-feedback").set(MAX_LAG)
    probes.beat()
    assert probes.ready() == [f"join: {MAX_LAG + 3} messages behind (bound {MAX_LAG})"]


def test_heartbeat_sets_the_ready_gauge() -> None:
    probes = Probes()
    probes.check(lambda: "not yet")
    metrics = common.start_metrics("worker", Settings(metrics_port=-1), probes)
    probes.beat()
    assert metrics.registry.get_sample_value("causalmem_ready") == 0.0
    assert (metrics.registry.get_sample_value("causalmem_heartbeat_timestamp_seconds") or 0) > 0


def test_k8s_probes_are_http_health_checks() -> None:
    """The probes ask /healthz and /readyz, not whether a TCP port opens."""
    seen = 0
    for f in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc or doc.get("kind") != "Deployment":
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                seen += 1
                port = "http" if c["name"] == "ui" else "metrics"  # the web app serves both on its one port
                assert port in {p["name"] for p in c["ports"]}, f
                assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}, f
                assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}, f
                assert c["startupProbe"]["httpGet"]["path"] == "/healthz", f
    assert seen == 5  # worker, learner, evaluator, write gate, web app


# --------------------------------------------------------------------------- metrics by default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_are_served_by_default_on_the_roles_port(monkeypatch, capsys) -> None:
    port = _free_port()
    monkeypatch.setitem(common.DEFAULT_METRICS_PORTS, "learner", port)
    metrics = common.start_metrics("learner", Settings())
    assert metrics.port == port
    assert f"metrics: http://127.0.0.1:{port}/metrics" in capsys.readouterr().out
    assert get(port, "/metrics")[0] == 200


def test_a_taken_default_port_falls_back_to_a_free_one(monkeypatch, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setitem(common.DEFAULT_METRICS_PORTS, "worker", port)
        common.start_metrics("worker", Settings())
        out = capsys.readouterr().out
    assert f"default port {port} is taken" in out
    bound = int(out.split("metrics: http://127.0.0.1:")[1].split("/")[0])
    assert bound != port and get(bound, "/metrics")[0] == 200


def test_an_explicit_port_that_is_taken_is_an_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit, match="cannot serve"):
            common.start_metrics("worker", Settings(metrics_port=taken.getsockname()[1]))


def test_metrics_port_none_turns_metrics_off(capsys) -> None:
    from pipeline import cli

    argv = ["worker", "--metrics-port", "none"]
    args = cli.build_parser(argv).parse_args(argv)
    settings = common.settings_from(args)
    assert settings.metrics_port == -1
    common.start_metrics("worker", settings)
    assert "metrics: off" in capsys.readouterr().out
    argv = ["learner", "--metrics-port", "9200"]
    assert cli.build_parser(argv).parse_args(argv).metrics_port == 9200


# --------------------------------------------------------------------------- a learner whose training died


async def _learner_dies_and_status_sees_it(s: Settings) -> dict[str, Any]:
    from pipeline.cli.learner import start_watched
    from pipeline.learner.loop import Learner
    from pipeline.status.collect import StatusCollector

    probes = Probes()
    metrics = common.start_metrics("learner", dataclasses.replace(s, metrics_port=0), probes)
    port = metrics.port
    assert port is not None
    learner = Learner(s.learner(), s.bootstrap or "", metrics)
    task, heartbeat = await start_watched(learner, probes, metrics, interval_s=0.1)
    out: dict[str, Any] = {}
    try:
        await until(lambda: learner.version >= 1 and not probes.ready(), 60, "an elected, ready learner")
        out["ready_before"] = await asyncio.to_thread(get, port, "/readyz")
        collector = StatusCollector(s.bootstrap or "", s, stall_after_s=1.0)
        out["status_before"] = (await collector.snapshot())["learner_lag"]

        task.cancel()  # the training task dies; the process lives on
        with contextlib.suppress(asyncio.CancelledError):
            await task
        producer = kafka.producer(s.bootstrap or "", s)
        await producer.start()
        try:
            for i in range(20):
                await producer.send_and_wait(
                    s.topics().experiences.name, encode(experience(s, i).to_dict()), partition=0
                )
        finally:
            await producer.stop()
        await asyncio.sleep(1.5)  # past stall_after_s, and a few heartbeats
        out["ready_after"] = await asyncio.to_thread(get, port, "/readyz")
        out["alive_after"] = await asyncio.to_thread(get, port, "/healthz")
        out["alive_gauge"] = metrics.registry.get_sample_value("causalmem_learner_training_alive")
        out["status_after"] = (await collector.snapshot())["learner_lag"]
    finally:
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat
        await learner.stop(publish=False)
    return out


@pytest.mark.broker
def test_learner_with_a_dead_training_task_is_not_ready_and_shows_stalled(topics_ready, capsys) -> None:
    out = asyncio.run(_learner_dies_and_status_sees_it(topics_ready))
    assert out["ready_before"][0] == 200
    assert out["status_before"]["lag"] == 0 and out["status_before"]["stalled"] is False

    code, body = out["ready_after"]
    assert code == 503 and "training task ended: cancelled" in orjson.loads(body)["problems"]
    assert out["alive_after"][0] == 503
    assert out["alive_gauge"] == 0.0
    after = out["status_after"]
    assert after["lag"] == 20 and after["stalled"] is True
    assert "20 experiences wait" in after["why"]


# --------------------------------------------------------------------------- status: learner lag from the topics


def _manifest(version: int, created_ts: float, applied: int) -> Any:
    from topics.manifest import Manifest

    return Manifest(
        "default", version, created_ts, "periodic", {"d": 8}, 0.5, 0.0, "0" * 64, 1, 1, {}, {"p.experiences:0": applied}
    )


def test_learner_lag_is_the_topic_end_minus_the_newest_manifests_offset() -> None:
    from io import StringIO

    from rich.console import Console

    from pipeline.modeltopic import ModelTopicIndex
    from pipeline.status.collect import learner_lag_view
    from pipeline.status.render import render

    index = ModelTopicIndex()
    index.manifests[("default", 3)] = _manifest(3, 1000.0, 150)
    index.manifests[("default", 4)] = _manifest(4, 1100.0, 180)
    index.manifests[("other", 9)] = _manifest(9, 1190.0, 0)

    fresh = learner_lag_view(index, "default", "p.experiences", 200, 1200.0, 300.0)
    assert (fresh["lag"], fresh["manifest_version"], fresh["stalled"]) == (20, 4, False)
    caught_up = learner_lag_view(index, "default", "p.experiences", 180, 9999.0, 300.0)
    assert caught_up["lag"] == 0 and caught_up["stalled"] is False
    stalled = learner_lag_view(index, "default", "p.experiences", 200, 1500.0, 300.0)
    assert stalled["stalled"] is True and stalled["why"].startswith("20 experiences wait and newest checkpoint v4")

    snap = {
        "bootstrap": "b:1",
        "prefix": "p.",
        "policy": "default",
        "ts": 1500.0,
        "checkpoints": {},
        "active_learning": {},
        "dead_letter": {},
        "errors": [],
        "learner_lag": stalled,
    }
    out = StringIO()
    Console(file=out, width=200).print(render(snap))
    assert "learner STALLED: 20 experiences wait" in out.getvalue()


def test_status_live_view_flags_a_dead_training_task() -> None:
    from io import StringIO

    from prometheus_client import generate_latest
    from rich.console import Console

    from pipeline.promtext import parse
    from pipeline.status.live import learner_view
    from pipeline.status.render import _live

    metrics = Metrics(role="learner")
    values = parse(generate_latest(metrics.registry).decode())
    assert learner_view("u", values, {}, "")["training_alive"] is None  # never beat: unknown, not dead
    metrics.heartbeat.set(1e9)
    metrics.training_alive.set(0)
    view = learner_view("u", parse(generate_latest(metrics.registry).decode()), {}, "")
    assert view["training_alive"] is False and view["ready"] is False
    view.update(updates_per_s=None, experiences_per_s=None)
    out = StringIO()
    Console(file=out, width=200).print(_live({"learners": [view]}))
    assert "training task ended" in out.getvalue()
