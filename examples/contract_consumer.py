#!/usr/bin/env python3
"""An outside team's policy consumer, written from the checkpoint contract alone (docs/contract.md §7).

It imports nothing from causal-memory-pipeline: only aiokafka, orjson, safetensors.numpy,
numpy and the standard library. It reads ``<prefix>policy-checkpoints`` (partition 0) from
the beginning up to the high watermark returned with the fetches, takes the newest
*serving* manifest (key exactly ``"{policy}"``; ``"{policy}/candidate"`` is ignored),
assembles its chunks (keys ``"{policy}/{version}/{i}"``, a null value is a tombstone),
checks size and sha256, loads the tensors, checks names and shapes against the manifest's
``arch``, and computes the intervention mask for one query in numpy:

    m = softplus(out(gelu(hidden([layernorm(q); last_step_loss; last_step_entropy]))))

with exact (erf) GELU and LayerNorm eps 1e-5. Prints one JSON line.

    python examples/contract_consumer.py --bootstrap 127.0.0.1:19092 --query-json '[0.1, ...]'
    python examples/contract_consumer.py --vectors tests/data/contract    # check the math only
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from safetensors.numpy import load as load_safetensors

MODEL_TOPIC = "policy-checkpoints"
MANIFEST_SCHEMA = "policy_checkpoint/v1"
MAX_CHUNK_BYTES = 512 * 1024
LAYER_NORM_EPS = 1e-5
TENSOR_NAMES = ("norm.weight", "norm.bias", "hidden.weight", "hidden.bias", "out.weight", "out.bias", "alpha")


class NotVerifiable(Exception):
    pass


# --------------------------------------------------------------------------- the math (contract §6, §7)

_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_exact(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = LAYER_NORM_EPS) -> np.ndarray:
    mean = x.mean()
    var = ((x - mean) ** 2).mean()  # biased variance, as LayerNorm
    return (x - mean) / math.sqrt(var + eps) * weight + bias


def policy_mask(t: dict[str, np.ndarray], q: np.ndarray, loss: float, entropy: float) -> np.ndarray:
    """The mask m over all S slots, in float64 from the float32 tensors."""
    f = {k: v.astype(np.float64) for k, v in t.items()}
    x = np.concatenate([layer_norm(np.asarray(q, np.float64), f["norm.weight"], f["norm.bias"]), [loss, entropy]])
    h = gelu_exact(f["hidden.weight"] @ x + f["hidden.bias"])
    return softplus(f["out.weight"] @ h + f["out.bias"])


def kept_after_drop(candidates: list[int], mask: np.ndarray, ratio: float = 0.01) -> list[int]:
    """The dynamic hard drop: keep slot i when m_i >= ratio · max over the candidates."""
    m = mask[candidates]
    return [c for c, mi in zip(candidates, m, strict=True) if mi >= ratio * m.max()]


def plackett_luce_logprob(z: np.ndarray, positions: list[int]) -> float:
    remaining = np.ones(len(z), dtype=bool)
    total = 0.0
    for p in positions:
        zr = z[remaining]
        top = float(zr.max())
        total += float(z[p]) - (top + math.log(float(np.exp(zr - top).sum())))
        remaining[p] = False
    return total


# --------------------------------------------------------------------------- checks


def check_manifest(obj: Any, policy: str) -> dict[str, Any]:
    """Validate the manifest fields this consumer relies on; unknown fields are ignored."""
    if not isinstance(obj, dict) or obj.get("schema") != MANIFEST_SCHEMA:
        raise NotVerifiable("not a policy_checkpoint/v1 manifest")
    if obj.get("policy") != policy:
        raise NotVerifiable(f"manifest policy {obj.get('policy')!r} differs from its key")
    arch = obj.get("arch")
    ints = {"version": obj.get("version"), "size": obj.get("size"), "chunks": obj.get("chunks")}
    if isinstance(arch, dict):
        ints.update({f"arch.{k}": arch.get(k) for k in ("input_dim", "hidden", "slots", "embedding_dim")})
    else:
        raise NotVerifiable("arch missing")
    for name, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise NotVerifiable(f"{name} must be a non-negative integer")
    if arch["input_dim"] != arch["embedding_dim"] + 2:
        raise NotVerifiable("arch.input_dim != embedding_dim + 2")
    sha = obj.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise NotVerifiable("sha256 must be 64 lowercase hex digits")
    if obj["chunks"] < 1 or obj["chunks"] * MAX_CHUNK_BYTES < obj["size"]:
        raise NotVerifiable("chunks cannot hold size bytes")
    return obj


def expected_shapes(arch: dict[str, int]) -> dict[str, tuple[int, ...]]:
    d, h, s = arch["embedding_dim"], arch["hidden"], arch["slots"]
    return {
        "norm.weight": (d,),
        "norm.bias": (d,),
        "hidden.weight": (h, d + 2),
        "hidden.bias": (h,),
        "out.weight": (s, h),
        "out.bias": (s,),
        "alpha": (1,),
    }


def load_tensors(blob: bytes, arch: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Parse safetensors bytes (no pickle) and check names, dtype, shapes and finiteness."""
    try:
        tensors = load_safetensors(blob)
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise NotVerifiable(f"unreadable safetensors: {exc}") from None
    if arch is None:
        h, i = tensors["hidden.weight"].shape
        arch = {"embedding_dim": i - 2, "hidden": h, "slots": tensors["out.weight"].shape[0]}
    shapes = expected_shapes(arch)
    for name in TENSOR_NAMES:
        t = tensors.get(name)
        if t is None:
            raise NotVerifiable(f"tensor {name} missing")
        if t.dtype != np.float32:
            raise NotVerifiable(f"tensor {name} is {t.dtype}, not float32")
        if tuple(t.shape) != shapes[name]:
            raise NotVerifiable(f"tensor {name} has shape {tuple(t.shape)}, arch says {shapes[name]}")
        if not np.isfinite(t).all():
            raise NotVerifiable(f"tensor {name} is not finite")
    return {n: tensors[n] for n in TENSOR_NAMES}


