"""Real text for the real-LM learning benchmark: fictional facts, questions, reference answers.

The bank holds facts about made-up systems (ports, maintainers, prices, versions, hosting
cities, launch months) that no language model can know, so a question's reference answer
is likely only when its supporting fact is in the prompt. Per question:

- one **gold** fact (the attribute asked about);
- **distractors**: the same system's other attributes (similar, useless);
- **harmful** memories: stale notes (a wrong, outdated value) written as the question's own
  wording and an answer, so MiniLM ranks them *above* the gold fact (seed 000's "Zhang San"
  case);
- a **background** of other systems' facts.

Everything is generated from templates and a seed, with no download. :func:`lm_utilities`
then scores, with the evaluator's LM (:class:`pipeline.lm_evaluator.scoring.AnswerScorer`), each
question's answer after every memory set a top-k retrieval over its candidates can read,
and caches the result on disk (docs/benchmarks.md, "Real-LM learning").

>>> ds = build_dataset()
>>> ds == build_dataset() and len(ds.questions) == 48 and len(ds.texts) == 300
True
>>> q = 0
>>> ds.answers[q] in ds.texts[ds.gold[q]] and all(ds.answers[q] not in ds.texts[h] for h in ds.harmful[q])
True
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from causalmem_lab.roles import HARMFUL, HELPFUL, IRRELEVANT

ATTRIBUTES: dict[str, dict[str, Any]] = {
    "port": {
        "fact": "The {e} listens on port {v}.",
        "questions": [
            "Which port does the {e} listen on?",
            "What is the port number of the {e}?",
            "On what network port does the {e} run?",
            "Tell me the port used by the {e}.",
        ],
        "harmful": [
            "Which port does the {e} listen on? Port {w}.",
            "What is the port number of the {e}? It is {w}.",
        ],
    },
    "owner": {
        "fact": "The {e} is maintained by {v}.",
        "questions": [
            "Who maintains the {e}?",
            "Who is the maintainer of the {e}?",
            "Which engineer looks after the {e}?",
            "Tell me who is responsible for the {e}.",
        ],
        "harmful": [
            "Who maintains the {e}? {w}.",
            "Who is the maintainer of the {e}? It is {w}.",
        ],
    },
    "price": {
        "fact": "The {e} costs {v} per month.",
        "questions": [
            "How much does the {e} cost per month?",
            "What is the monthly price of the {e}?",
            "What do we pay each month for the {e}?",
            "Tell me the monthly cost of the {e}.",
        ],
        "harmful": [
            "How much does the {e} cost per month? {w}.",
            "What is the monthly price of the {e}? It is {w}.",
        ],
    },
    "version": {
        "fact": "The current version of the {e} is {v}.",
        "questions": [
            "What is the current version of the {e}?",
            "Which version of the {e} is running?",
            "What release of the {e} do we use now?",
            "Tell me the latest version of the {e}.",
        ],
        "harmful": [
            "What is the current version of the {e}? Version {w}.",
            "Which version of the {e} is running? It is {w}.",
        ],
    },
    "city": {
        "fact": "The {e} is hosted in {v}.",
        "questions": [
            "Where is the {e} hosted?",
            "In which city is the {e} hosted?",
            "Which data centre city runs the {e}?",
            "Tell me where the {e} is located.",
        ],
        "harmful": [
            "Where is the {e} hosted? In {w}.",
            "In which city is the {e} hosted? It is {w}.",
        ],
    },
    "launch": {
        "fact": "The {e} was launched in {v}.",
        "questions": [
            "When was the {e} launched?",
            "In which month did the {e} launch?",
            "What was the launch date of the {e}?",
            "Tell me when the {e} went live.",
        ],
        "harmful": [
            "When was the {e} launched? In {w}.",
            "In which month did the {e} launch? It was {w}.",
        ],
    },
}


def _words(text: str) -> list[str]:
    return text.split()


SYLLABLES = _words("kor vath tes sa line brin dle quor vin zel mar oth pel dra nix ul ter gan sor vey lum ket ra fen")
KINDS = ["gateway", "scheduler", "ledger", "cache", "indexer", "router", "vault", "broker", "tracker", "archive"]
FIRST = _words(
    "Ilsa Tomas Renata Oskar Mireille Dagny Feliks Anouk Brannock Yelena Corvin Signe Lazlo Petra Emeric Ottilie"
)
LAST = _words(
    "Varnholt Kessridge Drummel Okonkwo-Lind Salvatierra Pelletreau "
    "Hrabal Quennell Vossberg Marchetti-Ruiz Thorsgaard Ilves"
)
CITIES = _words(
    "Varnholm Kestrelby Dunmarrow Ostravel Pellinor Quillhaven Sarnevik Tolvane Wrexmoor Ambergate Brisklow Corrowen"
)
MONTHS = _words("January February March April May June July August September October November December")


def _value(attr: str, rng: np.random.Generator) -> str:
    if attr == "port":
        return str(int(rng.integers(2000, 9999)))
    if attr == "owner":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if attr == "price":
        return f"{int(rng.integers(12, 990))} euros"
    if attr == "version":
        return f"{int(rng.integers(2, 9))}.{int(rng.integers(10, 40))}"
    if attr == "city":
        return str(rng.choice(CITIES))
    return f"{rng.choice(MONTHS)} {int(rng.integers(2011, 2024))}"


@dataclass(frozen=True)
class LMDataset:
    """Memories, questions with a reference answer each, and every question's roles.

    ``fact[i]`` / ``paraphrase[i]`` say which fact question ``i`` asks about and in which
    wording; questions with the same fact share their gold, harmful and distractor memories.
    """

    seed: int
    texts: list[str]
    questions: list[str]
    answers: list[str]
    fact: list[int]
    paraphrase: list[int]
    gold: list[int]
    harmful: list[list[int]]
    distractors: list[list[int]]
    meta: dict[str, int] = field(default_factory=dict)

    def roles(self, q: int) -> dict[int, int]:
        """Slot → role for question ``q`` (slots not listed are irrelevant background)."""
        out = {s: IRRELEVANT for s in self.distractors[q]}
        out.update({s: HARMFUL for s in self.harmful[q]})
        out[self.gold[q]] = HELPFUL
        return out

    def digest(self) -> str:
        """A hash of the whole content: a cache built for other text is never reused."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def build_dataset(seed: int = 0, asked: int = 6, attrs_asked: int = 2, background: int = 40) -> LMDataset:
    """The bank: ``asked`` systems with ``attrs_asked`` questioned attributes each, plus background.

    Each asked fact gets every paraphrase of its attribute's question templates (4), so the
    default is 6 × 2 × 4 = 48 questions over 36 + 24 + 240 = 300 memories.
    """
    rng = np.random.default_rng(seed)
    names: list[str] = []
    while len(names) < asked + background:
        word = "".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 4)))).capitalize()
        name = f"{word} {rng.choice(KINDS)}"
        if name not in names:
            names.append(name)
    texts: list[str] = []
    slot_of: dict[tuple[int, str], int] = {}
    values: dict[tuple[int, str], str] = {}
    for e, name in enumerate(names):
        for attr, spec in ATTRIBUTES.items():
            values[e, attr] = _value(attr, rng)
            slot_of[e, attr] = len(texts)
            texts.append(spec["fact"].format(e=name, v=values[e, attr]))
    questions: list[str] = []
    answers: list[str] = []
    fact: list[int] = []
    paraphrase: list[int] = []
    gold: list[int] = []
    harmful: list[list[int]] = []
    distractors: list[list[int]] = []
    attr_names = list(ATTRIBUTES)
    n_fact = 0
    for e in range(asked):
        chosen = [attr_names[int(i)] for i in rng.choice(len(attr_names), size=attrs_asked, replace=False)]
        for attr in chosen:
            spec = ATTRIBUTES[attr]
            bad = []
            for template in spec["harmful"]:
                wrong = values[e, attr]
                while wrong == values[e, attr]:
                    wrong = _value(attr, rng)
                bad.append(len(texts))
                texts.append(template.format(e=names[e], w=wrong))
            others = [slot_of[e, a] for a in attr_names if a != attr]
            for p, template in enumerate(spec["questions"]):
                questions.append(template.format(e=names[e]))
                answers.append(values[e, attr])
                fact.append(n_fact)
                paraphrase.append(p)
                gold.append(slot_of[e, attr])
                harmful.append(list(bad))
                distractors.append(list(others))
            n_fact += 1
    return LMDataset(
        seed,
        texts,
        questions,
        answers,
        fact,
        paraphrase,
        gold,
        harmful,
        distractors,
        meta={"asked": asked, "attrs_asked": attrs_asked, "background": background},
    )


