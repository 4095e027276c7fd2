"""``causalmem evaluate --shadow``: the policy's estimated gain over the incumbent, and the cut-over.

In shadow mode (:mod:`pipeline.client.shadow`, docs/byo-retriever.md) the incumbent
retriever serves; only its exploration budget is logged as ordinary (non-fallback)
retrieval events, in a uniformly random order with its true propensity. From the last
``--window`` of those joined steps, this module estimates V(serving policy) −
V(incumbent) with an interval (a paired bootstrap, :func:`models.offpolicy.estimators.gain`). The
incumbent is its own ranking: the similarity order at a near-zero temperature
(``ShadowConfig.incumbent_temperature``), i.e. its top k.

With ``--cutover-after SECONDS``, the verb keeps estimating every ``--watch`` seconds;
once the lower bound has stayed above 0 for that long (over at least ``min_decisions``
steps) it sends a ``cutover`` control event (docs/contract.md) and waits for the
learner's checkpoint of reason ``cutover``, which switches the adapters to the policy.

:func:`shadow_gain` is the one call into the estimators, so another estimator can be
swapped in there.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.offpolicy.estimators import Estimate, Method, gain
from models.offpolicy.logged import LoggedDecisions, Tempered
from models.policy.network import PolicyNetwork
from pipeline import kafka
from pipeline.client.subscriber import fetch_checkpoint
from pipeline.config import Connection, Settings, ShadowConfig
from pipeline.modeltopic import ModelTopicIndex, scan_model_topic
from pipeline.policy_evaluation.evaluate import experiences_tail
from topics.fields import encode
from topics.internal import CUTOVER_COMMAND, Control
from topics.signing import Key


def shadow_gain(decisions: LoggedDecisions, policy: PolicyNetwork, config: ShadowConfig) -> Estimate:
    """V(policy) − V(incumbent) from the exploration log, with a ``config.level`` interval."""
    method: Method = config.method  # type: ignore[assignment]
    incumbent = Tempered("similarity", config.incumbent_temperature)
    return gain(decisions, policy, incumbent, method=method, level=config.level)


@dataclass
class CutoverRule:
    """Fires once the gain's lower bound has stayed above 0 for ``period_s`` over ≥ ``min_decisions`` steps.

    >>> rule = CutoverRule(period_s=10.0, min_decisions=5)
    >>> est = Estimate(0.2, 0.05, 0.3, 40.0, 50, "snips-gain", 0.0)
    >>> rule.observe(est, 0.0), rule.observe(est, 9.0), rule.observe(est, 10.0)
    (False, False, True)
    >>> rule.observe(Estimate(0.2, -0.01, 0.3, 40.0, 50, "snips-gain", 0.0), 11.0), rule.since
    (False, None)
    """

    period_s: float
    min_decisions: int
    since: float | None = None

    def observe(self, estimate: Estimate | None, now: float) -> bool:
        if estimate is None or estimate.n < self.min_decisions or not estimate.low > 0:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        return now - self.since >= self.period_s


def cutover_manifest(index: ModelTopicIndex, policy: str) -> Any:
    """The newest checkpoint of ``policy`` with reason ``cutover`` (a full snapshot or a delta), or None
    (still in shadow mode)."""
    found = [m for m in index.links(policy) if m.reason == CUTOVER_COMMAND]
    return found[-1] if found else None


async def shadow_report(
    bootstrap: str, conn: Connection | Settings, window: int, config: ShadowConfig | None = None
) -> dict[str, Any]:
    """Mode, decisions and the gain estimate (value, interval, ESS) of the serving policy over the incumbent."""
    conn = Connection.of(conn)
    config = config or ShadowConfig()
    topic = conn.topics.policy_checkpoints.name
    index = await scan_model_topic(bootstrap, conn, topic)
    cut = cutover_manifest(index, conn.policy)
    serving = index.serving_head(conn.policy)  # a full snapshot or a delta (rebuilt from its chain)
    exps = await experiences_tail(bootstrap, conn, window)
    report: dict[str, Any] = {
        "policy": conn.policy,
        "mode": "policy" if cut is not None else "shadow",
        "cutover_version": cut.version if cut is not None else None,
        "serving_version": serving.version if serving is not None else None,
        "decisions": len(exps),
        "gain": None,
    }
    if serving is None or not exps:
        return report
    net = PolicyNetwork.from_tensors(await fetch_checkpoint(bootstrap, conn, index, serving, topic)).eval()
    est = shadow_gain(LoggedDecisions.from_experiences(exps), net, config)
    report["gain"] = {
        "value": est.value,
        "low": est.low,
        "high": est.high,
        "level": config.level,
        "ess": est.ess,
        "n": est.n,
        "method": est.method,
    }
    return report


def estimate_of(report: dict[str, Any]) -> Estimate | None:
    g = report.get("gain")
    if not g:
        return None
    return Estimate(g["value"], g["low"], g["high"], g["ess"], g["n"], g["method"], 0.0)


async def send_cutover(
    bootstrap: str,
    conn: Connection | Settings,
    report: dict[str, Any],
    reason: str,
    *,
    by: str = "",
    key: Key | None = None,
) -> Control:
    """Record the cut-over on the ``control`` topic, with the estimate that justified it; ``by``
    and ``key``: the operator who asks and the key whose signature proves it (contract 1.16)."""
    conn = Connection.of(conn)
    details: dict[str, Any] = {"gain": report.get("gain"), "serving_version": report.get("serving_version")}
    if by:
        details["by"] = by
    ctl = Control(CUTOVER_COMMAND, time.time(), reason, details, id=f"cutover-{uuid.uuid4().hex}")
    await kafka.send_control(bootstrap, conn, encode(ctl.to_dict()), key)
    return ctl


async def watch(
    bootstrap: str,
    conn: Connection | Settings,
    window: int,
    config: ShadowConfig,
    interval_s: float,
    show: Callable[[dict[str, Any]], None],
    timeout_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    *,
    by: str = "",
    key: Key | None = None,
) -> dict[str, Any]:
    """Estimate every ``interval_s``; cut over when :class:`CutoverRule` fires; returns the last report.

    Without ``config.cutover_period_s`` it only reports, until ``timeout_s``. After sending
    the control event (as ``by``, signed with ``key``: :func:`send_cutover`) it waits (up to
    ``timeout_s``) for the learner's ``cutover`` checkpoint.
    """
    conn = Connection.of(conn)
    rule = CutoverRule(config.cutover_period_s, config.min_decisions) if config.cutover_period_s is not None else None
    start = clock()
    report = await shadow_report(bootstrap, conn, window, config)
    while True:
        show(report)
        if report["mode"] == "policy":
            return report
        if rule is not None and rule.observe(estimate_of(report), clock()):
            await send_cutover(
                bootstrap,
                conn,
                report,
                f"shadow gain lower bound > 0 for {rule.period_s:g} s over {report['decisions']}",
                by=by,
                key=key,
            )
            rule = None  # sent once; now wait for the learner's checkpoint
        if timeout_s is not None and clock() - start >= timeout_s:
            return report
        await asyncio.sleep(interval_s)
        report = await shadow_report(bootstrap, conn, window, config)


def format_report(report: dict[str, Any]) -> str:
    """One line for the terminal (and ``status``).

    >>> format_report({"policy": "p", "mode": "shadow", "decisions": 0, "gain": None, "cutover_version": None})
    "policy 'p': shadow mode, no estimate yet (0 exploration steps)"
    """
    head = f"policy {report['policy']!r}: "
    if report["mode"] == "policy":
        head += f"serving the policy since the cut-over (v{report['cutover_version']})"
    else:
        head += "shadow mode"
    g = report.get("gain")
    if not g:
        return head + f", no estimate yet ({report['decisions']} exploration steps)"
    pct = round(100 * g["level"])
    return (
        head + f", gain over the incumbent {g['value']:+.4f} [{g['low']:+.4f}, {g['high']:+.4f}] "
        f"({pct}% interval, {g['method']}, ESS {g['ess']:,.0f}, {g['n']} steps, serving v{report['serving_version']})"
    )
