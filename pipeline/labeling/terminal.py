"""``causalmem label``: people label the samples the pipeline queues (DESIGN §3, §6).

Three modes:

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

- **file** (``--answers FILE.jsonl``, for scripts): one answer per line,
  ``{"sample_id": ..., "correct_memories": [...], "rating": 0-5 (optional)}`` or
  ``{"sample_id": ..., "skip": "reason"}``. Samples that come from the queue and are in the
  file are answered; the others are left uncommitted for other labelers (and nothing
  behind them on their partition is taken, see :meth:`LabelQueue.leave`). Stops when the
  file's answers are used up, after ``--max`` samples, or when ``--timeout`` passes with no
  new sample.
- **stats** (``--stats``): agreement between labelers where one sample got answers from
  several of them (see :func:`agreement` for the definitions).

Before each sample it shows ``waiting: N · done by you: M``: N is the samples not yet
committed on the partitions this labeler holds (the whole queue when it labels alone), M
what it answered or skipped in this session (``--stats`` counts everyone's, all time).

A sample's offset is committed only after its label is acknowledged by the broker (see
:mod:`pipeline.labeling.queue`): a crash never loses a label or a sample. A crash after the ack
and before the commit gives the sample again (at least once), and its second answer is a
second label with its own event id. If the group rebalances while a sample is on screen
(a labeler joins or leaves), the answer is refused before publishing and the sample goes
to its partition's new owner. Every label carries the labeler's identity: ``--labeler
NAME``, else the ``USER`` environment variable; an empty identity is refused.
``--group NAME`` labels in another consumer group, which gets every sample again: a way to
collect a second opinion for ``--stats`` (the worker applies both answers).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import orjson

RATING_MAX = 5
TEXT_WIDTH = 160  # characters of a memory text shown in the choices table

HELP = (
    "slots (space separated, e.g. '3 17'), optionally with r<0-5> · 'none' (no candidate is correct) · "
    "r<0-5> rating · s [reason] skip · q quit · ? help"
)


# --------------------------------------------------------------------------- agreement (pure)


def cohens_kappa(a: Sequence[Any], b: Sequence[Any], weights: str | None = None) -> float:
    """Cohen's κ of two raters who labelled the same items (``a[i]`` and ``b[i]``: item i).

    ``κ = 1 − D_o / D_e``: D_o is the mean disagreement weight over the items, D_e the one
    expected if the two raters chose independently with their own marginal frequencies.
    ``weights=None``: unweighted (nominal labels; weight 1 for any disagreement), which is
    the familiar ``(p_o − p_e) / (1 − p_e)``. ``"linear"``: weighted κ for numeric ordinal
    labels, weight ``|x − y|`` (a rating 4 against 3 counts less than 5 against 0);
    ``"quadratic"``: ``(x − y)²``. The scale of the weights cancels, so categories that
    neither rater used do not matter. Computed exactly (fractions). Returns NaN when κ is
    undefined: no items, or no disagreement expected by chance (both raters gave one and
    the same label to every item).

    >>> cohens_kappa([1, 1, 0, 0, 1], [1, 0, 0, 0, 1])  # p_o = 0.8, p_e = 0.6·0.4 + 0.4·0.6 = 0.48
    0.6153846153846154
    >>> cohens_kappa([0, 1, 2], [0, 2, 2], weights="linear")  # D_o = 1/3, D_e = 1
    0.6666666666666666
    >>> cohens_kappa([1, 0], [0, 1])
    -1.0
    >>> math.isnan(cohens_kappa([3, 3], [3, 3]))
    True
    """
    if len(a) != len(b):
        raise ValueError(f"the raters labelled different numbers of items ({len(a)} and {len(b)})")
    n = len(a)
    if n == 0:
        return math.nan
    if weights is None:

        def w(x: Any, y: Any) -> Fraction:
            return Fraction(0 if x == y else 1)

    elif weights in ("linear", "quadratic"):
        power = 1 if weights == "linear" else 2

        def w(x: Any, y: Any) -> Fraction:
            return abs(Fraction(x) - Fraction(y)) ** power

    else:
        raise ValueError(f"weights must be None, 'linear' or 'quadratic', not {weights!r}")
    observed = sum((w(x, y) for x, y in zip(a, b, strict=True)), Fraction(0)) / n
    count_a, count_b = Counter(a), Counter(b)
    expected = sum((ca * cb * w(x, y) for x, ca in count_a.items() for y, cb in count_b.items()), Fraction(0)) / (n * n)
    if expected == 0:
        return math.nan
    return float(1 - observed / expected)


@dataclass(frozen=True)
class Answer:
    """One labeler's latest answer to one sample (from a ``memory_choice`` label)."""

    labeler: str
    sample_id: str
    correct: frozenset[int]
    rating: int | None
    skip_reason: str | None  # not None: a skip (the labeler did not judge the memories)


