"""The soak's report (a Markdown summary) and plot.

RSS slopes are least-squares fits (``numpy.polyfit``) in MB/min, over the whole phase and
over its second half. The embedded broker keeps every message in RAM, so its slope is
expected to be about the bytes written per minute: the input, plus the ``experiences`` that
carry each retrieval event again, plus outcomes and the worker's table changelogs. The
worker's join state is bounded by the join window, but its faust tables keep per-query state
for ``label_window_s`` of event time (default one day): ``query-utility`` for every query and,
for each error candidate (utility below ``al_threshold``; about 20 % of the synthetic pairs),
its whole retrieval event in ``al-pending`` until a verdict arrives, so those tables grow until
their caps (``query_state_max``/``al_pending_max`` entries, ``query_state_max_bytes``/
``al_pending_max_bytes``) or the window, whichever comes first; on the default RocksDB store
they grow on disk, not in the worker's RSS. A process is flat when its RSS stays within ±10 %
of its mean after the first third of the phase. The learner's replay buffer (``replay_max``
experiences) and dedupe set grow until their caps, then stay flat. The RSS of every process
after the whole run is reported too.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np


def phase_line(p: dict[str, Any]) -> str:
    b = p["lag"]["backlog"]
    caught = "never" if p["caught_up_s"] is None else f"{p['caught_up_s']:.1f} s"
    verdict = "sustainable" if p["sustainable"] else "NOT sustainable: " + "; ".join(p["reasons"])
    return (
        f"  [{p['label']}] target {p['target_pairs_per_s']:,.0f} pairs/s, achieved {p['achieved_pairs_per_s']:,.1f}; "
        f"backlog max {b['max']:,.0f}; caught up after {caught}: {verdict}"
    )


def _f(x: float | None, fmt: str = ",.0f") -> str:
    return "–" if x is None else format(x, fmt)


def _verdict(p: dict[str, Any], bold: bool = False) -> str:
    word = "sustainable" if p["sustainable"] else "NOT sustainable"
    text = f"**{word}**" if bold else word
    return text if p["sustainable"] else f"{text}: " + "; ".join(p["reasons"])


def report(r: dict[str, Any]) -> str:
    c, m, st = r["config"], r["machine"], r["steady"]
    lines = [
        f"Soak on {m['cpus']} CPUs (load average at start {m['loadavg_start']}, "
        f"end {m.get('loadavg_end', '–')}); D={c['embedding_dim']}, S={c['slots']}, hidden {c['hidden']}, "
        f"{c['partitions']} partitions, batch {c['batch_size']}, gate {'on' if c['gate'] else 'off'}, "
        f"join window {c['join_window_s']:g} s, checkpoints every {c['checkpoint_interval_s']:g} s; "
        f"broker {c['broker']}.",
        "",
        f"### Steady phase: {st['target_pairs_per_s']:,.0f} pairs/s for {st['duration_s']:.0f} s",
        "",
        "| measure | value |",
        "|---|---|",
        f"| target input rate | {st['target_pairs_per_s']:,.0f} pairs/s ({2 * st['target_pairs_per_s']:,.0f} msg/s) |",
        f"| achieved input rate | {st['achieved_pairs_per_s']:,.1f} pairs/s "
        f"({st['achieved_input_per_s']:,.1f} msg/s) |",
        f"| pairs produced / joined / applied | {st['produced_pairs']:,.0f} / "
        f"{st['samples'][-1]['joined']:,.0f} / {st['samples'][-1]['applied']:,.0f} |",
        f"| input bytes | {st['input_mb_per_min']:,.1f} MB/min |",
        f"| caught up after the phase | {_f(st['caught_up_s'], '.1f')} s (limit {st['drain_limit_s']:g} s) |",
        f"| unmatched events expired | {st['join_expired']:,.0f} |",
        f"| verdict | {_verdict(st, bold=True)} |",
        "",
        "| stage lag | unit | mean | max | mean, first third | mean, last third | limit | bounded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    titles = {
        "worker_lag": "join (worker)",
        "learner_lag": "learner (experiences topic)",
        "backlog": "end to end (produced − applied)",
    }
    for name, lag in st["lag"].items():
        lines.append(
            f"| {titles[name]} | {lag['unit']} | {lag['mean']:,.1f} | {lag['max']:,.0f} | "
            f"{lag['first_third_mean']:,.0f} | {lag['last_third_mean']:,.0f} | {lag['limit']:,.0f} | "
            f"{'yes' if lag['bounded'] else 'NO'} |"
        )
    lines += [
        "",
        "| process | RSS start MB | RSS end MB | RSS max MB | slope MB/min | slope, 2nd half MB/min "
        "| after warm-up: mean MB, spread | flat (±10 %) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for proc, x in st["rss"].items():
        dev = x.get("after_warmup_spread")
        flat = x.get("flat")
        lines.append(
            f"| {proc} | {x['start_mb']:,.0f} | {x['end_mb']:,.0f} | {x['max_mb']:,.0f} | "
            f"{_f(x['slope_mb_per_min'], '+,.1f')} | {_f(x['slope_second_half_mb_per_min'], '+,.1f')} | "
            f"{_f(x.get('after_warmup_mean_mb'), ',.0f')}, ±{_f(None if dev is None else 100 * dev, '.1f')} % | "
            f"{'—' if flat is None else 'yes' if flat else 'NO'} |"
        )
    broker = st["rss"].get("broker")
    lines += [
        "",
        f"The embedded broker keeps every message in RAM: its slope is expected to be about the "
        f"bytes written per minute, here {st['input_mb_per_min']:,.1f} MB/min of input plus the `experiences` "
        f"that carry each retrieval event again (≈ 2× the input)"
        + (
            f"; measured {broker['slope_mb_per_min']:+,.1f} MB/min "
            f"({broker['slope_mb_per_min'] / st['input_mb_per_min']:.1f}× the input)."
            if broker and broker["slope_mb_per_min"] is not None and st["input_mb_per_min"] > 0
            else "."
        )
        + f" The worker's join state is bounded by the {c['join_window_s']:g} s join window, but its tables keep "
        f"per-query state for label_window_s = {c.get('label_window_s', 86400.0):,.0f} s of event time: the "
        f"utility sum of every query and, for each error candidate (utility < {c.get('al_threshold', -0.3):g}: "
        f"{c.get('error_candidate_share', 0.0):.0%} of these pairs), its whole retrieval event until a verdict "
        f"arrives. Those tables are on the {c.get('worker_store', 'memory')} store"
        + (
            " (on disk: the worker's RSS holds only RocksDB's write buffers and block caches)"
            if c.get("worker_store") == "rocksdb"
            else " (in the worker's RSS)"
        )
        + f" and grow until their caps (query_state_max = {c.get('query_state_max', 500_000):,} entries and "
        f"{c.get('query_state_max_bytes', 0) / 2**20:,.0f} MiB, al_pending_max = {c.get('al_pending_max', 20_000):,} "
        f"events and {c.get('al_pending_max_bytes', 0) / 2**20:,.0f} MiB) or the window, whichever comes first. "
        f"The learner's replay buffer ({c['replay_max']:,} "
        "experiences) and dedupe set grow until their caps, then stay flat.",
    ]
    end = r.get("processes_rss_end_mb")
    if end:
        lines += [
            "",
            f"RSS after the whole run ({r.get('pairs_total', 0):,} pairs in all): "
            + ", ".join(f"{k} {v:,.0f} MB" for k, v in end.items())
            + ".",
        ]
    search = r.get("search")
    if search:
        lines += [
            "",
            f"### Max-rate search ({search['step_seconds']:g} s phases; sustainable = rate reached, lag bounded, "
            f"≥ {search['keep_up']:.0%} applied {search['grace_s']:g} s after the phase)",
            "",
            "| phase | target pairs/s | achieved pairs/s | backlog max | backlog mean, first / last third | "
            "applied after the grace | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, p in enumerate(search["phases"], 1):
            b = p["lag"]["backlog"]
            lines.append(
                f"| {i} | {p['target_pairs_per_s']:,.0f} | {p['achieved_pairs_per_s']:,.1f} | {b['max']:,.0f} | "
                f"{b['first_third_mean']:,.0f} / {b['last_third_mean']:,.0f} | {p['applied_fraction']:.1%} | "
                f"{_verdict(p)} |"
            )
        lo, hi = search["max_sustainable_pairs_per_s"], search["first_unsustainable_pairs_per_s"]
        lines += [
            "",
            f"**Maximum sustainable rate: {_f(lo)} pairs/s = {_f(None if lo is None else 2 * lo)} input messages/s** "
            f"(first unsustainable: {_f(hi)} pairs/s)"
            + (f"; stopped: {search['stopped']}" if search["stopped"] else ""),
        ]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = r["steady"]
    t = [s["t"] for s in st["samples"]]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax1.plot(t, [s["worker_lag"] for s in st["samples"]], label="worker lag (input msgs)")
    ax1.plot(t, [s["learner_lag"] for s in st["samples"]], label="learner lag (experiences)")
    ax1.plot(t, [s["backlog"] for s in st["samples"]], label="backlog (pairs)")
    ax1.axvline(st["duration_s"], color="grey", ls=":")
    ax1.set_ylabel("messages")
    ax1.legend()
    ax1.set_title(f"soak: {st['target_pairs_per_s']:,.0f} pairs/s")
    for proc in st["rss"]:
        ax2.plot(t, [s["rss_mb"].get(proc, np.nan) for s in st["samples"]], label=proc)
    ax2.set_ylabel("RSS MB")
    ax2.set_xlabel("s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
