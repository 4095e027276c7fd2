"""Who may use the web app: labelers from a config file or the SASL principal, signed sessions, CSRF.

Two ways to log in:

- **The labelers file** (``--labelers``): the app checks a token or a password hash, and
  writes the labels with its own Kafka connection; each label names the labeler.
- **The SASL principal** (no labelers file, a SASL connection): a labeler logs in with
  their own Kafka user and password. The broker checks them (:class:`SaslLogin` connects a
  producer with those credentials), and that labeler's labels are written through it, so
  the broker's ACLs apply to them and the identity on the label is the authenticated
  principal, as with ``causalmem label``. The password is kept only by that producer, in
  memory, until logout; after a restart of the app the labeler logs in again.

The labelers file (TOML) names each labeler with a token or a password hash::

    [labelers.ann]
    password_hash = "pbkdf2_sha256$600000$<salt hex>$<hash hex>"   # causalmem ui --hash-password

    [labelers.bob]
    token = "a long random string"

The name is the identity the labels carry. Sessions are cookies signed with a key kept
in the state directory (``ui-secret``, created on first start, readable by its owner
only); each session carries a CSRF token that every form sends back and every write
checks. Every page but the login page needs a logged-in labeler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request

from pipeline import kafka
from pipeline.config import Connection

log = logging.getLogger(__name__)

PBKDF2_ITERATIONS = 600_000
NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-")


def hash_password(password: str, iterations: int = PBKDF2_ITERATIONS, salt: bytes | None = None) -> str:
    """A ``password_hash`` for the labelers file (PBKDF2-SHA256).

    >>> h = hash_password("pw", iterations=1000, salt=b"salt")
    >>> h.split("$")[:3], check_password("pw", h), check_password("no", h)
    (['pbkdf2_sha256', '1000', '73616c74'], True, False)
    """
    salt = salt if salt is not None else os.urandom(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


def check_password(password: str, stored: str) -> bool:
    try:
        scheme, iterations, salt, digest = stored.split("$")
        if scheme != "pbkdf2_sha256":
            return False
        got = hashlib.pbkdf2_hmac("sha256", password.encode(), bytes.fromhex(salt), int(iterations))
    except ValueError:
        return False
    return hmac.compare_digest(got.hex(), digest)


@dataclass(frozen=True)
class Labeler:
    name: str
    token: str | None = None
    password_hash: str | None = None

    def accepts(self, secret: str) -> bool:
        if self.token is not None and hmac.compare_digest(self.token.encode(), secret.encode()):
            return True
        return self.password_hash is not None and check_password(secret, self.password_hash)


def load_labelers(path: Path) -> dict[str, Labeler]:
    """Read the labelers file; a bad entry is an error naming it.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "labelers.toml"
    >>> _ = p.write_text('[labelers.ann]\\ntoken = "t0ken-of-ann"\\n')
    >>> load_labelers(p)["ann"].accepts("t0ken-of-ann")
    True
    """
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    table = data.get("labelers")
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: no [labelers.NAME] entries")
    out: dict[str, Labeler] = {}
    for name, entry in table.items():
        if not name or set(name) - NAME_OK or len(name) > 128:
            raise ValueError(f"{path}: labeler name {name!r}: letters, digits and ._@- only")
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: [labelers.{name}] must be a table")
        token, pw = entry.get("token"), entry.get("password_hash")
        if token is None and pw is None:
            raise ValueError(f"{path}: labeler {name!r} needs a token or a password_hash")
        if token is not None and (not isinstance(token, str) or len(token) < 12):
            raise ValueError(f"{path}: labeler {name!r}: a token is a string of at least 12 characters")
        if pw is not None and (not isinstance(pw, str) or not pw.startswith("pbkdf2_sha256$")):
            raise ValueError(f"{path}: labeler {name!r}: password_hash must come from causalmem ui --hash-password")
        out[name] = Labeler(name, token, pw)
    return out


class SaslLogin:
    """Logins checked by the broker: a producer connected with the labeler's own SASL credentials."""

    def __init__(self, bootstrap: str, conn: Connection) -> None:
        if not conn.security.security_protocol.startswith("SASL"):
            raise ValueError("SASL logins need a SASL connection (--security-protocol SASL_SSL or SASL_PLAINTEXT)")
        self.bootstrap = bootstrap
        self.conn = conn

    def connection_of(self, name: str, password: str) -> Connection:
        """The app's connection with the labeler's user and password instead of its own."""
        security = dataclasses.replace(self.conn.security, sasl_username=name, sasl_password=password)
        return dataclasses.replace(self.conn, security=security)

    async def log_in(self, name: str, password: str) -> Any | None:
        """A started producer authenticated as ``name``, or None when the broker refuses the credentials."""
        if not name or set(name) - NAME_OK or not password:
            return None
        producer = kafka.producer(self.bootstrap, self.connection_of(name, password))
        try:
            await producer.start()  # connecting authenticates: wrong credentials fail here
        except Exception as exc:
            log.info("ui: SASL login of %r refused (%s)", name, type(exc).__name__)
            with contextlib.suppress(Exception):
                await producer.stop()
            return None
        return producer


def session_secret(state_dir: Path) -> str:
    """The key that signs session cookies: created once, owner-readable only."""
    path = state_dir / "ui-secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def current_labeler(request: Request) -> str | None:
    who = request.session.get("labeler")
    return who if isinstance(who, str) and who else None


def csrf_token(request: Request) -> str:
    """This session's CSRF token (created with the session)."""
    token = request.session.get("csrf")
    if not isinstance(token, str):
        token = request.session["csrf"] = secrets.token_urlsafe(24)
    return token


def csrf_ok(request: Request, form: Any) -> bool:
    sent = form.get("csrf") if form is not None else None
    expected = request.session.get("csrf")
    return isinstance(sent, str) and isinstance(expected, str) and hmac.compare_digest(sent, expected)


def log_in(request: Request, labelers: dict[str, Labeler], name: str, secret: str) -> bool:
    """Start a session for ``name`` when ``secret`` is theirs (a fresh session: new CSRF token)."""
    who = labelers.get(name.strip())
    if who is None or not secret or not who.accepts(secret):
        return False
    start_session(request, who.name)
    return True


def start_session(request: Request, name: str) -> None:
    request.session.clear()
    request.session["labeler"] = name
    csrf_token(request)
