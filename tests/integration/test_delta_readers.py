"""Every reader of the model topic follows delta checkpoints (contract 1.3): evaluate, shadow, rollback,
status, the web UI, and the adapters' serving parameters.

The topic here is the learner's own ``Publishing`` writing to a recording producer (as in
tests/integration/test_delta_checkpoints.py); the readers' scans and re-fetches read that log. The last
test runs ``causalmem evaluate``'s and ``evaluate --shadow``'s readers on the embedded broker.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from models.serving.params import ServingParams
from pipeline import kafka
from pipeline.cli import rollback
from pipeline.client import chain
from pipeline.client.adapter import CausalServing
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.config import AdapterConfig, Settings
from pipeline.modeltopic import ModelTopicIndex, check_blob, scan_model_topic
from pipeline.policy_evaluation import evaluate, shadow
from pipeline.status.collect import checkpoint_view
from tests.adapter_fakes import CONN, hashed_embedding, policy
from tests.integration.test_delta_checkpoints import delta_publishing, learner, publish, same, train
from topics.delta import DeltaManifest
from topics.manifest import CheckpointError, Manifest


def index_of(log: list[tuple[int, bytes | None, bytes | None]]) -> ModelTopicIndex:
    index = ModelTopicIndex()
    for offset, key, value in log:
        index.observe(offset, key, value)
    return index


def read_log(log: list[tuple[int, bytes | None, bytes | None]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-fetches (``fetch_blob``) read ``log`` instead of a broker."""

    async def fetch_blob(bootstrap: str, conn: Any, index: ModelTopicIndex, manifest: Manifest, topic: Any) -> bytes:
        offsets = index.offsets_of(manifest)
        if any(i not in offsets for i in range(manifest.chunks)):
            raise CheckpointError("missing_chunk", f"v{manifest.version}")
        return check_blob(b"".join(log[offsets[i]][2] or b"" for i in range(manifest.chunks)), manifest)

    monkeypatch.setattr(chain, "fetch_blob", fetch_blob)


async def delta_chain(tmp_path: Path, reason: str = "periodic") -> tuple[Any, Any]:
    """v1 full, v2 and v3 deltas served at once (no gate); v3's reason is ``reason``."""
    p, t = learner(tmp_path, full_every=10)
    await publish(p, t, "init")
    train(t, [1])
    await publish(p, t)
    train(t, [2, 3])
    m3 = await publish(p, t, reason)
    assert isinstance(m3, DeltaManifest)
    return p, t


async def test_evaluate_reads_the_serving_delta_and_a_delta_candidate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``evaluate`` read ``index.serving`` (full snapshots only) and reported v1."""
    p, t = await delta_chain(tmp_path)
    log = p.publisher.producer.log
    held = {k: v.clone() for k, v in t.tensors().items()}

    # The next checkpoint is a candidate: is_candidate says so, and the manifest's gate record
    # reads a gate that has judged nothing yet.
    async def no_probe(publish: Any) -> bool:
        return False  # nothing served yet: no incumbent to probe

    p.gate = SimpleNamespace(
        serving_manifest=None, decisions=[], state=None, probe=no_probe, next_opens_trial=lambda: False
    )
    monkeypatch.setattr(type(p), "is_candidate", lambda self, reason: True)
    train(t, [4])
    cand = await publish(p, t)
    assert isinstance(cand, DeltaManifest) and log[-1][1] == b"default/delta/candidate"
    read_log(log, monkeypatch)
    index = index_of(log)

    async def scan(*args: Any, **kw: Any) -> ModelTopicIndex:
        return index

    async def tail(*args: Any, **kw: Any) -> list[Any]:
        return []

    loaded: dict[int, Any] = {}

    async def fetch(bootstrap: str, conn: Any, index: ModelTopicIndex, manifest: Manifest, topic: Any) -> Any:
        loaded[manifest.version] = await fetch_checkpoint(bootstrap, conn, index, manifest, topic)
        return loaded[manifest.version]

    monkeypatch.setattr(evaluate, "scan_model_topic", scan)
    monkeypatch.setattr(evaluate, "experiences_tail", tail)
    monkeypatch.setattr(evaluate, "fetch_checkpoint", fetch)
    report = await evaluate.evaluate_window("127.0.0.1:1", Settings(), 100, ("snips",))
    assert report["versions"] == {"serving": 3, "candidate": 4}
    assert same(loaded[3], held) and same(loaded[4], t.tensors())


async def test_shadow_reads_the_serving_delta_and_a_delta_cutover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the shadow report named v1 as serving and missed a cut-over published as a delta."""
    p, _ = await delta_chain(tmp_path, reason="cutover")
    index = index_of(p.publisher.producer.log)

    async def scan(*args: Any, **kw: Any) -> ModelTopicIndex:
        return index

    async def tail(*args: Any, **kw: Any) -> list[Any]:
        return []

    monkeypatch.setattr(shadow, "scan_model_topic", scan)
    monkeypatch.setattr(shadow, "experiences_tail", tail)
    report = await shadow.shadow_report("127.0.0.1:1", Settings(), 100)
    assert report["serving_version"] == 3
    assert report["mode"] == "policy" and report["cutover_version"] == 3


