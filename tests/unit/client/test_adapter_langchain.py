"""The LangChain adapter with the real langchain-core and its InMemoryVectorStore (no broker)."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import InMemoryVectorStore

from models.offpolicy.logged import uniform_logprob
from pipeline.client.idmap import IdSlotMap, SlotsFull
from pipeline.client.langchain import CausalMemoryRetriever, document_id
from pipeline.client.shadow import ShadowMode
from pipeline.config import AdapterConfig
from tests.adapter_fakes import CONN, DIM, TEXTS, AsyncRecorder, Recorder, hashed_embedding, policy


class HashEmbeddings(Embeddings):
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [hashed_embedding(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return hashed_embedding(text)


class Counting(BaseRetriever):
    """A plain retriever (no scores) that counts its searches."""

    docs: list[Document]
    calls: int = 0

    def _get_relevant_documents(self, query: str, *, run_manager: object) -> list[Document]:
        self.calls += 1
        return list(self.docs)


def store() -> InMemoryVectorStore:
    vs = InMemoryVectorStore(HashEmbeddings())
    vs.add_documents([Document(id=k, page_content=t) for k, t in TEXTS.items()])
    return vs


def adapter(**kw: object) -> tuple[CausalMemoryRetriever, Recorder]:
    rec = Recorder()
    cfg = kw.pop("config", AdapterConfig(k=2, n_candidates=6, seed=1))
    return CausalMemoryRetriever(kw.pop("wrapped", store()), conn=CONN, config=cfg, publisher=rec, **kw), rec


def test_serves_k_documents_maps_ids_to_slots_and_publishes_a_valid_event() -> None:
    r, rec = adapter()
    r.set_policy(policy())
    docs = r.invoke("what pizza did the user order", query_id="q1", step=2)
    assert len(docs) == 2
    (event,) = rec.values
    assert event.query_id == "q1" and event.step == 2 and not event.fallback
    assert sorted(event.candidates) == list(range(6))  # six documents, six slots, first come first served
    assert event.selected == [d.metadata["causalmem"]["slot"] for d in docs]
    assert [r.serving.idmap.key(s) for s in event.selected] == [d.id for d in docs]
    assert event.query_text == "what pizza did the user order"
    assert set(event.selected) <= set(event.memory_texts)
    assert event.logprob < 0 and np.isclose(event.candidate_probs.sum(), 1.0)
    assert docs[0].metadata["causalmem"]["event_id"] == event.event_id


def test_the_policy_drops_what_it_masks_and_draws_among_the_rest() -> None:
    r, rec = adapter()
    for k in TEXTS:
        r.serving.idmap.slot(k)
    keep = {r.serving.idmap.get("cat"): 5.0, r.serving.idmap.get("dog"): 5.0}
    r.set_policy(policy(bias=keep, zero=True))
    for i in range(10):
        docs = r.invoke("pizza order friday", query_id=f"q{i}")
        assert {d.id for d in docs} == {"cat", "dog"}  # everything else is below 1% of the largest mask
    assert sorted(rec.values[-1].dropped) == sorted(set(range(6)) - set(keep))
    assert rec.values[-1].policy_version == 1


def test_a_fixed_drop_that_leaves_nothing_serves_the_fallback() -> None:
    fb_doc = Document(id="kw", page_content="keyword hit")
    r, rec = adapter(config=AdapterConfig(k=2, n_candidates=6, drop=5.0, seed=0), fallback=lambda q, k: [fb_doc])
    r.set_policy(policy())  # every mask softplus(0) ≈ 0.69 < 5
    docs = r.invoke("pizza", query_id="q1")
    assert [d.id for d in docs] == ["kw"] and r.last.decision == "fallback"
    assert rec.values[0].fallback and rec.values[0].candidates == [] and rec.values[0].logprob == 0.0


def test_early_exit_skips_the_search_and_reports_the_saved_latency() -> None:
    vs = store()
    counting = Counting(docs=[d for d in vs.similarity_search("user", k=6)])
    r, rec = adapter(
        wrapped=counting,
        embed_query=hashed_embedding,
        config=AdapterConfig(k=2, n_candidates=6, early_exit_below=1.0, seed=0),
        fallback=lambda q, k: [],
    )
    r.invoke("a first query", query_id="q0")  # no policy yet: served normally, slots mapped, latency measured
    assert counting.calls == 1 and r.serving.search_latency_s is not None
    r.set_policy(policy())  # m ≈ 0.69 < 1.0 everywhere: nothing could survive
    assert r.invoke("pizza", query_id="q1") == []
    assert counting.calls == 1, "the search was skipped"
    assert r.last.decision == "early_exit" and r.last.saved_latency_s == r.serving.search_latency_s
    assert rec.values[-1].fallback and r.serving.saved_latency_s > 0
    r.set_policy(policy(bias={0: 3.0}))  # one slot above the threshold: search again
    r.invoke("pizza", query_id="q2")
    assert counting.calls == 2


def test_plain_retrievers_get_rank_scores_and_hashed_ids() -> None:
    doc = Document(page_content="no id here")
    assert document_id(doc).startswith("sha1:") and document_id(Document(page_content="x", metadata={"id": 7})) == "7"
    r, rec = adapter(wrapped=Counting(docs=[doc, Document(page_content="second")]), embed_query=hashed_embedding)
    r.set_policy(policy())
    r.invoke("anything", query_id="q")
    assert rec.values[0].scores.tolist() == [1.0, 0.5]


def test_memory_conflict_follows_the_feedback_on_the_selected_memories() -> None:
    r, rec = adapter(config=AdapterConfig(k=6, n_candidates=6, seed=0))
    docs = r.invoke("pizza", query_id="q1")
    assert not r.last.memory_conflict and r.last.expected_utility is None
    fb = r.feedback("q1", utility=-1.2)
    assert fb.event_id == rec.values[0].event_id and rec.values[-1] is fb
    docs = r.invoke("pizza", query_id="q2")
    assert r.last.memory_conflict and r.last.expected_utility == pytest.approx(-1.2)
    assert all(d.metadata["causalmem"]["memory_conflict"] for d in docs)
    for i in range(3, 30):  # each memory now helps (+0.5 each): the running estimates turn positive
        r.feedback(f"q{i - 1}", nll_with=1.0, nll_without=1.0, nll_without_slot=dict.fromkeys(r.last.slots, 1.5))
        r.invoke("pizza", query_id=f"q{i}")
    assert not r.last.memory_conflict and r.last.expected_utility > 0


def test_recent_published_events_leave_nothing_for_the_collector_to_track() -> None:
    """Thousands of recent events as objects survive into Python's oldest generation and bring on
    full collections of the process (~0.1 s with torch loaded) during requests; what a published
    event's feedback needs is kept in a form the collector stops tracking."""
    r = CausalMemoryRetriever(store(), conn=CONN, config=AdapterConfig(k=2, n_candidates=6, seed=1))
    r.set_policy(policy())
    r.invoke("warm up", query_id="w")
    gc.collect()
    tracked = len(gc.get_objects())
    for i in range(2000):
        r.invoke("pizza", query_id=f"q{i}")
    gc.collect(1)  # a young collection: what survives it waits for a full one
    assert len(gc.get_objects()) - tracked < 500  # events kept as objects: ~12,000 before
    fb = r.feedback("q5", nll_with=1.0, nll_without=2.0, nll_without_slot={s: 1.5 for s in r.last.slots})
    assert fb.utility == 1.0 and fb.event_id  # the feedback names the event from what was kept


