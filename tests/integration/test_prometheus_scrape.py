"""A real scrape: Debian's ``prometheus`` binary scrapes a running worker and learner.

Prometheus runs on loopback with a 1 s scrape interval against the two processes'
``/metrics``; traffic flows through the pipeline while the test asks Prometheus' HTTP API
whether the key series are ingested and move.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from causalmem_lab.procs import Child, wait_until

from pipeline.broker import free_port
from pipeline.client.publisher import EventPublisher
from pipeline.metrics import HEALTH_BANDS
from pipeline.promtext import metric
from pipeline.status.collect import collect
from tests.conftest import settings_env
from tests.helpers import feedback, retrieval_event

pytestmark = [
    pytest.mark.broker,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus binary is not installed"),
]

PAIRS_PER_ROUND = 16


def _config(worker_port: int, learner_port: int) -> str:
    return f"""\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: causalmem-worker
    static_configs:
      - targets: ["127.0.0.1:{worker_port}"]
  - job_name: causalmem-learner
    static_configs:
      - targets: ["127.0.0.1:{learner_port}"]
"""


def _query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            body = json.loads(resp.read())
    except OSError:
        return []
    assert body.get("status") == "success", body
    return body["data"]["result"]


def _value(base: str, expr: str) -> float | None:
    result = _query(base, expr)
    return float(result[0]["value"][1]) if result else None


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


async def _traffic(s, counter: itertools.count) -> None:
    async with EventPublisher(s.bootstrap, s) as pub:
        for _ in range(PAIRS_PER_ROUND):
            qid = f"p{next(counter)}"
            await pub.publish(retrieval_event(s, qid))
            await pub.publish(feedback(qid, utility=0.2))
        await pub.flush()


def test_prometheus_ingests_worker_and_learner_series(topics_ready, tmp_path: Path) -> None:
    s = topics_ready
    env = settings_env(s)
    worker = Child("worker", s.bootstrap, env, log_path=tmp_path / "worker.log", metrics_port=free_port())
    learner = Child("learner", s.bootstrap, env, log_path=tmp_path / "learner.log", metrics_port=free_port())
    config = tmp_path / "prometheus.yml"
    config.write_text(_config(worker.metrics_port, learner.metrics_port))
    web = free_port()
    base = f"http://127.0.0.1:{web}"
    prom_log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed in finally
    prom = subprocess.Popen(
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=prom_log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )

    def logs() -> str:
        prom_log.flush()
        tail = (tmp_path / "prometheus.log").read_text(errors="replace")[-2000:]
        return f"--- worker:\n{worker.log_tail(2000)}\n--- learner:\n{learner.log_tail(2000)}\n--- prometheus:\n{tail}"

    try:
        wait_until(lambda: _ready(base) or prom.poll() is not None, 20, what="prometheus to be ready")
        assert prom.poll() is None, logs()
        try:
            wait_until(
                lambda: (
                    metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0 and bool(learner.metrics())
                ),
                45,
                what="the worker to own partitions and the learner to serve metrics",
            )
        except TimeoutError:
            pytest.fail("processes did not start:\n" + logs())

        counter = itertools.count()
        seen: dict[str, list[float]] = {"joins": [], "experiences": []}
        exprs = {
            "joins": "sum(causalmem_joins_total)",
            "experiences": "sum(causalmem_learner_experiences_total)",
        }

        def moved(name: str) -> bool:
            v = seen[name]
            return len(v) >= 2 and v[0] > 0 and v[-1] > v[0]

        deadline = time.monotonic() + 40
        version = None
        while time.monotonic() < deadline:
            asyncio.run(_traffic(s, counter))
            time.sleep(1.2)
            for name, expr in exprs.items():
                v = _value(base, expr)
                if v is not None and v > 0 and (not seen[name] or v != seen[name][-1]):
                    seen[name].append(v)
            version = _value(base, 'causalmem_checkpoint_version{role="serving"}')
            if moved("joins") and moved("experiences") and version is not None:
                break
        print("prometheus saw", seen, "serving version", version)
        assert moved("joins"), f"joins not ingested or not moving: {seen}\n{logs()}"
        assert moved("experiences"), f"learner experiences not ingested or not moving: {seen}\n{logs()}"
        assert version is not None and version >= 1, logs()

        # Both targets are up, and the series carry the job labels Prometheus attached.
        up = {r["metric"]["job"]: float(r["value"][1]) for r in _query(base, "up")}
        assert up == {"causalmem-worker": 1.0, "causalmem-learner": 1.0}, up
        jobs = {r["metric"].get("job") for r in _query(base, "causalmem_memory_health_score")}
        assert jobs == {"causalmem-worker"}  # role-based registries: only the worker exports it
        assert _query(base, "causalmem_learner_baseline")

        # `causalmem status` reads the same running processes and topics.
        def status() -> dict:
            return asyncio.run(collect(s.bootstrap, s, [worker.url], [learner.url], rate_interval=0.5))

        snap = status()
        deadline = time.monotonic() + 20
        while snap["health"] is None and time.monotonic() < deadline:  # the worker computes it every 5 s
            time.sleep(1.0)
            snap = status()
        assert snap["errors"] == [], snap["errors"]
        assert snap["checkpoints"]["serving"]["version"] >= 1
        assert snap["health"]["band"] in HEALTH_BANDS
        assert snap["workers"][0]["joins_total"] >= seen["joins"][-1]
        assert snap["learners"][0]["experiences_total"] >= seen["experiences"][-1]
        assert snap["dead_letter"]["total"] == 0 and snap["active_learning"]["depth"] == 0
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(5)
        prom_log.close()
        for child in (worker, learner):
            child.stop(timeout=15)
