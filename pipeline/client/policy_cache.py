"""A local copy of the last verified serving checkpoint, for a client that starts without a broker.

:class:`~pipeline.client.subscriber.PolicySubscriber` (``cache_dir=``) writes the newest
policy it has verified into a directory of its own and, when it starts, serves what is there
until the model topic can be read: a service restarted while the broker is away serves the
policy it served before, not its wrapped ranking.

What is kept, per policy, is two files:

- ``{policy}.v{version}.safetensors``: the checkpoint's tensors as safetensors (never
  pickle). It is written only when its sha256 equals the digest the manifest names: a full
  snapshot's ``sha256`` (so the file holds exactly the bytes the learner published), a
  delta's ``state_sha256`` (the full snapshot of the state the delta produces);
- ``{policy}.v{version}.manifest.json``: the manifest exactly as it arrived on the model
  topic (its signature, when the learner signs, still over it).

Each file is written to a temporary name in the same directory, synced and renamed over
(the manifest last, so a half-written pair is never the newest), then older versions'
files are removed.

Reading re-verifies the pair as a checkpoint from the topic is verified: the manifest is
decoded with the subscriber's signing key (an unsigned or wrongly signed one is refused),
must name this policy, the role of the key it was read under (contract 1.11: serving, or
*1.25* the base key, for a full snapshot; delta for a delta) when signatures are checked,
the version of its file name and the expected architecture; the tensors pass
``models.policy.weights.verify_and_load`` against the manifest's digest (size, sha256, names,
shapes, dtype, finiteness). Anything else raises :class:`CheckpointError`.

>>> import tempfile
>>> from models.policy.network import init_policy
>>> from models.policy.weights import to_safetensors
>>> from topics.manifest import sha256_hex
>>> net = init_policy(4, 6, hidden=8)
>>> blob = to_safetensors(net.tensors())
>>> m = Manifest("default", 3, 1.0, "periodic", net.arch.to_dict(), 0.5, 0.0, sha256_hex(blob), len(blob), 1)
>>> cache = PolicyCache(tempfile.mkdtemp(), "default")
>>> cache.write(orjson.dumps(m.to_dict()), m, net.tensors())
>>> cached = cache.read()
>>> cached is not None and cached.manifest.version == 3 and sorted(cached.tensors) == sorted(net.tensors())
True
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch

from models.policy.network import Arch
from models.policy.weights import to_safetensors, verify_and_load
from pipeline.client.chain import arch_of
from pipeline.client.idmap import write_atomically
from topics.delta import SCHEMA_DELTA, DeltaManifest, decode_delta_manifest
from topics.fields import Rejected
from topics.manifest import CheckpointError, Manifest, decode_manifest, max_blob_bytes, sha256_hex
from topics.signing import Key

log = logging.getLogger(__name__)

__all__ = ["CachedPolicy", "PolicyCache"]

MANIFEST_SUFFIX = ".manifest.json"
BLOB_SUFFIX = ".safetensors"
MAX_MANIFEST_BYTES = 1024 * 1024  # what the model topic's manifests may take (topics.manifest.decode_manifest)


@dataclass
class CachedPolicy:
    """A checkpoint read back from the cache, verified: its manifest and its tensors."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]


def digest_of(manifest: Manifest) -> str:
    """What a full snapshot of ``manifest``'s state hashes to: its ``sha256``, a delta's ``state_sha256``."""
    return manifest.state_sha256 if isinstance(manifest, DeltaManifest) else manifest.sha256


