"""Answers to samples: the ``--answers`` JSONL file and the lines typed at the interactive prompt.

Pure: parsing and validation only; :mod:`pipeline.labeling.terminal` does the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from topics.labels import ActiveLearningSample

RATING_MAX = 5  # a rating: how much the query needed memory, 0–5

HELP = (
    "slots (space separated, e.g. '3 17'), optionally with r<0-5> · 'none' (no candidate is correct) · "
    "r<0-5> rating · s [reason] skip · q quit · ? help"
)


@dataclass(frozen=True)
class FileAnswer:
    """One line of the answers file: memories chosen (``correct``, maybe a ``rating``) or a ``skip``."""

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


def offered_slots(sample: ActiveLearningSample) -> list[int]:
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
