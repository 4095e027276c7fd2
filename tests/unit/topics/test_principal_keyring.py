"""Contract 1.16: a principal proves its values with a signature of the record's bytes.

By property: for any value bytes, the holder of a principal's key is proven and nobody else is
(another key, other bytes, a second header, a malformed signature); names the keyring does not
hold count as anonymous. The keyring directory's mistakes are refused when it is loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.client.publisher import SyncEventPublisher
from topics.fields import Rejected
from topics.principal import SIGNATURE_HEADER, Keyring, principal_signature
from topics.signing import generate_pem, load_key

PRIVATE, PUBLIC = (load_key(pem) for pem in generate_pem())
OTHER_PRIVATE, _ = (load_key(pem) for pem in generate_pem())
RING = Keyring({"svc-a": PUBLIC, "evaluator": b"shared-secret"})


@settings(max_examples=50, deadline=None)
@given(value=st.binary(max_size=512), other=st.binary(max_size=512))
def test_only_the_key_holder_is_proven_for_these_bytes(value: bytes, other: bytes) -> None:
    assert RING.proven("svc-a", value, [principal_signature(value, PRIVATE)]) == "svc-a"
    assert RING.proven("evaluator", value, [principal_signature(value, b"shared-secret")]) == "evaluator"
    refused = [
        [principal_signature(value, OTHER_PRIVATE)],  # another key
        [principal_signature(value, b"shared-secret")],  # a secret where a key pair is expected
        [principal_signature(value, PRIVATE)] * 2,  # two signatures: which one counts?
        [(SIGNATURE_HEADER, b"ed25519:not base64!")],
        [(SIGNATURE_HEADER, "ed25519:a str, not bytes")],
        [],
        None,
    ]
    if other != value:
        refused.append([principal_signature(other, PRIVATE)])  # the signature of other bytes
    for headers in refused:
        with pytest.raises(Rejected) as info:
            RING.proven("svc-a", value, headers)
        assert info.value.reason == "bad_signature"


def test_names_the_keyring_does_not_hold_count_as_anonymous() -> None:
    assert RING.proven("svc-x", b"{}", None) is None
    assert RING.proven(None, b"{}", [principal_signature(b"{}", PRIVATE)]) is None


def test_a_keyring_directory_is_loaded_and_its_mistakes_refused(tmp_path: Path) -> None:
    _, public_pem = generate_pem()
    private_pem, _ = generate_pem()
    (tmp_path / "svc-a.pem").write_bytes(public_pem)
    (tmp_path / "notes.txt").write_text("ignored: not <principal>.pem")
    ring = Keyring.load(tmp_path)
    assert set(ring.keys) == {"svc-a"}
    with pytest.raises(ValueError, match="not a directory"):
        Keyring.load(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no <principal>\.pem"):
        Keyring.load(empty)
    (empty / "two words.pem").write_bytes(public_pem)
    with pytest.raises(ValueError, match="does not name a principal"):
        Keyring.load(empty)
    (empty / "two words.pem").unlink()
    (empty / "svc-b.pem").write_bytes(private_pem)
    with pytest.raises(ValueError, match="private key"):
        Keyring.load(empty)


def test_a_publisher_signs_only_with_a_key_that_can_and_for_its_principal() -> None:
    with pytest.raises(ValueError, match="give principal too"):
        SyncEventPublisher("127.0.0.1:9", principal_key=PRIVATE)
    with pytest.raises(ValueError, match="public key"):
        SyncEventPublisher("127.0.0.1:9", principal="svc-a", principal_key=PUBLIC)
