#!/usr/bin/env python3
"""A LangChain application's vector store, served under the causal memory policy.

The application already has an ``InMemoryVectorStore`` (any LangChain ``VectorStore`` or
retriever works the same way). :class:`pipeline.client.langchain.CausalMemoryRetriever`
wraps it: each question asks the store for candidates with scores, maps their document
ids to memory slots (a JSON id map), serves k of them under the policy that
``PolicySubscriber`` keeps current, and publishes the retrieval event; the application then
sends its own measure of how useful the answer's memories were. With ``--shadow`` the
store's own ranking keeps serving (with a small logged exploration budget) until
``causalmem evaluate --shadow`` cuts over. docs/byo-retriever.md explains each step.

The embeddings are a word-hashing stand-in so that the example needs no model download;
use your application's embeddings (their dimension is the pipeline's D).

    python examples/langchain_example.py                      # starts an embedded broker
    python examples/langchain_example.py --bootstrap 127.0.0.1:19092 --prefix demo.

It prints one JSON line: what was served and how many events reached the topics.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import tempfile
import uuid
from pathlib import Path

import numpy as np
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import InMemoryVectorStore

from pipeline import kafka
from pipeline.broker import EmbeddedBroker
from pipeline.client import EventPublisher, PolicySubscriber
from pipeline.client.langchain import CausalMemoryRetriever
from pipeline.client.shadow import ShadowMode
from pipeline.config import AdapterConfig, Settings

DIM = 64  # the pipeline's D: the dimension of the query embeddings the policy sees
STOP = {"the", "user", "users", "what", "when", "where", "does", "did", "was", "is", "on", "in", "at", "a", "to", "s"}

MEMORIES = {
    "m-pizza": "The user ordered a margherita pizza on Friday.",
    "m-sushi": "The user ordered salmon sushi last week.",
    "m-flight": "The user's flight to Lisbon leaves on Monday at 9:40.",
    "m-hotel": "The user booked a hotel in Lisbon near the river.",
    "m-cat": "The user's cat is called Miso.",
    "m-old-cat": "The user's cat was called Pixel (old note, the user has a new cat).",
}
QUESTIONS = [
    "What did the user order on Friday?",
    "When does the flight to Lisbon leave?",
    "What is the cat called?",
    "Where is the hotel in Lisbon?",
]


class WordHashEmbeddings(Embeddings):
    """A deterministic stand-in for a real embedding model: hashed word counts, normalised."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.embed_query(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        v = np.zeros(DIM)
        for word in set(re.findall(r"[a-z]+", text.lower())) - STOP:
            v[int(hashlib.sha1(word.encode()).hexdigest(), 16) % DIM] += 1.0
        return (v / (np.linalg.norm(v) or 1.0)).tolist()


def usefulness(question: str, docs: list[Document]) -> float:
    """The application's own measure (here: the share of memories sharing a content word with the question)."""
    words = {w for w in re.findall(r"[a-z]{4,}", question.lower())} - {"what", "when", "where", "does"}
    return float(np.mean([bool(words & set(re.findall(r"[a-z]+", d.page_content.lower()))) for d in docs] or [0.0]))


async def run(bootstrap: str, prefix: str, state: Path, shadow: bool) -> dict[str, object]:
    settings = Settings(bootstrap=bootstrap, topic_prefix=prefix, embedding_dim=DIM, slots=64)
    conn = settings.connection()
    await kafka.create_topics(bootstrap, settings)

    store = InMemoryVectorStore(WordHashEmbeddings())  # the application's existing store
    store.add_documents([Document(id=k, page_content=t) for k, t in MEMORIES.items()])

    served = []
    async with EventPublisher(bootstrap, conn) as publisher:
        retriever = CausalMemoryRetriever(
            store,
            conn=conn,
            config=AdapterConfig(k=2, n_candidates=6, seed=0),
            idmap=str(state / "ids.json"),  # document id → slot, kept across restarts
            publisher=publisher,
            shadow=ShadowMode(explore_rate=0.05, path=state / "shadow.json") if shadow else None,
        )
        async with PolicySubscriber(
            bootstrap, conn=conn, on_update=retriever.set_policy, on_canary=retriever.set_canary
        ):
            for question in QUESTIONS:
                qid = f"example-{uuid.uuid4().hex}"  # unique across restarts: the join drops an id seen before
                docs = await retriever.ainvoke(question, query_id=qid)
                # ... the application answers with docs here ...
                await retriever.afeedback(qid, utility=usefulness(question, docs))
                served.append({"question": question, "memories": [d.id for d in docs], "how": retriever.last.decision})
        await publisher.flush()

    events = await kafka.read_all(bootstrap, conn, conn.topics.retrieval_events.name)
    feedback = await kafka.read_all(bootstrap, conn, conn.topics.llm_feedback.name)
    return {"mode": retriever.mode, "served": served, "events": len(events), "feedback": len(feedback)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", help="a running broker (default: start an embedded one for this run)")
    p.add_argument("--prefix", default="example.", help="topic prefix (default 'example.')")
    p.add_argument("--state", help="folder for the id map (default: a temporary one)")
    p.add_argument("--shadow", action="store_true", help="serve the store's own ranking (shadow mode)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(args.state or tmp)
        if args.bootstrap:
            report = asyncio.run(run(args.bootstrap, args.prefix, state, args.shadow))
        else:
            with EmbeddedBroker(log_path=Path(tmp) / "broker.log") as broker:
                report = asyncio.run(run(broker.bootstrap, args.prefix, state, args.shadow))
    print(json.dumps(report))
    return 0 if report["events"] == len(QUESTIONS) and report["feedback"] == len(QUESTIONS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
