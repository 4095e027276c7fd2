"""Checkpoint blobs (docs/contract.md §7): safetensors bytes, chunking, and verification before loading."""

from __future__ import annotations

import ast
import io
import json
import pickle
import struct
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import save as st_save

import models.policy.weights
import topics.manifest
from models.policy.network import TENSOR_NAMES, Arch, init_policy
from models.policy.weights import to_safetensors, verify_and_load
from topics.manifest import MAX_CHUNK_BYTES, CheckpointError, sha256_hex, split_chunks

ARCH = Arch(embedding_dim=4, slots=6, hidden=8)


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return init_policy(4, 6, hidden=8, seed=11).tensors()


def _verify(blob: bytes, arch: Arch = ARCH) -> dict[str, torch.Tensor]:
    return verify_and_load(blob, sha256_hex(blob), len(blob), arch)


def _reason(blob: bytes, sha: str | None = None, size: int | None = None, arch: Arch = ARCH) -> str:
    with pytest.raises(CheckpointError) as info:
        verify_and_load(blob, sha if sha is not None else sha256_hex(blob), len(blob) if size is None else size, arch)
    return info.value.reason


def test_round_trip_bit_exact(tensors: dict[str, torch.Tensor]) -> None:
    blob = to_safetensors(tensors)
    out = _verify(blob)
    assert list(out) == list(TENSOR_NAMES)
    for name in TENSOR_NAMES:
        assert out[name].dtype == torch.float32
        assert torch.equal(out[name], tensors[name]), name
    # deterministic bytes: the same parameters always give the same sha256
    assert to_safetensors(tensors) == blob
    assert to_safetensors(_verify(blob)) == blob


def test_to_safetensors_casts_and_requires_all_names(tensors: dict[str, torch.Tensor]) -> None:
    doubled = {k: v.double() for k, v in tensors.items()}
    out = _verify(to_safetensors(doubled))
    assert all(t.dtype == torch.float32 for t in out.values())
    extra = {**tensors, "junk": torch.zeros(3)}
    assert to_safetensors(extra) == to_safetensors(tensors)  # only the contract's names are written
    partial = dict(tensors)
    del partial["alpha"]
    with pytest.raises(ValueError, match="alpha"):
        to_safetensors(partial)


def test_blob_is_plain_safetensors(tensors: dict[str, torch.Tensor]) -> None:
    """Any language can read it: 8-byte little-endian header length, JSON header, raw F32 data."""
    blob = to_safetensors(tensors)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    assert {k for k in header if k != "__metadata__"} == set(TENSOR_NAMES)
    for name in TENSOR_NAMES:
        assert header[name]["dtype"] == "F32"
        assert tuple(header[name]["shape"]) == ARCH.shapes()[name]


def test_split_chunks_sizes_and_join() -> None:
    big = to_safetensors(init_policy(64, 1024, hidden=512, seed=0).tensors())
    assert len(big) > 2 * MAX_CHUNK_BYTES
    chunks = split_chunks(big)
    assert all(0 < len(c) <= MAX_CHUNK_BYTES for c in chunks)
    assert all(len(c) == MAX_CHUNK_BYTES for c in chunks[:-1])
    assert len(chunks) == -(-len(big) // MAX_CHUNK_BYTES)
    assert b"".join(chunks) == big
    assert MAX_CHUNK_BYTES == 512 * 1024


@pytest.mark.parametrize("size", [1, 99, 100, 101, 1000])
def test_split_chunks_small_sizes(size: int) -> None:
    blob = bytes(range(256)) * 4
    blob = blob[:size]
    chunks = split_chunks(blob, 100)
    assert all(len(c) <= 100 for c in chunks) and b"".join(chunks) == blob
    assert len(chunks) == -(-size // 100)


def test_split_chunks_limits() -> None:
    assert split_chunks(b"") == [b""]
    for bad in (0, -1, MAX_CHUNK_BYTES + 1):
        with pytest.raises(ValueError):
            split_chunks(b"abc", bad)
    assert split_chunks(b"abc", MAX_CHUNK_BYTES) == [b"abc"]


def test_size_mismatch(tensors: dict[str, torch.Tensor]) -> None:
    blob = to_safetensors(tensors)
    assert _reason(blob, size=len(blob) + 1) == "size_mismatch"
    assert _reason(blob[:-1], sha=sha256_hex(blob), size=len(blob)) == "size_mismatch"  # a chunk went missing


def test_sha256_mismatch(tensors: dict[str, torch.Tensor]) -> None:
    blob = bytearray(to_safetensors(tensors))
    sha = sha256_hex(bytes(blob))
    blob[-1] ^= 0x01  # one flipped bit in the data
    assert _reason(bytes(blob), sha=sha) == "sha256_mismatch"
    assert _reason(bytes(blob), sha="0" * 64) == "sha256_mismatch"


@pytest.mark.parametrize(
    "blob",
    [
        b"garbage bytes, not a checkpoint",
        b"\x00",
        struct.pack("<Q", 2**40) + b"{}",  # header longer than the blob
        struct.pack("<Q", 9) + b"not json!",
        struct.pack("<Q", 8) + b'{"a": 1}',
    ],
)
def test_unreadable(blob: bytes) -> None:
    assert _reason(blob) == "unreadable"


def test_arch_mismatch(tensors: dict[str, torch.Tensor]) -> None:
    blob = to_safetensors(tensors)
    assert _reason(blob, arch=Arch(4, 7, 8)) == "arch_mismatch"
    assert _reason(blob, arch=Arch(5, 6, 8)) == "arch_mismatch"
    assert _reason(blob, arch=Arch(4, 6, 16)) == "arch_mismatch"


@pytest.mark.parametrize("name", ["out.weight", "alpha", "norm.bias"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite(tensors: dict[str, torch.Tensor], name: str, bad: float) -> None:
    t = dict(tensors)
    t[name] = t[name].clone()
    t[name].view(-1)[0] = bad
    assert _reason(to_safetensors(t)) == "non_finite"


def test_missing_tensor(tensors: dict[str, torch.Tensor]) -> None:
    partial = {k: v for k, v in tensors.items() if k != "hidden.bias"}
    assert _reason(st_save(partial)) == "missing_tensor"
    assert _reason(st_save({})) == "missing_tensor"


def test_wrong_dtype(tensors: dict[str, torch.Tensor]) -> None:
    assert _reason(st_save({k: v.half() for k, v in tensors.items()})) == "wrong_dtype"


@pytest.mark.parametrize("module", [models.policy.weights, topics.manifest], ids=lambda m: m.__name__)
def test_checkpoint_module_never_imports_pickle(module: ModuleType) -> None:
    source = Path(str(module.__file__)).read_text()
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
            imported |= {a.name for a in node.names}
    assert "pickle" not in imported and "dill" not in imported and "cloudpickle" not in imported
    assert "torch.load" not in source and "pickle.load" not in source
    assert "import pickle" not in source


UNPICKLED: list[str] = []


def _record(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class _Payload:
    """Runs code when unpickled: a loader that used pickle would call ``_record``."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_record, ("executed",))


def test_pickled_payloads_are_unreadable() -> None:
    UNPICKLED.clear()
    raw = pickle.dumps({"alpha": _Payload()})
    assert _reason(raw) == "unreadable"
    buf = io.BytesIO()
    torch.save(init_policy(4, 6, hidden=8).state_dict(), buf)
    assert _reason(buf.getvalue()) == "unreadable"
    assert UNPICKLED == []
    # sanity: the payload really would run if it were unpickled
    pickle.loads(raw)
    assert UNPICKLED == ["executed"]
