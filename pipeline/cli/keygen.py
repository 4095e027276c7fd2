"""``causalmem keygen``: an Ed25519 key pair for signing checkpoints (docs/operations.md, "Signed checkpoints").

The private key goes to the learner only (``CAUSALMEM_CHECKPOINT_SIGNING_KEY_FILE``); the public
key to every reader: clients, ``status``, tools (``CAUSALMEM_CHECKPOINT_VERIFY_KEY_FILE``). A
reader's key verifies and cannot sign, so no client can forge what the others serve.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from topics.signing import generate_pem

PRIVATE_NAME = "checkpoint-signing.pem"
PUBLIC_NAME = "checkpoint-verify.pem"


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=".", help="folder to write the pair to (default: the current one)")
    p.add_argument("--force", action="store_true", help="replace an existing pair")


def run(args: argparse.Namespace) -> int:
    out = Path(os.path.expanduser(args.out))
    out.mkdir(parents=True, exist_ok=True)
    private, public = out / PRIVATE_NAME, out / PUBLIC_NAME
    if not args.force and (private.exists() or public.exists()):
        print(f"{private} or {public} exists; --force replaces the pair (readers then need the new public key)")
        return 1
    private_pem, public_pem = generate_pem()
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the learner's alone
    with os.fdopen(fd, "wb") as fh:
        fh.write(private_pem)
    os.chmod(private, 0o600)
    public.write_bytes(public_pem)
    print(f"learner (keep secret): CAUSALMEM_CHECKPOINT_SIGNING_KEY_FILE={private}")
    print(f"every reader:          CAUSALMEM_CHECKPOINT_VERIFY_KEY_FILE={public}")
    return 0
