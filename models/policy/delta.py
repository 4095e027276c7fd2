"""Row-sparse delta checkpoints: encode, verify, apply (docs/contract.md §7.1).

A delta blob is safetensors (no pickle) holding

- ``rows``: int64 [k], the output rows it replaces, sorted, unique, each in [0, S);
- ``out.weight.rows`` float32 [k, H] and ``out.bias.rows`` float32 [k]: their new values;
- ``norm.weight``, ``norm.bias``, ``hidden.weight``, ``hidden.bias``, ``alpha`` in full
  (the backbone: every learner step changes them, and they are small);

and, in its safetensors metadata, ``base_sha256``: the id of the link it applies to, so
that the blob's own sha256 commits to the whole chain (``topics.delta.link_id``).

>>> from models.policy.network import init_policy, Arch
>>> from topics.manifest import sha256_hex
>>> net = init_policy(4, 6, hidden=8)
>>> base = {k: v.clone() for k, v in net.tensors().items()}
>>> with torch.no_grad():
...     net.out.weight[2] += 1.0
>>> rows = changed_rows(net.tensors(), base)
>>> rows.tolist()
[2]
>>> blob = encode_delta(net.tensors(), rows, "0" * 64)
>>> d = decode_delta(blob, sha256_hex(blob), len(blob), Arch(4, 6, 8), "0" * 64)
>>> apply_delta(base, d)
>>> bool(torch.equal(base["out.weight"], net.tensors()["out.weight"]))
True
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import save as st_save

from models.policy.network import TENSOR_NAMES, Arch
from models.policy.weights import to_safetensors
from topics.manifest import CheckpointError, sha256_hex

SMALL_TENSORS = ("norm.weight", "norm.bias", "hidden.weight", "hidden.bias", "alpha")  # shipped in full
ROW_TENSORS = ("out.weight", "out.bias")  # shipped by row
DELTA_NAMES = ("rows", "out.weight.rows", "out.bias.rows", *SMALL_TENSORS)


@dataclass
class Delta:
    """A decoded, verified delta: the rows to replace, their values and the small tensors."""

    rows: torch.Tensor  # int64 [k]
    weight_rows: torch.Tensor  # float32 [k, H]
    bias_rows: torch.Tensor  # float32 [k]
    small: dict[str, torch.Tensor]
    base_sha256: str


def changed_rows(current: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> np.ndarray:
    """The output rows that differ between two states (int64, sorted), compared row-wise in one pass.

    Used when the trainer gives no hint of what it wrote (``PolicyTrainer.take_changed_rows``).
    """
    w = (current["out.weight"] != base["out.weight"]).any(dim=1)
    w |= current["out.bias"] != base["out.bias"]
    return torch.nonzero(w).reshape(-1).numpy().astype(np.int64)


def encode_delta(tensors: dict[str, torch.Tensor], rows: np.ndarray, base_sha256: str) -> bytes:
    """The delta blob carrying ``rows`` of the state ``tensors`` (plus its small tensors), based on ``base_sha256``."""
    idx = torch.as_tensor(np.unique(np.asarray(rows, dtype=np.int64)))
    out = {
        "rows": idx,
        "out.weight.rows": tensors["out.weight"].detach().cpu().index_select(0, idx).float().contiguous(),
        "out.bias.rows": tensors["out.bias"].detach().cpu().index_select(0, idx).float().contiguous(),
    }
    for name in SMALL_TENSORS:
        out[name] = tensors[name].detach().to("cpu", torch.float32).contiguous()
    return st_save(out, metadata={"base_sha256": base_sha256})


def delta_bytes(rows: int, arch: Arch) -> int:
    """About how many bytes a delta of ``rows`` rows takes (without the header): what the learner compares.

    >>> delta_bytes(0, Arch(384, 1024, 512))
    795652
    """
    d, h = arch.embedding_dim, arch.hidden
    return 8 * rows + 4 * rows * (h + 1) + 4 * (2 * d + h * (d + 2) + h + 1)


def full_bytes(arch: Arch) -> int:
    """About how many bytes a full snapshot takes (without the header)."""
    return delta_bytes(0, arch) + 4 * arch.slots * (arch.hidden + 1)


def decode_delta(
    blob: bytes | memoryview, sha256: str, size: int, arch: Arch, base_sha256: str, digest: str | None = None
) -> Delta:
    """Check a delta blob against its manifest and architecture; raises :class:`CheckpointError`.

    Checks: size, sha256, safetensors, the metadata's base equals ``base_sha256``, every
    tensor present with its dtype and shape, ``rows`` sorted, unique and in [0, S), every
    value finite.
    """
    if len(blob) != size:
        raise CheckpointError("size_mismatch", f"{len(blob)} bytes, manifest says {size}")
    if (digest or sha256_hex(blob)) != sha256:  # digest: hashed by the caller as the bytes arrived
        raise CheckpointError("sha256_mismatch")
    try:
        t, meta = read_safetensors(blob)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError("unreadable", str(exc)[:200]) from None
    if meta.get("base_sha256") != base_sha256:
        raise CheckpointError("base_mismatch", "the blob names another base than its manifest")
    for name in DELTA_NAMES:
        if name not in t:
            raise CheckpointError("missing_tensor", name)
    rows = t["rows"]
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise CheckpointError("wrong_dtype", "rows must be int64 [k]")
    k = int(rows.shape[0])
    shapes = arch.shapes()
    want = {"out.weight.rows": (k, arch.hidden), "out.bias.rows": (k,), **{n: shapes[n] for n in SMALL_TENSORS}}
    for name, shape in want.items():
        if t[name].dtype != torch.float32:
            raise CheckpointError("wrong_dtype", f"{name} is {t[name].dtype}")
        if tuple(t[name].shape) != shape:
            raise CheckpointError("arch_mismatch", f"{name} {tuple(t[name].shape)} != {shape}")
        if not all_finite(t[name]):
            raise CheckpointError("non_finite", name)
    if k and (int(rows[0]) < 0 or int(rows[-1]) >= arch.slots or (k > 1 and not bool((rows[1:] > rows[:-1]).all()))):
        raise CheckpointError("bad_rows", "rows must be sorted, unique and in [0, S)")
    return Delta(rows, t["out.weight.rows"], t["out.bias.rows"], {n: t[n] for n in SMALL_TENSORS}, base_sha256)


DTYPES = {"F32": torch.float32, "I64": torch.int64}


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value is finite: a sum first (finite only if every value is), the exact check only when not.

    >>> all_finite(torch.tensor([1.0, 3e38, 3e38])), all_finite(torch.tensor([1.0, float("nan")]))
    (True, False)
    """
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def read_safetensors(blob: bytes | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors blob's tensors *without copying them* (views of ``blob``) and its metadata.

    Strict like safetensors itself: the header is a JSON object; each tensor's dtype is
    F32 or I64, its ``data_offsets`` match its shape and the tensors tile the data exactly.
    A delta is read this way because copying it would cost as much as checking it.

    >>> t, meta = read_safetensors(st_save({"a": torch.arange(3.0)}, metadata={"k": "v"}))
    >>> t["a"].tolist(), meta
    ([0.0, 1.0, 2.0], {'k': 'v'})
    """
    n = int.from_bytes(blob[:8], "little")
    if len(blob) < 8 or n <= 0 or n > len(blob) - 8:
        raise ValueError("bad safetensors header length")
    header = json.loads(bytes(blob[8 : 8 + n]))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError("bad safetensors metadata")
    start, end = 8 + n, len(blob) - 8 - n
    out: dict[str, torch.Tensor] = {}
    spans = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer on bytes: read-only views, only read
        for name, info in header.items():
            dtype = DTYPES[info["dtype"]]
            shape = [int(x) for x in info["shape"]]
            lo, hi = (int(x) for x in info["data_offsets"])
            count = math.prod(shape)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if min(shape, default=0) < 0 or not 0 <= lo <= hi <= end or hi - lo != count * itemsize:
                raise ValueError(f"{name}: data_offsets do not match its shape")
            if (start + lo) % itemsize:
                raise ValueError(f"{name}: misaligned")
            spans.append((lo, hi))
            flat = (
                torch.frombuffer(blob, dtype=dtype, count=count, offset=start + lo)
                if count
                else torch.empty(0, dtype=dtype)
            )
            out[str(name)] = flat.reshape(shape)
    spans.sort()
    if [lo for lo, _ in spans] != [0, *[hi for _, hi in spans[:-1]]] or (spans[-1][1] if spans else 0) != end:
        raise ValueError("tensors do not tile the data")
    return out, {str(k): str(v) for k, v in meta.items()}


@torch.no_grad()
def apply_delta(tensors: dict[str, torch.Tensor], delta: Delta) -> None:
    """Apply ``delta`` to ``tensors`` in place (the rows, then the small tensors); no allocation of S-sized tensors.

    ``tensors`` may be a network's live parameters (``PolicyNetwork.state_dict(keep_vars=False)``
    shares their storage), so a client updates its served policy without copying it.
    """
    tensors["out.weight"].index_copy_(0, delta.rows, delta.weight_rows)
    tensors["out.bias"].index_copy_(0, delta.rows, delta.bias_rows)
    for name, value in delta.small.items():
        tensors[name].copy_(value)


def state_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The sha256 of the full snapshot of a state (what a delta's ``state_sha256`` names)."""
    return sha256_hex(to_safetensors({n: tensors[n] for n in TENSOR_NAMES}))
