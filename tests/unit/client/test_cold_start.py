"""Cold start: before a certified policy, every client front returns exactly the ranking it wraps.

Dropping an adapter in changed results before anything was learnt: with no policy it drew at
T = 0.05 over the similarity scores, and over 200 queries its top 3 was the store's in 14
(fake embeddings) and 105 (word-hash embeddings). Now a request that does not explore serves
the wrapped retriever's top k, in its order and (LlamaIndex) with its scores, logged as a
fallback step; only the exploration share the serving values ask for differs, and it is logged
as a draw.

Under the learner's first policy (not certified: its manifest says ``incumbent``, contract
1.17) the fronts used to draw near-greedily at T = 0.001 with masks that differ by ~1%, which
reorders near-tied candidates; now they serve the wrapped ranking the same way, logged as
incumbent steps with every candidate found.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import InMemoryVectorStore
from llama_index.core import VectorStoreIndex
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.schema import TextNode

from models.serving.params import ServingParams
from pipeline.client.langchain import CausalMemoryRetriever as LangChainRetriever
from pipeline.client.llamaindex import CausalMemoryRetriever as LlamaIndexRetriever
from pipeline.client.retriever import CausalRetriever
from pipeline.client.serving import UNSERVED
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import AdapterConfig
from pipeline.learner.publishing import first_serving
from tests.adapter_fakes import CONN, DIM, Recorder, hashed_embedding, policy

QUERIES = [
    f"which {a} did the user {b} on {c}"
    for a in ("pizza", "flight", "hotel", "cat", "dog")
    for b in ("order", "book", "walk", "see")
    for c in ("monday", "friday", "sunday", "lisbon", "the river")
]
WORDS = [
    "pizza",
    "sushi",
    "flight",
    "hotel",
    "lisbon",
    "river",
    "cat",
    "dog",
    "monday",
    "friday",
    "sunday",
    "order",
    "book",
    "walk",
    "user",
    "miso",
    "week",
]
DOCS = {
    f"d{i}": " ".join(np.random.default_rng(i).choice(WORDS, size=6)) for i in range(30)
}  # within the test map's 32 slots
K = 3


class HashEmbeddings(Embeddings):
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [hashed_embedding(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return hashed_embedding(text)


class HashEmbedding(BaseEmbedding):
    def _get_text_embedding(self, text: str) -> list[float]:
        return hashed_embedding(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return hashed_embedding(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return hashed_embedding(query)


def _shares(explored: list[bool]) -> float:
    return sum(explored) / len(explored)


def _check_share(explored: list[bool], rate: float) -> None:
    n, share = len(explored), _shares(explored)
    sd = (rate * (1 - rate) / n) ** 0.5
    assert abs(share - rate) <= 5 * sd + 1e-9, f"explored {share:.3f} of {n} requests; the rate is {rate}"


@pytest.mark.parametrize("explore_rate", [None, 0.0])
def test_causal_retriever_serves_its_similarity_ranking(explore_rate: float | None) -> None:
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(500, DIM)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    r = CausalRetriever(
        emb, texts=[f"m{i}" for i in range(500)], k=K, n_candidates=20, seed=1, explore_rate=explore_rate
    )
    explored = []
    for i in range(1_000):
        q = rng.normal(size=DIM).astype(np.float32)
        out = r.retrieve(q / np.linalg.norm(q), query_id=f"q{i}")
        top, _ = r.search(q / np.linalg.norm(q), K)
        explored.append(not out.event.fallback)
        if out.event.fallback:  # not exploring: the index's own top k, in its order
            assert out.slots == top.tolist() and out.event.candidates == [] and out.event.policy_version == 0
        else:  # the logged exploration share: a draw, with its true log-probability
            assert out.event.candidates and out.event.logprob < 0
    _check_share(explored, UNSERVED.explore_rate if explore_rate is None else explore_rate)


@pytest.mark.parametrize("explore_rate", [None, 0.0])
def test_langchain_adapter_returns_the_stores_documents_in_its_order(explore_rate: float | None) -> None:
    store = InMemoryVectorStore(HashEmbeddings())
    store.add_documents([Document(id=k, page_content=t) for k, t in DOCS.items()])
    rec = Recorder()
    cfg = AdapterConfig(k=K, n_candidates=10, seed=2, explore_rate=explore_rate)
    r = LangChainRetriever(store, conn=CONN, config=cfg, publisher=rec)
    explored = []
    for i, q in enumerate(QUERIES):
        docs = r.invoke(q, query_id=f"q{i}")
        explored.append(r.last.decision != "incumbent")
        if r.last.decision == "incumbent":
            assert [d.id for d in docs] == [d.id for d in store.similarity_search(q, k=10)[:K]]
            assert [d.page_content for d in docs] == [DOCS[d.id] for d in docs]
            assert rec.values[-1].fallback
    _check_share(explored, UNSERVED.explore_rate if explore_rate is None else explore_rate)


@pytest.mark.parametrize("explore_rate", [None, 0.0])
def test_llamaindex_adapter_returns_the_indexs_nodes_with_their_scores(explore_rate: float | None) -> None:
    index = VectorStoreIndex([TextNode(id_=k, text=t) for k, t in DOCS.items()], embed_model=HashEmbedding())
    wrapped = index.as_retriever(similarity_top_k=10)
    cfg = AdapterConfig(k=K, n_candidates=10, seed=3, explore_rate=explore_rate)
    r = LlamaIndexRetriever(wrapped, conn=CONN, config=cfg, publisher=Recorder())
    explored = []
    for q in QUERIES:
        nodes = r.retrieve(q)
        explored.append(r.last.decision != "incumbent")
        if r.last.decision == "incumbent":
            own = wrapped.retrieve(q)[:K]  # what the adapter wraps (ties keep its order)
            assert [(n.node.node_id, n.score) for n in nodes] == [(n.node.node_id, n.score) for n in own]
    _check_share(explored, UNSERVED.explore_rate if explore_rate is None else explore_rate)


# The learner's fresh first policy under the gate, as its manifest says to serve it; its masks
# differ by memory (as a fresh network's do, by ~1%), so a draw would reorder near ties.
FIRST = first_serving(ServingParams(), True, "init", 0)
NEAR_TIED = {s: 0.05 * ((s * 7) % 5) for s in range(32)}


def _first_policy() -> LoadedPolicy:
    return policy(version=1, reason="init", bias=NEAR_TIED, serving=FIRST.to_wire())


def test_under_the_first_policy_causal_retriever_serves_its_similarity_ranking() -> None:
    rng = np.random.default_rng(4)
    emb = rng.normal(size=(32, DIM)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    r = CausalRetriever(emb, texts=[f"m{i}" for i in range(32)], k=K, n_candidates=12, seed=5)
    r.set_policy(_first_policy())
    explored = []
    for i in range(1_000):
        q = rng.normal(size=DIM).astype(np.float32)
        q /= np.linalg.norm(q)
        out = r.retrieve(q, query_id=f"q{i}")
        top, _ = r.search(q, 12)
        ev = out.event
        explored.append(not ev.incumbent)
        assert ev.policy_version == 1 and not ev.fallback
        if ev.incumbent:  # the index's own top k, in its order, logged with every candidate
            assert out.slots == top[:K].tolist() and ev.candidates == top.tolist() and ev.logprob == 0.0
            assert ev.temperature == FIRST.temperature
        else:  # the explored share: the policy's draw at the exploration temperature
            assert ev.temperature == FIRST.explore_temperature and ev.logprob < 0
    _check_share(explored, FIRST.explore_rate)


def test_under_the_first_policy_the_adapters_return_what_they_wrap() -> None:
    store = InMemoryVectorStore(HashEmbeddings())
    store.add_documents([Document(id=k, page_content=t) for k, t in DOCS.items()])
    rec = Recorder()
    lc = LangChainRetriever(store, conn=CONN, config=AdapterConfig(k=K, n_candidates=10, seed=6), publisher=rec)
    index = VectorStoreIndex([TextNode(id_=k, text=t) for k, t in DOCS.items()], embed_model=HashEmbedding())
    wrapped = index.as_retriever(similarity_top_k=10)
    li = LlamaIndexRetriever(
        wrapped, conn=CONN, config=AdapterConfig(k=K, n_candidates=10, seed=7), publisher=Recorder()
    )
    for r in (lc, li):
        r.set_policy(_first_policy())
    explored = []
    for i, q in enumerate(QUERIES * 3):
        docs = lc.invoke(q, query_id=f"q{i}")
        explored.append(lc.last.decision != "incumbent")
        if lc.last.decision == "incumbent":
            assert [d.id for d in docs] == [d.id for d in store.similarity_search(q, k=10)[:K]]
            assert rec.values[-1].incumbent and not rec.values[-1].fallback and len(rec.values[-1].candidates) == 10
        nodes = li.retrieve(q)
        if li.last.decision == "incumbent":
            own = wrapped.retrieve(q)[:K]
            assert [(n.node.node_id, n.score) for n in nodes] == [(n.node.node_id, n.score) for n in own]
    _check_share(explored, FIRST.explore_rate)