def test_answers_wait_for_the_answer_then_go_out_with_it() -> None:
    r, rec = adapter(publish_on="answer")
    r.invoke("pizza", query_id="q1")
    assert rec.values == []
    r.answer("q1", "A margherita.")
    assert rec.values[0].answer_text == "A margherita."
    r.feedback("q1", utility=0.3)  # the event went out already: only the feedback follows
    assert len(rec.values) == 2
    r.invoke("sushi", query_id="q2")
    r.feedback("q2", utility=0.1)  # never answered: the event goes out first, then the feedback
    assert [type(v).__name__ for v in rec.values[2:]] == ["RetrievalEvent", "LLMFeedback"]
    r2, _ = adapter()
    r2.invoke("pizza", query_id="q1")
    with pytest.raises(ValueError, match="publish_on='answer'"):
        r2.answer("q1", "too late")


def test_async_invoke_publishes_through_an_async_publisher_and_sync_use_says_why_not() -> None:
    rec = AsyncRecorder()
    r = CausalMemoryRetriever(store(), conn=CONN, config=AdapterConfig(k=2), publisher=rec)
    docs = asyncio.run(r.ainvoke("flight to lisbon", query_id="q1"))
    assert len(docs) == 2 and rec.values[0].query_id == "q1"
    asyncio.run(r.afeedback("q1", utility=0.2))
    assert rec.values[1].utility == 0.2
    with pytest.raises(TypeError, match="async methods"):
        r.invoke("flight", query_id="q2")


