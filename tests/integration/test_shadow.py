"""Shadow mode: the incumbent serves, exploration is logged, the gain is estimated, the cut-over fires."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("langchain_core")

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import InMemoryVectorStore

from models.offpolicy.logged import LoggedDecisions
from models.policy.network import PolicyNetwork
from pipeline.client.langchain import CausalMemoryRetriever
from pipeline.client.shadow import ShadowMode
from pipeline.config import AdapterConfig, Connection, Settings, ShadowConfig
from pipeline.policy_evaluation.shadow import CutoverRule, format_report, shadow_gain
from tests.adapter_fakes import Recorder, hashed_embedding
from tests.helpers import running
from topics.internal import Experience

# Every query has the poisoned memory's words (in another order): the incumbent (similarity) ranks it first.
QUERIES = ["lisbon trip plans", "plans for the lisbon trip", "trip plans lisbon", "the lisbon trip plans"]
DOCS = {
    "poison": "lisbon trip plans",
    "hotel": "The user booked a hotel in Lisbon near the river.",
    "flight": "The user's flight to Lisbon leaves on Monday.",
    "order": "The user ordered a margherita pizza for the trip.",
    "cat": "The user's cat is called Miso.",
    "dog": "The user walks the neighbour's dog on Sundays.",
}


def utility(doc_ids: list[str]) -> float:
    return sum(-1.0 if d == "poison" else 0.5 for d in doc_ids)


class HashEmbeddings(Embeddings):
    def __init__(self, dim: int) -> None:
        self.dim = dim

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [hashed_embedding(t, self.dim) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return hashed_embedding(text, self.dim)


def world(conn: Connection, publisher: Any, explore_rate: float, seed: int = 0) -> CausalMemoryRetriever:
    dim = conn.limits.embedding_dim
    vs = InMemoryVectorStore(HashEmbeddings(dim))
    vs.add_documents([Document(id=k, page_content=t) for k, t in DOCS.items()])
    r = CausalMemoryRetriever(
        vs,
        conn=conn,
        config=AdapterConfig(k=2, n_candidates=6, seed=seed),
        publisher=publisher,
        shadow=ShadowMode(explore_rate=explore_rate),
    )
    for k in DOCS:  # the slots in a known order
        r.serving.idmap.slot(k)
    return r


def biased(conn: Connection, slot: int, bias: float, others: float, hidden: int = 8) -> PolicyNetwork:
    """A policy whose mask is softplus(bias) for ``slot`` and softplus(others) elsewhere."""
    net = PolicyNetwork(conn.limits.embedding_dim, conn.limits.slots, hidden)
    with torch.no_grad():
        net.out.weight.zero_()
        net.out.bias.fill_(others)
        net.out.bias[slot] = bias
    return net.eval()


def avoiding(conn: Connection, slot: int, hidden: int = 8) -> PolicyNetwork:
    """Masks ``slot`` to ~0 (the hard drop removes it)."""
    return biased(conn, slot, -30.0, 2.0, hidden)


def favouring(conn: Connection, slot: int) -> PolicyNetwork:
    return biased(conn, slot, 5.0, 0.0)


def test_the_gain_over_the_incumbent_is_estimated_from_the_exploration_log_only() -> None:
    conn = Connection.of(Settings(embedding_dim=8, slots=16))
    rec = Recorder(conn.limits)
    r = world(conn, rec, explore_rate=0.5)
    exps = []
    for i in range(240):
        docs = r.invoke(QUERIES[i % len(QUERIES)], query_id=f"q{i}")
        ev = rec.values[-1]
        if not ev.fallback:  # incumbent requests are fallback events: the estimators leave them out
            exps.append(Experience(ev.event_id, "feedback", ev, utility([d.id for d in docs])))
    assert 80 <= len(exps) <= 160
    decisions = LoggedDecisions.from_experiences(exps)
    poison = r.serving.idmap.get("poison")
    good = shadow_gain(decisions, avoiding(conn, poison), ShadowConfig())
    assert good.low > 0 and good.value == pytest.approx(1.5, abs=0.3)  # +1.0 against −0.5 per step
    same = shadow_gain(decisions, favouring(conn, poison), ShadowConfig())  # ranks like the incumbent
    assert same.low <= 0 and same.value < good.value - 1.0


def test_the_cutover_rule_needs_a_positive_lower_bound_held_for_the_period() -> None:
    from models.offpolicy.estimators import Estimate

    up, down = Estimate(1.0, 0.1, 2.0, 50.0, 80, "g", 0.0), Estimate(1.0, -0.1, 2.0, 50.0, 80, "g", 0.0)
    rule = CutoverRule(period_s=5.0, min_decisions=50)
    assert not rule.observe(up, 0.0) and not rule.observe(down, 4.0) and not rule.observe(up, 6.0)
    assert not rule.observe(Estimate(1.0, 0.1, 2.0, 5.0, 10, "g", 0.0), 20.0), "too few steps"
    assert not rule.observe(up, 21.0) and rule.observe(up, 26.0)
    assert not rule.observe(None, 30.0)
    line = format_report(
        {
            "policy": "default",
            "mode": "shadow",
            "decisions": 80,
            "serving_version": 3,
            "gain": {"value": 1.0, "low": 0.1, "high": 2.0, "level": 0.95, "ess": 50.0, "n": 80, "method": "g"},
        }
    )
    assert "shadow mode" in line and "+1.0000 [+0.1000, +2.0000]" in line and "95% interval" in line


@pytest.mark.broker
async def test_shadow_mode_end_to_end_incumbent_logs_estimate_cutover(topics_ready: Settings) -> None:
    """The incumbent serves with 50% logged exploration; the join makes experiences; the estimate's lower
    bound is above 0; the cut-over sends the control event; the learner (gate on) learns from the logs and
    answers with a ``cutover`` checkpoint of the estimated weights; the adapter serves the policy from then on."""
    from pipeline.client.publisher import EventPublisher
    from pipeline.client.subscriber import PolicySubscriber
    from pipeline.learner.loop import Learner
    from pipeline.metrics import Metrics
    from pipeline.modeltopic import CheckpointPublisher
    from pipeline.policy_evaluation.shadow import shadow_report, watch
    from pipeline.worker.join import JoinStage
    from tests.helpers import publish_tensors, until

    s = topics_ready.replace(gate=True)  # the cut-over serves the estimated version, not ungated weights
    conn = s.connection()
    bootstrap = s.bootstrap or ""
    poison_slot = list(DOCS).index("poison")
    net = avoiding(conn, poison_slot, hidden=s.hidden)
    from pipeline import kafka

    producer = kafka.producer(bootstrap, conn)
    await producer.start()
    try:  # the serving policy (as a learner would have published it)
        pub = CheckpointPublisher(producer, conn.topics.policy_checkpoints.name, conn.policy)
        await publish_tensors(pub, net.tensors(), reason="init", arch=net.arch, baseline=0.0)
    finally:
        await producer.stop()

    metrics = Metrics()
    async with EventPublisher(bootstrap, conn) as events, running(JoinStage(s.join(), bootstrap, metrics)):
        r = world(conn, events, explore_rate=0.5, seed=1)
        async with PolicySubscriber(bootstrap, conn=conn, on_update=r.set_policy) as sub:
            await sub.wait_for_policy(1, timeout=20)
            for i in range(160):
                qid = f"q{i}"
                docs = await r.ainvoke(QUERIES[i % len(QUERIES)], query_id=qid)
                assert r.last.decision in ("incumbent", "explore")
                if r.last.decision == "incumbent":
                    assert docs[0].id == "poison"
                await r.afeedback(qid, utility=utility([d.id for d in docs]))
            await events.flush()
            explored = r.serving.counts["explore"]
            await until(lambda: metrics.joins._value.get() >= 160, 30, "joins")

            report = await shadow_report(bootstrap, conn, 1000)
            assert report["mode"] == "shadow" and report["decisions"] == explored
            assert report["gain"]["low"] > 0

            shown: list[dict[str, Any]] = []
            config = ShadowConfig(min_decisions=20, cutover_period_s=0.0)
            async with running(Learner(s.learner(), bootstrap, Metrics())) as learner:
                final = await watch(bootstrap, conn, 1000, config, 0.5, shown.append, timeout_s=25)
                assert final["mode"] == "policy", shown[-1]
                await until(lambda: r.mode == "policy", 15, "the adapter sees the cut-over")
                # It learnt from the exploration log.
                assert learner.trainer.experiences >= explored
            cut = sub.current
            assert cut is not None and cut.manifest.reason == "cutover"
            for name, tensor in net.tensors().items():  # the weights whose gain was estimated (v1)
                assert torch.equal(cut.net.tensors()[name], tensor), name
            assert cut.manifest.metrics["cutover"]["gain"]["low"] > 0
            docs = await r.ainvoke("hotel in lisbon", query_id="after")
            assert r.last.decision == "policy" and "poison" not in [d.id for d in docs]
    from pipeline.cli.status import ShadowStatusCollector

    view = await ShadowStatusCollector(bootstrap, conn, window=1000).snapshot()
    assert view["shadow"]["mode"] == "policy" and view["shadow"]["gain"]["low"] > 0, view.get("errors")
    out = io.StringIO()
    print(format_report(final), file=out)
    assert "cut-over" in out.getvalue()
    assert np.isfinite(final["gain"]["value"])


def test_status_shows_the_shadow_line() -> None:
    from rich.console import Console

    from pipeline.status.render import render

    snap = {
        "ts": 1_767_225_600.0,
        "bootstrap": "127.0.0.1:1",
        "prefix": "",
        "policy": "default",
        "errors": [],
        "shadow": {"line": "policy 'default': shadow mode, gain over the incumbent +0.5000"},
    }
    console = Console(record=True, width=200)
    console.print(render(snap))
    assert "shadow: policy 'default': shadow mode, gain over the incumbent +0.5000" in console.export_text()
