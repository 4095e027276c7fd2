"""LangChain's standard retriever suite (langchain-tests) on the LangChain adapter, and how it takes ``k``.

The adapter wraps a langchain-core ``InMemoryVectorStore`` with a deterministic embedding of
the pipeline's dimension and publishes nothing (``publisher=None``): no broker, no policy
(it ranks by score at temperature T), so the suite runs wherever langchain-tests is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("langchain_tests")

from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_tests.integration_tests import RetrieversIntegrationTests
from pydantic import ValidationError

from pipeline.client.langchain import CausalMemoryRetriever
from pipeline.config import AdapterConfig, Connection

CONN = Connection.of(None)  # the default limits: D = 384, S = 1024
TEXTS = [
    "The user ordered a margherita pizza on Friday.",
    "The user's cat is called Miso.",
    "The user walks the dog every morning at seven.",
    "The user prefers window seats on long flights.",
    "The user booked a hotel in Lisbon for May.",
    "The user is allergic to peanuts.",
    "The user's sister lives in Montreal.",
    "The user runs a half marathon each autumn.",
    "The user drinks oat milk in coffee.",
    "The user is learning Portuguese.",
    "The user's laptop is a ten year old ThinkPad.",
    "The user plays chess on Sunday evenings.",
]


def store() -> InMemoryVectorStore:
    vs = InMemoryVectorStore(DeterministicFakeEmbedding(size=CONN.limits.embedding_dim))
    vs.add_documents([Document(id=f"doc-{i}", page_content=t) for i, t in enumerate(TEXTS)])
    return vs


class TestCausalMemoryRetrieverStandard(RetrieversIntegrationTests):
    """The standard suite: ``k`` in the constructor and per call, ``invoke``/``ainvoke`` give Documents."""

    @property
    def retriever_constructor(self) -> type[CausalMemoryRetriever]:
        return CausalMemoryRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"wrapped": store(), "conn": CONN, "publisher": None}

    @property
    def retriever_query_example(self) -> str:
        return "what pizza did the user order"


def retriever(**kw: Any) -> CausalMemoryRetriever:
    return CausalMemoryRetriever(store(), conn=CONN, publisher=None, **kw)


def test_unknown_constructor_arguments_are_rejected() -> None:
    with pytest.raises(ValidationError, match="top_k"):
        retriever(top_k=3)
    assert retriever(tags=["memories"], metadata={"team": "a"}).tags == ["memories"]  # BaseRetriever's own fields
    with pytest.raises(TypeError):
        CausalMemoryRetriever(store(), AdapterConfig())  # type: ignore[misc]  # config is keyword-only


def test_k_in_the_constructor_and_per_call_is_honoured() -> None:
    r = retriever(k=2, config=AdapterConfig(k=2, seed=0))
    assert r.k == 2 and len(r.invoke("pizza")) == 2
    assert len(r.invoke("pizza", k=5)) == 5
    assert len(r.last.event.selected) == 5
    assert len(r.invoke("pizza")) == 2  # a call's k does not stick
    assert retriever().k == AdapterConfig().k
    assert retriever(config=AdapterConfig(k=3)).k == 3
    r.k = 1  # the field is the retriever's k, as for LangChain's own retrievers
    assert len(r.invoke("pizza")) == 1


async def test_k_per_call_async() -> None:
    r = retriever(k=3)
    assert len(await r.ainvoke("pizza", k=1)) == 1
    assert len(await r.ainvoke("pizza")) == 3


@pytest.mark.parametrize("shadow", [False, True])
def test_a_call_may_ask_for_more_than_n_candidates(shadow: bool) -> None:
    r = retriever(config=AdapterConfig(k=2, n_candidates=3, shadow=shadow, seed=0))
    docs = r.invoke("pizza", k=6)  # six served from three candidates: the search was asked for max(n_candidates, k)
    assert len(docs) == 6 and len({d.id for d in docs}) == 6


def test_k_disagreeing_with_the_config_or_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"k=2 .* k=4"):
        retriever(k=2, config=AdapterConfig(k=4))
    with pytest.raises(ValidationError):
        retriever(k=0)
    with pytest.raises(ValueError, match="k must be"):
        retriever().invoke("pizza", k=0)


def test_documents_carry_causalmem_metadata_and_the_step_keywords() -> None:
    # Every request explores, so that it is a logged draw (else, before any policy, the store's
    # own ranking serves as a fallback step: tests/unit/client/test_cold_start.py).
    r = retriever(config=AdapterConfig(k=2, explore_rate=1.0))
    docs = r.invoke("pizza", query_id="conv-1:q3", step=3, last_step_loss=0.5, last_step_entropy=1.25, k=3)
    assert len(docs) == 3
    event = r.last.event
    for doc in docs:
        tag = doc.metadata["causalmem"]
        assert tag["query_id"] == "conv-1:q3" and tag["step"] == 3 and tag["event_id"] == event.event_id
        assert tag["memory_conflict"] is False
    assert [d.metadata["causalmem"]["slot"] for d in docs] == event.selected
    assert (event.features.last_step_loss, event.features.last_step_entropy) == (0.5, 1.25)
    assert np.isclose(event.candidate_probs.sum(), 1.0)
