"""The model topic (docs/contract.md §7), without torch.

- :mod:`pipeline.modeltopic.publisher`: :class:`CheckpointPublisher`, the learner's writer:
  chunks, then the manifest; tombstones for versions beyond the last few.
- :mod:`pipeline.modeltopic.reader`: :class:`ModelTopicIndex` (what the topic holds),
  :func:`scan_model_topic`, :func:`fetch_blob` and the checks every reader applies.

The publisher needs the reader's index only as a type; the reader never imports the publisher.
"""

from pipeline.modeltopic.publisher import CheckpointPublisher
from pipeline.modeltopic.reader import (
    KEEP_REJECTIONS,
    ModelTopicIndex,
    check_blob,
    chunk_plan,
    fetch_blob,
    model_topic,
    read_range,
    scan_model_topic,
    unsigned_warning,
)

__all__ = [
    "KEEP_REJECTIONS",
    "CheckpointPublisher",
    "ModelTopicIndex",
    "check_blob",
    "chunk_plan",
    "fetch_blob",
    "model_topic",
    "read_range",
    "scan_model_topic",
    "unsigned_warning",
]
