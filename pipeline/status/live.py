"""The live part of ``causalmem status``: what the workers' and learners' ``/metrics`` say.

Each view is built from one scrape (:func:`pipeline.promtext.scrape`); rates come from the
change of counters between two scrapes of the same process.
"""

from __future__ import annotations

from typing import Any

from pipeline.metrics import HEALTH_BANDS
from pipeline.promtext import finite, labelled, metric

# Counters whose rates the live view reports: (label in the output, metric name).
WORKER_RATES = (("joins_per_s", "causalmem_joins_total"), ("events_in_per_s", "causalmem_events_in_total"))
LEARNER_RATES = (
    ("updates_per_s", "causalmem_learner_updates_total"),
    ("experiences_per_s", "causalmem_learner_experiences_total"),
)


def strip_prefix(topic: str, prefix: str) -> str:
    """A topic's name without the deployment's prefix (how the views name topics)."""
    return topic[len(prefix) :] if prefix and topic.startswith(prefix) else topic


def counter_rates(
    now_values: dict[str, float],
    prev: tuple[float, dict[str, float]] | None,
    t: float,
    names: tuple[tuple[str, str], ...],
) -> dict[str, float | None]:
    """Per-second rates of counters since the previous scrape ``prev`` (time, values); None without one."""
    out: dict[str, float | None] = {key: None for key, _ in names}
    if prev is None or not prev[1] or not now_values or t <= prev[0]:
        return out
    for key, name in names:
        delta = metric(now_values, name) - metric(prev[1], name)
        out[key] = max(0.0, delta) / (t - prev[0])  # a restarted process resets its counters
    return out


def consumer_lag(values: dict[str, float], prefix: str) -> dict[str, int]:
    """A process's consumer lag in messages, per topic."""
    lag = labelled(values, "causalmem_consumer_lag_messages", "topic")
    return {strip_prefix(t, prefix): int(v) for t, v in lag.items()}


def worker_view(url: str, values: dict[str, float], rates: dict[str, float | None], prefix: str) -> dict[str, Any]:
    """A worker's health, correlation, joins, queue and lag (``up: False`` when the scrape got nothing)."""
    if not values:
        return {"url": url, "up": False}
    bands = labelled(values, "causalmem_memory_health_band", "band")
    band = next((b for b in HEALTH_BANDS if bands.get(b) == 1.0), None)
    # The score gauge reads 0 until the worker's first health computation sets a band.
    score = metric(values, "causalmem_memory_health_score") if band is not None else None
    reference = metric(values, "causalmem_utility_rating_correlation_reference")
    return {
        "url": url,
        "up": True,
        "health_score": score,
        "health_band": band,
        "correlation": finite(metric(values, "causalmem_utility_rating_correlation")),
        "correlation_pairs": int(metric(values, "causalmem_utility_rating_pairs")),
        # The gauge reads 0 until the drift trigger has a reference: 0 is shown as "none yet".
        "correlation_reference": reference if reference != 0.0 else None,
        "joins_total": metric(values, "causalmem_joins_total"),
        "join_pending": metric(values, "causalmem_join_pending"),
        "partitions_owned": int(metric(values, "causalmem_partitions_owned", stage="join")),
        "dead_letters_total": metric(values, "causalmem_dead_letter_total"),
        "al_samples_total": metric(values, "causalmem_al_samples_total"),
        "consumer_lag": consumer_lag(values, prefix),
        "ready": _flag(values, "causalmem_ready"),
        "memories": memory_view(values),
        **rates,
    }


def _flag(values: dict[str, float], name: str) -> bool | None:
    """A 0/1 gauge set at each heartbeat, as a bool.

    None when the process has not beaten yet (the gauges still read their initial 0) or
    does not export it (an older version).
    """
    if name not in values or not metric(values, "causalmem_heartbeat_timestamp_seconds"):
        return None
    return values[name] == 1.0


