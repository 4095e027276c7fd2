"""LlamaIndex adapter: :class:`CausalMemoryRetriever`, a llama-index-core ``BaseRetriever`` (extra ``llamaindex``).

It wraps what a LlamaIndex application already has — an index (``VectorStoreIndex``;
its retriever is made with ``similarity_top_k = max(n_candidates, k)``) or any
``BaseRetriever`` returning ``NodeWithScore`` — asks it for the candidates, serves k of
them under the policy (:class:`~pipeline.client.adapter.CausalServing`) and publishes the
retrieval event::

    retriever = CausalMemoryRetriever(index, conn=conn, idmap="~/.causalmem/ids.json", publisher=publisher)
    async with PolicySubscriber(bootstrap, conn=conn, on_update=retriever.set_policy,
                                on_canary=retriever.set_canary):
        nodes = await retriever.aretrieve_step("what did I order?", query_id="conv-1:q1")
        await retriever.afeedback("conv-1:q1", utility=0.4)   # or aanswer(...) for the evaluator

``retrieve`` / ``aretrieve`` (the LlamaIndex interface, usable by query engines) give
each query a fresh query id; :meth:`CausalMemoryRetriever.retrieve_step` and
:meth:`~CausalMemoryRetriever.aretrieve_step` take the query id and step. A wrapped
retriever with a smaller ``similarity_top_k`` is asked, through a copy, for
``max(n_candidates, k)`` nodes. Node ids map to slots. The nodes come back in the order
served, as copies: each one's ``score`` is its served rank's, ``1 / (1 + rank)`` (the
wrapped retriever's own where its ranking served: before any policy, or in shadow mode), and its
``metadata["causalmem"]`` holds the query id, step, event id, slot, ``memory_conflict``,
``rank`` and the wrapped retriever's own ``score``; that key is excluded from what the
LLM and the embedding model read. :attr:`CausalMemoryRetriever.last` holds the whole
:class:`~pipeline.client.adapter.Served` result. docs/byo-retriever.md has the details.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.extras import require

require("llama_index.core", "llamaindex")

from llama_index.core.base.base_retriever import BaseRetriever  # noqa: E402
from llama_index.core.schema import NodeWithScore, QueryBundle  # noqa: E402

from pipeline.client.adapter import AsyncSearch, Candidate, CausalServing, Search, Served  # noqa: E402
from pipeline.client.idmap import IdSlotMap  # noqa: E402
from pipeline.client.shadow import ShadowMode  # noqa: E402
from pipeline.client.subscriber import LoadedPolicy  # noqa: E402
from pipeline.config import AdapterConfig, Connection, Settings  # noqa: E402
from topics.events import RetrievalEvent  # noqa: E402
from topics.feedback import LLMFeedback  # noqa: E402

log = logging.getLogger(__name__)

KEY = "causalmem"
"""The metadata key of what the adapter adds to each returned node (excluded from the LLM's and the embedder's view)."""


def _top_k(retriever: BaseRetriever) -> int | None:
    """The retriever's ``similarity_top_k`` (``VectorIndexRetriever``, BM25, ...), None where it has none."""
    top_k = getattr(retriever, "similarity_top_k", None)
    return top_k if isinstance(top_k, int) and not isinstance(top_k, bool) else None


def _widened(retriever: BaseRetriever, n: int) -> BaseRetriever:
    """``retriever``, asking for at least ``n`` nodes.

    A retriever whose ``similarity_top_k`` is below ``n`` is asked through a shallow copy
    with it raised, so that the user's own retriever, which other code may share, keeps its
    top-k. Any other is returned as it is.
    """
    top_k = _top_k(retriever)
    if top_k is None or top_k >= n:
        return retriever
    wide = copy.copy(retriever)
    try:
        wide.similarity_top_k = n  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):  # a read-only or validated attribute
        return retriever
    return wide


