"""The LlamaIndex adapter with the real llama-index-core and its in-memory VectorStoreIndex (no broker)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import NodeWithScore, TextNode

from pipeline.client.llamaindex import CausalMemoryRetriever
from pipeline.client.shadow import ShadowMode
from pipeline.config import AdapterConfig
from tests.adapter_fakes import CONN, TEXTS, AsyncRecorder, Recorder, hashed_embedding, policy


class HashEmbedding(BaseEmbedding):
    def _get_query_embedding(self, query: str) -> list[float]:
        return hashed_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return hashed_embedding(text)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return hashed_embedding(query)


def index() -> VectorStoreIndex:
    nodes = [TextNode(id_=k, text=t) for k, t in TEXTS.items()]
    return VectorStoreIndex(nodes, embed_model=HashEmbedding())


def adapter(**kw: object) -> tuple[CausalMemoryRetriever, Recorder]:
    rec = kw.pop("publisher", Recorder())
    cfg = kw.pop("config", AdapterConfig(k=2, n_candidates=6, seed=1))
    return CausalMemoryRetriever(index(), conn=CONN, config=cfg, publisher=rec, **kw), rec  # type: ignore[arg-type]


def test_retrieve_serves_k_nodes_with_their_slots_and_publishes_the_event() -> None:
    r, rec = adapter()
    r.set_policy(policy())
    nodes = r.retrieve("where is the hotel in lisbon")
    assert len(nodes) == 2 and all(isinstance(n, NodeWithScore) for n in nodes)
    (event,) = rec.values
    assert sorted(event.candidates) == list(range(6)) and not event.fallback
    assert [r.serving.idmap.key(s) for s in event.selected] == [n.node.node_id for n in nodes]
    assert nodes[0].node.metadata["causalmem"]["query_id"] == event.query_id
    assert event.memory_texts[event.selected[0]] == nodes[0].node.get_content()
    assert event.logprob < 0


def test_retrieve_step_carries_the_query_id_and_the_policy_decides() -> None:
    r, rec = adapter()
    for k in TEXTS:
        r.serving.idmap.slot(k)
    r.set_policy(policy(bias={r.serving.idmap.get("pizza"): 6.0, r.serving.idmap.get("sushi"): 6.0}, zero=True))
    nodes = r.retrieve_step("lisbon flight", query_id="conv:q7", step=3)
    assert {n.node.node_id for n in nodes} == {"pizza", "sushi"}
    assert rec.values[0].query_id == "conv:q7" and rec.values[0].step == 3


def test_async_retrieval_answer_and_feedback() -> None:
    rec = AsyncRecorder()
    r, _ = adapter(publisher=rec, publish_on="answer")

    async def go() -> None:
        nodes = await r.aretrieve_step("what is the cat called", query_id="q1")
        assert len(nodes) == 2 and rec.values == []
        await r.aanswer("q1", "Miso.")
        await r.afeedback("q1", utility=0.5)

    asyncio.run(go())
    assert rec.values[0].answer_text == "Miso." and rec.values[1].utility == 0.5


def test_shadow_mode_serves_the_index_ranking_until_the_cut_over() -> None:
    r, rec = adapter(shadow=ShadowMode(explore_rate=0.0))
    top = [n.node.node_id for n in index().as_retriever(similarity_top_k=2).retrieve("cat called")]
    assert [n.node.node_id for n in r.retrieve("cat called")] == top
    assert rec.values[0].fallback and r.mode == "shadow"
    r.set_policy(policy(reason="cutover"))
    r.retrieve("cat called")
    assert r.mode == "policy" and not rec.values[1].fallback and np.isfinite(rec.values[1].logprob)


def test_a_retriever_without_an_embedding_model_needs_embed_query() -> None:
    class Plain:
        pass

    with pytest.raises(AttributeError):
        CausalMemoryRetriever(Plain(), conn=CONN)
    base = index().as_retriever(similarity_top_k=6)
    r = CausalMemoryRetriever(base, conn=CONN, config=AdapterConfig(k=1), embed_query=hashed_embedding)
    assert len(r.retrieve("pizza")) == 1


def test_unanswered_events_beyond_max_pending_go_out_without_their_answer_async_too() -> None:
    rec = AsyncRecorder()
    r, _ = adapter(publisher=rec, publish_on="answer")
    r.serving.max_pending = 2

    async def go() -> None:
        for i in range(3):
            await r.aretrieve_step("cat", query_id=f"q{i}")

    asyncio.run(go())
    assert [e.query_id for e in rec.values] == ["q0"] and rec.values[0].answer_text is None
    with pytest.raises(KeyError):
        r.serving.event("q0")
    assert r.serving.event("q2").query_id == "q2"
