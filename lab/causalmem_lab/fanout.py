"""Real questions and facts for the real-LM learning benchmark: the FanOutQA bank.

FanOutQA's dev set (the ``fanoutqa`` package ships it) holds 310 multi-hop questions, each
decomposed into sub-questions about Wikipedia articles, with their answers. Every
sub-question with an answer, at any depth, becomes one memory, a note as an agent would
store it: ``"{article title}: {sub-question} {answer}"``. The bench asks a sample of the
sub-questions whose answer is short; per asked question:

- the **gold** memory is its own note;
- **distractors** are the notes of its siblings (the other sub-questions of the same
  top-level question: the same wording about other entities, which similarity ranks high);
- **harmful** memories are *look-alikes*: the question's own wording with a wrong answer
  (another sibling's answer, or an answer of the same shape from elsewhere), which MiniLM
  ranks above the gold note (seed 000's "Zhang San" case).

Everything else is background. The result is the same :class:`~causalmem_lab.lmdata.LMDataset`
as the templated bank's, so :func:`~causalmem_lab.lmdata.lm_utilities` and
:class:`~causalmem_lab.lmworld.LMWorld` take it unchanged. Each question has one wording
(``paraphrase`` is 0 throughout): the world then measures on the questions it trains on.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.lmdata import LMDataset

DEV_SET = "data/fanout-final-dev.json"
INSTALL = "pip install --no-deps fanoutqa==1.1.1"
MAX_ANSWER_WORDS = 6  # asked questions: an answer of a few tokens, as the templated bank's
LOOKALIKE_SHARE = 0.1  # the default world: asked questions with one look-alike each
LOOKALIKES = ("some", "every")  # a share of the asked questions, or every one (1–2 each)
MONTH = re.compile(r"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?(?!\w)")


def dev_set_path() -> Path:
    """The dev set's JSON file inside the installed ``fanoutqa`` package (found, not imported:
    the package's ``__init__`` needs dependencies that reading the file does not)."""
    spec = importlib.util.find_spec("fanoutqa")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the FanOutQA bank needs the fanoutqa package's dev set: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEV_SET
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall fanoutqa ({INSTALL})")
    return path


def answer_text(value: Any) -> str:
    """An answer as a note writes it: booleans as Yes/No, whole floats as integers, a list
    comma-separated, a mapping as ``key: value`` pairs.

    >>> answer_text([True, 3.0, 2.5, {"Macau": 680000, "Malta": ["a", "b"]}])
    'Yes, 3, 2.5, Macau: 680000; Malta: a, b'
    """
    if isinstance(value, bool):
        return "Yes" if value else "No"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else str(value)
    if isinstance(value, int | str):
        return str(value).strip()
    if isinstance(value, list):
        return ", ".join(answer_text(v) for v in value)
    if isinstance(value, dict):
        return "; ".join(f"{k}: {answer_text(v)}" for k, v in value.items())
    return "" if value is None else str(value).strip()


def shape(answer: str) -> str:
    """A coarse kind of answer, so a look-alike's wrong answer reads like a plausible one.

    >>> [shape(a) for a in ("No", "1998", "$38.480 billion", "7 June 1957", "35°N 31°E", "Left", "AC Milan")]
    ['yesno', 'year', 'number', 'date', 'mixed', 'text1', 'text2']
    """
    if answer in ("Yes", "No"):
        return "yesno"
    if re.fullmatch(r"\d{4}", answer):
        return "year"
    if re.fullmatch(r"[$€£~-]?\d[\d,.]*\s*(%|[A-Za-z]+)?", answer):
        return "number"
    if re.search(r"\d", answer):
        return "date" if MONTH.search(answer) else "mixed"
    return f"text{min(len(answer.split()), 3)}"


@dataclass(frozen=True)
class SubQuestion:
    """One flattened sub-question: its top-level question, wording, answer and source article."""

    top: int
    question: str
    answer: str
    title: str

    @property
    def note(self) -> str:
        """The memory an agent would store for it."""
        return f"{self.title}: {self.question} {self.answer}" if self.title else f"{self.question} {self.answer}"


def sub_questions(raw: list[dict[str, Any]]) -> list[SubQuestion]:
    """Every sub-question of every top-level question, nested ones included, in file order."""
    out: list[SubQuestion] = []

    def walk(items: list[dict[str, Any]], top: int) -> None:
        for s in items:
            title = ((s.get("evidence") or {}).get("title") or "").strip()
            out.append(SubQuestion(top, str(s["question"]).strip(), answer_text(s.get("answer")), title))
            walk(s.get("decomposition") or [], top)

    for i, t in enumerate(raw):
        walk(t.get("decomposition") or [], i)
    return out


def _contains(text: str, answer: str) -> bool:
    return answer.lower() in text.lower()