async def test_rollback_sees_a_delta_version_on_the_topic_and_a_broken_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    p, _ = await delta_chain(tmp_path)
    index = index_of(p.publisher.producer.log)
    v2 = index.version("default", 2)
    assert isinstance(v2, DeltaManifest) and index.rebuildable(v2)
    assert index.links("default")[-1].version == 3 and index.serving_head("default").version == 3  # type: ignore[union-attr]

    async def scan(*args: Any, **kw: Any) -> ModelTopicIndex:
        return index

    class Producer:
        async def start(self) -> None: ...
        async def stop(self) -> None: ...
        async def send(self, *args: Any, **kw: Any) -> Any:
            async def done() -> None: ...

            return done()

    class Consumer:  # the verb watches dead-letter and the model topic for the learner's answer: none comes
        async def start(self) -> None: ...
        async def stop(self) -> None: ...
        def assign(self, tps: Any) -> None: ...
        async def seek_to_end(self, *tps: Any) -> None: ...
        async def position(self, tp: Any) -> int:
            return 0

        def seek(self, tp: Any, offset: int) -> None: ...
        async def getmany(self, *tps: Any, timeout_ms: int = 0) -> dict[Any, Any]:
            return {}

    async def nothing(*args: Any, **kw: Any) -> None: ...

    monkeypatch.setattr(kafka, "consumer", lambda *a, **kw: Consumer())
    monkeypatch.setattr(rollback, "scan_model_topic", scan)
    monkeypatch.setattr(
        kafka,
        "wait_for_broker",
        nothing,
    )

    async def started(*a: Any, **kw: Any) -> Producer:
        return Producer()

    monkeypatch.setattr(kafka, "start_producer", started)
    assert await rollback.rollback("127.0.0.1:1", Settings(), 2, "test", timeout=0.0) == 1  # no learner answers
    assert "back to v2 (on the model topic;" in capsys.readouterr().out
    # v1's chunk is gone (tombstoned): v2 can no longer be rebuilt from the topic
    index.chunk_offsets.pop(("default", 1))
    assert not index.rebuildable(v2)
    await rollback.rollback("127.0.0.1:1", Settings(), 2, "test", timeout=0.0)
    assert "not on the model topic any more" in capsys.readouterr().out


async def test_status_shows_the_serving_delta(tmp_path: Path) -> None:
    """Before: ``causalmem status`` showed the last full snapshot (v1) as serving."""
    p, _ = await delta_chain(tmp_path)
    view = checkpoint_view(index_of(p.publisher.producer.log), "default", now=0.0)
    assert view["serving"]["version"] == 3 and view["manifests_seen"] == 3
    assert view["update_rate"] is not None and view["update_rate"]["to_version"] == 3


