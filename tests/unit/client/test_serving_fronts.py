"""One check suite that every client serving front passes: ``CausalRetriever``, the LangChain
adapter and the LlamaIndex adapter (the real langchain-core and llama-index-core, their
in-memory stores), over the same memories, queries, seed and policies.

Each check runs on every front (river's ``check_estimator`` style): the front serves and
logs exactly what the serving core does for the same candidates (:class:`CoreFront`, the
reference: a brute-force search handed to :class:`~pipeline.client.serving_core.ServingCore`),
its events keep the contract's §6 promises (``logprob`` and ``candidate_probs`` are the
Plackett–Luce draw's over the candidates as served), it serves the canary on its share of
requests as the canary's own manifest says (contract 1.4) or draws both slates (1.5), and
it revives dropped candidates on exploratory requests only (§6 step 3b).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import pytest
import torch

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import InMemoryVectorStore
from llama_index.core import VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import TextNode

from models.policy.network import init_policy
from models.serving.params import ServingParams
from models.serving.rule import plackett_luce_logprob
from pipeline.client import langchain as lc
from pipeline.client import llamaindex as li
from pipeline.client.retriever import CausalRetriever
from pipeline.client.serving import policy_masks
from pipeline.client.serving_core import EXPLORE_REVIVE, Found, ServingCore
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import AdapterConfig
from tests.adapter_fakes import CONN, DIM, Recorder
from topics.events import Features, RetrievalEvent
from topics.manifest import Manifest

N, K, CANDIDATES, SEED = 12, 3, 8, 5
SLOTS = CONN.limits.slots
_rng = np.random.default_rng(2026)
MEMORIES = _rng.normal(size=(N, DIM)).astype(np.float32)
MEMORIES /= np.linalg.norm(MEMORIES, axis=1, keepdims=True)
QUERIES = _rng.normal(size=(40, DIM)).astype(np.float32)
QUERIES /= np.linalg.norm(QUERIES, axis=1, keepdims=True)
TEXTS = [f"memory {i}" for i in range(N)]


def vector(text: str) -> list[float]:
    """``"memory i"`` → memory i's embedding, ``"query j"`` → query j's (what the stores embed)."""
    kind, i = re.fullmatch(r"(memory|query) (\d+)", text.strip()).groups()  # type: ignore[union-attr]
    out: list[float] = (MEMORIES if kind == "memory" else QUERIES)[int(i)].tolist()
    return out


def loaded(version: int, seed: int, serving: ServingParams, spread: float = 4.0) -> LoadedPolicy:
    """A policy whose output biases spread by ``spread``: some memories' masks fall below 1% of the largest."""
    net = init_policy(DIM, SLOTS, hidden=16, seed=seed)
    with torch.no_grad():
        net.out.bias.add_(spread * torch.randn(SLOTS, generator=torch.Generator().manual_seed(seed)))
    m = Manifest("default", version, 0.0, "periodic", {}, 0.5, 0.0, "0" * 64, 1, 1, serving=serving.to_wire())
    return LoadedPolicy(manifest=m, net=net)


class Front(Protocol):
    def set_policy(self, policy: LoadedPolicy | None) -> None: ...
    def set_canary(self, canary: LoadedPolicy | None) -> None: ...
    def serve(self, i: int) -> RetrievalEvent: ...


class CoreFront:
    """The reference: the serving core given the exact top candidates of a brute-force search."""

    def __init__(self, **explicit: Any) -> None:
        self.core = ServingCore(k=K, explicit=explicit, explore_revive=EXPLORE_REVIVE, seed=SEED)
        self.set_policy, self.set_canary = self.core.set_policy, self.core.set_canary

    def serve(self, i: int) -> RetrievalEvent:
        q = QUERIES[i % len(QUERIES)]
        arm = self.core.arm()
        similarity = MEMORIES @ q
        slots = np.argsort(-similarity, kind="stable")[:CANDIDATES].astype(np.int64)
        scores = similarity[slots].astype(np.float64)

        def under(p: LoadedPolicy) -> tuple[np.ndarray, np.ndarray]:
            return slots, policy_masks(p, q, 0.0, 0.0, slots)

        found = Found(slots, policy_masks(arm.policy, q, 0.0, 0.0, slots), scores, lambda: [], under=under)
        slate = self.core.serve(arm, found)
        return self.core.event(
            slate,
            policy_name="default",
            query_id=f"q{i}",
            step=0,
            features=Features(q, 0.0, 0.0),
            query_text=f"query {i % len(QUERIES)}",
            text_of=lambda s: TEXTS[s],
        )


