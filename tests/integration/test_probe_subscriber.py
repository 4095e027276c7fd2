"""A client started while a probe over a certified version serves (contract 1.23) loads that
version from the model topic first, then the probe: it serves the certified version on every
request but the exploration share, as a client that followed the topic all along does. (One
that found only the probe would keep serving what it held, nothing: the index's own ranking.)"""

from __future__ import annotations

import numpy as np
import pytest

from models.policy.network import Arch, init_policy
from models.serving.params import ServingParams
from pipeline import kafka
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import PolicySubscriber
from pipeline.config import Settings
from pipeline.modeltopic import CheckpointPublisher
from tests.helpers import publish_tensors


async def _publish(s: Settings, keep_versions: int = 3, compacted: bool = False) -> None:
    """v1 the first policy, v2 certified, v3 and v4 probes over v2 (what the learner publishes);
    chunks of all but the newest ``keep_versions`` tombstoned. ``compacted``: v2's serving
    manifest is not on the topic (as after the topic's compaction: its key's newest record is
    the probe), only its copy under the base key (contract 1.25) and its chunks (pinned)."""
    producer = kafka.producer(s.bootstrap or "", s)
    await producer.start()
    try:
        topic = s.connection().topics.policy_checkpoints.name
        pub = CheckpointPublisher(producer, topic, s.policy, keep_versions=keep_versions)
        arch = Arch(s.embedding_dim, s.slots, s.hidden)
        served, probe = ServingParams(), ServingParams(base=2)
        for seed, reason, params in (
            (1, "init", served),
            (2, "periodic", served),
            (3, "probe", probe),
            (4, "probe", probe),
        ):
            tensors = init_policy(s.embedding_dim, s.slots, s.hidden, seed=seed).tensors()
            hidden = compacted and seed == 2
            published = await publish_tensors(
                pub, tensors, arch=arch, reason=reason, baseline=0.0, serving=params.to_wire(), candidate=hidden
            )
            if seed == 2:
                await pub.set_base(published)  # before the first probe over it, as the learner does
    finally:
        await producer.stop()


@pytest.mark.broker
@pytest.mark.timeout(120)
async def test_a_client_started_under_a_probe_loads_the_certified_version_it_names(topics_ready: Settings) -> None:
    s = topics_ready.replace(policy="probed")
    await _publish(s)
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(s.slots, s.embedding_dim)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    r = CausalRetriever(emb, texts=[f"m{i}" for i in range(s.slots)], k=3, n_candidates=8, seed=1)
    loaded: list[int] = []

    def on_update(p: object) -> None:
        loaded.append(p.version)  # type: ignore[attr-defined]
        r.set_policy(p)  # type: ignore[arg-type]

    async with PolicySubscriber(s.bootstrap or "", s.policy, s, on_update=on_update) as sub:
        await sub.wait_for_policy(4, timeout=60)
    assert loaded == [2, 4]  # the version the probe names, then the probe
    assert r.policy is not None and r.policy.version == 4 and r.core.base is not None and r.core.base.version == 2
    events = []
    for i in range(300):
        q = rng.normal(size=s.embedding_dim).astype(np.float32)
        events.append(r.retrieve(q / np.linalg.norm(q), query_id=f"q{i}").event)
    assert all(ev.policy_version == 4 for ev in events)
    drawn_by_base = sum(bool(ev.base) for ev in events) / len(events)
    assert 0.8 < drawn_by_base < 0.97  # every request but the exploration share (0.1)


@pytest.mark.broker
@pytest.mark.timeout(120)
async def test_a_probe_whose_version_does_not_load_is_passed_over(topics_ready: Settings) -> None:
    """The chunks of v2 are gone (here: tombstoned as old, which the learner never does to a
    version a probe names): neither probe over it can be served, and no earlier version loads
    either. The subscriber says it serves nothing, where it used to claim the probe."""
    s = topics_ready.replace(policy="probed-gone")
    await _publish(s, keep_versions=2)  # v3, v4 kept; v1, v2 tombstoned
    loaded: list[int] = []
    async with PolicySubscriber(s.bootstrap or "", s.policy, s, on_update=lambda p: loaded.append(p.version)) as sub:
        with pytest.raises(TimeoutError):
            await sub.wait_for_policy(1, timeout=8)
        assert sub.current is None and loaded == []


@pytest.mark.broker
@pytest.mark.timeout(120)
async def test_a_client_started_under_a_probe_loads_its_base_from_the_base_key_after_compaction(
    topics_ready: Settings,
) -> None:
    """Compaction keeps the newest record of each key: once probes follow it on the serving key,
    the certified version's own manifest goes, and a client started then found no version to
    serve the probe with (it served nothing). The copy under the base key (contract 1.25) stays."""
    s = topics_ready.replace(policy="probed-compacted")
    await _publish(s, compacted=True)
    loaded: list[int] = []
    async with PolicySubscriber(s.bootstrap or "", s.policy, s, on_update=lambda p: loaded.append(p.version)) as sub:
        await sub.wait_for_policy(4, timeout=60)
    assert loaded == [2, 4]  # the version the probe names, then the probe
