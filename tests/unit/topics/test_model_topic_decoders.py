"""Model-topic keys and values, by property: whatever a producer writes, parsing a key returns a
classification and decoding a value returns a record or raises :class:`Rejected`, never anything else
(one message keyed ``default/²/0`` used to raise ValueError in every reader of the topic)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topics.delta import decode_delta_manifest
from topics.fields import REASONS, SCHEMA_MANIFEST, Rejected
from topics.manifest import Manifest, decode_epoch_claim, decode_manifest, parse_key, sha256_hex
from topics.signing import verify_signature
from topics.slotmap import decode_slot_record, parse_slot_key

KEY = b"secret"

# Key parts: digits of every script ('²', '٣', '𝟘'), ASCII digits (long ones too), words, empties.
key_parts = st.one_of(
    st.text(alphabet=st.characters(categories=["Nd", "No"]), min_size=1, max_size=6),
    st.text(alphabet="0123456789", min_size=1, max_size=5000),
    st.sampled_from(["", "candidate", "epoch", "canary", "delta", "slot", "²", "-1", "+1", " 1", "1_0"]),
    st.text(max_size=8),
)
keys = st.lists(key_parts, min_size=1, max_size=5).map("/".join)


@settings(max_examples=500, deadline=None)
@given(keys)
def test_key_parsers_never_raise(key: str) -> None:
    kind, _, version, index = parse_key(key)
    if kind in ("chunk", "delta_chunk"):
        assert isinstance(version, int) and isinstance(index, int) and version >= 0 and index >= 0
    slot = parse_slot_key(key)
    assert slot is None or (isinstance(slot[1], int) and slot[1] >= 0)


@pytest.mark.parametrize("key", ["default/²/0", "default/0/²", "default/delta/²/0", "default/slot/²", "default/٣/0"])
def test_unicode_digits_are_unknown_keys(key: str) -> None:
    assert parse_key(key)[0] == "unknown"
    assert parse_slot_key(key) is None


def test_ascii_keys_still_parse() -> None:
    assert parse_key("default/7/2") == ("chunk", "default", 7, 2)
    assert parse_key("default/delta/9/0") == ("delta_chunk", "default", 9, 0)
    assert parse_slot_key("default/slot/31") == ("default", 31)
    assert parse_key("default/" + "9" * 5000 + "/0")[0] == "unknown"


def _manifest() -> dict[str, Any]:
    arch = {"input_dim": 10, "hidden": 4, "slots": 8, "embedding_dim": 8}
    return Manifest("default", 3, 1.0, "periodic", arch, 0.5, 0.0, sha256_hex(b"x"), 1, 1).to_dict()


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _decode_all(raw: bytes, signing_key: bytes | None) -> None:
    decoders = [
        lambda: decode_manifest(raw, signing_key=signing_key),
        lambda: decode_delta_manifest(raw, signing_key=signing_key),
        lambda: decode_epoch_claim(raw, signing_key),
        lambda: decode_slot_record(raw, key=b"default/slot/1"),
    ]
    for decode in decoders:
        try:
            decode()
        except Rejected as exc:
            assert exc.reason in REASONS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.sampled_from([None, KEY]))
def test_arbitrary_bytes_only_reject(raw: bytes, signing_key: bytes | None) -> None:
    _decode_all(raw, signing_key)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([*sorted(_manifest()), "signature", "schema", "epoch", "serving"]), json_values, st.booleans())
def test_mutated_manifest_fields_only_reject(name: str, value: Any, signed: bool) -> None:
    obj = _manifest()
    obj[name] = value
    _decode_all(json.dumps(obj).encode(), KEY if signed else None)  # json: integers beyond 64 bits too


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_any_signature_text_is_a_rejection(sig: str) -> None:
    obj = {**_manifest(), "schema": SCHEMA_MANIFEST, "signature": sig}
    assert verify_signature(obj, KEY) is False
    with pytest.raises(Rejected):
        decode_manifest(orjson.dumps(obj), signing_key=KEY)


@pytest.mark.parametrize("sig", ["hmac-sha256:é", "ü" * 76, "hmac-sha256:" + "ｆ" * 64])
def test_non_ascii_signature_is_rejected_not_a_type_error(sig: str) -> None:
    obj = {**_manifest(), "signature": sig}
    with pytest.raises(Rejected):
        decode_manifest(orjson.dumps(obj), signing_key=KEY)
    claim = {"schema": "writer_epoch/v1", "policy": "default", "epoch": 2, "writer": "w", "ts": 1.0, "signature": sig}
    with pytest.raises(Rejected):
        decode_epoch_claim(orjson.dumps(claim), KEY)
