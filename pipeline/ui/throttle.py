"""Login throttling: a token bucket per labeler name and one per client address.

Every login attempt — against the labelers file or, in SASL mode, against the broker —
takes one token from the name's bucket and one from the address's before the password is
checked; a successful login gives them back, so only failures are rationed. When either
bucket has no whole token, the attempt is refused (HTTP 429) with the seconds until both
have one (``Retry-After``), and no password is hashed and no broker connection is made
for it.

Per name, a guesser who spreads over many addresses is held to ``burst`` guesses and then
one every ``refill_s``; per address, one client trying many names is held likewise. The
price: anyone can hold a known labeler's name at that pace (they wait a minute between
tries), and labelers behind one proxy share the address bucket, which is why it is larger.

The decision is a pure function of the buckets and the clock (:func:`decide`);
:class:`LoginThrottle` only keeps the buckets, at most ``max_keys`` of them (least
recently used dropped first).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.config import UiConfig


@dataclass(frozen=True)
class Rate:
    """``burst`` attempts at once, then one more every ``refill_s`` seconds."""

    burst: int
    refill_s: float

    def __post_init__(self) -> None:
        if self.burst < 1 or self.refill_s <= 0:
            raise ValueError("a rate needs burst >= 1 and refill_s > 0")


# The defaults are ``causalmem ui``'s (UiConfig, its --login-* flags).
PER_NAME = Rate(burst=UiConfig.login_name_burst, refill_s=UiConfig.login_name_refill_s)
PER_ADDRESS = Rate(burst=UiConfig.login_address_burst, refill_s=UiConfig.login_address_refill_s)


@dataclass(frozen=True)
class Bucket:
    tokens: float
    at: float  # when ``tokens`` was counted


def refill(bucket: Bucket | None, rate: Rate, now: float) -> Bucket:
    """The bucket at ``now``: a new key starts full; tokens come back at ``1 / refill_s`` per second.

    >>> r = Rate(burst=2, refill_s=10.0)
    >>> refill(None, r, 0.0), refill(Bucket(0.0, 0.0), r, 5.0), refill(Bucket(1.0, 0.0), r, 100.0)
    (Bucket(tokens=2, at=0.0), Bucket(tokens=0.5, at=5.0), Bucket(tokens=2, at=100.0))
    """
    if bucket is None:
        return Bucket(rate.burst, now)
    return Bucket(min(rate.burst, bucket.tokens + max(0.0, now - bucket.at) / rate.refill_s), now)


@dataclass(frozen=True)
class Verdict:
    """May this attempt go ahead; if not, after how many seconds it may."""

    allowed: bool
    retry_after_s: float = 0.0

    @property
    def retry_after(self) -> str:
        """The ``Retry-After`` header value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


def decide(buckets: Sequence[tuple[Bucket, Rate]]) -> Verdict:
    """Allowed when every bucket holds a whole token; else the longest wait until each does.

    >>> r = Rate(burst=5, refill_s=60.0)
    >>> decide([(Bucket(1.0, 0.0), r), (Bucket(3.0, 0.0), r)])
    Verdict(allowed=True, retry_after_s=0.0)
    >>> decide([(Bucket(0.5, 0.0), r), (Bucket(0.0, 0.0), r)])
    Verdict(allowed=False, retry_after_s=60.0)
    """
    wait = max((0.0 if b.tokens >= 1.0 else (1.0 - b.tokens) * rate.refill_s) for b, rate in buckets)
    return Verdict(wait == 0.0, wait)


class LoginThrottle:
    """The buckets of recent login attempts, by name and by address (in memory, bounded)."""

    @classmethod
    def of(cls, config: UiConfig) -> LoginThrottle:
        """The throttle ``causalmem ui`` runs with (its ``--login-*`` options)."""
        return cls(
            per_name=Rate(config.login_name_burst, config.login_name_refill_s),
            per_address=Rate(config.login_address_burst, config.login_address_refill_s),
        )

    def __init__(
        self,
        *,
        per_name: Rate = PER_NAME,
        per_address: Rate = PER_ADDRESS,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_name = per_name
        self.per_address = per_address
        self.max_keys = max_keys
        self.clock = clock
        self.refused = 0  # attempts answered 429
        self._buckets: OrderedDict[tuple[str, str], Bucket] = OrderedDict()

    def _keys(self, name: str, address: str) -> list[tuple[tuple[str, str], Rate]]:
        # Names are matched case-blind and cut short: "Ann" and "ann " are one name's guesses.
        return [(("name", name.strip().lower()[:128]), self.per_name), (("address", address), self.per_address)]

    def acquire(self, name: str, address: str) -> Verdict:
        """Take a token from the name's and the address's bucket, or refuse the attempt (nothing taken)."""
        now = self.clock()
        keys = self._keys(name, address)
        current = [(refill(self._buckets.get(key), rate, now), rate) for key, rate in keys]
        verdict = decide(current)
        for (key, _), (bucket, _) in zip(keys, current, strict=True):
            self._put(key, Bucket(bucket.tokens - 1.0, now) if verdict.allowed else bucket)
        if not verdict.allowed:
            self.refused += 1
        return verdict

    def give_back(self, name: str, address: str) -> None:
        """A successful login: the tokens its attempt took are returned."""
        now = self.clock()
        for key, rate in self._keys(name, address):
            bucket = refill(self._buckets.get(key), rate, now)
            self._put(key, Bucket(min(rate.burst, bucket.tokens + 1.0), now))

    def _put(self, key: tuple[str, str], bucket: Bucket) -> None:
        self._buckets[key] = bucket
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