def latest_answers(labels: Sequence[Any]) -> dict[tuple[str, str], Answer]:
    """``{(sample_id, labeler): Answer}`` from HumanLabels in topic order; the last answer wins.

    A sample's labels all share one partition (they are keyed by query id), so topic order
    is publish order: a labeler who answered a sample twice (a crash after the broker's ack
    and before the commit) counts once, with the later answer.
    """
    out: dict[tuple[str, str], Answer] = {}
    for label in labels:
        if label.kind != "memory_choice" or not label.sample_id:
            continue
        out[(label.sample_id, label.labeler)] = Answer(
            label.labeler,
            label.sample_id,
            frozenset(label.correct_memories or ()),
            label.rating,
            label.skip_reason,
        )
    return out


def agreement(labels: Sequence[Any], offered: dict[str, set[int]] | None = None) -> dict[str, Any]:
    """Per-labeler counts and pairwise agreement over samples answered by several labelers.

    Only ``memory_choice`` labels count, the latest per (sample, labeler). For a pair of
    labelers, the *overlap* is the samples both answered without skipping (a skip means
    "could not judge", not "no memory is correct", so it is no decision to agree with).

    - **κ memories** (unweighted): one binary decision per (overlapping sample, slot),
      "is this slot a correct memory?", for every slot the labelers were offered: the
      sample's candidates and top slots, as queued on ``active-learning`` (``offered``),
      plus any slot either of them chose. Samples whose candidates are no longer known (the
      sample has left the topic) are left out of this κ and counted as ``unknown``: without
      the offered slots there are no "no" decisions, and κ would be meaningless.
    - **same set**: the share of overlapping samples where the two chose identical sets.
    - **κ rating** (linear-weighted, see :func:`cohens_kappa`): over the overlapping
      samples that both rated 0–5 (how much the query needed memory).
    """
    offered = offered or {}
    answers = latest_answers(labels)
    per: dict[str, dict[str, Any]] = {}
    by_sample: dict[str, dict[str, Answer]] = {}
    for (sid, who), ans in answers.items():
        stats = per.setdefault(who, {"answered": 0, "skipped": 0, "rated": 0, "skip_reasons": Counter()})
        if ans.skip_reason is not None:
            stats["skipped"] += 1
            stats["skip_reasons"][ans.skip_reason or "skipped"] += 1
        else:
            stats["answered"] += 1
        if ans.rating is not None:
            stats["rated"] += 1
        by_sample.setdefault(sid, {})[who] = ans
    pairs = []
    for x, y in itertools.combinations(sorted(per), 2):
        overlap = [
            (s[x], s[y])
            for sid, s in sorted(by_sample.items())
            if x in s and y in s and s[x].skip_reason is None and s[y].skip_reason is None
        ]
        dec_x: list[int] = []
        dec_y: list[int] = []
        unknown = 0
        for ax, ay in overlap:
            slots = offered.get(ax.sample_id)
            if slots is None:
                unknown += 1
                continue
            for slot in sorted(set(slots) | ax.correct | ay.correct):
                dec_x.append(int(slot in ax.correct))
                dec_y.append(int(slot in ay.correct))
        rated = [(ax.rating, ay.rating) for ax, ay in overlap if ax.rating is not None and ay.rating is not None]
        if not overlap:
            continue
        pairs.append(
            {
                "labelers": [x, y],
                "overlap": len(overlap),
                "slot_decisions": len(dec_x),
                "unknown_samples": unknown,
                "kappa_memories": _finite(cohens_kappa(dec_x, dec_y)),
                "same_set": sum(ax.correct == ay.correct for ax, ay in overlap) / len(overlap),
                "rated_by_both": len(rated),
                "kappa_rating": _finite(cohens_kappa([r[0] for r in rated], [r[1] for r in rated], weights="linear")),
            }
        )
    labelers = {
        who: {**s, "skip_reasons": dict(sorted(s["skip_reasons"].items(), key=lambda kv: (-kv[1], kv[0])))}
        for who, s in sorted(per.items())
    }
    return {
        "samples": len(by_sample),
        "samples_with_several_labelers": sum(len(v) > 1 for v in by_sample.values()),
        "labelers": labelers,
        "pairs": pairs,
    }


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)