def test_shadow_mode_serves_the_incumbent_explores_with_true_propensities_and_cuts_over(tmp_path) -> None:
    state = tmp_path / "shadow.json"
    r, rec = adapter(
        config=AdapterConfig(k=2, n_candidates=6, seed=3),
        shadow=ShadowMode(explore_rate=0.3, path=state),
    )
    incumbent = [d.id for d in store().similarity_search("hotel in lisbon", k=2)]
    decisions = []
    for i in range(60):
        docs = r.invoke("hotel in lisbon", query_id=f"q{i}")
        decisions.append(r.last.decision)
        if r.last.decision == "incumbent":
            assert [d.id for d in docs] == incumbent
    assert r.mode == "shadow" and 5 <= decisions.count("explore") <= 35
    for e, d in zip(rec.values, decisions, strict=True):
        if d == "explore":
            assert not e.fallback and len(e.candidates) == 6
            assert e.logprob == pytest.approx(float(uniform_logprob(np.array([6]), np.array([2]))[0]))
        else:
            assert e.fallback and e.logprob == 0.0 and e.candidates == []
    r.set_policy(policy(version=2))
    assert r.mode == "shadow", "an ordinary checkpoint does not cut over"
    r.set_policy(policy(version=3, reason="cutover"))
    assert r.mode == "policy"
    r.invoke("hotel in lisbon", query_id="after")
    assert r.last.decision == "policy" and rec.values[-1].policy_version == 3
    assert ShadowMode(path=state).mode == "policy", "the cut-over survives a restart"


def test_the_id_map_persists_is_bounded_and_fails_clearly(tmp_path) -> None:
    path = tmp_path / "ids.json"
    r, _ = adapter(idmap=str(path))
    r.invoke("pizza", query_id="q1")
    again = IdSlotMap(CONN.limits.slots, path)
    assert {again.key(s) for s in again.assigned()} == set(TEXTS)
    assert all(again.get(k) == r.serving.idmap.get(k) for k in TEXTS)
    small = IdSlotMap(3, tmp_path / "small.json")
    r2, _ = adapter(idmap=small)
    with pytest.raises(SlotsFull, match="all 3 memory slots are taken"):
        r2.invoke("pizza", query_id="q1")
    assert len(IdSlotMap(3, tmp_path / "small.json")) == 3
    with pytest.raises(ValueError, match="more than the 2 slots"):
        IdSlotMap(2, tmp_path / "small.json")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary file left behind"


def test_the_query_embedding_must_have_the_pipelines_dimension() -> None:
    r, _ = adapter(embed_query=lambda q: [0.0] * (DIM + 1))
    with pytest.raises(ValueError, match=f"expects {DIM}"):
        r.invoke("pizza")


@pytest.mark.slow  # several seconds: make test runs it, make check does not
def test_without_the_extras_the_adapters_name_them_and_the_client_needs_neither() -> None:
    from tests.unit.cli.test_extras import _run_without

    code = """
import pipeline.client
for module in ("langchain", "llamaindex"):
    try:
        __import__(f"pipeline.client.{module}")
    except RuntimeError as exc:
        print(exc)
"""
    done = _run_without({"langchain_core", "llama_index"}, code)
    assert done.returncode == 0, done.stderr
    assert "from the 'langchain' extra" in done.stdout and "from the 'llamaindex' extra" in done.stdout


def test_difficulty_scaling_drops_more_on_hard_queries_only() -> None:
    from pipeline.client.adapter import Candidate, CausalServing

    def found(top: float):
        return lambda q, n, v: [Candidate("a", top, "a", "a"), Candidate("b", top - 0.1, "b", "b")]

    net = policy(bias={0: 5.0, 1: float(np.log(np.expm1(0.1)))}, zero=True)  # m_b / m_a ≈ 0.02
    for beta, top, kept in [(0.0, 0.5, 2), (4.0, 0.5, 1), (4.0, 1.0, 2)]:  # ratio 0.01·(1 + β·(1 − top))
        config = AdapterConfig(k=2, difficulty_scaling=beta, explore_revive=0.0, seed=0)  # the drop alone: no revival
        serving = CausalServing(hashed_embedding, CONN, config)
        serving.idmap.slots_of(["a", "b"])
        serving.set_policy(net)
        served = serving.serve("q", found(top))
        assert len(served.event.candidates) == kept, (beta, top)


def test_each_request_embeds_the_query_once() -> None:
    """The store embeds with the same model as the policy: it is searched by the policy's embedding
    (a real embedding model's call is the slowest part of a request; it used to be made twice)."""

    class Counting(HashEmbeddings):
        calls = 0

        def embed_query(self, text: str) -> list[float]:
            Counting.calls += 1
            return super().embed_query(text)

    vs = InMemoryVectorStore(Counting())
    vs.add_documents([Document(id=k, page_content=t) for k, t in TEXTS.items()])
    r, _ = adapter(wrapped=vs)
    for i in range(5):
        r.invoke("what pizza did the user order", query_id=f"q{i}")
    assert Counting.calls == 5
    asyncio.run(r.ainvoke("pizza", query_id="q5"))
    assert Counting.calls == 6
