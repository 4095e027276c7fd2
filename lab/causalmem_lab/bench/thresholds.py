"""Threshold scaling by query difficulty, measured: ``python -m causalmem_lab.bench.thresholds``.

The adapters (docs/byo-retriever.md) can scale the hard drop's threshold by the query's
difficulty, ``1 − top candidate score``: the dynamic drop keeps ``m_i ≥ 0.01·(1 + β·d)·max m``
(a fixed τ becomes ``τ·(1 + β·d)``). A hard query (no close memory) then drops more.

For each seed, a policy is trained in process on the simulator (:mod:`causalmem_lab.simulator`,
the same pieces as :mod:`causalmem_lab.offline`, without drift), then *served* — greedy
temperature, no exploration — through :class:`~pipeline.client.adapter.CausalServing` over
the same evaluation queries for each β. Reported per β: the share of empty results (the
drop left nothing), of leaks (a harmful memory served), the recall of helpful memories
and the mean true utility; three seeds side by side. docs/byo-retriever.md records the
figures.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from causalmem_lab.offline import OfflineConfig, _snapshot
from causalmem_lab.simulator import Environment, Scenario, serve
from models.policy.trainer import PolicyTrainer
from pipeline.client.adapter import Candidate, CausalServing
from pipeline.client.retriever import CausalRetriever
from pipeline.config import AdapterConfig, Connection, Settings
from topics.internal import Experience

BETAS = (0.0, 2.0, 5.0, 10.0)


def scenario(seed: int) -> Scenario:
    return Scenario(
        seed=seed, embedding_dim=64, slots=256, intents=8, background=120, drift_day=None, queries_per_day=400
    )


def train(env: Environment, s: Scenario, queries: int) -> Any:
    """A policy trained on ``queries`` simulated queries (REINFORCE, as the learner does)."""
    cfg = OfflineConfig(hidden=64, lr=3e-3, batch_size=32, seed=s.seed)
    trainer = PolicyTrainer(cfg.trainer(s))
    retriever = CausalRetriever(env.memory, k=s.k, n_candidates=s.n_candidates, temperature=s.temperature, seed=s.seed)
    retriever.explore_rate, retriever.explore_temperature = s.explore_rate, s.explore_temperature
    pending: list[Experience] = []
    for i in range(queries):
        if i % 200 == 0:
            retriever.set_policy(_snapshot(trainer, i // 200 + 1))
        q = env.next_query()
        for step in range(q.steps):
            res = serve(retriever, env.step_features(q, step), with_texts=False)
            _, nll_with, nll_without, _ = env.feedback(q.intent, res.slots)
            if not res.event.fallback:
                pending.append(Experience(res.event.event_id, "feedback", res.event, nll_without - nll_with))
            if len(pending) >= cfg.batch_size:
                trainer.update(pending)
                pending = []
    return _snapshot(trainer, 10_000)


def measure(seed: int, train_queries: int, eval_queries: int, betas: tuple[float, ...]) -> dict[str, Any]:
    s = scenario(seed)
    env = Environment(s)
    policy = train(env, s, train_queries)
    steps = [env.step_features(q, 0) for q in (env.next_query() for _ in range(eval_queries))]
    intents = {st.query_id: st.intent for st in steps}
    search = CausalRetriever(env.memory, n_candidates=s.n_candidates)
    conn = Connection.of(Settings(embedding_dim=s.embedding_dim, slots=s.slots))
    emb = {st.text or st.query_id: st.embedding for st in steps}
    out: dict[str, Any] = {}
    for beta in betas:
        cfg = AdapterConfig(
            k=s.k, n_candidates=s.n_candidates, temperature=s.temperature, explore_rate=0.0, difficulty_scaling=beta
        )
        serving: CausalServing[int] = CausalServing(emb.__getitem__, conn, cfg)
        for slot in range(s.slots):
            serving.idmap.slot(str(slot))  # slot i is memory row i
        serving.set_policy(policy)
        empty = leak = 0
        recall: list[float] = []
        utility: list[float] = []
        for st in steps:

            def found(_: str, n: int, q: np.ndarray = st.embedding) -> list[Candidate[int]]:
                slots, scores = search.search(q, n)
                return [Candidate(str(int(i)), float(sc), None, int(i)) for i, sc in zip(slots, scores, strict=True)]

            served = serving.serve(
                st.text or st.query_id, found, st.query_id, 0, st.last_step_loss, st.last_step_entropy
            )
            intent = intents[st.query_id]
            empty += not served.slots
            leak += env.leak(intent, served.slots)
            recall.append(env.recall(intent, served.slots))
            utility.append(env.utility(intent, served.slots))
        n = len(steps)
        out[f"{beta:g}"] = {
            "empty": empty / n,
            "leak": leak / n,
            "recall": float(np.mean(recall)),
            "utility": float(np.mean(utility)),
        }
    return out


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--train-queries", type=int, default=3000)
    p.add_argument("--eval-queries", type=int, default=1000)
    p.add_argument("--betas", type=float, nargs="+", default=list(BETAS))


def main(args: argparse.Namespace) -> int:
    betas = tuple(args.betas)
    results = {str(seed): measure(seed, args.train_queries, args.eval_queries, betas) for seed in args.seeds}
    print(json.dumps(results))
    print(f"{'β':>5} " + " ".join(f"{'seed ' + s:>34}" for s in results))
    print(f"{'':>5} " + " ".join(f"{'empty   leak  recall utility':>34}" for _ in results))
    for beta in results[str(args.seeds[0])]:
        cells = [results[s][beta] for s in results]
        row = " ".join(
            f"{c['empty']:>10.3f} {c['leak']:>6.3f} {c['recall']:>7.3f} {c['utility']:>+8.3f}" for c in cells
        )
        print(f"{beta:>5} {row}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser)
    raise SystemExit(main(parser.parse_args()))
