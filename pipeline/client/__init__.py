"""The service API: what an agent or RAG service imports.

>>> from pipeline.client import CausalRetriever, EventPublisher, SyncEventPublisher, PolicySubscriber

Each takes a :class:`~pipeline.config.Connection` (or a whole ``Settings``, whose part is
taken). Needs none of faust, matplotlib, rich or yaml.
"""

from pipeline.client.follower import MemoryFollower
from pipeline.client.publisher import EventPublisher, SyncEventPublisher
from pipeline.client.retriever import CausalRetriever, RetrievalResult
from pipeline.client.subscriber import LoadedPolicy, PolicySubscriber, fetch_checkpoint
from pipeline.config import Connection

__all__ = [
    "CausalRetriever",
    "Connection",
    "EventPublisher",
    "LoadedPolicy",
    "MemoryFollower",
    "PolicySubscriber",
    "RetrievalResult",
    "SyncEventPublisher",
    "fetch_checkpoint",
]
