"""LlamaIndex's retriever contract, run against the real llama-index-core (no broker, no network).

A check suite in river's ``check_estimator`` style: each ``check_*`` function takes a
:data:`MakeRetriever` — how to build the retriever under test over a user's LlamaIndex
retriever — and asserts one promise; :func:`yield_checks` lists them and
:func:`check_retriever` runs them all, so other tests can point the suite at another
retriever. The promises, from ``BaseRetriever``'s documentation and what LlamaIndex's own
retrievers, query engines and postprocessors rely on:

* ``retrieve`` and ``aretrieve`` take a ``str`` or a ``QueryBundle`` and return a list of
  ``NodeWithScore``;
* the order returned is the ranking, and ``NodeWithScore.score`` agrees with it (never
  increasing): postprocessors and rerankers read the score, synthesizers the order;
* asked for k nodes, the retriever returns k (the corpus holds more), even where the
  wrapped retriever's own top-k is smaller (``index.as_retriever()`` returns 2);
* it works inside a ``RetrieverQueryEngine`` (here with ``MockLLM``, which answers with
  the prompt it was given, so the test reads the prompt);
* metadata the retriever adds for its own bookkeeping never reaches the LLM or the
  embedding model (``BaseNode.excluded_llm_metadata_keys`` /
  ``excluded_embed_metadata_keys``): a returned node's ``get_content`` in
  ``MetadataMode.LLM`` and ``MetadataMode.EMBED`` is the user's node's;
* the user's nodes (the objects a retriever holds, the index's docstore) are not changed.

The suite runs on LlamaIndex's own ``VectorIndexRetriever`` too, the reference that shows
the checks ask nothing the library itself does not do. The tests after the suite pin the
adapter's own choices (docs/byo-retriever.md, "LlamaIndex").
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import VectorStoreIndex
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.indices.vector_store.retrievers import VectorIndexRetriever
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode

from pipeline.client.llamaindex import CausalMemoryRetriever
from pipeline.client.shadow import ShadowMode
from pipeline.config import AdapterConfig
from tests.adapter_fakes import CONN, hashed_embedding, policy

DIM = CONN.limits.embedding_dim  # the pipeline's D: the policy reads the query embedding
K = 3  # what the retriever under test is asked for
WIDE = 8  # the wrapped retriever's top-k where it is not the point of the check

MEMORIES = {
    "pizza": "The user ordered a margherita pizza on Friday.",
    "sushi": "The user ordered salmon sushi last week.",
    "flight": "The user's flight to Lisbon leaves on Monday.",
    "hotel": "The user booked a hotel in Lisbon near the river.",
    "cat": "The user's cat is called Miso.",
    "old-cat": "The user's cat was called Pixel, an old note.",
    "dog": "The user walks the neighbour's dog on Sundays.",
    "gym": "The user goes to the gym on Tuesday evenings.",
    "sister": "The user's sister lives in Porto.",
    "allergy": "The user is allergic to peanuts.",
}
QUERIES = [
    "what did the user order on friday",
    "when does the flight to lisbon leave",
    "what is the cat called",
    "where is the hotel in lisbon",
    "what does the user do on sundays",
    "where does the sister live",
    "is the user allergic to anything",
    "what did the user order last week",
]


class WordHashEmbedding(BaseEmbedding):
    """Hashed words, normalised, of the pipeline's dimension: deterministic, no download."""

    def _get_query_embedding(self, query: str) -> list[float]:
        return hashed_embedding(query, DIM)

    def _get_text_embedding(self, text: str) -> list[float]:
        return hashed_embedding(text, DIM)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return hashed_embedding(query, DIM)


def user_nodes() -> list[TextNode]:
    """The user's nodes: metadata the LLM sees (``source``), one key it already hides (``owner``)."""
    return [
        TextNode(
            id_=key,
            text=text,
            metadata={"source": "notes", "owner": "ana"},
            excluded_llm_metadata_keys=["owner"],
            excluded_embed_metadata_keys=["owner"],
        )
        for key, text in MEMORIES.items()
    ]


