"""How ``causalmem status`` shows a snapshot: rich tables, a live view with ``--watch``, or JSON lines.

A snapshot is the dict :meth:`pipeline.status.collect.StatusCollector.snapshot` returns;
:func:`render` draws it one section at a time (header, checkpoints, live metrics, queues,
errors), each section from its part of the snapshot only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import orjson
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pipeline import kafka
from pipeline.status.collect import StatusCollector

BAND_STYLE = {"efficient": "bold green", "healthy": "green", "warning": "yellow", "critical": "bold red"}
CHECKPOINT_COLUMNS = (
    ("", "left"),
    ("version", "right"),
    ("reason", "left"),
    ("age", "right"),
    ("baseline", "right"),
    ("alpha", "right"),
    ("updates", "right"),
    ("experiences", "right"),
)


def fmt_age(seconds: float | None) -> str:
    """A short age: seconds, then minutes, hours or days with the next unit.

    >>> [fmt_age(x) for x in (None, 5, 75, 7300, 90000)]
    ['-', '5s', '1m 15s', '2h 01m', '1d 01h']
    """
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d {int(s % 86400 // 3600):02d}h"


def _num(x: Any, fmt: str = "{:,.3f}") -> str:
    """A table cell: ``-`` for nothing, thousands separators for integers, ``fmt`` for floats."""
    if x is None:
        return "-"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    if isinstance(x, float):
        return fmt.format(x)
    return str(x)


# --------------------------------------------------------------------------- sections


def render(s: dict[str, Any]) -> Group:
    """The whole view of one snapshot."""
    parts: list[Any] = [_header(s), _checkpoints(s.get("checkpoints") or {})]
    parts.extend(freeze_text((s.get("checkpoints") or {}).get("freeze")))
    lag = s.get("learner_lag")
    if lag and not lag.get("missing"):
        parts.append(_learner_lag(lag))
    live = _live(s)
    if live.row_count:
        parts.append(live)
    parts.append(_queues(s.get("active_learning") or {}, s.get("dead_letter") or {}))
    if s.get("do_not_use"):
        parts.append(do_not_use_text(s["do_not_use"]))
    if s.get("principals") and (s["principals"].get("principals") or s["principals"].get("quarantined")):
        parts.append(principals_text(s["principals"]))
    if s.get("shadow"):  # `status --shadow`: the line comes formatted (pipeline/policy_evaluation/shadow.py)
        parts.append(Text(f"shadow: {s['shadow']['line']}"))
    parts.extend(Text(f"! {err}", style="red") for err in s.get("errors", []))
    return Group(*parts)


def do_not_use_text(d: dict[str, Any]) -> Text:
    """Suppressed memories, the newest audit entry and open proposals, in one line each.

    >>> print(do_not_use_text({"suppressed": [4], "audit": [{"command": "suppress", "slots": [4], "by": "ops",
    ...     "ts": 0.0, "reason": "leaks"}], "proposals": {"open": 1, "memories": [{"slot": 9, "marks": 2,
    ...     "labelers": 2, "last_ts": 0.0}]}}).plain.splitlines()[0])
    do not use: suppressed [4]; last: suppress [4] by ops (leaks)
    """
    audit = d.get("audit") or []
    last = audit[0] if audit else None
    line = f"do not use: suppressed {d.get('suppressed') or 'none'}"
    if last:
        line += f"; last: {last['command']} {last['slots']} by {last['by'] or '?'}"
        line += f" ({last['reason']})" if last.get("reason") else ""
    proposals = d.get("proposals")
    if proposals and proposals["open"]:
        shown = ", ".join(f"{m['slot']} ({m['marks']} marks, {m['labelers']} labelers)" for m in proposals["memories"])
        line += f"\nlabelers propose (causalmem suppress to act): {proposals['open']} memories: {shown}"
    return Text(line)


def principals_text(v: dict[str, Any]) -> Text:
    """Who the learner hears from (contract 1.15): the flagged principals (red), the quarantined, the largest shares.

    >>> v = {"principals": [{"name": "bot-9", "share": 0.25, "weight": 0.8, "n": 120,
    ...     "residual": -0.9, "low": -1.1, "high": -0.7, "flagged": True, "quarantined": False},
    ...     {"name": "svc-a", "share": 0.75, "weight": 1.0, "n": 400, "residual": 0.0, "low": -0.1, "high": 0.1,
    ...     "flagged": False, "quarantined": False}], "flagged": ["bot-9"], "quarantined": []}
    >>> t = principals_text(v)
    >>> print(t.plain.replace("; ", chr(10)))
    principals: FLAGGED bot-9 (25% of traffic, weight 0.80, residual -0.90 [-1.10, -0.70], n 120
    causalmem quarantine to act)
    quarantined none
    top: svc-a 75%, bot-9 25%
    >>> held = {**v["principals"][0], "share": 0.0, "weight": 0.0}
    >>> print(principals_text({**v, "principals": [held]}).plain.split("; ")[0])
    principals: FLAGGED bot-9 (held at weight 0, residual -0.90 [-1.10, -0.70], n 120
    """
    rows = v.get("principals") or []
    flagged = [r for r in rows if r["flagged"] and not r["quarantined"]]
    parts = []
    for r in flagged:
        interval = f" [{r['low']:.2f}, {r['high']:.2f}]" if r["low"] is not None and r["high"] is not None else ""
        # Held at weight 0 while flagged (its share of the window then falls to 0): say so instead.
        share = f"{r['share']:.0%} of traffic"
        weight = "held at weight 0" if r["weight"] == 0 else f"{share}, weight {r['weight'] or 0:.2f}"
        parts.append(
            f"FLAGGED {r['name']} ({weight}, residual {r['residual'] or 0:+.2f}{interval}, n {r['n']}; "
            "causalmem quarantine to act)"
        )
    parts.append(f"quarantined {', '.join(v.get('quarantined') or []) or 'none'}")
    top = sorted(rows, key=lambda r: -r["share"])[:5]
    if top:
        parts.append("top: " + ", ".join(f"{r['name']} {r['share']:.0%}" for r in top))
    return Text("principals: " + "; ".join(parts), style="red" if flagged else "")


def freeze_text(f: dict[str, Any] | None) -> list[Text]:
    """Why serving has not moved while candidates wait (red once that is a freeze).

    >>> [t.plain for t in freeze_text({"line": "serving v1 for 12m while 20 candidates waited: x",
    ...                                "frozen": False})]
    ['serving v1 for 12m while 20 candidates waited: x']
    """
    if not f:
        return []
    out = []
    if f.get("line"):
        out.append(
            Text(f"{'FROZEN: ' if f.get('frozen') else ''}{f['line']}", style="bold red" if f["frozen"] else "yellow")
        )
    return out


def _header(s: dict[str, Any]) -> Text:
    return Text.assemble(
        ("causalmem status", "bold"),
        f"  broker {s['bootstrap']}",
        f"  prefix {s['prefix']!r}" if s["prefix"] else "",
        f"  policy {s['policy']!r}",
        ("  " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["ts"])), "dim"),
    )


def _checkpoints(ck: dict[str, Any]) -> Table:
    """Serving and candidate manifests, with the learner's update rate as the caption."""
    tbl = Table(title="checkpoints", title_justify="left", expand=False, pad_edge=False)
    for col, just in CHECKPOINT_COLUMNS:
        tbl.add_column(col, justify=just)  # type: ignore[arg-type]
    if ck.get("missing"):
        tbl.add_row("-", "", "topic missing", "", "", "", "", "")
    for role in ("serving", "candidate", "canary"):
        m = ck.get(role)
        if m:
            tbl.add_row(
                role,
                str(m["version"]),
                # an incumbent (contract 1.17): clients serve their own ranking until a candidate is promoted;
                # a probe over a certified version (1.23): clients serve that version but on the explored share
                f"{m['reason']}, incumbent"
                if m.get("incumbent")
                else f"{m['reason']} over v{m['base']}"
                if m.get("base") is not None
                else m["reason"],
                fmt_age(m["age_s"]),
                _num(m["baseline"], "{:+.4f}"),
                _num(m["alpha"], "{:.3f}"),
                _num(m["metrics"].get("updates")),
                _num(m["metrics"].get("experiences")),
            )
    if not ck.get("missing") and not ck.get("serving") and not ck.get("candidate"):
        tbl.add_row("-", "", "no checkpoint yet", "", "", "", "", "")
    rate = ck.get("update_rate")
    if rate:
        tbl.caption = (
            f"v{rate['from_version']}→v{rate['to_version']} over {rate['seconds']:.1f}s: "
            f"{_num(rate['updates_per_s'], '{:.2f}')} updates/s, "
            f"{_num(rate['experiences_per_s'], '{:.1f}')} experiences/s"
        )
        tbl.caption_justify = "left"
    return tbl


def _learner_lag(lag: dict[str, Any]) -> Text:
    """The learner's lag against the newest manifest; red when stalled."""
    if lag.get("stalled"):
        return Text(f"learner STALLED: {lag['why']}", style="bold red")
    n = "-" if lag.get("lag") is None else f"{lag['lag']:,}"
    return Text(f"learner lag: {n} experiences past the newest checkpoint", style="dim" if not lag.get("lag") else "")


def _live(s: dict[str, Any]) -> Table:
    """Health, then one row per worker and per learner scraped (empty without ``--worker``/``--learner``)."""
    live = Table(title="live", title_justify="left", show_header=False, pad_edge=False, box=None)
    live.add_column(style="dim")
    live.add_column()
    h = s.get("health")
    if h is None and any(w["up"] for w in s.get("workers", [])):
        live.add_row("health", Text("not computed yet (first computation ~5 s after a worker is ready)", style="dim"))
    if h:
        band = h["band"] or "?"
        live.add_row("health", Text(f"{h['score']:.1f}  {band}", style=BAND_STYLE.get(band, "")))
        corr = "-" if h["correlation"] is None else f"{h['correlation']:+.3f}"
        ref = "" if h["correlation_reference"] is None else f", reference {h['correlation_reference']:+.3f}"
        live.add_row("correlation (7 d)", f"{corr} over {h['correlation_pairs']} pairs{ref}")
    for w in s.get("workers", []):
        live.add_row("worker", _worker_line(w) if w["up"] else Text(f"{w['url']} unreachable", style="red"))
    for lr in s.get("learners", []):
        live.add_row("learner", _learner_line(lr) if lr["up"] else Text(f"{lr['url']} unreachable", style="red"))
        if lr["up"] and lr.get("training_alive") is False:
            live.add_row("", Text("training task ended: restart the learner", style="bold red"))
        if lr["up"] and lr.get("memories"):
            live.add_row("memories", _memories(lr["memories"]))
        if lr["up"] and lr.get("gate"):
            live.add_row("gate", gate_line(lr["gate"]))
    return live


def _memories(mv: dict[str, Any]) -> Table:
    """The learner's most harmful and most helpful memories by measured effect (per-memory credit)."""
    tbl = Table(
        caption=f"{mv['measured']:,} memories with a measured effect; effect = nll_without_slot − nll_with",
        caption_justify="left",
        pad_edge=False,
    )
    for col in ("", "slot", "mean effect", "95% interval", "reads", "measured"):
        tbl.add_column(col, justify="left" if not col else "right")
    for side in ("harmful", "helpful"):
        for r in mv.get(side, []):
            interval = "-" if r["low"] is None else f"[{r['low']:+.3f}, {r['high']:+.3f}]"
            style = "red" if side == "harmful" else "green"
            tbl.add_row(
                Text(side, style=style),
                str(r["slot"]),
                _num(r["mean"], "{:+.3f}"),
                interval,
                f"{r['reads']:,}",
                f"{r['effects']:,}",
            )
    return tbl


def gate_line(g: dict[str, Any]) -> Text:
    """The gate's last decision; 'insufficient data' with the ESS it has and needs.

    >>> gate_line({"decision": "insufficient", "ess": 38.0, "ess_needed": 200.0}).plain
    'insufficient data: ESS 38 (200 needed)'
    """
    ess = f"ESS {g['ess']:,.0f}"
    if g["decision"] == "insufficient":
        return Text(f"insufficient data: {ess} ({g['ess_needed']:,.0f} needed)", style="yellow")
    return Text(f"last candidate {g['decision']} ({ess})", style="green" if g["decision"] == "promoted" else "")


def _worker_line(w: dict[str, Any]) -> str:
    lag = sum(w["consumer_lag"].values())
    return (
        f"{w['partitions_owned']} partitions, joins {w['joins_total']:,.0f}"
        f" ({_num(w['joins_per_s'], '{:.1f}')}/s), pending {w['join_pending']:,.0f}, lag {lag:,}"
    )


def _learner_line(lr: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} v{v}" for k, v in sorted(lr["checkpoint_version"].items())) or "-"
    return (
        f"updates {lr['updates_total']:,.0f} ({_num(lr['updates_per_s'], '{:.2f}')}/s), "
        f"experiences {lr['experiences_total']:,.0f} ({_num(lr['experiences_per_s'], '{:.1f}')}/s), "
        f"baseline {lr['baseline']:+.4f}, lag {sum(lr['consumer_lag'].values()):,}, {versions}"
    )


def _queues(al: dict[str, Any], dl: dict[str, Any]) -> Table:
    """The active-learning queue's depth and the dead letters by reason."""
    q = Table(title="queues", title_justify="left", show_header=False, pad_edge=False, box=None)
    q.add_column(style="dim")
    q.add_column(justify="right")
    q.add_column()
    if al.get("missing"):
        q.add_row("active-learning", "-", "topic missing")
    else:
        q.add_row(
            "active-learning",
            _num(al.get("depth")),
            f"waiting for labelers ({al.get('queued_total', 0):,} queued in all, "
            f"{al.get('committed_partitions', 0)}/{len(al.get('partitions', {}))} partitions committed)",
        )
    if dl.get("missing"):
        q.add_row("dead-letter", "-", "topic missing")
    else:
        q.add_row("dead-letter", _num(dl.get("total", 0)), "rejected messages")
        for reason, n in (dl.get("by_reason") or {}).items():
            q.add_row("", _num(n), Text(reason, style="yellow"))
    return q


# --------------------------------------------------------------------------- showing


def _emit_json(snap: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(snap, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
    sys.stdout.flush()


async def show(
    collector: StatusCollector, as_json: bool = False, watch: float | None = None, broker_timeout: float = 15.0
) -> int:
    """Wait for the broker, then print one snapshot, or refresh every ``watch`` seconds until cancelled."""
    await kafka.wait_for_broker(collector.bootstrap, collector.conn, timeout=broker_timeout)
    if watch is None:
        snap = await collector.snapshot()
        if as_json:
            _emit_json(snap)
        else:
            Console().print(render(snap))
        return 0
    if as_json:
        while True:
            _emit_json(await collector.snapshot())
            await asyncio.sleep(watch)
    with Live(Text("collecting…"), console=Console(), refresh_per_second=4, transient=False) as live:
        while True:
            live.update(render(await collector.snapshot()))
            await asyncio.sleep(watch)
