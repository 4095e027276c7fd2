"""Contract 1.4's canary on the client side, without a broker: what the publisher writes
under ``"{policy}/canary"``, how the index and the subscriber read it, and how a
CausalRetriever serves it on its share of requests."""

from __future__ import annotations

import numpy as np
import pytest

from models.policy.network import init_policy
from models.policy.weights import to_safetensors
from models.serving.params import ServingParams
from pipeline.client.retriever import CausalRetriever
from pipeline.client.subscriber import LoadedPolicy, PolicySubscriber
from pipeline.modeltopic import ModelTopicIndex
from pipeline.modeltopic.publisher import CheckpointPublisher
from pipeline.status.collect import checkpoint_view
from tests.integration.test_delta_checkpoints import ARCH, RecordingProducer
from topics.fields import encode
from topics.manifest import MAX_VERSION_JUMP, Manifest, canary_key

SERVING = ServingParams(canary_rate=0.5).to_wire()


async def _published(
    keep_versions: int = 3, n: int = 2
) -> tuple[CheckpointPublisher, RecordingProducer, list[Manifest]]:
    producer = RecordingProducer()
    pub = CheckpointPublisher(producer, "t", "default", keep_versions=keep_versions)
    out = []
    for v in range(1, n + 1):
        net = init_policy(ARCH.embedding_dim, ARCH.slots, hidden=ARCH.hidden, seed=v)
        blob = to_safetensors(net.tensors())
        out.append(
            await pub.publish(
                blob, alpha=0.5, reason="periodic", arch=ARCH.to_dict(), baseline=0.0, candidate=v > 1, serving=SERVING
            )
        )
    return pub, producer, out


async def _feed(sub: PolicySubscriber, producer: RecordingProducer, start: int = 0) -> int:
    for offset, key, value in producer.log[start:]:
        await sub.handle(offset, key, value)
    return len(producer.log)


async def test_the_publisher_names_a_canary_keeps_its_chunks_and_ends_it() -> None:
    pub, producer, (_, m2) = await _published(keep_versions=1)
    await pub.set_canary(m2)
    assert producer.log[-1][1] == canary_key("default").encode()
    for v in range(3, 7):  # newer candidates: older chunks are tombstoned, the canary's are not
        blob = to_safetensors(init_policy(ARCH.embedding_dim, ARCH.slots, hidden=ARCH.hidden, seed=v).tensors())
        await pub.publish(blob, alpha=0.5, reason="periodic", arch=ARCH.to_dict(), baseline=0.0, candidate=True)
    dead = {k for _, k, v in producer.log if v is None and k is not None}
    assert not any(k.startswith(b"default/2/") for k in dead)
    before = len(producer.log)
    await pub.set_canary(None)
    assert producer.log[before][1:] == (canary_key("default").encode(), None)
    assert all(k.startswith(b"default/2/") and v is None for _, k, v in producer.log[before + 1 :] if k is not None)
    assert len(producer.log) > before + 1  # its chunks go once it ended
    index = ModelTopicIndex()
    for offset, key, value in producer.log:
        index.observe(offset, key, value)
    assert index.canary["default"] is None
    assert index.observe(len(producer.log), canary_key("default").encode(), encode(m2.to_dict())) == ("canary", m2)
    assert index.canary["default"] == m2
    view = checkpoint_view(index, "default", now=m2.created_ts + 5.0)  # what `causalmem status` shows
    assert view["canary"]["version"] == 2 and view["canary"]["age_s"] == 5.0
    other = Manifest(**{**m2.__dict__, "policy": "other"})
    assert index.observe(99, canary_key("default").encode(), encode(other.to_dict()))[0] == "rejected"
    # the serving and candidate manifests' checks, the version jump included
    far = Manifest(**{**m2.__dict__, "version": 7 + MAX_VERSION_JUMP})
    assert index.observe(100, canary_key("default").encode(), encode(far.to_dict()))[0] == "rejected"
    assert "jumps beyond" in index.rejected[-1][1] and index.canary["default"] == m2


@pytest.mark.slow  # several seconds: make test runs it, make check does not
async def test_a_subscriber_loads_the_canary_and_a_retriever_serves_it_on_its_share() -> None:
    pub, producer, (_, m2) = await _published()
    rng = np.random.default_rng(0)
    memories = rng.normal(size=(ARCH.slots, ARCH.embedding_dim)).astype(np.float32)
    retriever = CausalRetriever(memories, k=2, n_candidates=8, seed=3)
    seen: list[LoadedPolicy | None] = []

    def on_canary(c: LoadedPolicy | None) -> None:
        seen.append(c)
        retriever.set_canary(c)

    sub = PolicySubscriber("127.0.0.1:1", on_update=retriever.set_policy, on_canary=on_canary)
    done = await _feed(sub, producer)
    assert sub.current is not None and sub.current.version == 1 and sub.canary is None
    await pub.set_canary(m2)
    done = await _feed(sub, producer, done)
    assert sub.canary is not None and sub.canary.version == 2 and seen[-1] is sub.canary
    assert retriever.canary_rate == 0.5  # the serving manifest's
    events = [retriever.retrieve(rng.normal(size=ARCH.embedding_dim), f"q{i}").event for i in range(400)]
    canary = [e for e in events if e.canary]
    assert 0.4 < len(canary) / len(events) < 0.6
    assert {e.policy_version for e in canary} == {2}
    assert {e.policy_version for e in events if not e.canary} == {1}
    assert all(e.canary is None for e in events if e.policy_version == 1)
    # Contract 1.9: every request says it was drawn from the mixture, and the other policy's version.
    assert all(e.canary_rate == 0.5 for e in events)
    assert {e.alternative_version for e in canary} == {1} and {
        e.alternative_version for e in events if not e.canary
    } == {2}
    # The canary promoted: its network is taken over, and the canary ends.
    canary_net = sub.canary.net
    await pub.promote(m2)
    done = await _feed(sub, producer, done)
    assert sub.current.version == 2 and sub.current.net is canary_net
    assert sub.canary is None and seen[-1] is None and retriever.canary is None
    # A canary no newer than what is served is not loaded.
    await pub.set_canary(m2)
    done = await _feed(sub, producer, done)
    assert sub.canary is None


async def test_a_tombstone_ends_the_canary_and_an_explicit_rate_wins() -> None:
    pub, producer, (_, m2) = await _published()
    rng = np.random.default_rng(1)
    memories = rng.normal(size=(ARCH.slots, ARCH.embedding_dim)).astype(np.float32)
    opted_out = CausalRetriever(memories, k=2, n_candidates=8, seed=3, canary_rate=0.0)
    sub = PolicySubscriber("127.0.0.1:1", on_update=opted_out.set_policy, on_canary=opted_out.set_canary)
    await pub.set_canary(m2)
    done = await _feed(sub, producer)
    assert opted_out.canary is not None and opted_out.canary_rate == 0.0
    served = [opted_out.retrieve(rng.normal(size=8), f"q{i}").event for i in range(100)]
    assert not any(e.canary for e in served) and all(e.canary_rate is None for e in served)  # no mixture
    await pub.set_canary(None)
    await _feed(sub, producer, done)
    assert sub.canary is None and opted_out.canary is None


def test_serving_params_carry_the_canary_rate_only_when_set() -> None:
    assert "canary_rate" not in ServingParams(canary_rate=0.0).to_wire()
    assert ServingParams.from_wire(ServingParams(canary_rate=0.2).to_wire()).canary_rate == 0.2
    with pytest.raises(ValueError, match="canary_rate"):
        ServingParams(canary_rate=1.5)