class HeldNodesRetriever(BaseRetriever):
    """A user's own retriever that returns the very node objects it holds (as many custom
    retrievers do), so that a retriever changing what it was given changes the user's nodes."""

    def __init__(self, nodes: list[TextNode], similarity_top_k: int = 2) -> None:
        super().__init__()
        self.nodes = nodes
        self.similarity_top_k = similarity_top_k
        self._embed_model = WordHashEmbedding()
        self._vectors = np.array([hashed_embedding(n.get_content(MetadataMode.EMBED), DIM) for n in nodes])

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        q = np.asarray(self._embed_model.get_agg_embedding_from_queries(query_bundle.embedding_strs))
        scores = self._vectors @ q
        top = np.argsort(-scores, kind="stable")[: self.similarity_top_k]
        return [NodeWithScore(node=self.nodes[i], score=float(scores[i])) for i in top]


@dataclass
class Corpus:
    """The user's side: their nodes, an index over copies of them, and a retriever over the nodes themselves."""

    nodes: list[TextNode] = field(default_factory=user_nodes)

    def __post_init__(self) -> None:
        self.index = VectorStoreIndex([n.model_copy(deep=True) for n in self.nodes], embed_model=WordHashEmbedding())
        self.by_id = {n.node_id: n for n in self.nodes}

    def index_retriever(self, similarity_top_k: int = WIDE) -> VectorIndexRetriever:
        retriever = self.index.as_retriever(similarity_top_k=similarity_top_k)
        assert isinstance(retriever, VectorIndexRetriever)
        return retriever

    def held_retriever(self, similarity_top_k: int = WIDE) -> HeldNodesRetriever:
        return HeldNodesRetriever(self.nodes, similarity_top_k)

    def snapshot(self) -> list[dict[str, Any]]:
        """Everything about the user's nodes: the objects, then the index's stored copies."""
        stored = self.index.docstore.get_nodes(list(self.by_id))
        return [n.model_dump() for n in self.nodes] + [n.model_dump() for n in stored]


MakeRetriever = Callable[[Corpus, BaseRetriever, int], BaseRetriever]
"""(the corpus, the user's retriever over it, k) → the retriever under test, serving k nodes."""


# ---------------------------------------------------------------------- the checks


def _queries() -> Iterator[str | QueryBundle]:
    for q in QUERIES:
        yield q
        yield QueryBundle(q)


def _label(query: str | QueryBundle) -> str:
    return f"QueryBundle({query.query_str!r})" if isinstance(query, QueryBundle) else repr(query)


def _descending(scores: list[float | None]) -> bool:
    """Every score set, none above the one before it."""
    known = [s for s in scores if s is not None]
    return len(known) == len(scores) and all(a >= b for a, b in itertools.pairwise(known))


def _retrieve_both(retriever: BaseRetriever, query: str | QueryBundle) -> list[list[NodeWithScore]]:
    """``retrieve`` and ``aretrieve`` for one query."""
    return [retriever.retrieve(query), asyncio.run(retriever.aretrieve(query))]


def check_str_and_query_bundle(make: MakeRetriever) -> None:
    """``retrieve`` / ``aretrieve`` take a str or a QueryBundle and return k distinct scored corpus nodes."""
    corpus = Corpus()
    retriever = make(corpus, corpus.index_retriever(), K)
    for query in _queries():
        for way, nodes in zip(["retrieve", "aretrieve"], _retrieve_both(retriever, query), strict=True):
            assert isinstance(nodes, list) and all(isinstance(n, NodeWithScore) for n in nodes), (way, query)
            ids = [n.node.node_id for n in nodes]
            assert len(ids) == K and len(set(ids)) == K, f"{way}({_label(query)}) returned {ids}"
            assert set(ids) <= set(corpus.by_id), ids
            assert all(isinstance(n.score, float) for n in nodes), f"{way}({_label(query)}): scores missing"


def check_scores_descend_in_the_order_returned(make: MakeRetriever) -> None:
    """The order returned is the ranking: each node's score is at most the one before it."""
    corpus = Corpus()
    retriever = make(corpus, corpus.index_retriever(), K)
    results = [
        (f"{way}({_label(q)})", [n.score for n in nodes])
        for q in _queries()
        for way, nodes in zip(["retrieve", "aretrieve"], _retrieve_both(retriever, q), strict=True)
    ]
    unordered = [(call, s) for call, s in results if not _descending(s)]
    assert not unordered, f"{len(unordered)} of {len(results)} results not in descending score order: {unordered[:3]}"