# --------------------------------------------------------------------------- answers (pure)


@dataclass(frozen=True)
class FileAnswer:
    line: int
    sample_id: str
    correct: list[int] | None = None
    rating: int | None = None
    skip: str | None = None


def _rating(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= RATING_MAX:
        raise ValueError(f"{where}: rating must be an integer 0–{RATING_MAX}, not {value!r}")
    return value


def load_answers(path: str | Path) -> dict[str, FileAnswer]:
    """Read the answers file (JSONL); any bad line is an error naming the line.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl"
    >>> _ = p.write_text('{"sample_id": "s1", "correct_memories": [3, 17], "rating": 4}\\n\\n'
    ...                  '{"sample_id": "s2", "skip": "not sure"}\\n')
    >>> sorted((a.sample_id, a.correct, a.rating, a.skip) for a in load_answers(p).values())
    [('s1', [3, 17], 4, None), ('s2', None, None, 'not sure')]
    """
    out: dict[str, FileAnswer] = {}
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        sid = obj.get("sample_id")
        if not isinstance(sid, str) or not sid:
            raise ValueError(f"{where}: sample_id (a non-empty string) is required")
        if sid in out:
            raise ValueError(f"{where}: sample {sid} is already answered on line {out[sid].line}")
        has_skip, has_correct = "skip" in obj, "correct_memories" in obj
        if has_skip == has_correct:
            raise ValueError(f"{where}: give either correct_memories or skip")
        if has_skip:
            reason = obj["skip"]
            if reason is not None and not isinstance(reason, str):
                raise ValueError(f"{where}: skip must be a string (the reason)")
            if obj.get("rating") is not None:
                raise ValueError(f"{where}: a skip carries no rating")
            out[sid] = FileAnswer(n, sid, skip=reason or "skipped")
            continue
        correct = obj["correct_memories"]
        if not isinstance(correct, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in correct
        ):
            raise ValueError(f"{where}: correct_memories must be a list of slot numbers")
        if len(set(correct)) != len(correct):
            raise ValueError(f"{where}: correct_memories repeats a slot")
        out[sid] = FileAnswer(n, sid, correct=list(correct), rating=_rating(obj.get("rating"), where))
    return out


def offered_slots(sample: Any) -> list[int]:
    """The slots a labeler may choose: the top slots (most likely first), then the other candidates."""
    out = [int(t["slot"]) for t in sorted(sample.top_slots, key=lambda t: -float(t["prob"]))]
    out += [s for s in sample.candidates if s not in out]
    return out


@dataclass(frozen=True)
class Command:
    """A parsed line of the interactive prompt."""

    action: str  # "answer", "rating" (a rating alone), "skip", "quit", "help"
    slots: tuple[int, ...] | None = None  # "answer": () is "none of them"
    rating: int | None = None
    reason: str = ""


def parse_line(line: str, offered: Sequence[int]) -> Command:
    """Parse one answer line; raises ValueError with a message for the person.

    >>> parse_line("3 17", [3, 5, 17])
    Command(action='answer', slots=(3, 17), rating=None, reason='')
    >>> parse_line("17,3 r4", [3, 5, 17])
    Command(action='answer', slots=(17, 3), rating=4, reason='')
    >>> parse_line("s not sure", [3]).reason
    'not sure'
    >>> parse_line("9", [3, 5])
    Traceback (most recent call last):
    ...
    ValueError: slot 9 is not among this sample's candidates (3 5)
    """
    text = line.strip()
    low = text.lower()
    if not text:
        raise ValueError("type the correct slots, 'none', 's [reason]' to skip, 'q' to quit ('?' for help)")
    if low in ("q", "quit", "exit"):
        return Command("quit")
    if low in ("?", "h", "help"):
        return Command("help")
    if low in ("s", "skip") or low.startswith(("s ", "skip ")):
        return Command("skip", reason=text.split(None, 1)[1].strip() if " " in text else "")
    slots: list[int] = []
    rating: int | None = None
    none = False
    for token in text.replace(",", " ").split():
        tok = token.lower()
        if tok in ("none", "-"):
            none = True
        elif tok.startswith("r") and tok[1:].isdigit():
            value = int(tok[1:])
            if value > RATING_MAX:
                raise ValueError(f"a rating is 0–{RATING_MAX} (r0 … r{RATING_MAX}), not {value}")
            rating = value
        elif tok.isdigit():
            slot = int(tok)
            if slot not in offered:
                raise ValueError(f"slot {slot} is not among this sample's candidates ({' '.join(map(str, offered))})")
            if slot not in slots:
                slots.append(slot)
        else:
            raise ValueError(f"cannot read {token!r}: {HELP}")
    if none and slots:
        raise ValueError("'none' and slot numbers contradict each other")
    if not slots and not none:
        return Command("rating", rating=rating)
    return Command("answer", slots=tuple(slots), rating=rating)


def parse_rating(line: str) -> int | None:
    """The rating prompt: ``r4`` or ``4``; empty for no rating.

    >>> parse_rating("r4"), parse_rating(" 2 "), parse_rating("")
    (4, 2, None)
    """
    text = line.strip().lower()
    if not text:
        return None
    if text.startswith("r"):
        text = text[1:]
    if not text.isdigit() or int(text) > RATING_MAX:
        raise ValueError(f"a rating is 0–{RATING_MAX} (r4 or 4); Enter for no rating")
    return int(text)


# --------------------------------------------------------------------------- terminal


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
            loop.add_reader(self.fd, lambda: fut.done() or fut.set_result(None))
        except (OSError, ValueError, NotImplementedError):
            return  # a regular file (never blocks) or a loop without add_reader: just read
        try:
            await fut
        finally:
            loop.remove_reader(self.fd)


def render_sample(item: Any) -> Any:
    """A rich renderable of one queued sample."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

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


async def _status_line(queue: Any) -> str:
    try:
        waiting = await queue.waiting()
    except Exception:  # a display hint, never fatal
        waiting = None
    shown = "?" if waiting is None else str(waiting)
    return f"waiting: {shown} · done by you: {queue.done + queue.skipped} ({queue.skipped} skipped)"


# --------------------------------------------------------------------------- modes


async def interactive(queue: Any, console: Any, timeout: float | None, max_samples: int | None) -> int:
    from rich.text import Text

    from pipeline.labeling.queue import SampleMoved

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


async def ask(item: Any, console: Any, stdin: StdinLines) -> Command | None:
    """Prompt until a complete answer (``answer`` with slots, or ``skip``); None to quit."""
    from rich.text import Text

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
    queue: Any, console: Any, answers: dict[str, FileAnswer], timeout: float, max_samples: int | None
) -> int:
    from rich.text import Text

    from pipeline.labeling.queue import SampleMoved

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


async def stats(bootstrap: str, settings: Any) -> dict[str, Any]:
    from pipeline import kafka
    from topics.fields import Rejected
    from topics.labels import decode_active_learning_sample, decode_human_label

    topics, limits = settings.topics(), settings.limits()
    labels = []
    for msg in await kafka.read_all(bootstrap, settings, topics.human_labels.name):
        try:
            labels.append(decode_human_label(msg.value, limits, msg.key))
        except Rejected:
            continue
    offered: dict[str, set[int]] = {}
    for msg in await kafka.read_all(bootstrap, settings, topics.active_learning.name):
        try:
            sample = decode_active_learning_sample(msg.value, limits, msg.key)
        except Rejected:
            continue
        offered.setdefault(sample.sample_id, set()).update(offered_slots(sample))
    return agreement(labels, offered)


def render_stats(result: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

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


# --------------------------------------------------------------------------- the verb
