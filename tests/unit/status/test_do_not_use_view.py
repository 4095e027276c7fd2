"""``causalmem status``'s "do not use" view: labelers' proposals tallied from ``human-labels``,
operators' suppressions and audit from the newest manifest."""

from __future__ import annotations

from pipeline.modeltopic import ModelTopicIndex
from pipeline.status.render import do_not_use_text
from pipeline.status.suppression import ProposalTally, suppression_view
from topics.fields import Limits, encode
from topics.labels import DO_NOT_USE_PREFIX, HumanLabel


def _mark(event_id: str, labeler: str, slots: list[int], ts: float = 10.0) -> bytes:
    label = HumanLabel(
        event_id,
        "q1",
        ts,
        labeler,
        "memory_choice",
        sample_id=f"{DO_NOT_USE_PREFIX}{slots[0]}",
        correct_memories=[],
        harmful_memories=slots,
    )
    return encode(label.to_dict())


def test_proposals_are_tallied_per_memory_and_suppressed_ones_are_not_open() -> None:
    t = ProposalTally(limits=Limits(slots=64))
    t.observe(_mark("a", "ann", [4]), b"q1")
    t.observe(_mark("b", "bob", [4, 9], ts=20.0), b"q1")
    t.observe(_mark("c", "ann", [4]), b"q1")
    t.observe(b'{"schema": "human_label/v1", "sample_id": "do-not-use:1", "broken', b"q1")  # skipped
    t.observe(None, b"q1")
    other = HumanLabel("d", "q1", 5.0, "ann", "memory_choice", sample_id="s1", correct_memories=[2])
    t.observe(encode(other.to_dict()), b"q1")  # an ordinary answer is no proposal
    view = t.view(suppressed=[])
    assert view["open"] == 2
    assert view["memories"][0] == {"slot": 4, "marks": 3, "labelers": 2, "last_ts": 20.0}
    assert t.view(suppressed=[4])["memories"] == [{"slot": 9, "marks": 1, "labelers": 1, "last_ts": 20.0}]


def test_the_view_reads_the_suppressed_set_and_audit_from_the_newest_manifest() -> None:
    empty = suppression_view(ModelTopicIndex(), "default")
    assert empty == {"suppressed": [], "audit": []}
    text = do_not_use_text({**empty, "proposals": {"open": 1, "memories": [{"slot": 9, "marks": 2, "labelers": 1}]}})
    assert "suppressed none" in text.plain and "9 (2 marks, 1 labelers)" in text.plain