class RetrieverFront:
    def __init__(self, **explicit: Any) -> None:
        self.r = CausalRetriever(
            MEMORIES, texts=TEXTS, k=K, n_candidates=CANDIDATES, seed=SEED, fallback=lambda *a: [], **explicit
        )
        self.set_policy, self.set_canary = self.r.set_policy, self.r.set_canary

    def serve(self, i: int) -> RetrievalEvent:
        j = i % len(QUERIES)
        return self.r.retrieve(QUERIES[j], f"q{i}", query_text=f"query {j}").event


class VectorEmbeddings(Embeddings):
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [vector(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return vector(text)


class VectorEmbedding(BaseEmbedding):
    def _get_query_embedding(self, query: str) -> list[float]:
        return vector(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return vector(text)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return vector(query)


def config(**explicit: Any) -> AdapterConfig:
    return AdapterConfig(k=K, n_candidates=CANDIDATES, seed=SEED, **explicit)


class LangChainFront:
    def __init__(self, **explicit: Any) -> None:
        store = InMemoryVectorStore(VectorEmbeddings())
        store.add_documents([Document(id=f"m{i}", page_content=t) for i, t in enumerate(TEXTS)])
        self.rec = Recorder()
        self.r = lc.CausalMemoryRetriever(store, conn=CONN, config=config(**explicit), publisher=self.rec)
        for i in range(N):  # slot i is memory i, as in CausalRetriever
            assert self.r.serving.idmap.slot(f"m{i}") == i
        self.set_policy, self.set_canary = self.r.set_policy, self.r.set_canary

    def serve(self, i: int) -> RetrievalEvent:
        self.r.invoke(f"query {i % len(QUERIES)}", query_id=f"q{i}")
        event: RetrievalEvent = self.rec.values[-1]
        return event


class LlamaIndexFront:
    def __init__(self, **explicit: Any) -> None:
        nodes = [TextNode(id_=f"m{i}", text=t) for i, t in enumerate(TEXTS)]
        index = VectorStoreIndex(nodes, embed_model=VectorEmbedding())
        self.rec = Recorder()
        self.r = li.CausalMemoryRetriever(index, conn=CONN, config=config(**explicit), publisher=self.rec)
        for i in range(N):
            assert self.r.serving.idmap.slot(f"m{i}") == i
        self.set_policy, self.set_canary = self.r.set_policy, self.r.set_canary

    def serve(self, i: int) -> RetrievalEvent:
        self.r.retrieve_step(f"query {i % len(QUERIES)}", query_id=f"q{i}")
        event: RetrievalEvent = self.rec.values[-1]
        return event


FRONTS: dict[str, Callable[..., Front]] = {
    "CausalRetriever": RetrieverFront,
    "langchain": LangChainFront,
    "llamaindex": LlamaIndexFront,
}

# The serving manifests of the scenarios: exploration (with revival), an A/B canary, a coupled one.
EXPLORING = ServingParams(explore_rate=0.5, explore_temperature=0.5, drop="dynamic")  # what exploration revives
AB = ServingParams(explore_rate=0.2, canary_rate=0.5)
COUPLED = ServingParams(explore_rate=0.2, canary_rate=0.6, canary_coupled=True)
CANARY_SERVED = ServingParams(temperature=0.1, explore_rate=0.3, explore_temperature=0.7)  # the canary's own


def scenario(name: str) -> tuple[LoadedPolicy | None, LoadedPolicy | None]:
    """The serving policy and the canary of a scenario."""
    if name == "no policy":
        return None, None
    if name == "exploring":
        return loaded(1, seed=1, serving=EXPLORING), None
    serving = AB if name == "A/B canary" else COUPLED
    return loaded(1, seed=1, serving=serving), loaded(2, seed=9, serving=CANARY_SERVED)


def events(front: Front, serving: LoadedPolicy | None, canary: LoadedPolicy | None, n: int) -> list[RetrievalEvent]:
    front.set_policy(serving)
    front.set_canary(canary)
    return [front.serve(i) for i in range(n)]


EXACT = (
    *("query_id", "step", "policy", "policy_version", "candidates", "selected", "fallback", "dropped"),
    *("query_text", "memory_texts", "candidate_ids", "canary", "canary_arm", "canary_version", "canary_other"),
)
CLOSE = ("scores", "temperature", "logprob", "mask_max", "candidate_masks", "candidate_probs")


def assert_same_event(got: RetrievalEvent, want: RetrievalEvent) -> None:
    """Equal in every field the serving decides; floats to 1e-5 (the stores compute cosine in float64, faiss
    in float32). ``event_id`` and ``ts`` are each event's own."""
    for name in EXACT:
        assert getattr(got, name) == getattr(want, name), (name, got.query_id)
    for name in CLOSE:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), (name, got.query_id)
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{name} of {got.query_id}")
    np.testing.assert_array_equal(got.features.query_embedding, want.features.query_embedding)


# ---------------------------------------------------------------------- the checks, every front


@pytest.mark.parametrize("name", ["no policy", "exploring", "A/B canary", "coupled canary"])
@pytest.mark.parametrize("front", FRONTS)
def test_serves_and_logs_what_the_serving_core_does(front: str, name: str) -> None:
    serving, canary = scenario(name)
    want = events(CoreFront(), serving, canary, 60)
    got = events(FRONTS[front](), serving, canary, 60)
    for g, w in zip(got, want, strict=True):
        assert_same_event(g, w)


@pytest.mark.parametrize("front", FRONTS)
def test_logprob_and_candidate_probs_are_the_draw_over_the_candidates_as_served(front: str) -> None:
    serving, canary = scenario("A/B canary")
    policies = {1: serving, 2: canary}
    for e in events(FRONTS[front](), serving, canary, 80):
        assert not e.fallback and len(e.selected) == K and set(e.selected) <= set(e.candidates)
        dropped = e.dropped or []
        assert not set(dropped) & set(e.candidates) and len(e.candidates) + len(dropped) == CANDIDATES
        alpha = policies[e.policy_version].alpha  # type: ignore[union-attr]
        z = np.asarray(e.scores) * (1.0 + alpha * np.asarray(e.candidate_masks)) / e.temperature
        positions = [e.candidates.index(s) for s in e.selected]
        assert e.logprob == pytest.approx(plackett_luce_logprob(z, positions), rel=1e-5, abs=1e-6)
        p = np.exp(z - z.max())
        assert e.candidate_probs is not None
        np.testing.assert_allclose(e.candidate_probs, p / p.sum(), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("front", FRONTS)
def test_an_ab_canary_serves_its_share_as_its_own_manifest_says(front: str) -> None:
    serving, canary = scenario("A/B canary")
    got = events(FRONTS[front](), serving, canary, 200)
    served_by_canary = [e for e in got if e.canary]
    assert 0.35 < len(served_by_canary) / len(got) < 0.65  # AB.canary_rate = 0.5
    assert {e.policy_version for e in served_by_canary} == {2}
    assert {e.temperature for e in served_by_canary} == {0.1, 0.7}  # the canary's T and explore T
    rest = [e for e in got if not e.canary]
    assert {e.policy_version for e in rest} == {1} and all(e.canary is None for e in rest)
    assert {e.temperature for e in rest} == {AB.temperature, AB.explore_temperature}  # the serving manifest's
    assert all(e.canary_arm is None and e.canary_version is None for e in got)


@pytest.mark.slow  # several seconds: make test runs it, make check does not
@pytest.mark.parametrize("front", FRONTS)
def test_a_coupled_canary_draws_both_slates_and_logs_the_arm(front: str) -> None:
    serving, canary = scenario("coupled canary")
    got = events(FRONTS[front](), serving, canary, 200)
    coupled = [e for e in got if e.canary_arm is not None]
    assert 0.45 < len(coupled) / len(got) < 0.75  # COUPLED.canary_rate = 0.6
    assert {e.canary_arm for e in coupled} == {"tie", "canary", "serving"}
    for e in coupled:
        assert e.canary_version == 2
        assert e.canary is (True if e.canary_arm == "canary" else None)
        assert e.policy_version == (2 if e.canary_arm == "canary" else 1)
        assert (e.canary_other is None) == (e.canary_arm == "tie")
        assert e.canary_other != e.selected
    # The same network as canary: every coupled request ties (the shared random numbers).
    same = loaded(2, seed=1, serving=COUPLED)  # served the same way too
    twin = events(FRONTS[front](), serving, same, 100)
    assert {e.canary_arm for e in twin} == {None, "tie"} and not any(e.canary for e in twin)


@pytest.mark.parametrize("front", FRONTS)
def test_exploratory_requests_and_only_they_revive_dropped_candidates(front: str) -> None:
    serving, _ = scenario("exploring")
    got = events(FRONTS[front](), serving, None, 200)
    revived = {True: 0, False: 0}
    for e in got:
        assert e.mask_max is not None
        below = np.asarray(e.candidate_masks) < 0.01 * e.mask_max  # kept only by the revival
        revived[e.temperature == 0.5] += int(below.sum())
    assert {e.temperature for e in got} == {0.05, 0.5}
    assert revived[True] > 0 and revived[False] == 0
    assert sum(len(e.dropped or []) for e in got) > 100, "the spread policy drops memories"


@pytest.mark.parametrize("front", FRONTS)
def test_an_explicit_canary_rate_of_zero_serves_no_canary(front: str) -> None:
    serving, canary = scenario("A/B canary")
    got = events(FRONTS[front](canary_rate=0.0), serving, canary, 100)
    assert not any(e.canary for e in got) and {e.policy_version for e in got} == {1}


# ---------------------------------------------------------------------- the adapters against CausalRetriever


@pytest.mark.parametrize("adapter", ["langchain", "llamaindex"])
@pytest.mark.parametrize("name", ["A/B canary", "coupled canary"])
def test_the_adapters_serve_the_canary_exactly_as_causal_retriever_does(adapter: str, name: str) -> None:
    serving, canary = scenario(name)
    want = events(RetrieverFront(), serving, canary, 120)
    got = events(FRONTS[adapter](), serving, canary, 120)
    assert any(e.canary for e in got) and any(not e.canary for e in got)
    for g, w in zip(got, want, strict=True):
        assert_same_event(g, w)
    assert math.isclose(sum(bool(e.canary) for e in got), sum(bool(e.canary) for e in want))


def test_shadow_mode_serves_no_canary_until_the_cut_over() -> None:
    from pipeline.client.shadow import ShadowMode

    front = LangChainFront()
    front.r.serving.shadow = ShadowMode(explore_rate=0.2)
    serving, canary = scenario("A/B canary")
    shadowed = events(front, serving, canary, 60)
    assert not any(e.canary for e in shadowed) and {e.policy_version for e in shadowed} == {1}
    cutover = Manifest(**{**serving.manifest.__dict__, "reason": "cutover"})  # type: ignore[union-attr]
    front.set_policy(LoadedPolicy(manifest=cutover, net=serving.net))  # type: ignore[union-attr]
    after = [front.serve(i) for i in range(60)]
    assert front.r.mode == "policy" and any(e.canary for e in after)
