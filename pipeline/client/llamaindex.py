"""LlamaIndex adapter: :class:`CausalMemoryRetriever`, a llama-index-core ``BaseRetriever`` (extra ``llamaindex``).

It wraps what a LlamaIndex application already has — an index (``VectorStoreIndex``;
its retriever is made with ``similarity_top_k = n_candidates``) or any ``BaseRetriever``
returning ``NodeWithScore`` — asks it for the candidates, serves k of them under the
policy (:class:`~pipeline.client.adapter.CausalServing`) and publishes the retrieval event::

    retriever = CausalMemoryRetriever(index, conn=conn, idmap="~/.causalmem/ids.json", publisher=publisher)
    async with PolicySubscriber(bootstrap, conn=conn, on_update=retriever.set_policy,
                                on_canary=retriever.set_canary):
        nodes = await retriever.aretrieve_step("what did I order?", query_id="conv-1:q1")
        await retriever.afeedback("conv-1:q1", utility=0.4)   # or aanswer(...) for the evaluator

``retrieve`` / ``aretrieve`` (the LlamaIndex interface, usable by query engines) give
each query a fresh query id; :meth:`CausalMemoryRetriever.retrieve_step` and
:meth:`~CausalMemoryRetriever.aretrieve_step` take the query id and step. Node ids map
to slots; each returned node's ``metadata["causalmem"]`` holds the query id, event id,
slot and ``memory_conflict``, and :attr:`CausalMemoryRetriever.last` the whole
:class:`~pipeline.client.adapter.Served` result. docs/byo-retriever.md has the details.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeline.extras import require

require("llama_index.core", "llamaindex")

from llama_index.core.base.base_retriever import BaseRetriever  # noqa: E402
from llama_index.core.schema import NodeWithScore, QueryBundle  # noqa: E402

from pipeline.client.adapter import Candidate, CausalServing, Served  # noqa: E402
from pipeline.client.idmap import IdSlotMap  # noqa: E402
from pipeline.client.shadow import ShadowMode  # noqa: E402
from pipeline.client.subscriber import LoadedPolicy  # noqa: E402
from pipeline.config import AdapterConfig, Connection, Settings  # noqa: E402
from topics.events import RetrievalEvent  # noqa: E402
from topics.feedback import LLMFeedback  # noqa: E402


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
            wrapped = wrapped.as_retriever(similarity_top_k=cfg.n_candidates)
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
                nodes = fb_fn.retrieve(query) if isinstance(fb_fn, BaseRetriever) else fb_fn(query, k)
                return _candidates(nodes[:k])

        self.serving: CausalServing[NodeWithScore] = CausalServing(
            embed_query, conn, cfg, idmap, publisher, fb, shadow, publish_on
        )
        self.last: Served[NodeWithScore] | None = None

    # ------------------------------------------------------------------ search
    def _search(self, query: str, n: int) -> list[Candidate[NodeWithScore]]:
        return _candidates(self.wrapped.retrieve(query)[:n])

    async def _asearch(self, query: str, n: int) -> list[Candidate[NodeWithScore]]:
        return _candidates((await self.wrapped.aretrieve(query))[:n])

    def _nodes(self, served: Served[NodeWithScore]) -> list[NodeWithScore]:
        self.last = served
        out = []
        for item, slot in zip(served.items, served.slots, strict=True):
            node = item.node.model_copy(deep=False)
            node.metadata = {
                **item.node.metadata,
                "causalmem": {
                    "query_id": served.event.query_id,
                    "step": served.event.step,
                    "event_id": served.event.event_id,
                    "slot": slot,
                    "memory_conflict": served.memory_conflict,
                },
            }
            out.append(NodeWithScore(node=node, score=item.score))
        return out

    def retrieve_step(
        self,
        query: str,
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
    ) -> list[NodeWithScore]:
        """Retrieve for one step of a query (its id and step number go on the event)."""
        served = self.serving.serve(query, self._search, query_id, step, last_step_loss, last_step_entropy)
        return self._nodes(served)

    async def aretrieve_step(
        self,
        query: str,
        query_id: str | None = None,
        step: int = 0,
        last_step_loss: float = 0.0,
        last_step_entropy: float = 0.0,
    ) -> list[NodeWithScore]:
        """:meth:`retrieve_step` with the async search and publisher."""
        served = await self.serving.aserve(query, self._asearch, query_id, step, last_step_loss, last_step_entropy)
        return self._nodes(served)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self.retrieve_step(query_bundle.query_str)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await self.aretrieve_step(query_bundle.query_str)

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
