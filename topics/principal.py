"""Who sent a value (contract 1.15): the optional ``principal`` of RetrievalEvent and LLMFeedback.

A principal is a short name for the client (or service) that produced a value: at most
:data:`MAX_PRINCIPAL_LEN` characters of ``[A-Za-z0-9._:@-]``. The pipeline records it in
each experience (which principal produced the event, which the feedback) and the learner
bounds each principal's influence by it (docs/learning.md, "Influence per principal").
A value without one is :data:`ANONYMOUS`'s. The name is the sender's claim, unless the
deployment gives the worker a :class:`Keyring` (contract 1.16): then a principal it holds a key
for must prove each value with a signature of the record's bytes in the record header
:data:`SIGNATURE_HEADER` (a value without a valid one is rejected, ``bad_signature``), and a
claim of any other name counts as :data:`ANONYMOUS`: names nobody proved are one principal
for the influence bound, however many a sender makes up.

>>> check_principal("svc-a@tenant.1")
'svc-a@tenant.1'
>>> try:
...     check_principal("two words")
... except Rejected as e:
...     print(e.reason)
out_of_range
>>> principal_of(None), principal_of("svc-a")
('anonymous', 'svc-a')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topics.fields import Rejected
from topics.signing import Key, is_public, load_key, sign_bytes, verify_bytes, verify_key

MAX_PRINCIPAL_LEN = 128
ANONYMOUS = "anonymous"  # what a value without a principal (or an older writer's) counts as
# The LM evaluator's name on the feedback it writes (contract 1.18). It measures another
# principal's event, so for influence that feedback counts under the event's principal.
EVALUATOR = "causalmem-evaluator"
PRINCIPAL_RE = re.compile(rf"[A-Za-z0-9._:@-]{{1,{MAX_PRINCIPAL_LEN}}}")
SIGNATURE_HEADER = "causalmem-principal-signature"  # contract 1.16: a principal's proof, over the record's bytes
KEY_SUFFIX = ".pem"  # a keyring directory holds <principal>.pem


def valid_principal(value: Any) -> bool:
    """Whether ``value`` is a well-formed principal (a string of the allowed characters, 1–128 long)."""
    return type(value) is str and PRINCIPAL_RE.fullmatch(value) is not None


def check_principal(value: Any, where: str = "principal") -> str:
    """``value`` if it is a well-formed principal, else :class:`~topics.fields.Rejected`
    (``wrong_type`` for a non-string, ``oversize`` past 128 characters, ``out_of_range`` for
    an empty name or another character)."""
    if type(value) is not str:
        raise Rejected("wrong_type", f"{where} must be a string")
    if len(value) > MAX_PRINCIPAL_LEN:
        raise Rejected("oversize", f"{where} longer than {MAX_PRINCIPAL_LEN}")
    if PRINCIPAL_RE.fullmatch(value) is None:
        raise Rejected("out_of_range", f"{where} must be 1-{MAX_PRINCIPAL_LEN} characters of A-Z a-z 0-9 . _ : @ -")
    return value


def principal_of(value: str | None) -> str:
    """The name a value counts under: its principal, or :data:`ANONYMOUS`."""
    return value if value is not None else ANONYMOUS


def principal_signature(value: bytes, key: Key) -> tuple[str, bytes]:
    """The record header that proves ``value`` (the record's bytes, as sent) was sent by the
    holder of ``key``: an Ed25519 private key (the keyring holds its public key) or a shared
    secret (the keyring holds the same).

    >>> name, sig = principal_signature(b'{"a":1}', b"s3cret")
    >>> name, sig.startswith(b"hmac-sha256:")
    ('causalmem-principal-signature', True)
    """
    if is_public(key):
        raise ValueError("a public key verifies a principal's signatures; sign with the private key")
    return SIGNATURE_HEADER, sign_bytes(value, key).encode("ascii")


@dataclass(frozen=True)
class Keyring:
    """The principals whose values must be signed, each with the key that verifies them.

    >>> ring = Keyring({"svc-a": b"s3cret"})
    >>> value = b'{"principal":"svc-a"}'
    >>> ring.proven("svc-a", value, [principal_signature(value, b"s3cret")])
    'svc-a'
    >>> ring.proven("svc-b", value, None), ring.proven(None, value, None)  # nobody proved these names
    (None, None)
    >>> try:
    ...     ring.proven("svc-a", value, None)
    ... except Rejected as e:
    ...     print(e.reason)
    bad_signature
    """

    keys: Mapping[str, Key]

    @classmethod
    def load(cls, directory: str | Path, what: str = "principal_keys") -> Keyring:
        """Every ``<principal>.pem`` of ``directory`` (the setting ``what``): a principal's
        Ed25519 public key (or a shared secret). ``ValueError`` for a directory that does not
        exist or holds no key, a file name that is not a principal, and a private key (the
        verifier needs only the public one)."""
        path = Path(directory).expanduser()
        if not path.is_dir():
            raise ValueError(f"{what}: {path} is not a directory")
        keys: dict[str, Key] = {}
        for file in sorted(path.glob(f"*{KEY_SUFFIX}")):
            name = file.name[: -len(KEY_SUFFIX)]
            if not valid_principal(name):
                raise ValueError(f"{what}: {file.name} does not name a principal ({PRINCIPAL_RE.pattern})")
            key = load_key(file.read_bytes())
            if verify_key(key) is not key:
                raise ValueError(f"{what}: {file.name} is a private key; give the verifier the public key")
            keys[name] = key
        if not keys:
            raise ValueError(f"{what}: no <principal>{KEY_SUFFIX} in {path}")
        return cls(keys)

    def proven(self, claimed: str | None, value: bytes, headers: Any) -> str | None:
        """The principal a value counts under: ``claimed`` where its key verifies the record's
        signature; None (:data:`ANONYMOUS`) for a name the keyring does not hold; and
        :class:`~topics.fields.Rejected` (``bad_signature``) for a held name without a valid
        signature, which anyone could have claimed."""
        if claimed is None or claimed not in self.keys:
            return None
        found = [v for k, v in (headers or ()) if k == SIGNATURE_HEADER]
        one = found[0] if len(found) == 1 and isinstance(found[0], bytes) else None
        if one is not None and verify_bytes(value, one.decode("utf-8", "surrogateescape"), self.keys[claimed]):
            return claimed
        why = "no signature" if not found else "more than one signature" if len(found) > 1 else "a wrong signature"
        raise Rejected("bad_signature", f"principal {claimed!r}: {why} in header {SIGNATURE_HEADER}")
