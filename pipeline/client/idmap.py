"""A persisted map from a vector store's document ids to the pipeline's memory slots.

The policy scores *slots* 0..S−1 (docs/contract.md); a LangChain or LlamaIndex store names
its documents by string ids. The adapters (:mod:`pipeline.client.langchain`,
:mod:`pipeline.client.llamaindex`) give each document id it sees the next free slot and
keep the assignment in a JSON file, so a restarted service maps the same document to the
same slot (the policy's output row for that memory). The file is replaced atomically
(write to a temporary file in the same folder, fsync, rename): a crash leaves the old map
or the new one, never half of one.

The map only grows and is bounded by S: when every slot is taken it raises
:class:`SlotsFull`, saying so. Reusing the slots of deleted documents needs the memory
lifecycle (eviction, retirement of a slot's learned row), which this map will be
replaced by once it exists; until then, size S for the documents the store will hold
(docs/byo-retriever.md).

>>> m = IdSlotMap(slots=2)
>>> m.slot("doc-a"), m.slot("doc-b"), m.slot("doc-a"), m.key(1)
(0, 1, 0, 'doc-b')
>>> try:
...     m.slot("doc-c")
... except SlotsFull as e:
...     print(e)
all 2 memory slots are taken: 'doc-c' has none (raise the pipeline's slots S, or use a new map)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path

import orjson

FORMAT = "causalmem-idmap/v1"


class SlotsFull(RuntimeError):
    """Every slot of the map is taken."""


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` all at once (a temporary file, fsync, rename): a crash
    leaves the old content or the new, never half of it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class IdSlotMap:
    """Document id → slot, first come first served, persisted to ``path`` when given.

    Parameters
    ----------
    slots
        S, the number of memory slots of the pipeline (``Connection.limits.slots``).
    path
        The JSON file; read when it exists (its S must not exceed ``slots``), written after
        every new assignment. None keeps the map in memory.
    """

    def __init__(self, slots: int, path: str | os.PathLike[str] | None = None) -> None:
        if slots < 1:
            raise ValueError("slots must be ≥ 1")
        self.slots = slots
        self.path = Path(path).expanduser() if path is not None else None
        self._by_id: dict[str, int] = {}
        self._by_slot: list[str] = []
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def _load(self, path: Path) -> None:
        try:
            obj = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}: not an id → slot map ({exc})") from exc
        if not isinstance(obj, dict) or obj.get("format") != FORMAT or not isinstance(obj.get("ids"), list):
            raise ValueError(f"{path}: not an id → slot map (format {FORMAT!r} expected)")
        ids = obj["ids"]
        if len(ids) > self.slots:
            raise ValueError(f"{path} maps {len(ids)} ids, more than the {self.slots} slots configured")
        if not all(isinstance(i, str) for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"{path}: ids must be distinct strings")
        self._by_slot = list(ids)
        self._by_id = {k: s for s, k in enumerate(ids)}

    def __len__(self) -> int:
        return len(self._by_slot)

    def __contains__(self, key: object) -> bool:
        return key in self._by_id

    def get(self, key: str) -> int | None:
        """The slot of ``key``, or None when it has none (assigns nothing)."""
        return self._by_id.get(key)

    def slot(self, key: str) -> int:
        """The slot of ``key``, assigning (and persisting) the next free one when it is new."""
        found = self._by_id.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._by_id.get(key)
            if found is not None:
                return found
            if len(self._by_slot) >= self.slots:
                raise SlotsFull(
                    f"all {self.slots} memory slots are taken: {key!r} has none "
                    "(raise the pipeline's slots S, or use a new map)"
                )
            s = len(self._by_slot)
            self._by_slot.append(key)
            self._by_id[key] = s
            try:
                self.save()
            except BaseException:
                self._by_slot.pop()
                del self._by_id[key]
                raise
            return s

    def slots_of(self, keys: list[str]) -> list[int]:
        """:meth:`slot` of each key, in order."""
        return [self.slot(k) for k in keys]

    def key(self, slot: int) -> str:
        """The document id of ``slot`` (IndexError when it is free)."""
        return self._by_slot[slot]

    def assigned(self) -> list[int]:
        """Every assigned slot, ascending."""
        return list(range(len(self._by_slot)))

    def save(self) -> None:
        """Write the map atomically (nothing to do without a path)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = orjson.dumps({"format": FORMAT, "slots": self.slots, "ids": self._by_slot})
        write_atomically(self.path, data)
