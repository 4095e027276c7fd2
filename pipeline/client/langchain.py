"""LangChain adapter: :class:`CausalMemoryRetriever`, a langchain-core ``BaseRetriever`` (extra ``langchain``).

It wraps the retriever a LangChain application already has — a ``VectorStore``, a
``VectorStoreRetriever`` (its store is asked directly, for scores) or any other
``BaseRetriever`` (scores from ``metadata["score"]`` when it sets one, else from the
rank) — asks it for ``n_candidates`` documents (at least k), serves k of them under the
policy (:class:`~pipeline.client.adapter.CausalServing`) and publishes the retrieval event::

    retriever = CausalMemoryRetriever(vector_store, conn=conn, idmap="~/.causalmem/ids.json",
                                      publisher=publisher)
    async with PolicySubscriber(bootstrap, conn=conn, on_update=retriever.set_policy,
                                on_canary=retriever.set_canary):
        docs = await retriever.ainvoke("what did I order?", query_id="conv-1:q1")  # k=... per call
        await retriever.afeedback("conv-1:q1", utility=0.4)   # or aanswer(...) for the evaluator

Document ids are ``Document.id``, else ``metadata["id"]``, else a hash of the text. Each
returned document is a copy whose ``metadata["causalmem"]`` holds the query id, the
event id, its slot and the step's ``memory_conflict`` flag; :attr:`CausalMemoryRetriever.last`
is the whole :class:`~pipeline.client.adapter.Served` result. The class passes LangChain's
standard retriever suite (tests/integration/test_langchain_standard.py). docs/byo-retriever.md
has the details.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.extras import require

require("langchain_core", "langchain")

from langchain_core.callbacks import (  # noqa: E402
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.vectorstores import VectorStore, VectorStoreRetriever  # noqa: E402
from pydantic import ConfigDict, Field  # noqa: E402

from pipeline.client.adapter import Candidate, CausalServing, Served  # noqa: E402
from pipeline.client.idmap import IdSlotMap  # noqa: E402
from pipeline.client.shadow import ShadowMode  # noqa: E402
from pipeline.client.subscriber import LoadedPolicy  # noqa: E402
from pipeline.config import AdapterConfig, Connection, Settings  # noqa: E402
from topics.events import RetrievalEvent  # noqa: E402
from topics.feedback import LLMFeedback  # noqa: E402


def document_id(doc: Document) -> str:
    """The id a document is mapped to a slot by: ``doc.id``, ``metadata["id"]`` or a hash of its text."""
    if doc.id:
        return str(doc.id)
    if doc.metadata.get("id") is not None:
        return str(doc.metadata["id"])
    return "sha1:" + hashlib.sha1(doc.page_content.encode("utf-8")).hexdigest()


def _candidates(pairs: Sequence[tuple[Document, float]]) -> list[Candidate[Document]]:
    return [Candidate(document_id(d), float(s), d.page_content, d) for d, s in pairs]


def _scored(docs: Sequence[Document]) -> list[tuple[Document, float]]:
    """Scores of a plain retriever's documents: ``metadata["score"]``, else 1/(1 + rank)."""
    return [(d, float(d.metadata.get("score", 1.0 / (1.0 + r)))) for r, d in enumerate(docs)]


def _store_of(wrapped: Any) -> VectorStore | None:
    if isinstance(wrapped, VectorStore):
        return wrapped
    if isinstance(wrapped, VectorStoreRetriever):
        return wrapped.vectorstore
    return None


