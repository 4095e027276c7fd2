"""Decisions made by an id alone: the same in every process and on every replay.

>>> keep_by_id("e1", 0.0), keep_by_id("e1", 1.0)
(False, True)
>>> sum(keep_by_id(f"e{i}", 0.25) for i in range(4000)) / 4000  # doctest: +ELLIPSIS
0.2...
"""

from __future__ import annotations

import hashlib


def keep_by_id(key: str, rate: float) -> bool:
    """True for a share ``rate`` of keys, decided by a hash of ``key``."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < rate