async def test_the_ui_gate_history_lists_delta_candidates_and_promotions(tmp_path: Path) -> None:
    from pipeline.ui.feeds import Feeds

    p, _ = await delta_chain(tmp_path)
    feeds = Feeds("127.0.0.1:1", Settings(state_dir=str(tmp_path)).ui())
    log = p.publisher.producer.log
    delta3 = next(v for _, k, v in log if k == b"default/delta" and b'"version":3' in (v or b""))
    for offset, key, value in log:
        feeds._apply("model", SimpleNamespace(offset=offset, key=key, value=value))
    feeds._apply("model", SimpleNamespace(offset=len(log), key=b"default/delta/candidate", value=delta3))
    assert sorted(feeds.manifests) == [1, 2, 3]
    assert feeds.manifests[3]["served"] and feeds.manifests[3]["candidate"] and not feeds.manifests[2]["candidate"]


def test_the_adapters_follow_the_manifests_serving_parameters() -> None:
    """Before: ``CausalServing`` served by its config alone and ignored the manifest's ``serving``."""
    wire = ServingParams(temperature=0.4, explore_rate=0.3, explore_temperature=0.9, drop="none").to_wire()
    loaded = policy()
    loaded = dataclasses.replace(loaded, manifest=dataclasses.replace(loaded.manifest, serving=wire))
    follows: CausalServing[str] = CausalServing(hashed_embedding, CONN, AdapterConfig(seed=0))
    # before a manifest: the serving defaults (as a manifest without serving means), 10% explored
    assert (follows.params.temperature, follows.params.explore_rate, follows.params.drop) == (0.05, 0.1, "dynamic")
    follows.set_policy(loaded)
    assert (follows.params.temperature, follows.params.explore_rate) == (0.4, 0.3)
    assert (follows.params.explore_temperature, follows.params.drop) == (0.9, "none")
    fixed: CausalServing[str] = CausalServing(hashed_embedding, CONN, AdapterConfig(seed=0, temperature=0.1, drop=0.2))
    fixed.set_policy(loaded)
    assert (fixed.params.temperature, fixed.params.drop, fixed.params.explore_rate) == (0.1, 0.2, 0.3)
    # what is served: the event carries the followed temperature (or the exploration one)
    docs = {k: (k, 1.0 - 0.1 * i, f"text {k}", k) for i, k in enumerate("abcdef")}
    temps = set()
    for i in range(30):
        served = follows.serve(f"q{i}", lambda q, n, _: [chain_candidate(*v) for v in docs.values()][:n])
        temps.add(served.event.temperature)
    assert temps == {0.4, 0.9}


def chain_candidate(key: str, score: float, text: str, item: str) -> Any:
    from pipeline.client.adapter import Candidate

    return Candidate(key, score, text, item)


@pytest.mark.broker
async def test_broker_evaluate_and_shadow_rebuild_a_delta_head(topics_ready: Settings, tmp_path: Path) -> None:
    """On a real broker: the learner publishes v1 full and v2, v3 deltas; both readers load v3 through its chain."""
    conn = topics_ready.connection()
    async with delta_publishing(topics_ready, tmp_path, full_every=10) as (p, t):
        await publish(p, t, "init")
        for rows in ([1], [2, 3]):
            train(t, rows)
            assert isinstance(await publish(p, t), DeltaManifest)
    bootstrap = topics_ready.bootstrap or ""
    report = await evaluate.evaluate_window(bootstrap, conn, 100, ("snips",))
    assert report["versions"] == {"serving": 3}
    index = await scan_model_topic(bootstrap, conn)
    head = index.serving_head(conn.policy)
    assert head is not None and head.version == 3
    assert same(await chain.fetch_state(bootstrap, conn, index, head), t.tensors())
    assert (await shadow.shadow_report(bootstrap, conn, 100))["serving_version"] == 3