def _excluding(keys: Sequence[str]) -> list[str]:
    """A new list of excluded metadata keys with :data:`KEY` (the user's list stays as it is)."""
    return [*keys, KEY] if KEY not in keys else list(keys)


def _candidates(nodes: Sequence[NodeWithScore]) -> list[Candidate[NodeWithScore]]:
    return [
        Candidate(n.node.node_id, float(n.score if n.score is not None else 1.0 / (1.0 + r)), n.node.get_content(), n)
        for r, n in enumerate(nodes)
    ]


class CausalMemoryRetriever(BaseRetriever):
    """The user's index or retriever, served under the causal memory policy.

    Parameters
    ----------
    wrapped
        An index with ``as_retriever`` (e.g. ``VectorStoreIndex``) or a ``BaseRetriever``.
    embed_query
        Text → query embedding of dimension D; default: the wrapped retriever's (or index's)
        embedding model.
    conn, config, idmap, publisher, shadow, publish_on
        As for :class:`~pipeline.client.adapter.CausalServing`.
    fallback
        A ``BaseRetriever`` (e.g. BM25) or ``(query, k) → nodes``, used when the hard drop
        leaves nothing or on early exit.
    """

    def __init__(
        self,
        wrapped: Any,
        *,
        embed_query: Callable[[str], Sequence[float]] | None = None,
        conn: Connection | Settings | None = None,
        config: AdapterConfig | None = None,
        idmap: IdSlotMap | str | None = None,
        publisher: Any = None,
        fallback: BaseRetriever | Callable[[str, int], list[NodeWithScore]] | None = None,
        shadow: ShadowMode | None = None,
        publish_on: str = "retrieve",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        cfg = config or AdapterConfig()
        if not isinstance(wrapped, BaseRetriever):
            wrapped = wrapped.as_retriever(similarity_top_k=max(cfg.n_candidates, cfg.k))
        self.wrapped: BaseRetriever = wrapped
        if embed_query is None:
            model = getattr(wrapped, "_embed_model", None)
            if model is None:
                raise ValueError(
                    "pass embed_query: the wrapped retriever has no embedding model to embed the query with"
                )
            embed_query = model.get_query_embedding
        fb = None
        if fallback is not None:
            fb_fn = fallback

            def fb(query: str, k: int) -> list[Candidate[NodeWithScore]]:
                nodes = _widened(fb_fn, k).retrieve(query) if isinstance(fb_fn, BaseRetriever) else fb_fn(query, k)
                return _candidates(nodes[:k])

        self.serving: CausalServing[NodeWithScore] = CausalServing(
            embed_query, conn, cfg, idmap, publisher, fb, shadow, publish_on
        )
        self.last: Served[NodeWithScore] | None = None
        self._warned = False

    # ------------------------------------------------------------------ search
    def _found(self, nodes: Sequence[NodeWithScore], wanted: int, sized: bool) -> list[Candidate[NodeWithScore]]:
        """The candidates among ``nodes``; ``sized``: the retriever was asked for ``wanted``."""
        if len(nodes) < self.serving.config.k and not sized and not self._warned:
            self._warned = True  # once: a small corpus returns few nodes too
            log.warning(
                "the wrapped %s returned %d nodes, fewer than k = %d, and has no settable similarity_top_k "
                "to widen: configure it to return n_candidates = %d",
                type(self.wrapped).__name__,
                len(nodes),
                self.serving.config.k,
                wanted,
            )
        return _candidates(nodes[:wanted])

    def _searches(self, query: str | QueryBundle) -> tuple[Search[NodeWithScore], AsyncSearch[NodeWithScore]]:
        """The search of one query, sync and async. The wrapped retriever gets the query as
        given, so that a QueryBundle's embedding or ``custom_embedding_strs`` still choose its candidates."""

        def wrapped(n: int) -> tuple[BaseRetriever, int, bool]:
            # The policy chooses k among the n_candidates: the search must find them, and at least k.
            wanted = max(n, self.serving.config.k)
            retriever = _widened(self.wrapped, wanted)
            return retriever, wanted, (_top_k(retriever) or 0) >= wanted

        def search(_text: str, n: int, _vector: np.ndarray) -> list[Candidate[NodeWithScore]]:
            retriever, wanted, sized = wrapped(n)
            return self._found(retriever.retrieve(query), wanted, sized)

        async def asearch(_text: str, n: int, _vector: np.ndarray) -> list[Candidate[NodeWithScore]]:
            retriever, wanted, sized = wrapped(n)
            return self._found(await retriever.aretrieve(query), wanted, sized)

        return search, asearch

    def _nodes(self, served: Served[NodeWithScore]) -> list[NodeWithScore]:
        """Copies of the served nodes, in the order served, scored by their rank.

        The serving draw, not the similarity, orders them, and LlamaIndex reads ``score`` as
        that order (postprocessors, rerankers): each node's score is ``1 / (1 + rank)``, and
        the wrapped retriever's own score stays in ``metadata["causalmem"]["score"]``. Where the
        wrapped retriever's own ranking served (``decision == "incumbent"``: no policy yet, or
        shadow mode), its nodes keep their scores: that order is theirs. The
        copies hide that key from the LLM and the embedding model; the user's nodes keep
        their metadata and excluded keys.
        """
        self.last = served
        out = []
        for rank, (item, slot) in enumerate(zip(served.items, served.slots, strict=True)):
            ours = {
                "query_id": served.event.query_id,
                "step": served.event.step,
                "event_id": served.event.event_id,
                "slot": slot,
                "memory_conflict": served.memory_conflict,
                "rank": rank,
                "score": item.score,
            }
            node = item.node.model_copy(
                update={
                    "metadata": {**item.node.metadata, KEY: ours},
                    "excluded_llm_metadata_keys": _excluding(item.node.excluded_llm_metadata_keys),
                    "excluded_embed_metadata_keys": _excluding(item.node.excluded_embed_metadata_keys),
                }
            )
            own = served.decision == "incumbent" and item.score is not None
            score = float(item.score) if own and item.score is not None else 1.0 / (1.0 + rank)
            out.append(NodeWithScore(node=node, score=score))
        return out

    def retrieve_step(
        self,
        query: str | QueryBundle,
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
    ) -> list[NodeWithScore]:
        """Retrieve for one step of a query (its id and step number go on the event)."""
        text = query.query_str if isinstance(query, QueryBundle) else query
        search, _ = self._searches(query)
        served = self.serving.serve(text, search, query_id, step, last_step_loss, last_step_entropy)
        return self._nodes(served)

    async def aretrieve_step(
        self,
        query: str | QueryBundle,
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
    ) -> list[NodeWithScore]:
        """:meth:`retrieve_step` with the async search and publisher."""
        text = query.query_str if isinstance(query, QueryBundle) else query
        _, asearch = self._searches(query)
        served = await self.serving.aserve(text, asearch, query_id, step, last_step_loss, last_step_entropy)
        return self._nodes(served)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self.retrieve_step(query_bundle)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await self.aretrieve_step(query_bundle)

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
        return self.serving.mode

    def answer(self, query_id: str, answer_text: str, step: int = 0) -> RetrievalEvent:
        """Publish the held event with the answer, for ``causalmem evaluator`` (``publish_on="answer"``)."""
        return self.serving.answer(query_id, answer_text, step)

    async def aanswer(self, query_id: str, answer_text: str, step: int = 0) -> RetrievalEvent:
        return await self.serving.aanswer(query_id, answer_text, step)

    def feedback(self, query_id: str, step: int = 0, **measure: Any) -> LLMFeedback:
        """Send your own utility (``utility=`` or ``nll_with=``/``nll_without=``) for a retrieval."""
        return self.serving.feedback(query_id, step, **measure)

    async def afeedback(self, query_id: str, step: int = 0, **measure: Any) -> LLMFeedback:
        return await self.serving.afeedback(query_id, step, **measure)