class CausalMemoryRetriever(BaseRetriever):
    """The user's retriever or vector store, served under the causal memory policy.

    Parameters
    ----------
    wrapped
        A ``VectorStore``, a ``VectorStoreRetriever`` or another ``BaseRetriever``.
    embed_query
        Text → query embedding of dimension D; default: the store's ``embeddings.embed_query``.
    conn, config, idmap, publisher, shadow, publish_on
        As for :class:`~pipeline.client.adapter.CausalServing`.
    fallback
        A ``BaseRetriever`` (e.g. keyword search) or ``(query, k) → documents``, used when
        the hard drop leaves nothing or on early exit.
    k
        Documents served per query (at most: the hard drop may leave fewer); default
        ``config.k``. Given with a ``config`` whose k differs, it is refused (ValueError).
    **kwargs
        ``BaseRetriever``'s own fields (``tags``, ``metadata``); any other name is refused
        (pydantic's ``ValidationError``).

    ``invoke`` / ``ainvoke`` take ``query_id``, ``step``, ``last_step_loss``,
    ``last_step_entropy`` and ``k`` (this call's number of documents; default :attr:`k`) as
    keyword arguments (default: a fresh query id, step 0).
    """

    # A misspelt argument (``top_k=``) must fail, not be ignored.
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    wrapped: Any
    serving: Any
    k: int = Field(ge=1)
    last: Any = None
    by_vector: bool = False  # the store is searched by the policy's query embedding (the same model's)

    def __init__(
        self,
        wrapped: Any,
        *,
        embed_query: Callable[[str], Sequence[float]] | None = None,
        conn: Connection | Settings | None = None,
        config: AdapterConfig | None = None,
        idmap: IdSlotMap | str | None = None,
        publisher: Any = None,
        fallback: BaseRetriever | Callable[[str, int], list[Document]] | None = None,
        shadow: ShadowMode | None = None,
        publish_on: str = "retrieve",
        k: int | None = None,
        **kwargs: Any,
    ) -> None:
        if config is None:
            config = AdapterConfig() if k is None else AdapterConfig(k=k)
        elif k is not None and k != config.k:
            raise ValueError(f"k={k} and the config's k={config.k} differ; give k once, or the same in both")
        by_vector = False
        if embed_query is None:
            store = _store_of(wrapped)
            emb = getattr(store, "embeddings", None) if store is not None else None
            if emb is None:
                raise ValueError("pass embed_query: the wrapped retriever has no embeddings to embed the query with")
            embed_query = emb.embed_query
            # The store embeds queries with the same model: search by the policy's embedding, one
            # model call a request instead of two.
            by_vector = hasattr(store, "similarity_search_with_score_by_vector")
        fb = None
        if fallback is not None:
            fb_fn = fallback

            def fb(query: str, k: int) -> list[Candidate[Document]]:
                docs = fb_fn.invoke(query) if isinstance(fb_fn, BaseRetriever) else fb_fn(query, k)
                return _candidates(_scored(docs[:k]))

        serving: CausalServing[Document] = CausalServing(
            embed_query, conn, config, idmap, publisher, fb, shadow, publish_on
        )
        super().__init__(wrapped=wrapped, serving=serving, k=config.k, by_vector=by_vector, **kwargs)  # type: ignore[call-arg]  # pydantic fields

    # ------------------------------------------------------------------ search
    def _search(self, query: str, n: int, vector: np.ndarray) -> list[Candidate[Document]]:
        store = _store_of(self.wrapped)
        if store is not None and self.by_vector:
            return _candidates(store.similarity_search_with_score_by_vector(vector.tolist(), k=n))  # type: ignore[attr-defined]
        if store is not None:
            return _candidates(store.similarity_search_with_score(query, k=n))
        return _candidates(_scored(self.wrapped.invoke(query)[:n]))

    async def _asearch(self, query: str, n: int, vector: np.ndarray) -> list[Candidate[Document]]:
        store = _store_of(self.wrapped)
        if store is not None and self.by_vector:  # a store's own in-memory search: no I/O to await
            return self._search(query, n, vector)
        if store is not None:
            return _candidates(await store.asimilarity_search_with_score(query, k=n))
        return _candidates(_scored((await self.wrapped.ainvoke(query))[:n]))

    def _documents(self, served: Served[Document]) -> list[Document]:
        self.last = served
        out = []
        for doc, slot in zip(served.items, served.slots, strict=True):
            tag = {
                "query_id": served.event.query_id,
                "step": served.event.step,
                "event_id": served.event.event_id,
                "slot": slot,
                "memory_conflict": served.memory_conflict,
            }
            out.append(Document(id=doc.id, page_content=doc.page_content, metadata={**doc.metadata, "causalmem": tag}))
        return out

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
        k: int | None = None,
    ) -> list[Document]:
        # self.k is read per call: it is a field, which a user may change after construction.
        served = self.serving.serve(
            query,
            self._search,
            query_id,
            step,
            last_step_loss,
            last_step_entropy,
            k=self.k if k is None else k,
        )
        return self._documents(served)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
        k: int | None = None,
    ) -> list[Document]:
        # self.k is read per call: it is a field, which a user may change after construction.
        served = await self.serving.aserve(
            query,
            self._asearch,
            query_id,
            step,
            last_step_loss,
            last_step_entropy,
            k=self.k if k is None else k,
        )
        return self._documents(served)

    # ------------------------------------------------------------------ policy, answers, feedback
    def set_policy(self, policy: LoadedPolicy | None) -> None:
        """``PolicySubscriber``'s ``on_update``."""
        self.serving.set_policy(policy)

    def set_canary(self, canary: LoadedPolicy | None) -> None:
        """``PolicySubscriber``'s ``on_canary``: serve the learner's canary on its share of the requests,
        as ``CausalRetriever`` does (docs/contract.md §7.2)."""
        self.serving.set_canary(canary)

    @property
    def mode(self) -> str:
        """``"shadow"`` or ``"policy"``."""
        mode: str = self.serving.mode
        return mode

    def answer(self, query_id: str, answer_text: str, step: int = 0) -> RetrievalEvent:
        """Publish the held event with the answer, for ``causalmem evaluator`` (``publish_on="answer"``)."""
        event: RetrievalEvent = self.serving.answer(query_id, answer_text, step)
        return event

    async def aanswer(self, query_id: str, answer_text: str, step: int = 0) -> RetrievalEvent:
        event: RetrievalEvent = await self.serving.aanswer(query_id, answer_text, step)
        return event

    def feedback(self, query_id: str, step: int = 0, **measure: Any) -> LLMFeedback:
        """Send your own utility (``utility=`` or ``nll_with=``/``nll_without=``) for a retrieval."""
        fb: LLMFeedback = self.serving.feedback(query_id, step, **measure)
        return fb

    async def afeedback(self, query_id: str, step: int = 0, **measure: Any) -> LLMFeedback:
        fb: LLMFeedback = await self.serving.afeedback(query_id, step, **measure)
        return fb


__all__ = ["CausalMemoryRetriever", "document_id"]
