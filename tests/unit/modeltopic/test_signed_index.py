"""The model-topic index with a signing key (contract 1.7): an unsigned chunk or canary tombstone
is rejected, a signed one followed; without a key tombstones are followed as before."""

from __future__ import annotations

from pipeline.modeltopic import ModelTopicIndex
from topics.signing import TOMBSTONE_HEADER, tombstone_signature

KEY = b"k"


def test_index_rejects_an_unsigned_tombstone_with_a_key_only() -> None:
    signed = ModelTopicIndex(signing_key=KEY)
    unsigned = ModelTopicIndex()
    for index in (signed, unsigned):
        index.observe(0, b"default/1/0", b"chunk")
        index.observe(1, b"default/1/0", None)
    assert signed.chunk_offsets == {("default", 1): {0: 0}} and signed.rejected[0][0] == 1
    assert unsigned.chunk_offsets == {("default", 1): {}} and unsigned.rejected == []


def test_index_follows_a_signed_tombstone() -> None:
    index = ModelTopicIndex(signing_key=KEY)
    index.observe(0, b"default/1/0", b"chunk")
    index.observe(1, b"default/1/0", None, [(TOMBSTONE_HEADER, tombstone_signature(b"default/1/0", b"other"))])
    assert index.chunk_offsets == {("default", 1): {0: 0}}
    index.observe(2, b"default/1/0", None, [(TOMBSTONE_HEADER, tombstone_signature(b"default/1/0", KEY))])
    assert index.chunk_offsets == {("default", 1): {}}
    assert [offset for offset, _ in index.rejected] == [1]


def test_a_flood_of_rejections_is_counted_but_not_all_kept() -> None:
    from pipeline.modeltopic import KEEP_REJECTIONS

    index = ModelTopicIndex(signing_key=KEY)
    for offset in range(5 * KEEP_REJECTIONS):
        index.observe(offset, b"default", b"{not a manifest")
    assert index.rejected_total == 5 * KEEP_REJECTIONS
    assert len(index.rejected) <= 2 * KEEP_REJECTIONS and index.rejected[-1][0] == 5 * KEEP_REJECTIONS - 1


def test_a_base_record_is_a_served_version_signed_for_the_base_key_only() -> None:
    """Contract 1.25: the manifest of the version probes name, under ``"{policy}/base"``, signed
    for that key: the index holds it as that version's manifest (compaction may have removed the
    serving one); a candidate's signed manifest replayed there is rejected, as under any key."""
    from models.policy.network import Arch
    from topics.fields import encode
    from topics.manifest import Manifest, base_key

    def signed(role: str) -> bytes:
        arch = Arch(8, 6, 4).to_dict()
        m = Manifest("default", 2, 0.0, "periodic", arch, 0.5, 0.0, "0" * 64, 1, 1).signed(KEY, role=role)
        return encode(m.to_dict())

    index = ModelTopicIndex(signing_key=KEY)
    assert index.observe(0, base_key("default").encode(), signed("candidate"))[0] == "rejected"
    kind, manifest = index.observe(1, base_key("default").encode(), signed("base"))
    assert kind == "base" and manifest is not None and index.version("default", 2) == manifest
    assert index.serving_head("default") is None  # not a serving manifest
    assert index.observe(2, b"default", signed("base"))[0] == "rejected"  # nor replayable as one
