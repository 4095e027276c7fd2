"""``causalmem bench coldstart``: how fast a new helpful memory enters the served top-k.

In process, no broker, on the simulator (:mod:`causalmem_lab.simulator`, no drift). For
each seed a policy is trained by REINFORCE (:class:`~models.policy.trainer.PolicyTrainer`, as the
learner does) on a bank from which one helpful memory per intent is held out: those
memories are not in the index, so their output rows never receive a gradient. Then they
are added (the bank and the index gain them, as ``memory-lifecycle`` adds do) and their
rows are initialised two ways, from the same trained policy and with the same traffic:

* **fresh**: neutral rows (:func:`models.policy.network.neutral_rows`, mask ≈ 1), what a
  new slot gets today;
* **knn**: :func:`models.policy.cold_start.knn_rows`, the similarity-weighted mean of the rows
  of the ``k`` nearest live memories (by memory embedding).

Learning goes on with the traffic served by the checkpoint of the moment (refreshed every
``--refresh`` retrievals, exploration included, as clients serve). After every learner
step the policy *as served* — greedy, no exploration: the top k by ``score·(1 + α·m)``
over the candidates the hard drop keeps — is asked, for fixed evaluation queries of each
new memory's intent, whether the new memory is in its top k. A new memory has *entered*
once it is there for at least half of its intent's evaluation queries. Reported per seed
and initialisation: the share entered at once (step 0) and by the horizon, the median learner
steps to enter (memories that never enter count as the horizon: a lower bound) and the
median over those that entered, the share of
(memory, evaluation query) pairs served in the top k averaged over the steps, and that
share at the horizon. docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from causalmem_lab.offline import OfflineConfig, _snapshot
from causalmem_lab.roles import HELPFUL
from causalmem_lab.simulator import Environment, Scenario, serve
from models.policy.cold_start import knn_rows
from models.policy.network import neutral_rows
from models.policy.trainer import PolicyTrainer
from models.serving.rule import adjusted_logits, keep_dynamic
from pipeline.client.retriever import CausalRetriever
from topics.internal import Experience

INITS = ("fresh", "knn")


def scenario(seed: int, helpful: int) -> Scenario:
    return Scenario(
        seed=seed,
        embedding_dim=64,
        slots=256,
        intents=8,
        background=120,
        helpful_per_intent=helpful,
        drift_day=None,
        queries_per_day=400,
    )


class Bank:
    """The simulator's memories in slot order: live ones first, the held-out new ones last."""

    def __init__(self, env: Environment) -> None:
        self.new = [env.helpful(i)[0] for i in range(env.s.intents)]  # one per intent (env memory index)
        live = [m for m in range(env.n_memories) if m not in set(self.new)]
        self.order = np.array(live + self.new)  # slot → env memory index
        self.n_live = len(live)
        self.memory = env.memory[self.order]
        self.new_slots = np.arange(self.n_live, self.n_live + len(self.new))

    def env_slots(self, slots: list[int]) -> list[int]:
        return [int(self.order[s]) for s in slots]


def _none(query_text: str | None, query_embedding: np.ndarray, k: int) -> list[int]:
    return []  # no text fallback in the simulator: an empty hard drop serves nothing


def retriever(bank: Bank, s: Scenario, n: int) -> CausalRetriever:
    r = CausalRetriever(
        bank.memory[:n], k=s.k, n_candidates=s.n_candidates, temperature=s.temperature, seed=s.seed, fallback=_none
    )
    r.explore_rate, r.explore_temperature = s.explore_rate, s.explore_temperature
    return r


