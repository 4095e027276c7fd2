"""Topic names and configurations (docs/contract.md §2), and the decoder of each input topic.

Every topic name may carry a configurable prefix. Input topics that are joined are
co-partitioned by ``query_id``: they share one partition count so that a key lands on the
same partition number in each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from topics.events import decode_retrieval_event
from topics.feedback import decode_llm_feedback
from topics.labels import decode_active_learning_sample, decode_human_label
from topics.lifecycle import decode_memory_record
from topics.writes import decode_memory_write

DAY_MS = 24 * 3600 * 1000
SEVEN_DAYS_MS = 7 * DAY_MS  # the input topics' retention, and rejected proposals' by default
DEFAULT_PARTITIONS = 8  # of the co-partitioned topics (the partitions setting refers to it)
DEFAULT_MIN_INSYNC = 1  # leaves the broker's default (the min_insync_replicas setting refers to it)


@dataclass(frozen=True)
class TopicSpec:
    """One topic: name, partition count, replication factor and creation-time configs."""

    name: str
    partitions: int
    configs: dict[str, str] = field(default_factory=dict)
    description: str = ""
    replication: int = 1  # replicas of each partition (the embedded broker has one node)


@dataclass(frozen=True)
class Topics:
    """The product's topics for one deployment (one prefix, one partition count).

    >>> t = Topics.build(prefix="dev.", partitions=4)
    >>> t.retrieval_events.name, t.retrieval_events.partitions
    ('dev.retrieval-events', 4)
    >>> t.policy_checkpoints.partitions
    1

    On a cluster of several brokers each partition has ``replication_factor`` copies, and a
    write with ``acks=all`` (every producer of the product) needs ``min_insync_replicas``
    of them (1 leaves the broker's own default):

    >>> t = Topics.build(replication_factor=3, min_insync_replicas=2)
    >>> t.control.replication, t.control.configs["min.insync.replicas"]
    (3, '2')
    >>> "min.insync.replicas" in Topics.build().control.configs
    False
    """

    retrieval_events: TopicSpec
    llm_feedback: TopicSpec
    human_labels: TopicSpec
    active_learning: TopicSpec
    policy_checkpoints: TopicSpec
    dead_letter: TopicSpec
    experiences: TopicSpec
    outcomes: TopicSpec
    rating_pairs: TopicSpec
    control: TopicSpec
    epoch: TopicSpec
    memory_writes: TopicSpec
    memory_writes_rejected: TopicSpec
    memory_lifecycle: TopicSpec
    prefix: str = ""

    @classmethod
    def build(
        cls,
        prefix: str = "",
        partitions: int = DEFAULT_PARTITIONS,
        retention_ms: int = SEVEN_DAYS_MS,
        replication_factor: int = TopicSpec.replication,
        min_insync_replicas: int = DEFAULT_MIN_INSYNC,
        rejected_writes_retention_ms: int = SEVEN_DAYS_MS,
    ) -> Topics:
        if partitions < 1:
            raise ValueError("partitions must be >= 1")
        if replication_factor < 1 or not 1 <= min_insync_replicas <= replication_factor:
            raise ValueError("need 1 <= min_insync_replicas <= replication_factor")
        keep = {"cleanup.policy": "delete", "retention.ms": str(retention_ms)}
        # The learner warms up on 7 days of experiences and restores from offsets in the
        # manifest, so its input must be kept at least that long.
        keep_longer = {"cleanup.policy": "delete", "retention.ms": str(2 * SEVEN_DAYS_MS)}
        # 1 leaves the broker's default (min.insync.replicas may be set cluster-wide).
        durable = {"min.insync.replicas": str(min_insync_replicas)} if min_insync_replicas > 1 else {}

        def spec(name: str, n: int, configs: dict[str, str], doc: str) -> TopicSpec:
            return TopicSpec(prefix + name, n, {**configs, **durable}, doc, replication_factor)

        return cls(
            retrieval_events=spec("retrieval-events", partitions, keep, "serving side: RetrievalEvent"),
            llm_feedback=spec("llm-feedback", partitions, keep, "LLM evaluator: LLMFeedback"),
            human_labels=spec("human-labels", partitions, keep, "labelers: HumanLabel"),
            active_learning=spec("active-learning", partitions, keep, "pipeline: ActiveLearningSample"),
            policy_checkpoints=spec(
                "policy-checkpoints",
                1,
                {"cleanup.policy": "compact", "max.message.bytes": str(1024 * 1024)},
                "learner: checkpoint chunks + manifests",
            ),
            dead_letter=spec("dead-letter", 1, keep, "pipeline: rejected message + reason"),
            # Internal. One partition: the learner is the single writer of the policy and
            # reads its input in one order, so a restart replays exactly the same batches.
            experiences=spec("experiences", 1, keep_longer, "internal: joined experiences and labels"),
            # Internal, co-partitioned with the inputs: per-batch outcome records for the
            # faust stages (active learning, U_query), one message per join batch.
            outcomes=spec("outcomes", partitions, keep, "internal: batched join outcomes"),
            rating_pairs=spec("rating-pairs", 1, keep_longer, "internal: (U_query, rating) pairs"),
            control=spec("control", 1, keep_longer, "internal: commands to the learner (reset)"),
            # One marker message, written when the topics are created: an empty epoch topic
            # means the cluster lost everything (an embedded broker restarted).
            epoch=spec("epoch", 1, {"cleanup.policy": "compact"}, "internal: cluster epoch marker"),
            # Proposed memories (seed 004), keyed by write_id; the write gate shares the partitions.
            memory_writes=spec("memory-writes", partitions, keep, "agents: MemoryWrite proposals"),
            # Kept for review, one per write_id (compacted), dropped after the review period.
            memory_writes_rejected=spec(
                "memory-writes-rejected",
                1,
                {"cleanup.policy": "compact,delete", "retention.ms": str(rejected_writes_retention_ms)},
                "write gate: RejectedWrite, kept for review",
            ),
            # Contract 1.3. Compacted: the newest record of each memory id is what counts.
            # One partition: the learner assigns slots in the topic's order, so a replay
            # assigns the same slots (docs/contract.md §9.1).
            memory_lifecycle=spec(
                "memory-lifecycle", 1, {"cleanup.policy": "compact"}, "memory stores: MemoryRecord (add/update/remove)"
            ),
            prefix=prefix,
        )

    def all(self) -> list[TopicSpec]:
        return [
            self.retrieval_events,
            self.llm_feedback,
            self.human_labels,
            self.active_learning,
            self.policy_checkpoints,
            self.dead_letter,
            self.experiences,
            self.outcomes,
            self.rating_pairs,
            self.control,
            self.epoch,
            self.memory_writes,
            self.memory_writes_rejected,
            self.memory_lifecycle,
        ]

    def inputs(self) -> list[TopicSpec]:
        """The topics users write to."""
        return [self.retrieval_events, self.llm_feedback, self.human_labels, self.memory_lifecycle]

    def by_short_name(self, short: str) -> TopicSpec:
        """Look a topic up by its unprefixed name, e.g. ``"llm-feedback"``."""
        for spec in self.all():
            if spec.name == self.prefix + short:
                return spec
        raise KeyError(short)


# The decoder of each topic that users write to or read, by unprefixed name; each takes
# ``(raw, limits, key)``.
DECODERS: dict[str, Callable[..., Any]] = {
    "retrieval-events": decode_retrieval_event,
    "llm-feedback": decode_llm_feedback,
    "human-labels": decode_human_label,
    "active-learning": decode_active_learning_sample,
    "memory-writes": decode_memory_write,
    "memory-lifecycle": decode_memory_record,
}