def check_k_is_served_where_the_wrapped_top_k_is_smaller(make: MakeRetriever) -> None:
    """k nodes come back where the user's retriever returns fewer by default (``as_retriever()``: 2),
    and the user's retriever keeps its own top-k."""
    corpus = Corpus()
    for wrapped in (corpus.index_retriever(similarity_top_k=2), corpus.held_retriever(similarity_top_k=2)):
        retriever = make(corpus, wrapped, K)
        for q in QUERIES:
            for way, nodes in zip(["retrieve", "aretrieve"], _retrieve_both(retriever, q), strict=True):
                assert len(nodes) == K, f"{way}({q!r}) over {type(wrapped).__name__} (top-k 2): {len(nodes)} nodes"
        assert wrapped.similarity_top_k == 2, "the user's retriever was changed"


def check_added_metadata_reaches_neither_llm_nor_embedding(make: MakeRetriever) -> None:
    """A returned node reads, to the LLM and to the embedding model, exactly as the user's node does."""
    corpus = Corpus()
    for wrapped in (corpus.index_retriever(), corpus.held_retriever()):
        retriever = make(corpus, wrapped, K)
        for q in QUERIES:
            for nodes in _retrieve_both(retriever, q):
                for n in nodes:
                    mine = corpus.by_id[n.node.node_id]
                    added = sorted(set(n.node.metadata) - set(mine.metadata))
                    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
                        got, want = n.node.get_content(metadata_mode=mode), mine.get_content(metadata_mode=mode)
                        assert got == want, f"{mode}: metadata {added} reaches it: {got!r}"


def check_serves_a_retriever_query_engine(make: MakeRetriever) -> None:
    """Inside ``RetrieverQueryEngine``: k source nodes, scores descending, the prompt holds the
    nodes' text and user metadata and none of the metadata the retriever added."""
    corpus = Corpus()
    retriever = make(corpus, corpus.index_retriever(), K)
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM())  # MockLLM answers with its prompt
    for q in QUERIES:
        for response in (engine.query(q), asyncio.run(engine.aquery(q))):
            prompt, sources = str(response), response.source_nodes
            assert len(sources) == K, (q, len(sources))
            scores = [n.score for n in sources]
            assert _descending(scores), (q, scores)
            for n in sources:
                mine = corpus.by_id[n.node.node_id]
                assert mine.get_content(metadata_mode=MetadataMode.LLM) in prompt, (q, n.node.node_id)
                for key in set(n.node.metadata) - set(mine.metadata):
                    assert f"{key}: " not in prompt, f"metadata {key!r} is in the LLM prompt: {prompt!r}"


def check_the_user_nodes_are_unchanged(make: MakeRetriever) -> None:
    """Retrieving (sync, async, through a query engine) changes neither the user's node objects nor the index."""
    corpus = Corpus()
    before = corpus.snapshot()
    for wrapped in (corpus.index_retriever(), corpus.held_retriever(), corpus.held_retriever(similarity_top_k=2)):
        retriever = make(corpus, wrapped, K)
        engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM())
        for q in QUERIES:
            _retrieve_both(retriever, q)
            engine.query(q)
    after = corpus.snapshot()
    changed = [a["id_"] for a, b in zip(after, before, strict=True) if a != b]
    assert not changed, f"the user's nodes changed: {changed}"


def yield_checks() -> list[Callable[[MakeRetriever], None]]:
    """The contract's checks, each ``check(make)``."""
    return [
        check_str_and_query_bundle,
        check_scores_descend_in_the_order_returned,
        check_k_is_served_where_the_wrapped_top_k_is_smaller,
        check_added_metadata_reaches_neither_llm_nor_embedding,
        check_serves_a_retriever_query_engine,
        check_the_user_nodes_are_unchanged,
    ]


def check_retriever(make: MakeRetriever) -> None:
    """Run every check of the contract against the retrievers ``make`` builds."""
    for check in yield_checks():
        check(make)


# ---------------------------------------------------------------------- the subjects


def llamaindex_own(corpus: Corpus, wrapped: BaseRetriever, k: int) -> BaseRetriever:
    """The reference: LlamaIndex's own retriever over the index, asked for k."""
    return corpus.index.as_retriever(similarity_top_k=k)


def causal(shadow_explore_rate: float | None = None) -> MakeRetriever:
    """The adapter over the user's retriever (no publisher: the events stay in ``retriever.last``),
    in shadow mode where ``shadow_explore_rate`` is given."""

    def make(corpus: Corpus, wrapped: BaseRetriever, k: int) -> BaseRetriever:
        cfg = AdapterConfig(k=k, n_candidates=WIDE, seed=0)
        shadow = ShadowMode(explore_rate=shadow_explore_rate) if shadow_explore_rate is not None else None
        return CausalMemoryRetriever(wrapped, conn=CONN, config=cfg, publisher=None, shadow=shadow)

    return make


