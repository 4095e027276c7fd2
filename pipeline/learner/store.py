"""The learner's local state: its recent checkpoint versions and their optimizer moments.

The model topic is the system of record; this directory is the learner's own copy, kept
for the cases the topic cannot serve (docs/operations.md):

* the topic is empty (an embedded broker restarted and lost everything): the learner
  republishes what it had learnt instead of starting over;
* a rollback to a version the topic has already tombstoned (the directory keeps the last
  ``LOCAL_VERSIONS`` versions, the topic ``keep_versions``);
* a newest checkpoint whose chunks on the topic are missing or corrupt: the restore takes
  this directory's copy of that version when it has the manifest's sha256.

Adam's moments live only here: a restore uses them when they belong to the checkpoint it
restored, and starts a fresh optimizer otherwise. Each version's manifest is kept next to
its tensors (a restore can fall back to the newest local version that verifies), and the
moments of the last ``OPTIMIZER_VERSIONS``: a checkpoint is saved here *before* it is
published, so whichever version a killed learner last published, its moments are here.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import orjson
import torch
from safetensors.torch import load_file, save_file

from models.policy.network import Arch
from models.policy.weights import to_safetensors, verify_and_load
from topics.manifest import CheckpointError, Manifest, sha256_hex

log = logging.getLogger(__name__)

LOCAL_VERSIONS = 20  # checkpoint versions kept in the local directory (rollback)
OPTIMIZER_VERSIONS = 3  # versions whose Adam moments are kept

# (manifest and baseline as stored, policy tensors, optimizer tensors)
LocalCheckpoint = tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]


def local_dir(state_dir: Path, bootstrap: str, topic_prefix: str, policy: str) -> Path:
    """The directory of one policy on one cluster (and topic prefix) under ``state_dir``.

    >>> local_dir(Path("/s"), "127.0.0.1:9092", "", "default").parent
    PosixPath('/s/learner')
    """
    ident = hashlib.sha256(f"{bootstrap}|{topic_prefix}".encode()).hexdigest()[:12]
    return state_dir / "learner" / f"{policy}-{ident}"


class LocalStore:
    """The learner's recent checkpoints (and optimizer moments) on local disk, one per version."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def save(
        self,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        baseline_state: dict[str, Any],
        blob: bytes | None = None,
    ) -> None:
        """Save a checkpoint; ``blob`` (the published safetensors bytes) is kept as that version's copy."""
        # Every version (the last LOCAL_VERSIONS): for restores when the topic's copy cannot be
        # verified, and for rollbacks after the model topic has tombstoned them. The manifest
        # is written last, atomically: a version without it (a crash mid-save) is not used.
        versions = self.root / "versions"
        versions.mkdir(exist_ok=True)
        v = manifest.version
        if blob is None:
            blob = to_safetensors(tensors)
        (versions / f"{v}.safetensors").write_bytes(blob)
        if optimizer:
            save_file(optimizer, str(versions / f"{v}.optimizer.safetensors"))
        tmp = versions / f"{v}.json.tmp"
        tmp.write_bytes(orjson.dumps({"manifest": manifest.to_dict(), "baseline": baseline_state}))
        tmp.replace(versions / f"{v}.json")
        for old in self.versions()[:-LOCAL_VERSIONS]:
            for path in versions.glob(f"{old}.*"):
                path.unlink()
        for old in self.versions()[:-OPTIMIZER_VERSIONS]:
            (versions / f"{old}.optimizer.safetensors").unlink(missing_ok=True)

    def versions(self) -> list[int]:
        """The versions kept locally, oldest first."""
        root = self.root / "versions"
        return sorted(int(p.stem) for p in root.glob("*.safetensors") if p.stem.isdigit())

    def manifest_of(self, version: int) -> dict[str, Any] | None:
        """The manifest (as a dict) saved with a local version, if any."""
        try:
            meta = orjson.loads((self.root / "versions" / f"{version}.json").read_bytes())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) and isinstance(meta.get("manifest"), dict) else None

    def verified(self, version: int, arch: Arch) -> LocalCheckpoint | None:
        """A local version whose tensors match its saved manifest (size, sha256, names, shapes), with its moments."""
        meta = self.manifest_of(version)
        path = self.root / "versions" / f"{version}.safetensors"
        if meta is None or not path.exists():
            return None
        blob = path.read_bytes()
        manifest = meta["manifest"]
        try:
            tensors = verify_and_load(blob, str(manifest.get("sha256", "")), int(manifest.get("size", -1)), arch)
        except (CheckpointError, ValueError) as exc:
            log.error("learner: local copy of v%d is unusable (%s)", version, exc)
            return None
        return meta, tensors, self.optimizer_of(version, str(manifest.get("sha256", "")))

    def optimizer_of(self, version: int, sha256: str) -> dict[str, torch.Tensor]:
        """Adam's moments saved with ``version`` when that version had this sha256; else none."""
        meta = self.manifest_of(version)
        path = self.root / "versions" / f"{version}.optimizer.safetensors"
        if meta is None or meta["manifest"].get("sha256") != sha256 or not path.exists():
            return {}
        try:
            return load_file(str(path))
        except (OSError, ValueError):
            return {}

    def load_version(self, version: int, arch: Arch) -> dict[str, torch.Tensor] | None:
        path = self.root / "versions" / f"{version}.safetensors"
        if not path.exists():
            return None
        blob = path.read_bytes()
        try:
            return verify_and_load(blob, sha256_hex(blob), len(blob), arch)
        except CheckpointError as exc:
            log.error("learner: local copy of v%d is unusable (%s)", version, exc)
            return None