class PolicyCache:
    """The newest verified checkpoint of one policy, in a local directory.

    Parameters
    ----------
    directory
        Where the files are kept (created when missing). One directory may hold several
        policies' files; it should be the service's own (whoever can write there can make the
        client refuse its cache, never make it serve something the verification refuses).
    policy
        The policy whose checkpoint is kept.
    signing_key
        What manifests are verified with (as the subscriber's ``signing_key``); None: none is checked.
    expected_arch
        When set, a cached checkpoint of another architecture is refused.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        policy: str,
        *,
        signing_key: Key | None = None,
        expected_arch: Arch | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.policy = policy
        self.signing_key = signing_key
        self.expected_arch = expected_arch

    def _path(self, version: int, suffix: str) -> Path:
        return self.directory / f"{self.policy}.v{version}{suffix}"

    def versions(self) -> list[int]:
        """The versions whose manifest file is in the directory, newest first."""
        prefix = f"{self.policy}.v"
        found = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        for name in names:
            if name.startswith(prefix) and name.endswith(MANIFEST_SUFFIX):
                middle = name[len(prefix) : -len(MANIFEST_SUFFIX)]
                if middle.isascii() and middle.isdigit() and len(middle) <= 16:
                    found.append(int(middle))
        return sorted(found, reverse=True)

    def write(self, raw_manifest: bytes, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
        """Keep ``manifest`` (``raw_manifest``: its bytes as received) and its state ``tensors``.

        Raises
        ------
        CheckpointError
            ``digest_mismatch`` when the tensors' safetensors bytes do not have the digest the
            manifest names (e.g. a policy updated in place while it was serialized): nothing is written.
        OSError
            When the directory cannot be written.
        """
        blob = to_safetensors(tensors)
        if sha256_hex(blob) != digest_of(manifest):
            raise CheckpointError("digest_mismatch", f"v{manifest.version}: the state is not the manifest's")
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self._path(manifest.version, BLOB_SUFFIX), blob)
        write_atomically(self._path(manifest.version, MANIFEST_SUFFIX), raw_manifest)
        _sync_directory(self.directory)
        for old in self.versions():
            if old != manifest.version:
                for suffix in (MANIFEST_SUFFIX, BLOB_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        self._path(old, suffix).unlink()

    def read(self) -> CachedPolicy | None:
        """The newest cached checkpoint, verified; None when the directory holds none.

        Raises
        ------
        CheckpointError
            When it does not verify (``cache_manifest``, ``cache_policy``, ``cache_role``,
            ``cache_version``, ``arch_mismatch``, ``cache_blob`` or what ``verify_and_load``
            raises: ``size_mismatch``, ``sha256_mismatch``, ...).
        """
        versions = self.versions()
        if not versions:
            return None
        version = versions[0]
        manifest = self._manifest(version)
        blob_path = self._path(version, BLOB_SUFFIX)
        arch = arch_of(manifest)
        try:
            size = blob_path.stat().st_size
        except OSError as exc:
            raise CheckpointError("cache_blob", f"v{version}: {exc}") from None
        if size > max_blob_bytes(manifest.arch):
            raise CheckpointError("size_mismatch", f"{size} bytes, more than the architecture can need")
        try:
            blob = blob_path.read_bytes()
        except OSError as exc:
            raise CheckpointError("cache_blob", f"v{version}: {exc}") from None
        want = len(blob) if isinstance(manifest, DeltaManifest) else manifest.size  # the digest fixes a state's size
        return CachedPolicy(manifest, verify_and_load(blob, digest_of(manifest), want, arch))

    def _manifest(self, version: int) -> Manifest:
        """The cached manifest of ``version``, decoded and checked as the model topic's reader checks it."""
        path = self._path(version, MANIFEST_SUFFIX)
        try:
            if path.stat().st_size > MAX_MANIFEST_BYTES:
                raise CheckpointError("cache_manifest", f"{path.name} is larger than a manifest may be")
            raw = path.read_bytes()
        except OSError as exc:
            raise CheckpointError("cache_manifest", f"v{version}: {exc}") from None
        try:
            schema = orjson.loads(raw).get("schema")
            delta = schema == SCHEMA_DELTA
            decode = decode_delta_manifest if delta else decode_manifest
            manifest: Manifest = decode(raw, signing_key=self.signing_key)
        except Rejected as exc:
            raise CheckpointError("cache_manifest", f"{exc.reason}: {exc.detail}") from None
        except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
            raise CheckpointError("cache_manifest", repr(exc)[:200]) from None
        if manifest.policy != self.policy:
            raise CheckpointError("cache_policy", f"the manifest names policy {manifest.policy!r}")
        # Contract 1.25: a served version read under the base key (a probe's base) is cached as read.
        roles = ("delta",) if delta else ("serving", "base")
        if self.signing_key is not None and manifest.role not in roles:
            role = roles[0]
            raise CheckpointError("cache_role", f"signed for the {manifest.role or 'unnamed'} key, cached as {role}")
        if manifest.version != version:
            raise CheckpointError("cache_version", f"the manifest says v{manifest.version}, its file v{version}")
        if self.expected_arch is not None and arch_of(manifest) != self.expected_arch:
            raise CheckpointError("arch_mismatch", f"{arch_of(manifest)} != {self.expected_arch}")
        return manifest


def _sync_directory(directory: Path) -> None:
    """Make the renames durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
