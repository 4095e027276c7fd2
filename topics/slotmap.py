"""The id → slot map on the model topic (docs/contract.md §9.1, contract 1.3).

The learner publishes one record per slot whose owner changed, under the key
``"{policy}/slot/{slot}"``, just before the manifest of the version that first holds the
change. The topic is compacted, so the newest record of each slot is the map: a client
reads it once from the beginning and then follows the changes. A reader of contract 1.2
ignores these keys (its key parser classifies them as unknown).

A record says which memory holds the slot (``live``), or which memory left it
(``live: false``, a tombstone), and from which policy ``version`` that holds: a client
serving version v maps a memory to its slot only when the loaded checkpoint has the
memory's row (:meth:`SlotTable.slot_of`).

>>> r = SlotRecord("default", 5, "doc-7", live=True, version=12, since=12, ts=1.0)
>>> r.key, decode_slot_record(r.to_bytes(), key=r.key.encode()) == r
('default/slot/5', True)
>>> t = SlotTable()
>>> t.apply(r)
>>> t.slot_of("doc-7", version=11), t.slot_of("doc-7", version=12)
(None, 5)
>>> t.apply(SlotRecord("default", 5, "doc-7", live=False, version=15, since=12, ts=9.0))
>>> t.slot_of("doc-7", version=14), t.slot_of("doc-7", version=15)
(5, None)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from topics.fields import Limits, Rejected, WireValue, check_key, encode, open_value
from topics.manifest import key_number
from topics.signing import Key, sign, verify_signature

SCHEMA_SLOT = "slot_map/v1"
SLOT_KEY_PART = "slot"
MAX_SLOT = 2**31


def slot_key(policy: str, slot: int) -> str:
    return f"{policy}/{SLOT_KEY_PART}/{slot}"


def parse_slot_key(key: str) -> tuple[str, int] | None:
    """``(policy, slot)`` of a slot-map key; None for any other model-topic key.

    >>> parse_slot_key("default/slot/3"), parse_slot_key("default/3/0")
    (('default', 3), None)
    """
    parts = key.split("/")
    slot = key_number(parts[2]) if len(parts) == 3 and parts[1] == SLOT_KEY_PART else None
    return (parts[0], slot) if slot is not None else None


@dataclass(frozen=True, slots=True)
class SlotRecord(WireValue):
    """One slot's newest owner: ``memory_id`` holds ``slot`` from ``version`` on (``live``), or left it then."""

    SCHEMA: ClassVar[str] = SCHEMA_SLOT
    FIELDS: ClassVar[tuple[str, ...]] = ("policy", "slot", "memory_id", "live", "version", "since", "ts")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("signature",)  # contract 1.7

    policy: str
    slot: int
    memory_id: str
    live: bool
    version: int  # live: the first version with the memory's row; tombstone: the first version without it
    since: int  # the first version with the memory's row (equals ``version`` on a live record)
    ts: float  # event time of the lifecycle record behind the change (a tombstone's grace runs from it)
    signature: str | None = None  # contract 1.7: "hmac-sha256:<hex>" when the learner has a signing key

    @property
    def key(self) -> str:
        return slot_key(self.policy, self.slot)

    def to_bytes(self, signing_key: Key | None = None) -> bytes:
        """The record's value; signed (the manifests' HMAC, ``topics.manifest.sign``) with ``signing_key``.

        >>> r = SlotRecord("default", 5, "doc-7", live=True, version=12, since=12, ts=1.0)
        >>> decode_slot_record(r.to_bytes(b"k"), signing_key=b"k").signature.startswith("hmac-sha256:")
        True
        >>> decode_slot_record(r.to_bytes(), signing_key=b"k")
        Traceback (most recent call last):
        ...
        topics.fields.Rejected: inconsistent: slot-map record: signature missing or not the configured key's
        """
        obj = self.to_dict()
        if signing_key is not None:
            obj["signature"] = sign(obj, signing_key)
        return encode(obj)


def decode_slot_record(
    raw: bytes, key: Any = None, limits: Limits | None = None, signing_key: Key | None = None
) -> SlotRecord:
    """A slot-map value, validated; ``key`` (when given) must be the record's own key; with
    ``signing_key`` its signature must be that key's (contract 1.7)."""
    f = open_value(raw, limits or Limits(), SCHEMA_SLOT)
    if signing_key is not None and not verify_signature(f.obj, signing_key):
        raise Rejected("inconsistent", "slot-map record: signature missing or not the configured key's")
    record = SlotRecord(
        policy=f.str_("policy", max_len=128),
        slot=f.int_("slot", 0, MAX_SLOT),
        memory_id=f.str_("memory_id"),
        live=f.bool_("live"),
        version=f.int_("version", 1, 2**53),
        since=f.int_("since", 1, 2**53),
        ts=f.float_("ts", 0.0, 1e11),
        signature=f.str_("signature", required=False, empty_ok=True),
    )
    if record.since > record.version:
        raise Rejected("inconsistent", "since is above version")
    if key is not None:
        check_key(key, record.key, "slot-map key")
    return record


class SlotTable:
    """The map as a reader holds it: the newest record of each slot, and an index by memory id."""

    def __init__(self) -> None:
        self.by_slot: dict[int, SlotRecord] = {}
        self.by_id: dict[str, SlotRecord] = {}  # the newest record naming each memory

    def __len__(self) -> int:
        return len(self.by_slot)

    def __iter__(self) -> Iterator[SlotRecord]:
        return iter(self.by_slot.values())

    def apply(self, record: SlotRecord) -> None:
        old = self.by_slot.get(record.slot)
        if old is not None and self.by_id.get(old.memory_id) is old:
            del self.by_id[old.memory_id]
        self.by_slot[record.slot] = record
        current = self.by_id.get(record.memory_id)
        if current is None or current.version <= record.version:
            self.by_id[record.memory_id] = record

    def slot_of(self, memory_id: str, version: int) -> int | None:
        """The slot whose row serves ``memory_id`` in policy ``version``; None when that version has none."""
        r = self.by_id.get(memory_id)
        if r is None:
            return None
        if r.live:
            return r.slot if version >= r.version else None
        return r.slot if r.since <= version < r.version else None

    def latest_slot(self, memory_id: str) -> int | None:
        """The slot the learner gave ``memory_id`` most recently, whatever version is loaded."""
        r = self.by_id.get(memory_id)
        return r.slot if r is not None and r.live else None