# --------------------------------------------------------------------------- utilities by the LM


def subset_masks(c: int, k: int) -> list[int]:
    """Every set of at most ``k`` of ``c`` candidates, as bit masks over candidate positions.

    >>> len(subset_masks(6, 3))  # C(6,3) + C(6,2) + C(6,1) + 1
    42
    """
    return [sum(1 << i for i in combo) for r in range(k + 1) for combo in itertools.combinations(range(c), r)]


@dataclass
class LMUtilities:
    """Each question's candidates and the LM's answer NLL after every memory set it can read.

    ``nll[q, mask]`` is the mean answer-span NLL after the prompt holding the candidates whose
    positions are the bits of ``mask``, listed in candidate (similarity) order: a set has one
    prompt, whatever order a draw picked it in. ``nll[q, 0]`` is the empty prompt (NaN for
    masks of more than ``k`` bits, never scored). ``fallback[q]`` is what the retriever's BM25
    fallback returns when the hard drop leaves nothing, ``nll_fallback[q]`` its NLL.
    """

    candidates: np.ndarray  # (Q, C) slots, by descending MiniLM similarity
    similarity: np.ndarray  # (Q, C)
    nll: np.ndarray  # (Q, 2**C)
    fallback: np.ndarray  # (Q, k) slots
    nll_fallback: np.ndarray  # (Q,)
    memory: np.ndarray  # (N, 384) MiniLM embeddings of the memories (unit norm)
    query: np.ndarray  # (Q, 384) and of the questions
    key: str
    k: int

    def mask(self, q: int, selected: list[int]) -> int | None:
        """The bit mask of ``selected`` among question ``q``'s candidates (None: not all are)."""
        pos = {int(s): i for i, s in enumerate(self.candidates[q])}
        if any(int(s) not in pos for s in selected):
            return None
        return sum(1 << pos[int(s)] for s in set(selected))

    def nll_of(self, q: int, selected: list[int]) -> float:
        """The answer NLL after ``selected`` (any order); KeyError for a set never scored."""
        m = self.mask(q, selected)
        if m is not None and np.isfinite(self.nll[q, m]):
            return float(self.nll[q, m])
        if set(selected) == {int(s) for s in self.fallback[q]}:
            return float(self.nll_fallback[q])
        raise KeyError(f"question {q}: memory set {sorted(selected)} was not scored")

    def utility(self, q: int, selected: list[int]) -> float:
        """``nll_without − nll_with``: how much ``selected`` lowers the answer's NLL."""
        return float(self.nll[q, 0]) - self.nll_of(q, selected)

    def oracle(self, q: int) -> float:
        """The best utility any non-empty set of at most ``k`` candidates reaches."""
        return float(np.nanmax(self.nll[q, 0] - self.nll[q, 1:]))