def build_fanout_dataset(seed: int = 0, questions: int = 400, lookalikes: str = "some") -> LMDataset:
    """The FanOutQA bank: every sub-question's note, ``questions`` asked ones and their look-alikes.

    Parameters
    ----------
    seed
        Draws the asked questions, which of them get look-alikes and their wrong answers.
    questions
        How many sub-questions are asked, among those with an answer of at most
        ``MAX_ANSWER_WORDS`` words, a source article, a wording no other sub-question shares
        and an answer the wording does not give away.
    lookalikes
        ``"some"``: one look-alike for ``LOOKALIKE_SHARE`` of the asked questions (the default
        world); ``"every"``: one or two for every asked question (the look-alike world).

    Returns
    -------
    LMDataset
        Notes first (file order, identical notes stored once), then look-alikes; ``meta``
        holds the counts.

    Examples
    --------
    >>> ds = build_fanout_dataset()
    >>> len(ds.questions), len(ds.texts) >= 2000, ds.meta["lookalikes"]
    (400, True, 40)
    >>> q = 0
    >>> ds.answers[q] in ds.texts[ds.gold[q]] and all(ds.answers[q] not in ds.texts[h] for h in ds.harmful[q])
    True
    >>> every = build_fanout_dataset(lookalikes="every")
    >>> all(1 <= len(h) <= 2 for h in every.harmful), every.texts[every.harmful[q][0]].startswith(every.questions[q])
    (True, True)
    """
    if lookalikes not in LOOKALIKES:
        raise ValueError(f"lookalikes must be one of {LOOKALIKES}, got {lookalikes!r}")
    subs = sub_questions(json.loads(dev_set_path().read_text(encoding="utf-8")))
    texts: list[str] = []
    slot_of: dict[str, int] = {}
    note_slot: list[int] = []  # per sub-question; -1: no answer, no note
    for s in subs:
        if not s.answer:
            note_slot.append(-1)
            continue
        if s.note not in slot_of:
            slot_of[s.note] = len(texts)
            texts.append(s.note)
        note_slot.append(slot_of[s.note])
    n_notes = len(texts)
    by_top: dict[int, list[int]] = {}
    for i, s in enumerate(subs):
        by_top.setdefault(s.top, []).append(i)
    wordings: dict[str, int] = {}
    for s in subs:
        wordings[s.question] = wordings.get(s.question, 0) + 1
    eligible = [
        i
        for i, s in enumerate(subs)
        if s.answer
        and s.title
        and len(s.answer.split()) <= MAX_ANSWER_WORDS
        and wordings[s.question] == 1
        and not _contains(s.question, s.answer)
    ]
    if questions > len(eligible):
        raise ValueError(f"{questions} questions asked, {len(eligible)} eligible")
    rng = np.random.default_rng(seed)
    asked = sorted(int(i) for i in rng.choice(len(eligible), size=questions, replace=False))
    asked = [eligible[i] for i in asked]
    # Wrong answers of each shape from elsewhere, when no sibling has one (sorted: deterministic).
    pool: dict[str, list[str]] = {}
    for a in sorted({subs[i].answer for i in eligible}):
        pool.setdefault(shape(a), []).append(a)
    if lookalikes == "every":
        wanted = [int(n) for n in rng.integers(1, 3, size=len(asked))]
    else:
        chosen = set(rng.choice(len(asked), size=round(LOOKALIKE_SHARE * len(asked)), replace=False).tolist())
        wanted = [int(j in chosen) for j in range(len(asked))]
    answers: list[str] = []
    gold: list[int] = []
    harmful: list[list[int]] = []
    distractors: list[list[int]] = []
    for i, n in zip(asked, wanted, strict=True):
        s = subs[i]
        siblings = [j for j in by_top[s.top] if j != i and note_slot[j] >= 0]
        bad: list[int] = []
        for wrong in _wrong_answers(s, [subs[j].answer for j in siblings], pool, n, rng):
            text = f"{s.question} {wrong}"
            if text in slot_of:  # never a note, never another look-alike
                continue
            slot_of[text] = len(texts)
            bad.append(len(texts))
            texts.append(text)
        answers.append(s.answer)
        gold.append(note_slot[i])
        harmful.append(bad)
        distractors.append(sorted({note_slot[j] for j in siblings} - {note_slot[i]}))
    return LMDataset(
        seed,
        texts,
        [subs[i].question for i in asked],
        answers,
        list(range(len(asked))),  # each question its own fact
        [0] * len(asked),  # one wording each: no paraphrases
        gold,
        harmful,
        distractors,
        meta={
            "top_level_questions": len(by_top),
            "sub_questions": len(subs),
            "notes": n_notes,
            "eligible": len(eligible),
            "questions": len(asked),
            "lookalikes": len(texts) - n_notes,
            "with_lookalikes": sum(bool(h) for h in harmful),
        },
    )


def _wrong_answers(
    s: SubQuestion, sibling_answers: list[str], pool: dict[str, list[str]], n: int, rng: Any
) -> list[str]:
    """Up to ``n`` distinct wrong answers for ``s``: siblings' answers of its shape first, then
    answers of its shape from the whole bank; none holds the true answer, even as a part."""
    if n == 0:
        return []
    kind = shape(s.answer)

    def fits(w: str) -> bool:
        return bool(w) and w != s.answer and not _contains(f"{s.question} {w}", s.answer)

    if kind == "yesno":  # the one wrong answer there is
        return ["No" if s.answer == "Yes" else "Yes"]
    near = [w for w in dict.fromkeys(sibling_answers) if shape(w) == kind and fits(w)]
    far = [w for w in pool.get(kind, []) if fits(w) and w not in near]
    out: list[str] = []
    for options in (near, far):
        while options and len(out) < n:
            out.append(options.pop(int(rng.integers(len(options)))))
    return out
