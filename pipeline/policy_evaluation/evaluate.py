"""``causalmem evaluate``: off-policy estimates of policies from logged events.

Like an offline-evaluation report: for the last ``--window`` joined experiences, the
estimated mean utility — with a 95% bootstrap interval and the effective sample size —
of the serving policy, the latest candidate, similarity-only retrieval (plain top-k, as a
client without the policy serves it) and uniform random choice over the candidates, the
policies **as clients serve them** (the serving
parameters recorded in the serving manifest, else the defaults: :mod:`models.serving.params`);
the serving and candidate versions are full snapshots or deltas (rebuilt from their chain),
by standard slate IPS, its self-normalised form, the pseudo-inverse estimator and slate
doubly robust estimation (:mod:`models.offpolicy.served`), as the promotion gate sees them. The
logged (on-policy) mean utility is shown for reference.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from models.offpolicy.logged import TOPK, LoggedDecisions, Served
from models.offpolicy.served import SLATE_METHODS, SlateLog, evaluate_served
from models.policy.network import PolicyNetwork
from models.serving.params import ServingParams
from pipeline import kafka
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.config import Connection, Settings
from pipeline.modeltopic import scan_model_topic
from topics.fields import Rejected
from topics.internal import Experience, decode_experience

METHODS: tuple[str, ...] = SLATE_METHODS
WINDOW = 2000  # the last joined experiences an evaluation reads, unless told otherwise


async def experiences_tail(bootstrap: str, conn: Connection, window: int) -> list[Experience]:
    """The policy's last ``window`` feedback experiences (fallbacks left out) on the experiences topic."""
    topic = conn.topics.experiences.name
    end = await kafka.high_watermark(bootstrap, conn, topic)
    msgs = await kafka.read_all(bootstrap, conn, topic, partitions=[0], start={0: max(0, end - 2 * window)})
    out = []
    for msg in msgs:
        try:
            exp = decode_experience(msg.value, conn.limits)
        except Rejected:
            continue
        if exp.kind == "feedback" and not exp.event.fallback and exp.event.policy == conn.policy:
            out.append(exp)
    return out[-window:]


async def evaluate_window(
    bootstrap: str,
    conn: Connection | Settings,
    window: int,
    methods: tuple[str, ...],
    params: ServingParams | None = None,
) -> dict[str, Any]:
    """The report of ``causalmem evaluate``: estimates per policy and method over the last ``window`` steps.

    Every policy is evaluated as served by ``params`` (default: the serving manifest's
    serving parameters, else :class:`ServingParams`'s defaults).
    """
    conn = Connection.of(conn)
    topic = conn.topics.policy_checkpoints.name
    exps = await experiences_tail(bootstrap, conn, window)
    index = await scan_model_topic(bootstrap, conn, topic)
    policies: dict[str, Any] = {}
    versions: dict[str, int | None] = {}
    # Full snapshots or deltas (contract 1.3): a delta's version is rebuilt from its chain.
    serving_manifest = index.serving_head(conn.policy)
    if params is None:
        params = ServingParams.from_wire(serving_manifest.serving if serving_manifest is not None else None)
        # Each network below is valued as served with these parameters; a probe over a certified
        # version (contract 1.23) names a version it serves on the rest, not one of them.
        params = dataclasses.replace(params, base=None)
    for role, manifest in (
        ("serving", serving_manifest),
        ("candidate", index.candidate_head(conn.policy)),
    ):
        if manifest is None or (
            role == "candidate" and "serving" in versions and manifest.version <= (versions["serving"] or 0)
        ):
            continue
        tensors = await fetch_checkpoint(bootstrap, conn, index, manifest, topic)
        policies[role] = PolicyNetwork.from_tensors(tensors).eval()
        versions[role] = manifest.version
    policies["similarity-only"] = TOPK  # plain top-k, as the gate compares (docs/learning.md)
    policies["uniform"] = "uniform"
    report: dict[str, Any] = {
        "policy": conn.policy,
        "decisions": len(exps),
        "versions": versions,
        "estimates": {},
    }
    if not exps:
        return report
    report["serving_params"] = params.to_wire()  # how every policy below is evaluated
    decisions = LoggedDecisions.from_experiences(exps)
    report["logged_mean_utility"] = float(np.mean([e.utility for e in exps]))
    served = {name: Served(p, params) for name, p in policies.items()}
    slogs = {moments: SlateLog.prepare(decisions, moments=moments) for moments in {m in ("pi", "dr") for m in methods}}
    for method in methods:
        slog = slogs[method in ("pi", "dr")]
        if len(slog) == 0:  # no event carries candidate_probs: pi and dr cannot be computed
            continue
        results = evaluate_served(slog, served, method)
        for name, est in results.items():
            report["estimates"].setdefault(name, {})[method] = {
                "value": est.value,
                "low": est.low,
                "high": est.high,
                "ess": est.ess,
                "clipped_share": est.clipped_share,
            }
    return report


def _num(x: float) -> str:
    """An estimate for the table; one that cannot be computed (NaN, e.g. no weight on any decision) is "–".

    >>> _num(0.25), _num(float("nan"))
    ('+0.2500', '–')
    """
    return f"{x:+.4f}" if np.isfinite(x) else "–"


def print_report(report: dict[str, Any]) -> None:
    """The report as a table: one row per policy, a value with its 95% interval and the ESS per method."""
    c = Console()
    if not report["decisions"]:
        c.print(f"no logged experiences of policy {report['policy']!r} yet")
        return
    t = Table(
        title=f"off-policy evaluation over the last {report['decisions']:,} logged steps "
        f"(logged mean utility {report['logged_mean_utility']:+.4f}), each policy as served: "
        + ", ".join(f"{k} {v}" for k, v in report["serving_params"].items()),
        title_justify="left",
    )
    t.add_column("policy")
    t.add_column("version", justify="right")
    methods = sorted({m for e in report["estimates"].values() for m in e}, key=METHODS.index)
    for m in methods:
        t.add_column(f"{m.upper()} (95% CI)", justify="right")
        t.add_column("ESS", justify="right")
    for name, per in report["estimates"].items():
        row = [name, str(report["versions"].get(name, "")) or "–"]
        for m in methods:
            e = per[m]
            row += [f"{_num(e['value'])} [{_num(e['low'])}, {_num(e['high'])}]", f"{e['ess']:,.0f}"]
        t.add_row(*row)
    c.print(t)
    sys.stdout.flush()