def cache_path(cache_dir: Path, model_key: str, data_key: str, c: int, k: int) -> Path:
    return cache_dir / f"{model_key}-{data_key}-c{c}k{k}.npz"


def model_key(path: Path) -> str:
    """A hash of the model file (or a directory's weight and config files)."""
    h = hashlib.sha256()
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.suffix in {".json", ".safetensors", ".bin", ".gguf"})
    )
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "causalmem" / "lm-utilities"


def embed(texts: list[str]) -> np.ndarray:
    from causalmem_lab.textdata import load_encoder

    out = load_encoder().encode(
        texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    )
    return np.asarray(out, np.float32)


def lm_utilities(
    ds: LMDataset,
    scorer: Any = None,
    *,
    c: int = 6,
    k: int = 3,
    cache_dir: Path | None = None,
    model: str = "",
    console: Any = None,
    embedder: Any = embed,
) -> LMUtilities:
    """The LM's utilities for ``ds``, from the cache when it holds them, else computed and saved.

    The cache file is named by a hash of the model file, of the dataset and by ``c`` and
    ``k``; changing any of them computes anew. ``scorer`` (an object with
    ``nll(prompts, answers)``) is built from ``model`` only on a cache miss.
    """
    import faiss

    from pipeline.client.retriever import BM25Fallback
    from pipeline.lm_evaluator.scoring import build_prompt, default_model_path

    mkey = getattr(scorer, "cache_key", None) or model_key(Path(model) if model else default_model_path())
    path = cache_path(cache_dir or default_cache_dir(), mkey, ds.digest(), c, k)
    if path.exists():
        z = np.load(path)
        return LMUtilities(
            z["candidates"],
            z["similarity"],
            z["nll"],
            z["fallback"],
            z["nll_fallback"],
            z["memory"],
            z["query"],
            path.stem,
            k,
        )
    memory = embedder(ds.texts)
    query = embedder(ds.questions)
    # The retriever's own search (faiss, inner product): its candidates are the scored ones, ties included.
    index = faiss.IndexFlatIP(memory.shape[1])
    index.add(memory)
    sims, cand = index.search(query, c)
    bm25 = BM25Fallback(ds.texts)
    fallback = np.array([(bm25(qt, query[i], k) + [-1] * k)[:k] for i, qt in enumerate(ds.questions)], np.int64)
    masks = subset_masks(c, k)
    prompts, answers, where = [], [], []
    for q in range(len(ds.questions)):
        for m in masks:
            prompts.append(build_prompt(ds.questions[q], [ds.texts[int(cand[q, i])] for i in range(c) if m >> i & 1]))
            answers.append(ds.answers[q])
            where.append((q, m))
        prompts.append(build_prompt(ds.questions[q], [ds.texts[int(s)] for s in fallback[q] if s >= 0]))
        answers.append(ds.answers[q])
        where.append((q, -1))
    if scorer is None:
        from pipeline.lm_evaluator.scoring import AnswerScorer, ScorerConfig

        scorer = AnswerScorer(ScorerConfig(model=model))
    values = _score(scorer, prompts, answers, console)
    nll = np.full((len(ds.questions), 1 << c), np.nan)
    nll_fb = np.full(len(ds.questions), np.nan)
    for (q, m), v in zip(where, values, strict=True):
        if m < 0:
            nll_fb[q] = v
        else:
            nll[q, m] = v
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(
        tmp,
        candidates=cand,
        similarity=sims,
        nll=nll,
        fallback=fallback,
        nll_fallback=nll_fb,
        memory=memory,
        query=query,
    )
    tmp.replace(path)
    return LMUtilities(cand, sims, nll, fallback, nll_fb, memory, query, path.stem, k)


def _score(scorer: Any, prompts: list[str], answers: list[str], console: Any) -> np.ndarray:
    """Score in chunks under a progress bar (the first computation takes minutes)."""
    rp = importlib.import_module("rich.progress")
    chunk = 128
    out = np.empty(len(prompts))
    columns = (
        rp.TextColumn("[bold]LM utilities[/]"),
        rp.BarColumn(),
        rp.MofNCompleteColumn(),
        rp.TimeRemainingColumn(),
    )
    with rp.Progress(*columns, console=console) as progress:
        task = progress.add_task("score", total=len(prompts))
        for a in range(0, len(prompts), chunk):
            out[a : a + chunk] = scorer.nll(prompts[a : a + chunk], answers[a : a + chunk])
            progress.update(task, completed=min(len(prompts), a + chunk))
    return out