# --------------------------------------------------------------------------- the model topic


async def read_model_topic(bootstrap: str, topic: str, timeout: float) -> list[tuple[int, bytes | None, bytes | None]]:
    """(offset, key, value) of partition 0, from the beginning to the fetches' high watermark.

    Not ``end_offsets``: on the embedded broker it is wrong (docs/contract.md §7).
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        if topic not in set(await admin.list_topics()):
            raise NotVerifiable(f"topic {topic!r} does not exist")  # and do not auto-create it
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=2 * 1024 * 1024,
    )
    await consumer.start()
    out: list[tuple[int, bytes | None, bytes | None]] = []
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        deadline = time.monotonic() + timeout
        while True:
            batch = await consumer.getmany(tp, timeout_ms=300)
            out.extend((m.offset, m.key, m.value) for m in batch.get(tp, []))
            hw = consumer.highwater(tp)
            if hw is not None and await consumer.position(tp) >= hw:
                return out
            if time.monotonic() > deadline:
                if hw is None and not out:
                    return out  # an empty partition reports no watermark
                raise NotVerifiable(f"could not read {topic} up to its high watermark in {timeout:.0f} s")
    finally:
        await consumer.stop()


def newest_verified(
    records: list[tuple[int, bytes | None, bytes | None]], policy: str
) -> tuple[dict[str, Any], dict[str, np.ndarray], list[str]]:
    """The newest serving manifest whose chunks assemble and verify, its tensors, and what was skipped."""
    chunks: dict[int, dict[int, bytes]] = {}
    serving: dict[int, dict[str, Any]] = {}
    problems: list[str] = []
    prefix = policy + "/"
    for offset, key, value in records:
        if key is None:
            continue
        k = key.decode("utf-8", "replace")
        if k == policy:
            if value is None:
                continue
            try:
                manifest = check_manifest(orjson.loads(value), policy)
            except (orjson.JSONDecodeError, NotVerifiable) as exc:
                problems.append(f"offset {offset}: bad manifest ({exc})")
                continue
            serving[manifest["version"]] = manifest
        elif k.startswith(prefix):
            parts = k[len(prefix) :].split("/")
            # ASCII digits only: str.isdigit() also accepts '²', which int() refuses
            if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 16 for p in parts):
                continue  # "{policy}/candidate" and anything else: not ours to follow
            version, index = int(parts[0]), int(parts[1])
            if value is None:  # tombstone
                chunks.get(version, {}).pop(index, None)
            else:
                chunks.setdefault(version, {})[index] = value
    for version in sorted(serving, reverse=True):
        manifest = serving[version]
        have = chunks.get(version, {})
        missing = [i for i in range(manifest["chunks"]) if i not in have]
        if missing:
            problems.append(f"version {version}: chunks {missing[:5]} missing")
            continue
        blob = b"".join(have[i] for i in range(manifest["chunks"]))
        if len(blob) != manifest["size"]:
            problems.append(f"version {version}: {len(blob)} bytes, manifest says {manifest['size']}")
            continue
        if hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
            problems.append(f"version {version}: sha256 mismatch")
            continue
        try:
            tensors = load_tensors(blob, manifest["arch"])
        except NotVerifiable as exc:
            problems.append(f"version {version}: {exc}")
            continue
        return manifest, tensors, problems
    raise NotVerifiable("no verifiable serving checkpoint" + (f" ({'; '.join(problems)})" if problems else ""))


def parse_query(text: str | None, dim: int, loss: float, entropy: float) -> tuple[np.ndarray, float, float]:
    if text is None:  # deterministic default
        return np.array([math.sin(i + 1.0) for i in range(dim)]), loss, entropy
    obj = orjson.loads(text)
    if isinstance(obj, dict):
        loss = float(obj.get("last_step_loss", loss))
        entropy = float(obj.get("last_step_entropy", entropy))
        obj = obj.get("query_embedding")
    q = np.asarray(obj, dtype=np.float64)
    if q.shape != (dim,) or not np.isfinite(q).all():
        raise NotVerifiable(f"the query must be {dim} finite numbers (the checkpoint's embedding_dim)")
    return q, loss, entropy


async def follow_once(args: argparse.Namespace) -> dict[str, Any]:
    records = await read_model_topic(args.bootstrap, args.prefix + MODEL_TOPIC, args.timeout)
    manifest, tensors, problems = newest_verified(records, args.policy)
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    q, loss, entropy = parse_query(args.query_json, manifest["arch"]["embedding_dim"], args.loss, args.entropy)
    mask = policy_mask(tensors, q, loss, entropy)
    return {
        "policy": manifest["policy"],
        "version": manifest["version"],
        "reason": manifest.get("reason"),
        "sha256": manifest["sha256"],
        "sha256_ok": True,
        "alpha": float(tensors["alpha"][0]),
        "arch": manifest["arch"],
        "mask": [float(v) for v in mask],
    }


# --------------------------------------------------------------------------- test vectors


def check_vectors(path: Path) -> tuple[dict[str, Any], bool]:
    """Compare this file's numpy math with contract/vectors.json + vectors.safetensors."""
    json_path = path / "vectors.json" if path.is_dir() else path
    spec = orjson.loads(json_path.read_bytes())
    tensors = load_tensors(json_path.with_suffix(".safetensors").read_bytes())
    alpha = float(tensors["alpha"][0])
    mask_err = logprob_err = 0.0
    kept_ok = True
    for case in spec["cases"]:
        mask = policy_mask(
            tensors, np.asarray(case["query_embedding"]), case["last_step_loss"], case["last_step_entropy"]
        )
        expected = np.asarray(case["expected_mask"], dtype=np.float64)
        mask_err = max(mask_err, float(np.max(np.abs(mask - expected) / np.maximum(np.abs(expected), 1e-30))))
        candidates = list(case["index_candidates"])
        kept = kept_after_drop(candidates, mask)
        kept_ok = kept_ok and kept == list(case["expected_kept"])
        score_of = dict(zip(candidates, case["index_scores"], strict=True))
        z = np.array([score_of[c] * (1.0 + alpha * mask[c]) / case["temperature"] for c in kept])
        logprob = plackett_luce_logprob(z, [kept.index(s) for s in case["selected"]])
        want = case["expected_logprob"]
        logprob_err = max(logprob_err, abs(logprob - want) / max(abs(want), 1e-30))
    # Contract 1.2 (§6 step 3b): on exploratory requests dropped candidates may be revived;
    # the logprob is then over the candidates as served (kept plus revived, index order).
    for case in spec.get("revive_cases", []):
        mask = policy_mask(
            tensors, np.asarray(case["query_embedding"]), case["last_step_loss"], case["last_step_entropy"]
        )
        candidates = list(case["index_candidates"])
        kept = kept_after_drop(candidates, mask)
        served = [c for c in candidates if c in kept or c in case["revived"]]
        kept_ok = kept_ok and kept == list(case["expected_kept"]) and served == list(case["expected_candidates"])
        score_of = dict(zip(candidates, case["index_scores"], strict=True))
        z = np.array([score_of[c] * (1.0 + alpha * mask[c]) / case["temperature"] for c in served])
        logprob = plackett_luce_logprob(z, [served.index(s) for s in case["selected"]])
        want = case["expected_logprob"]
        logprob_err = max(logprob_err, abs(logprob - want) / max(abs(want), 1e-30))
    worst = float(max(mask_err, logprob_err))
    ok = bool(worst <= 1e-5 and kept_ok)
    report = {
        "cases": len(spec["cases"]),
        "max_rel_err": worst,
        "max_rel_err_mask": mask_err,
        "max_rel_err_logprob": logprob_err,
        "kept_ok": kept_ok,
        "ok": ok,
    }
    return report, ok


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default="127.0.0.1:19092", help="Kafka bootstrap HOST:PORT")
    p.add_argument("--prefix", default="", help="topic name prefix of the deployment")
    p.add_argument("--policy", default="default", help="policy name (the serving manifest's key)")
    p.add_argument("--query-json", help="D numbers, or {query_embedding, last_step_loss, last_step_entropy}")
    p.add_argument("--loss", type=float, default=0.0, help="last_step_loss (default 0)")
    p.add_argument("--entropy", type=float, default=0.0, help="last_step_entropy (default 0)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to read the model topic")
    p.add_argument(
        "--vectors", type=Path, help="check the math against contract test vectors (dir or .json); no broker"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.vectors is not None:
            report, ok = check_vectors(args.vectors)
            print(orjson.dumps(report).decode(), flush=True)
            if not ok:
                print("error: numpy forward pass does not match the contract vectors", file=sys.stderr)
            return 0 if ok else 1
        result = asyncio.run(follow_once(args))
    except NotVerifiable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(orjson.dumps(result).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
