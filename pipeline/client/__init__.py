"""The service API: what an agent or RAG service imports.

>>> from pipeline.client import CausalRetriever, EventPublisher, SyncEventPublisher, PolicySubscriber

Needs none of faust, matplotlib, rich or yaml.
"""

from pipeline.client.publisher import EventPublisher, SyncEventPublisher
from pipeline.client.retriever import CausalRetriever, RetrievalResult
from pipeline.modeltopic import LoadedPolicy, PolicySubscriber

__all__ = [
    "CausalRetriever",
    "EventPublisher",
    "LoadedPolicy",
    "PolicySubscriber",
    "RetrievalResult",
    "SyncEventPublisher",
]
