"""The terminal labeler behind ``causalmem label``: its three modes, the prompt and the screens.

- **interactive** (default): takes the next sample from the shared queue (the consumer
  group ``causalmem-labelers``: several labelers share the queue and never get the same
  sample), shows the query, the memories read and the candidate slots with the serving
  policy's first-draw probabilities, and reads short answers line by line from standard
  input (a terminal or a pipe, so scripts and tests can drive it; see :class:`StdinLines`)::

      label> 3 17          the correct memories (candidate slots), then a rating prompt
      rating> r4           0–5: how much the query needed memory (Enter: no rating)
      label> 3 17 r4       both at once
      label> none r2       no candidate is a correct memory
      label> s not sure    skip, with an optional reason
      label> q             quit (the sample on screen stays in the queue)

- **file** (``--answers FILE.jsonl``, for scripts): one answer per line (the format:
  :func:`~pipeline.labeling.answers.load_answers`). Samples that come from the queue and
  are in the file are answered; the others are left uncommitted for other labelers (and
  nothing behind them on their partition is taken, see :meth:`LabelQueue.leave`). Stops
  when the file's answers are used up, after ``--max`` samples, or when ``--timeout``
  passes with no new sample.
- **stats** (``--stats``): agreement between labelers where one sample got answers from
  several of them (the definitions: :func:`~pipeline.labeling.agreement.agreement`).

Before each sample it shows ``waiting: N · done by you: M``: N is the samples not yet
committed on the partitions this labeler holds (the whole queue when it labels alone), M
what it answered or skipped in this session (``--stats`` counts everyone's, all time).

A sample's offset is committed only after its label is acknowledged by the broker (see
:mod:`pipeline.labeling.queue`): a crash never loses a label or a sample. A crash after the ack
and before the commit gives the sample again (at least once): to another labeler, whose
answer counts too, or to the same one, who passes over it (a labeler answers a sample
once). If the group rebalances while a sample is on screen (a labeler joins or leaves), the
answer is refused before publishing and the sample goes to its partition's new owner. Every
label carries the labeler's identity, the SASL principal when the connection is
authenticated; an empty one is refused. Another consumer group (``--group``) gets every
sample again: a way for *other* labelers to give a second opinion for ``--stats``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import orjson
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pipeline import kafka
from pipeline.config import Connection
from pipeline.labeling.agreement import agreement
from pipeline.labeling.answers import HELP, RATING_MAX, Command, FileAnswer, offered_slots, parse_line, parse_rating
from pipeline.labeling.queue import LabelQueue, QueuedSample, SampleMoved
from topics.fields import Rejected
from topics.labels import decode_active_learning_sample, decode_human_label

TEXT_WIDTH = 160  # characters of a memory text shown in the choices table


# --------------------------------------------------------------------------- sessions


async def prepare(bootstrap: str, conn: Connection) -> None:
    """Wait for the broker and make sure the topics exist.

    Subscribing to a missing topic would auto-create it with the wrong partition count.
    """
    await kafka.wait_for_broker(bootstrap, conn)
    await kafka.create_topics(bootstrap, conn)


async def label(
    bootstrap: str,
    conn: Connection,
    labeler: str,
    answers: dict[str, FileAnswer] | None = None,
    group: str | None = None,
    timeout: float | None = None,
    max_samples: int | None = None,
) -> int:
    """Join the queue as ``labeler`` and label: from ``answers`` when given, else interactively.

    ``timeout``: seconds to wait for a sample before stopping (None: wait on, interactive;
    10 s with answers). Returns the exit status (1 when the file named a slot no sample offered).
    """
    console = Console(highlight=False)
    await prepare(bootstrap, conn)
    queue = LabelQueue(bootstrap, conn, labeler, group=group)
    console.print(f"labeler {labeler}: joining the queue {queue.group} …", markup=False)
    await queue.start()
    try:
        if answers is not None:
            return await from_file(queue, console, answers, 10.0 if timeout is None else timeout, max_samples)
        return await interactive(queue, console, timeout, max_samples)
    finally:
        await queue.stop()


async def show_stats(bootstrap: str, conn: Connection, as_json: bool = False) -> int:
    """Print the agreement between labelers: tables, or one JSON object."""
    await prepare(bootstrap, conn)
    result = await stats(bootstrap, conn)
    if as_json:
        sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        Console(highlight=False).print(render_stats(result))
    return 0


# --------------------------------------------------------------------------- terminal


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class StdinLines:
    """Lines from standard input, read without blocking the event loop; None at EOF.

    Heartbeats go on while a person thinks (a blocked loop would drop the labeler from the
    group after the session timeout). No thread is involved, so Ctrl-C at a prompt exits
    cleanly (a thread blocked in ``input()`` makes the interpreter abort at shutdown). Like
    ``input()``, it reads a terminal or a pipe, so scripts and tests can drive it.
    """

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        self.buffer = b""
        self.eof = False

    async def readline(self, prompt: str) -> str | None:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        while b"\n" not in self.buffer and not self.eof:
            await self._readable()
            chunk = os.read(self.fd, 65536)
            self.buffer += chunk
            self.eof = not chunk
        if not self.buffer:
            return None
        line, _, rest = self.buffer.partition(b"\n")
        self.buffer = rest
        return line.decode("utf-8", errors="replace").rstrip("\r")

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        try:
            loop.add_reader(self.fd, _wake, fut)
        except (OSError, ValueError, NotImplementedError):
            return  # a regular file (never blocks) or a loop without add_reader: just read
        try:
            await fut
        finally:
            loop.remove_reader(self.fd)


def render_sample(item: QueuedSample) -> Group:
    """A rich renderable of one queued sample."""

    s = item.sample
    texts = s.memory_texts or {}
    probs = {int(t["slot"]): float(t["prob"]) for t in s.top_slots}
    head = Text()
    head.append(f"sample {s.sample_id}", style="bold")
    head.append(f"   query {s.query_id} · step {s.step}   reason {s.reason}   utility {s.utility:+.3f}")
    head.append(f"   policy {s.policy} v{s.policy_version}")
    parts: list[Any] = [head]
    if s.query_text:
        parts.append(Panel(Text(s.query_text), title="query", title_align="left"))
    read = Table(title="memories read", title_justify="left", show_edge=False, expand=False)
    read.add_column("slot", justify="right")
    read.add_column("memory")
    for slot in s.selected:
        read.add_row(str(slot), Text(_clip(texts.get(slot))))
    if not s.selected:
        read.add_row("—", "(nothing was read)")
    parts.append(read)
    choices = Table(title="choices: type slot numbers", title_justify="left", show_edge=False)
    choices.add_column("slot", justify="right", style="bold")
    choices.add_column("P(first)", justify="right")
    choices.add_column("read", justify="center")
    choices.add_column("memory")
    for slot in offered_slots(s):
        p = probs.get(slot)
        choices.add_row(
            str(slot), "" if p is None else f"{p:.3f}", "✓" if slot in s.selected else "", Text(_clip(texts.get(slot)))
        )
    parts.append(choices)
    return Group(*parts)


def _clip(text: str | None) -> str:
    if not text:
        return "—"
    text = " ".join(text.split())
    return text if len(text) <= TEXT_WIDTH else text[: TEXT_WIDTH - 1] + "…"


async def _status_line(queue: LabelQueue) -> str:
    try:
        waiting = await queue.waiting()
    except Exception:  # a display hint, never fatal
        waiting = None
    shown = "?" if waiting is None else str(waiting)
    return f"waiting: {shown} · done by you: {queue.done + queue.skipped} ({queue.skipped} skipped)"


# --------------------------------------------------------------------------- modes


async def interactive(queue: LabelQueue, console: Console, timeout: float | None, max_samples: int | None) -> int:

    stdin = StdinLines()
    handled = 0
    said_waiting = False
    while max_samples is None or handled < max_samples:
        item = await queue.next(timeout=timeout if timeout is not None else 5.0)
        if item is None:
            if timeout is not None:
                console.print(f"no sample within {timeout:g} s; stopping")
                break
            if not said_waiting:
                console.print("waiting for samples… (Ctrl-C to quit)")
                said_waiting = True
            continue
        said_waiting = False
        console.rule()
        console.print(await _status_line(queue))
        console.print(render_sample(item))
        outcome = await ask(item, console, stdin)
        if outcome is None:  # quit: the sample stays in the queue, uncommitted
            console.print("quit: this sample stays in the queue for the next labeler")
            break
        try:
            if outcome.action == "skip":
                await queue.skip(item, outcome.reason)
                console.print(f"skipped ({outcome.reason or 'no reason'}); acknowledged and committed", markup=False)
            else:
                assert outcome.slots is not None
                await queue.answer(item, list(outcome.slots), outcome.rating)
                shown = " ".join(map(str, outcome.slots)) or "none"
                rating = "no rating" if outcome.rating is None else f"rating {outcome.rating}"
                console.print(f"labelled: memories {shown}, {rating}; acknowledged and committed")
        except SampleMoved as exc:
            console.print(Text(str(exc), style="yellow"))
            if not exc.published:
                console.print("your answer was not recorded; the labeler that now holds the sample will answer it")
        handled += 1
    console.print(await _status_line(queue))
    return 0


async def ask(item: QueuedSample, console: Console, stdin: StdinLines) -> Command | None:
    """Prompt until a complete answer (``answer`` with slots, or ``skip``); None to quit."""

    offered = offered_slots(item.sample)
    rating: int | None = None
    console.print(HELP, markup=False)
    while True:
        line = await stdin.readline("label> ")
        if line is None:
            return None
        try:
            cmd = parse_line(line, offered)
        except ValueError as exc:
            console.print(Text(str(exc), style="red"))
            continue
        if cmd.action == "quit":
            return None
        if cmd.action == "help":
            console.print(HELP, markup=False)
            continue
        if cmd.action == "skip":
            return cmd
        if cmd.rating is not None:
            rating = cmd.rating
        if cmd.action == "rating":
            console.print(f"rating {rating} noted; now the correct memories (or 'none')")
            continue
        if rating is None:
            while True:
                line = await stdin.readline(
                    f"rating> how much did the query need memory, r0–r{RATING_MAX} (Enter: none) "
                )
                if line is None:
                    return None
                if line.strip().lower() in ("q", "quit"):
                    return None
                try:
                    rating = parse_rating(line)
                    break
                except ValueError as exc:
                    console.print(Text(str(exc), style="red"))
        return Command("answer", slots=cmd.slots, rating=rating)


async def from_file(
    queue: LabelQueue, console: Console, answers: dict[str, FileAnswer], timeout: float, max_samples: int | None
) -> int:

    pending = dict(answers)
    answered = skipped = 0
    left: list[str] = []
    rejected: list[str] = []
    moved: list[str] = []
    while pending and (max_samples is None or answered + skipped < max_samples):
        item = await queue.next(timeout=timeout)
        if item is None:
            break  # nothing new within --timeout
        sid = item.sample.sample_id
        ans = pending.get(sid)
        if ans is None:
            queue.leave(item)
            left.append(sid)
            continue
        try:
            if ans.skip is not None:
                await queue.skip(item, ans.skip)
                skipped += 1
            else:
                assert ans.correct is not None
                allowed = offered_slots(item.sample)
                bad = [s for s in ans.correct if s not in allowed]
                if bad:
                    queue.leave(item)
                    rejected.append(f"line {ans.line}: sample {sid}: slots {bad} are not among its candidates")
                    del pending[sid]
                    continue
                await queue.answer(item, ans.correct, ans.rating)
                answered += 1
            del pending[sid]
        except SampleMoved as exc:
            moved.append(str(exc))
            if exc.published:
                del pending[sid]
    console.print(
        f"labelled {answered}, skipped {skipped} (labeler {queue.labeler}); "
        f"left {len(left)} sample(s) not in the file in the queue",
        markup=False,
    )
    for line in rejected:
        console.print(Text(f"rejected: {line}", style="red"))
    for line in moved:
        console.print(Text(line, style="yellow"))
    if pending:
        ids = sorted(pending, key=lambda k: pending[k].line)
        more = f" … (+{len(ids) - 10})" if len(ids) > 10 else ""
        console.print(
            f"{len(ids)} answer(s) unused: their samples did not reach this labeler "
            f"(answered already, held by another labeler, behind a sample not in the file, or not queued): "
            f"{' '.join(ids[:10])}{more}",
            markup=False,
        )
    console.print(await _status_line(queue))
    return 1 if rejected else 0


async def stats(bootstrap: str, conn: Connection) -> dict[str, Any]:
    """Agreement over every label on ``human-labels`` (see :func:`~pipeline.labeling.agreement.agreement`)."""
    topics, limits = conn.topics, conn.limits
    labels = []
    for msg in await kafka.read_all(bootstrap, conn, topics.human_labels.name):
        try:
            labels.append(decode_human_label(msg.value, limits, msg.key))
        except Rejected:
            continue
    offered: dict[str, set[int]] = {}
    for msg in await kafka.read_all(bootstrap, conn, topics.active_learning.name):
        try:
            sample = decode_active_learning_sample(msg.value, limits, msg.key, any_shape=True)
        except Rejected:
            continue
        offered.setdefault(sample.sample_id, set()).update(offered_slots(sample))
    return agreement(labels, offered)


def render_stats(result: dict[str, Any]) -> Group:
    def num(x: float | None, fmt: str = "{:.3f}") -> str:
        return "n/a" if x is None else fmt.format(x)

    parts: list[Any] = [
        Text(
            f"{result['samples']} sample(s) labelled, {result['samples_with_several_labelers']} by several labelers",
            style="bold",
        )
    ]
    who = Table(title="labelers", title_justify="left")
    for col in ("labeler", "answered", "skipped", "rated"):
        who.add_column(col, justify="left" if col == "labeler" else "right")
    reasons = Table(title="skip reasons", title_justify="left")
    for col in ("labeler", "reason", "count"):
        reasons.add_column(col, justify="right" if col == "count" else "left")
    for name, s in result["labelers"].items():
        who.add_row(Text(name), str(s["answered"]), str(s["skipped"]), str(s["rated"]))
        for reason, count in s["skip_reasons"].items():
            reasons.add_row(Text(name), Text(reason), str(count))
    parts.append(who)
    if reasons.row_count:
        parts.append(reasons)
    if result["pairs"]:
        pairs = Table(title="agreement over samples both answered", title_justify="left")
        for col in ("labelers", "overlap", "slot decisions", "κ memories", "same set", "rated by both", "κ rating"):
            pairs.add_column(col, justify="left" if col == "labelers" else "right")
        for p in result["pairs"]:
            decisions = str(p["slot_decisions"])
            if p["unknown_samples"]:
                decisions += f" ({p['unknown_samples']} sample(s) unknown)"
            pairs.add_row(
                Text(" / ".join(p["labelers"])),
                str(p["overlap"]),
                decisions,
                num(p["kappa_memories"]),
                num(p["same_set"], "{:.0%}"),
                str(p["rated_by_both"]),
                num(p["kappa_rating"]),
            )
        parts.append(pairs)
        parts.append(
            Text(
                "κ memories: Cohen's κ (unweighted) over one yes/no decision per (sample, offered slot): "
                "is the slot a correct memory; skips are left out.\n"
                "κ rating: linear-weighted Cohen's κ over the 0–5 ratings of samples both rated.",
                style="dim",
            )
        )
    else:
        parts.append(Text("no sample was answered by two labelers: no agreement to report"))
    return Group(*parts)
