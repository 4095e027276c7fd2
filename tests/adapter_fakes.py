"""Shared pieces of the adapter tests: deterministic embeddings, a policy, a recording publisher."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
import torch

from models.policy.network import PolicyNetwork
from pipeline.client.subscriber import LoadedPolicy
from pipeline.config import Connection, Settings
from topics.events import decode_retrieval_event
from topics.feedback import decode_llm_feedback
from topics.fields import Limits, encode
from topics.manifest import Manifest

DIM = 16
SLOTS = 32
CONN = Connection.of(Settings(embedding_dim=DIM, slots=SLOTS))

TEXTS = {
    "pizza": "The user ordered a margherita pizza on Friday.",
    "sushi": "The user ordered salmon sushi last week.",
    "flight": "The user's flight to Lisbon leaves on Monday.",
    "hotel": "The user booked a hotel in Lisbon near the river.",
    "cat": "The user's cat is called Miso.",
    "dog": "The user walks the neighbour's dog on Sundays.",
}


def hashed_embedding(text: str, dim: int = DIM) -> list[float]:
    """Bag of hashed words, normalised: texts sharing words are similar (deterministic, no download)."""
    v = np.zeros(dim)
    for word in re.findall(r"[a-z]+", text.lower()):
        h = int(hashlib.sha1(word.encode()).hexdigest(), 16)
        v[h % dim] += 1.0 if (h >> 8) % 2 else -1.0
    n = np.linalg.norm(v)
    return (v / n if n else v).tolist()


def policy(
    version: int = 1,
    reason: str = "periodic",
    bias: dict[int, float] | None = None,
    zero: bool = False,
    serving: dict[str, Any] | None = None,
) -> LoadedPolicy:
    """A policy whose mask is set by its output bias only (hidden weights zero): m_s = softplus(bias_s);
    ``serving``: its manifest's serving values (None: none, the contract's defaults)."""
    torch.manual_seed(0)
    net = PolicyNetwork(embedding_dim=DIM, slots=SLOTS, hidden=8)
    with torch.no_grad():
        net.out.weight.zero_()
        net.out.bias.fill_(-30.0 if zero else 0.0)
        for s, b in (bias or {}).items():
            net.out.bias[s] = b
    net.eval()
    manifest = Manifest(
        "default",
        version,
        1.0,
        reason,
        net.arch.to_dict(),
        0.5,
        0.0,
        "0" * 64,
        1,
        1,
        {},
        {"experiences:0": 0},
        serving=serving,
    )
    return LoadedPolicy(manifest=manifest, net=net)


class Recorder:
    """A sync publisher that validates each value as the pipeline will, and keeps it."""

    def __init__(self, limits: Limits = CONN.limits) -> None:
        self.values: list[Any] = []
        self.limits = limits

    def publish(self, value: Any) -> None:
        raw = encode(value.to_dict())
        decode = decode_retrieval_event if value.SCHEMA.startswith("retrieval") else decode_llm_feedback
        decode(raw, self.limits)
        self.values.append(value)


class AsyncRecorder(Recorder):
    async def publish(self, value: Any) -> None:  # type: ignore[override]
        Recorder.publish(self, value)
