"""Login throttling, address first: token buckets per client address, per name from an address,
and per name from every address together.

Every login attempt — against the labelers file or, in SASL mode, against the broker — is
checked against three buckets before any password is:

1. ``per_address``: its client address, whatever names it tries (20, then one every 15 s);
2. ``per_name``: its name from that address (5, then one a minute);
3. ``per_name_all``: its name from every address together (30, then one every 5 s): more
   attempts than (2) before it holds and a much shorter wait, so a guesser spread over many
   addresses slows the name but cannot lock it; the real labeler waits seconds, not minutes.
   An address the name has logged in from within :attr:`LoginThrottle.KNOWN_S` is not held
   by this bucket at all: a spray of a labeler's name does not reach her at her own desk.

When a bucket it needs has no whole token, the attempt is refused (HTTP 429) with the
seconds until each has one (``Retry-After``) and the limit that held; nothing is taken from
any bucket, no password is hashed and no broker connection is made for it. Otherwise one
token is taken from each, and a successful login gives them back, so only failures are
rationed. One address refused by its own bucket therefore costs the names it sprays nothing.

The address is whatever the app decided the client is (:func:`pipeline.ui.app.client_address`:
the connection's peer, or a configured proxy's ``X-Forwarded-For``). IPv6 addresses are
counted by their /64, the block one host is given (:func:`address_key`).

The decision is a pure function of the buckets and the clock (:func:`decide`);
:class:`LoginThrottle` only keeps the buckets and the known addresses, at most ``max_keys``
of each (least recently used dropped first), on an injected clock.
"""

from __future__ import annotations

import ipaddress
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
PER_NAME_ALL = Rate(burst=UiConfig.login_name_all_burst, refill_s=UiConfig.login_name_all_refill_s)


def address_key(address: str) -> str:
    """The key an address is counted under: an IPv4 address itself (also when IPv4-mapped), an
    IPv6 address by its /64; anything else (a test client's name) as it is.

    >>> address_key("10.0.0.7"), address_key("::ffff:10.0.0.7"), address_key("2001:db8::1"), address_key("x")
    ('10.0.0.7', '10.0.0.7', '2001:db8::/64', 'x')
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


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
    """May this attempt go ahead; if not, after how many seconds it may, and which limit held."""

    allowed: bool
    retry_after_s: float = 0.0
    limit: str | None = None  # "address", "name" or "name_all" when refused

    @property
    def retry_after(self) -> str:
        """The ``Retry-After`` header value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


def decide(buckets: Sequence[tuple[str, Bucket, Rate]]) -> Verdict:
    """Allowed when every bucket holds a whole token; else the longest wait until each does, and
    the first bucket (in the order given) that has none.

    >>> r = Rate(burst=5, refill_s=60.0)
    >>> decide([("address", Bucket(1.0, 0.0), r), ("name", Bucket(3.0, 0.0), r)])
    Verdict(allowed=True, retry_after_s=0.0, limit=None)
    >>> decide([("address", Bucket(0.5, 0.0), r), ("name", Bucket(0.0, 0.0), r)])
    Verdict(allowed=False, retry_after_s=60.0, limit='address')
    """
    wait = max((0.0 if b.tokens >= 1.0 else (1.0 - b.tokens) * rate.refill_s) for _, b, rate in buckets)
    if wait == 0.0:
        return Verdict(True)
    return Verdict(False, wait, next(kind for kind, b, _ in buckets if b.tokens < 1.0))


Key = tuple[str, ...]


class LoginThrottle:
    """The buckets of recent login attempts (in memory, bounded), and the addresses each name
    logged in from."""

    KNOWN_S = 7 * 86400.0  # an address a name logged in from skips the name-wide bucket this long

    @classmethod
    def of(cls, config: UiConfig) -> LoginThrottle:
        """The throttle ``causalmem ui`` runs with (its ``--login-*`` options)."""
        return cls(
            per_name=Rate(config.login_name_burst, config.login_name_refill_s),
            per_address=Rate(config.login_address_burst, config.login_address_refill_s),
            per_name_all=Rate(config.login_name_all_burst, config.login_name_all_refill_s),
        )

    def __init__(
        self,
        *,
        per_name: Rate = PER_NAME,
        per_address: Rate = PER_ADDRESS,
        per_name_all: Rate = PER_NAME_ALL,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_name = per_name
        self.per_address = per_address
        self.per_name_all = per_name_all
        self.max_keys = max_keys
        self.clock = clock
        self.refused = 0  # attempts answered 429
        self.refused_by = {"address": 0, "name": 0, "name_all": 0}  # … by the limit that held
        self._buckets: OrderedDict[Key, Bucket] = OrderedDict()
        self._known: OrderedDict[Key, float] = OrderedDict()  # (name, address) → when it last logged in

    def _keys(self, name: str, address: str, now: float) -> list[tuple[str, Key, Rate]]:
        # Names are matched case-blind and cut short: "Ann" and "ann " are one name's guesses.
        who, where = name.strip().lower()[:128], address_key(address)
        keys = [
            ("address", ("address", where), self.per_address),
            ("name", ("name", who, where), self.per_name),
        ]
        known = self._known.get((who, where))
        if known is None or now - known > self.KNOWN_S:
            keys.append(("name_all", ("name_all", who), self.per_name_all))
        return keys

    def acquire(self, name: str, address: str) -> Verdict:
        """Take a token from each bucket the attempt needs, or refuse it (nothing taken)."""
        now = self.clock()
        keys = self._keys(name, address, now)
        current = [(kind, refill(self._buckets.get(key), rate, now), rate) for kind, key, rate in keys]
        verdict = decide(current)
        if verdict.allowed:
            for (_, key, _), (_, bucket, _) in zip(keys, current, strict=True):
                self._put(key, Bucket(bucket.tokens - 1.0, now))
        else:
            self.refused += 1
            self.refused_by[verdict.limit or "address"] += 1
        return verdict

    def give_back(self, name: str, address: str) -> None:
        """A successful login: the tokens its attempt took are returned, and its address is known to the name."""
        now = self.clock()
        for _, key, rate in self._keys(name, address, now):
            bucket = refill(self._buckets.get(key), rate, now)
            self._put(key, Bucket(min(rate.burst, bucket.tokens + 1.0), now))
        known = (name.strip().lower()[:128], address_key(address))
        self._known[known] = now
        self._known.move_to_end(known)
        while len(self._known) > self.max_keys:
            self._known.popitem(last=False)

    def _put(self, key: Key, bucket: Bucket) -> None:
        self._buckets[key] = bucket
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
