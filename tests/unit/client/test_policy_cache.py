"""The subscriber's local policy cache (``PolicySubscriber(..., cache_dir=)``, pipeline/client/policy_cache.py).

A subscriber that starts while the broker is away serves the cached checkpoint only if it
verifies as a checkpoint from the model topic would: a cache file changed on disk, or signed
by another key, is refused, logged and counted, and nothing is served (the caller's wrapped
ranking). No broker here: the subscribers point at a port where nothing listens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import torch

from models.policy.network import PolicyNetwork, init_policy
from models.policy.weights import to_safetensors
from pipeline.broker import free_port
from pipeline.client.policy_cache import PolicyCache
from pipeline.client.subscriber import PolicySubscriber
from topics.manifest import CheckpointError, Manifest, sha256_hex
from topics.signing import Key, generate_pem, load_key

PRIVATE, PUBLIC = (load_key(pem) for pem in generate_pem())


def checkpoint(version: int = 3, seed: int = 0, key: Key = PRIVATE) -> tuple[bytes, Manifest, PolicyNetwork]:
    """A signed serving manifest (its bytes as the learner sends them), and its policy."""
    net = init_policy(8, 32, hidden=16, seed=seed)
    blob = to_safetensors(net.tensors())
    alpha = float(net.tensors()["alpha"].reshape(-1)[0])
    m = Manifest("default", version, 1.0, "periodic", net.arch.to_dict(), alpha, 0.0, sha256_hex(blob), len(blob), 1)
    m.signed(key, role="serving")
    return orjson.dumps(m.to_dict()), m, net


def start_without_broker(cache_dir: Path) -> PolicySubscriber:
    """Start a subscriber on ``cache_dir`` whose broker is away; what it serves right after ``start``."""

    async def run() -> PolicySubscriber:
        async with PolicySubscriber(
            f"127.0.0.1:{free_port()}", policy="default", signing_key=PUBLIC, cache_dir=cache_dir
        ) as sub:
            return sub

    return asyncio.run(run())


def test_a_verified_cache_is_served_at_start(tmp_path: Path) -> None:
    raw, m, net = checkpoint()
    PolicyCache(tmp_path, "default", signing_key=PUBLIC).write(raw, m, net.tensors())
    sub = start_without_broker(tmp_path)
    assert sub.current is not None and sub.current.version == 3 and sub.from_cache == 3
    assert sub.cache_refused_total == 0
    served = sub.current.net.tensors()
    assert all(torch.equal(served[n], t) for n, t in net.tensors().items())


def _flip_a_tensor_byte(d: Path) -> None:
    path = d / "default.v3.safetensors"
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01  # the last byte of the last tensor's data: still a readable safetensors file
    path.write_bytes(bytes(blob))


def _raise_alpha(d: Path) -> None:
    path = d / "default.v3.manifest.json"
    obj = orjson.loads(path.read_bytes())
    obj["alpha"] += 1.0  # the signature no longer covers it
    path.write_bytes(orjson.dumps(obj))


def _another_policys_blob(d: Path) -> None:
    _, _, other = checkpoint(seed=1)
    (d / "default.v3.safetensors").write_bytes(to_safetensors(other.tensors()))


def _signed_by_another_key(d: Path) -> None:
    raw, _, _ = checkpoint(key=load_key(generate_pem()[0]))
    (d / "default.v3.manifest.json").write_bytes(raw)


def _renamed_to_a_newer_version(d: Path) -> None:
    for suffix in (".manifest.json", ".safetensors"):
        (d / f"default.v3{suffix}").rename(d / f"default.v9{suffix}")


def _truncated_manifest(d: Path) -> None:
    path = d / "default.v3.manifest.json"
    path.write_bytes(path.read_bytes()[:40])


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (_flip_a_tensor_byte, "sha256_mismatch"),
        (_another_policys_blob, "sha256_mismatch"),
        (_raise_alpha, "signature missing or not the configured key's"),
        (_signed_by_another_key, "signature missing or not the configured key's"),
        (_renamed_to_a_newer_version, "cache_version"),
        (_truncated_manifest, "cache_manifest"),
    ],
)
def test_a_tampered_cache_is_refused_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, tamper: Callable[[Path], None], reason: str
) -> None:
    raw, m, net = checkpoint()
    PolicyCache(tmp_path, "default", signing_key=PUBLIC).write(raw, m, net.tensors())
    tamper(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pipeline.client.subscriber"):
        sub = start_without_broker(tmp_path)
    assert sub.current is None and sub.from_cache is None  # the caller serves its wrapped ranking
    assert sub.cache_refused_total == 1
    assert sub.cache_refused is not None and reason in sub.cache_refused
    assert any("refused the policy cache" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_an_unsigned_cache_is_refused_by_a_subscriber_that_checks_signatures(tmp_path: Path) -> None:
    _, m, net = checkpoint()
    m.signature, m.role = None, None
    PolicyCache(tmp_path, "default").write(orjson.dumps(m.to_dict()), m, net.tensors())
    assert PolicyCache(tmp_path, "default").read() is not None  # verifies where no key is configured
    sub = start_without_broker(tmp_path)
    assert sub.current is None and sub.cache_refused_total == 1


def test_a_state_without_the_manifests_digest_is_not_written(tmp_path: Path) -> None:
    raw, m, _ = checkpoint()
    _, _, other = checkpoint(seed=1)
    cache = PolicyCache(tmp_path, "default", signing_key=PUBLIC)
    with pytest.raises(CheckpointError, match="digest_mismatch"):
        cache.write(raw, m, other.tensors())
    assert cache.versions() == [] and cache.read() is None


def test_a_write_replaces_the_older_version_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    cache = PolicyCache(tmp_path, "default", signing_key=PUBLIC)
    for version, seed in ((3, 0), (4, 1)):
        raw, m, net = checkpoint(version, seed)
        cache.write(raw, m, net.tensors())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["default.v4.manifest.json", "default.v4.safetensors"]
    cached = cache.read()
    assert cached is not None and cached.manifest.version == 4
    assert torch.equal(cached.tensors["out.weight"], net.tensors()["out.weight"])


def test_the_topics_version_replaces_the_cached_one_even_an_older_one(tmp_path: Path) -> None:
    """The topic is the truth once it can be read (it may have been reset or rolled back since):
    its verified v1 replaces the cached v3, and the cache then holds v1."""
    raw, m, net = checkpoint(version=3)
    PolicyCache(tmp_path, "default", signing_key=PUBLIC).write(raw, m, net.tensors())
    sub = start_without_broker(tmp_path)
    assert sub.current is not None and sub.from_cache == 3
    raw1, m1, net1 = checkpoint(version=1, seed=1)

    async def from_the_topic() -> None:
        await sub.handle(0, b"default/1/0", to_safetensors(net1.tensors()))
        await sub.handle(1, b"default", raw1)
        deadline = asyncio.get_running_loop().time() + 30
        while sub.cached_version != 1 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)

    asyncio.run(from_the_topic())
    assert sub.current is not None and sub.current.version == 1 and sub.from_cache is None
    assert sub.rejected_total == 0 and sub.cached_version == 1
    assert torch.equal(sub.current.net.tensors()["hidden.weight"], net1.tensors()["hidden.weight"])
    cached = PolicyCache(tmp_path, "default", signing_key=PUBLIC).read()
    assert cached is not None and cached.manifest.version == 1 and cached.manifest.sha256 == m1.sha256
