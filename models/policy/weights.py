"""Weights ↔ tensors: the policy's float32 tensors as safetensors bytes (docs/contract.md §7).

safetensors is a JSON header plus raw little-endian tensor data: no pickle, so a blob
read from the network is safe to parse. :func:`verify_and_load` is the only way the
pipeline turns bytes from the model topic into parameters: it checks size, sha256,
tensor names, shapes, dtype and finiteness before anything is swapped in.

>>> from models.policy.network import init_policy, Arch
>>> from topics.manifest import sha256_hex, split_chunks
>>> net = init_policy(4, 6, hidden=8)
>>> blob = to_safetensors(net.tensors())
>>> chunks = split_chunks(blob, 100)
>>> t = verify_and_load(b"".join(chunks), sha256_hex(blob), len(blob), Arch(4, 6, 8))
>>> sorted(t) == sorted(net.tensors())
True
"""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models.policy.network import TENSOR_NAMES, Arch
from topics.manifest import CheckpointError, sha256_hex


def to_safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    missing = [n for n in TENSOR_NAMES if n not in tensors]
    if missing:
        raise ValueError(f"missing tensors {missing}")
    return st_save({n: tensors[n].detach().to("cpu", torch.float32).contiguous() for n in TENSOR_NAMES})


def verify_and_load(blob: bytes, sha256: str, size: int, arch: Arch) -> dict[str, torch.Tensor]:
    """Check a whole checkpoint blob against its manifest and architecture; return its tensors."""
    if len(blob) != size:
        raise CheckpointError("size_mismatch", f"{len(blob)} bytes, manifest says {size}")
    if sha256_hex(blob) != sha256:
        raise CheckpointError("sha256_mismatch")
    try:
        tensors = st_load(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CheckpointError("unreadable", str(exc)[:200]) from None
    expected = arch.shapes()
    for name in TENSOR_NAMES:
        if name not in tensors:
            raise CheckpointError("missing_tensor", name)
        t = tensors[name]
        if t.dtype != torch.float32:
            raise CheckpointError("wrong_dtype", f"{name} is {t.dtype}")
        if tuple(t.shape) != expected[name]:
            raise CheckpointError("arch_mismatch", f"{name} {tuple(t.shape)} != {expected[name]}")
        if not torch.isfinite(t).all():
            raise CheckpointError("non_finite", name)
    return {n: tensors[n] for n in TENSOR_NAMES}