def traffic(env: Environment, bank: Bank, r: CausalRetriever, trainer: PolicyTrainer, queries: int, cfg: Any) -> Any:
    """Serve and learn: yields after every learner step (the trainer's update)."""
    pending: list[Experience] = []
    served = 0
    for _ in range(queries):
        q = env.next_query()
        for step in range(q.steps):
            if served % cfg.refresh_every == 0:
                r.set_policy(_snapshot(trainer, served // cfg.refresh_every + 1))
            served += 1
            res = serve(r, env.step_features(q, step), with_texts=False)
            _, nll_with, nll_without, _ = env.feedback(q.intent, bank.env_slots(res.slots))
            if not res.event.fallback:
                pending.append(Experience(res.event.event_id, "feedback", res.event, nll_without - nll_with))
            if len(pending) >= cfg.batch_size:
                trainer.update(pending)
                pending = []
                yield


def in_served_top_k(trainer: PolicyTrainer, r: CausalRetriever, emb: np.ndarray, slot: int, k: int) -> float:
    """Share of the queries ``emb`` [n, D] whose greedy served top k holds ``slot``."""
    net = trainer.net
    hits = 0
    with torch.no_grad():
        zeros = torch.zeros(emb.shape[0])
        h = net.features(torch.as_tensor(emb), zeros, zeros)
        scores, slots = r.index.search(np.ascontiguousarray(emb, np.float32), r.n_candidates)
        masks = net.candidate_masks(h, torch.as_tensor(slots, dtype=torch.long)).numpy().astype(np.float64)
        alpha = float(net.alpha[0])
    for i in range(emb.shape[0]):
        keep = keep_dynamic(masks[i])
        z = np.where(keep, adjusted_logits(scores[i].astype(np.float64), masks[i], alpha, 1.0), -np.inf)
        top = slots[i][np.argsort(-z, kind="stable")[: min(k, int(keep.sum()))]]
        hits += int(slot in set(top.tolist()))
    return hits / int(emb.shape[0])


def measure(trainer: PolicyTrainer, r: CausalRetriever, bank: Bank, evals: list[np.ndarray], k: int) -> list[float]:
    """Per new memory: the share of its intent's evaluation queries served with it in the top k."""
    return [in_served_top_k(trainer, r, e, int(slot), k) for e, slot in zip(evals, bank.new_slots, strict=True)]


def pretrain(seed: int, args: argparse.Namespace) -> tuple[Scenario, Environment, Bank, PolicyTrainer, Any]:
    """A policy trained on the live memories only (the new ones are not in the index)."""
    s = scenario(seed, args.helpful)
    env = Environment(s)
    bank = Bank(env)
    cfg = OfflineConfig(hidden=64, lr=3e-3, batch_size=32, seed=seed, refresh_every=args.refresh)
    trainer = PolicyTrainer(cfg.trainer(s))
    for _ in traffic(env, bank, retriever(bank, s, bank.n_live), trainer, args.pretrain_queries, cfg):
        pass
    return s, env, bank, trainer, cfg


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    s, env, bank, trainer, cfg = pretrain(seed, args)
    # evaluation queries of each new memory's intent, drawn from a twin of the world
    twin = Environment(s)
    per_intent: dict[int, list[np.ndarray]] = {i: [] for i in range(s.intents)}
    while min(len(v) for v in per_intent.values()) < args.eval_queries:
        q = twin.next_query()
        per_intent[q.intent].append(q.embedding)
    evals = [np.stack(per_intent[i][: args.eval_queries]) for i in range(s.intents)]
    assert all(env.role(bank.new[i], i) == HELPFUL for i in range(s.intents))
    out: dict[str, Any] = {}
    trained, world_then = trainer, env
    for init in INITS:
        # the same trained policy (Adam and baseline state included) and the same traffic for both
        trainer, world = copy.deepcopy(trained), copy.deepcopy(world_then)
        w, b = trainer.net.out.weight, trainer.net.out.bias
        new_emb = bank.memory[bank.new_slots]
        if init == "knn":
            live = np.arange(bank.n_live)
            rows, bias = knn_rows(w, b, bank.memory[: bank.n_live], live, new_emb, k=args.neighbours)
        else:
            rows, bias = neutral_rows(len(bank.new_slots), w.shape[1], torch.Generator().manual_seed(seed))
        # the learner's own path for a new memory's row (its Adam state and statistics cleared)
        trainer.init_rows(bank.new_slots.tolist(), rows.to(w.dtype).detach(), bias.to(b.dtype).detach())
        r = retriever(bank, s, len(bank.order))
        curve = [measure(trainer, r, bank, evals, s.k)]
        for step, _ in enumerate(traffic(world, bank, r, trainer, args.queries, cfg), start=1):
            curve.append(measure(trainer, r, bank, evals, s.k))
            if step >= args.steps:
                break
        c = np.array(curve)  # [steps + 1, intents]
        entered = c >= 0.5
        first = np.where(entered.any(axis=0), entered.argmax(axis=0), c.shape[0]).astype(float)
        out[init] = {
            "entered_at_0": float(entered[0].mean()),
            "median_steps": float(np.median(first)),
            "median_steps_entered": float(np.median(first[first < c.shape[0]])) if (first < c.shape[0]).any() else None,
            "entered_by_end": float(entered.any(axis=0).mean()),
            "in_top_k_at_end": float(c[-1].mean()),
            "in_top_k_mean": float(c.mean()),
            "steps": int(c.shape[0] - 1),
            "first_step": first.tolist(),
        }
    return out


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--pretrain-queries", type=int, default=2000, help="queries served before the new memories")
    p.add_argument("--steps", type=int, default=150, help="learner steps measured after the new memories arrive")
    p.add_argument("--queries", type=int, default=5000, help="at most this many queries after the arrival")
    p.add_argument("--neighbours", type=int, default=5, help="k of the kNN initialisation")
    p.add_argument("--helpful", type=int, default=3, help="helpful memories per intent (one of them is new)")
    p.add_argument("--eval-queries", type=int, default=16, help="evaluation queries per intent")
    p.add_argument("--refresh", type=int, default=300, help="retrievals between checkpoint refreshes")
    p.add_argument("--quick", action="store_true", help="a small run (used by the tests)")
    p.add_argument("--out", help="write the report as JSON here")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.seeds, args.pretrain_queries, args.steps, args.eval_queries = [0], 300, 5, 4
    torch.set_num_threads(1)
    t0 = time.time()
    report: dict[str, Any] = {"seeds": {str(seed): run_seed(seed, args) for seed in args.seeds}}
    report["seconds"] = time.time() - t0
    print(
        f"{'seed':>4} {'init':>6} {'at step 0':>10} {'entered':>8} {'median steps':>13} {'of those':>9} "
        f"{'top-k mean':>11} {'top-k at end':>13}"
    )
    for seed, by_init in report["seeds"].items():
        for init in INITS:
            r = by_init[init]
            entered = "-" if r["median_steps_entered"] is None else f"{r['median_steps_entered']:.0f}"
            print(
                f"{seed:>4} {init:>6} {r['entered_at_0']:>10.0%} {r['entered_by_end']:>8.0%} "
                f"{r['median_steps']:>13.0f} {entered:>9} {r['in_top_k_mean']:>11.0%} {r['in_top_k_at_end']:>13.0%}"
            )
    print(f"{report['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0
