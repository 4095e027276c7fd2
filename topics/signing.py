"""Signatures on the model topic: who may write what clients serve (docs/contract.md §7).

Two schemes, told apart by the signature's prefix:

* ``ed25519:<base64>`` (contract 1.11): the learner signs with its Ed25519 private key and
  every reader verifies with the public key. A reader cannot sign, so a client, a tool or
  anyone else who holds what a reader holds cannot forge a checkpoint.
* ``hmac-sha256:<hex>`` (contract 1.2): one shared secret signs and verifies, so every holder
  can also forge. Kept for deployments that have not moved to a key pair.

A :data:`Key` is what a process holds: the learner an ``Ed25519PrivateKey`` (or the shared
secret), a reader the ``Ed25519PublicKey`` (or the shared secret). :func:`load_key` reads
either from PEM text or a file, and :func:`generate_pem` makes a pair.

What is signed is the JSON object without its ``signature``, serialized with sorted keys,
so a reader verifies what it parsed, whatever the field order on the wire; a tombstone (a
null value) carries its signature in a record header, over its message key.

>>> private, public = (load_key(pem) for pem in generate_pem())
>>> sig = sign({"b": 1, "a": 2.5}, private)
>>> sig.startswith(ED25519_PREFIX), verify_signature({"a": 2.5, "b": 1, "signature": sig}, public)
(True, True)
>>> verify_signature({"a": 2.5, "b": 2, "signature": sig}, public)
False
>>> sign({"a": 1}, public)
Traceback (most recent call last):
...
ValueError: a public key verifies signatures; only the learner's private key signs
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import Any

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE_PREFIX = "hmac-sha256:"  # contract 1.2's shared-secret scheme
ED25519_PREFIX = "ed25519:"  # contract 1.11
TOMBSTONE_HEADER = "causalmem-signature"  # contract 1.7: a tombstone's signature, in a record header

Key = bytes | Ed25519PrivateKey | Ed25519PublicKey


def canonical(obj: dict[str, Any]) -> bytes:
    """What is signed: ``obj`` without ``signature``, keys sorted."""
    return orjson.dumps({k: v for k, v in obj.items() if k != "signature"}, option=orjson.OPT_SORT_KEYS)


def _sign_bytes(data: bytes, key: Key) -> str:
    if isinstance(key, Ed25519PublicKey):
        raise ValueError("a public key verifies signatures; only the learner's private key signs")
    if isinstance(key, Ed25519PrivateKey):
        return ED25519_PREFIX + base64.b64encode(key.sign(data)).decode("ascii")
    return SIGNATURE_PREFIX + hmac.new(key, data, hashlib.sha256).hexdigest()


def _verify_bytes(data: bytes, signature: object, key: Key) -> bool:
    """Whether ``signature`` is ``key``'s over ``data``; anything malformed is a wrong signature, never an error."""
    if not isinstance(signature, str):
        return False
    if isinstance(key, bytes):
        expected = _sign_bytes(data, key).encode("ascii")
        # As bytes: compare_digest raises TypeError on a non-ASCII str.
        return hmac.compare_digest(signature.encode("utf-8", "surrogatepass"), expected)
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    if not signature.startswith(ED25519_PREFIX):
        return False
    try:
        public.verify(base64.b64decode(signature[len(ED25519_PREFIX) :], validate=True), data)
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


def sign(obj: dict[str, Any], key: Key) -> str:
    """The signature of a manifest, epoch claim or slot-map record (its JSON object, without ``signature``).

    >>> sign({"b": 1, "a": 2.5}, b"k").startswith(SIGNATURE_PREFIX)
    True
    """
    return _sign_bytes(canonical(obj), key)


def verify_signature(obj: dict[str, Any], key: Key) -> bool:
    """Whether ``obj["signature"]`` is ``key``'s signature of the rest of ``obj``.

    >>> verify_signature({"a": 1, "signature": sign({"a": 1}, b"k")}, b"k")
    True
    >>> verify_signature({"a": 1, "signature": "hmac-sha256:é"}, b"k"), verify_signature({"a": 1}, b"k")
    (False, False)
    """
    return _verify_bytes(canonical(obj), obj.get("signature"), key)


def tombstone_signature(message_key: bytes, key: Key) -> bytes:
    """The ``causalmem-signature`` header of a tombstone sent under ``message_key``.

    >>> sig = tombstone_signature(b"default/3/0", b"k")
    >>> verify_tombstone(b"default/3/0", [(TOMBSTONE_HEADER, sig)], b"k")
    True
    >>> verify_tombstone(b"default/4/0", [(TOMBSTONE_HEADER, sig)], b"k"), verify_tombstone(b"default/3/0", None, b"k")
    (False, False)
    """
    return _sign_bytes(b"tombstone\x00" + message_key, key).encode("ascii")


def verify_tombstone(message_key: bytes, headers: Any, key: Key) -> bool:
    """Whether a tombstone's record headers carry ``key``'s signature of its message key."""
    found = [v for k, v in (headers or ()) if k == TOMBSTONE_HEADER]
    if len(found) != 1 or not isinstance(found[0], bytes):
        return False
    return _verify_bytes(b"tombstone\x00" + message_key, found[0].decode("utf-8", "surrogateescape"), key)


def sign_bytes(data: bytes, key: Key) -> str:
    """``key``'s signature of ``data`` (``ed25519:`` or ``hmac-sha256:``, by the key's kind).

    >>> verify_bytes(b"x", sign_bytes(b"x", b"k"), b"k"), verify_bytes(b"y", sign_bytes(b"x", b"k"), b"k")
    (True, False)
    """
    return _sign_bytes(data, key)


def verify_bytes(data: bytes, signature: object, key: Key) -> bool:
    """Whether ``signature`` is ``key``'s over ``data``; anything malformed is a wrong signature."""
    return _verify_bytes(data, signature, key)


def load_key(text: str | bytes) -> Key:
    """A key from its text: a PEM Ed25519 private key (the learner's), a PEM public key (a
    reader's), else a shared HMAC secret (the bytes themselves, surrounding whitespace removed).

    >>> load_key(b"  s3cret\\n")
    b's3cret'
    """
    raw = (text.encode() if isinstance(text, str) else text).strip()
    if raw.startswith(b"-----BEGIN PRIVATE KEY-----"):
        private = serialization.load_pem_private_key(raw, password=None)
        if not isinstance(private, Ed25519PrivateKey):
            raise ValueError("the checkpoint signing key must be an Ed25519 key")
        return private
    if raw.startswith(b"-----BEGIN PUBLIC KEY-----"):
        public = serialization.load_pem_public_key(raw)
        if not isinstance(public, Ed25519PublicKey):
            raise ValueError("the checkpoint verify key must be an Ed25519 key")
        return public
    if not raw:
        raise ValueError("empty key")
    return raw


def is_public(key: Key) -> bool:
    """Whether ``key`` is an Ed25519 public key (it verifies, it cannot sign)."""
    return isinstance(key, Ed25519PublicKey)


def verify_key(key: Key) -> Key:
    """What a reader needs of ``key``: the public half of a private key; a shared secret as it is."""
    return key.public_key() if isinstance(key, Ed25519PrivateKey) else key


def generate_pem() -> tuple[bytes, bytes]:
    """A fresh Ed25519 pair as PEM: (private key, for the learner only; public key, for every reader)."""
    private = Ed25519PrivateKey.generate()
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_pem, public_pem