def learner_view(url: str, values: dict[str, float], rates: dict[str, float | None], prefix: str) -> dict[str, Any]:
    """A learner's baseline, loss, counters, checkpoint versions and lag (``up: False`` when unreachable)."""
    if not values:
        return {"url": url, "up": False}
    return {
        "url": url,
        "up": True,
        "baseline": metric(values, "causalmem_learner_baseline"),
        "loss": finite(metric(values, "causalmem_learner_loss")),
        "updates_total": metric(values, "causalmem_learner_updates_total"),
        "experiences_total": metric(values, "causalmem_learner_experiences_total"),
        "resets_total": metric(values, "causalmem_learner_resets_total"),
        "checkpoint_version": {
            role: int(v) for role, v in labelled(values, "causalmem_checkpoint_version", "role").items()
        },
        "consumer_lag": consumer_lag(values, prefix),
        "gate": gate_view(values),
        # pipeline/learner/freeze.py: serving standing still while candidates come (0 without the gate)
        "seconds_since_promotion": metric(values, "causalmem_learner_seconds_since_promotion"),
        "candidates_waiting": int(metric(values, "causalmem_learner_candidates_waiting")),
        "training_alive": _flag(values, "causalmem_learner_training_alive"),
        "elected": _flag(values, "causalmem_learner_elected"),
        "ready": _flag(values, "causalmem_ready"),
        "memories": memory_view(values),
        **rates,
    }


def memory_view(values: dict[str, float], n: int = 5) -> dict[str, Any] | None:
    """The learner's most harmful and most helpful memories (``causalmem_memory_effect``),
    ``n`` each, worst and best first; None when it exports none (no per-memory credit yet).

    >>> v = {"causalmem_memories_measured": 2.0,
    ...      "causalmem_memory_effect{bound=mean,side=harmful,slot=7}": -0.4,
    ...      "causalmem_memory_effect{bound=low,side=harmful,slot=7}": -0.6,
    ...      "causalmem_memory_effect{bound=high,side=harmful,slot=7}": -0.2,
    ...      "causalmem_memory_reads{kind=reads,side=harmful,slot=7}": 12.0,
    ...      "causalmem_memory_reads{kind=effects,side=harmful,slot=7}": 9.0}
    >>> memory_view(v)["harmful"]
    [{'slot': 7, 'mean': -0.4, 'low': -0.6, 'high': -0.2, 'reads': 12, 'effects': 9}]
    """
    slots = labelled(values, "causalmem_memory_reads", "slot")
    if not slots and not metric(values, "causalmem_memories_measured"):
        return None
    out: dict[str, Any] = {"measured": int(metric(values, "causalmem_memories_measured"))}
    for side in ("harmful", "helpful"):
        rows = []
        for slot in slots:
            reads = metric(values, "causalmem_memory_reads", slot=slot, side=side, kind="reads")
            if not reads:
                continue
            row: dict[str, Any] = {"slot": int(slot)}
            for bound in ("mean", "low", "high"):
                row[bound] = finite(metric(values, "causalmem_memory_effect", slot=slot, side=side, bound=bound))
            row["reads"] = int(reads)
            row["effects"] = int(metric(values, "causalmem_memory_reads", slot=slot, side=side, kind="effects"))
            rows.append(row)
        rows.sort(key=lambda r: (r["mean"] if side == "harmful" else -r["mean"]) if r["mean"] is not None else 0.0)
        out[side] = rows[:n]
    return out


def gate_view(values: dict[str, float]) -> dict[str, Any] | None:
    """The promotion gate's last decision and its effective sample size (None before the first).

    >>> gate_view({"causalmem_gate_decision{decision=insufficient}": 1.0, "causalmem_gate_ess": 38.0,
    ...            "causalmem_gate_ess_needed": 200.0})
    {'decision': 'insufficient', 'ess': 38.0, 'ess_needed': 200.0}
    """
    last = labelled(values, "causalmem_gate_decision", "decision")
    decision = next((d for d, v in last.items() if v == 1.0), None)
    if decision is None:
        return None
    return {
        "decision": decision,
        "ess": metric(values, "causalmem_gate_ess"),
        "ess_needed": metric(values, "causalmem_gate_ess_needed"),
    }


def health_summary(workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The worst health score among reachable workers (each computes its own)."""
    up = [w for w in workers if w.get("up") and w.get("health_score") is not None]
    if not up:
        return None
    worst = min(up, key=lambda w: w["health_score"])
    return {
        "score": worst["health_score"],
        "band": worst["health_band"],
        "correlation": worst["correlation"],
        "correlation_pairs": worst["correlation_pairs"],
        "correlation_reference": worst["correlation_reference"],
        "from": worst["url"],
    }