def causal_with_a_policy(corpus: Corpus, wrapped: BaseRetriever, k: int) -> BaseRetriever:
    """The adapter serving a policy that favours memories similarity ranks low (it reorders the candidates)."""
    retriever = causal()(corpus, wrapped, k)
    assert isinstance(retriever, CausalMemoryRetriever)
    slot = retriever.serving.idmap.slot
    retriever.set_policy(policy(bias={slot("gym"): 6.0, slot("allergy"): 4.0, slot("dog"): 3.0}))
    return retriever


SUBJECTS: dict[str, MakeRetriever] = {
    "llamaindex VectorIndexRetriever (reference)": llamaindex_own,
    "CausalMemoryRetriever": causal(),
    "CausalMemoryRetriever with a policy": causal_with_a_policy,
    "CausalMemoryRetriever in shadow mode": causal(shadow_explore_rate=0.5),
}


@pytest.mark.parametrize("check", yield_checks(), ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("subject", SUBJECTS)
def test_the_llamaindex_retriever_contract(subject: str, check: Callable[[MakeRetriever], None]) -> None:
    check(SUBJECTS[subject])


# ---------------------------------------------------------------------- the adapter's own choices


def test_the_score_is_the_served_rank_and_the_wrapped_score_stays_in_the_metadata() -> None:
    corpus = Corpus()
    wrapped = corpus.index_retriever()
    retriever = causal_with_a_policy(corpus, wrapped, K)
    assert isinstance(retriever, CausalMemoryRetriever)
    for q in QUERIES:
        similarity = {n.node.node_id: n.score for n in wrapped.retrieve(q)}
        nodes = retriever.retrieve(q)
        assert retriever.last is not None
        assert [n.score for n in nodes] == [1.0 / (1.0 + rank) for rank in range(K)]
        for rank, n in enumerate(nodes):
            mine = n.node.metadata["causalmem"]
            assert mine["rank"] == rank and mine["score"] == pytest.approx(similarity[n.node.node_id])
            assert mine["slot"] == retriever.last.slots[rank]


def test_the_wrapped_retriever_is_asked_for_n_candidates_and_at_least_k() -> None:
    corpus = Corpus()
    wrapped = corpus.index_retriever(similarity_top_k=2)
    # Every request explores: a logged draw lists its candidates (a cold-start fallback step does not).
    config = AdapterConfig(k=3, n_candidates=7, seed=0, explore_rate=1.0)
    retriever = CausalMemoryRetriever(wrapped, conn=CONN, config=config)
    retriever.retrieve("what is the cat called")
    assert retriever.last is not None and len(retriever.last.event.candidates) == 7
    few = CausalMemoryRetriever(wrapped, conn=CONN, config=AdapterConfig(k=4, n_candidates=2, seed=0))
    assert len(few.retrieve("what is the cat called")) == 4
    assert wrapped.similarity_top_k == 2


def test_a_retriever_that_cannot_be_widened_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    class Fixed(BaseRetriever):
        """Two nodes, whatever is asked: no similarity_top_k to raise."""

        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [NodeWithScore(node=n, score=1.0) for n in user_nodes()[:2]]

    config = AdapterConfig(k=3, n_candidates=WIDE, seed=0)
    retriever = CausalMemoryRetriever(
        Fixed(), conn=CONN, config=config, embed_query=WordHashEmbedding().get_query_embedding
    )
    with caplog.at_level("WARNING", logger="pipeline.client.llamaindex"):
        for q in QUERIES[:3]:
            assert len(retriever.retrieve(q)) == 2
    assert [r.getMessage() for r in caplog.records if "similarity_top_k" in r.getMessage()] == [
        "the wrapped Fixed returned 2 nodes, fewer than k = 3, and has no settable similarity_top_k "
        "to widen: configure it to return n_candidates = 8"
    ]


def test_a_query_bundle_reaches_the_wrapped_retriever_whole() -> None:
    """A QueryBundle's ``custom_embedding_strs`` choose the candidates, as they do for the wrapped retriever."""
    corpus = Corpus()
    retriever = CausalMemoryRetriever(
        corpus.index_retriever(similarity_top_k=2), conn=CONN, config=AdapterConfig(k=2, n_candidates=2, seed=0)
    )
    bundle = QueryBundle("tell me something", custom_embedding_strs=[MEMORIES["sister"]])
    for nodes in _retrieve_both(retriever, bundle):
        assert "sister" in {n.node.node_id for n in nodes}
