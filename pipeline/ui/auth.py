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
checks, the login form included (a page on another site cannot log the browser in). Every
page but the login page needs a logged-in labeler.

Checking a password is made to cost the same whoever is named (:func:`authenticate`: one
PBKDF2 per attempt, against a dummy hash for an unknown name or a token), and the app runs
it in a worker thread, never on the event loop. A signed cookie alone is not a session:
each login records a session id in :class:`Sessions`, in the app's memory, and logging
out (or restarting the app) ends it, so a copied cookie stops working with its session.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request

from pipeline import kafka
from pipeline.config import Connection

log = logging.getLogger(__name__)

PBKDF2_ITERATIONS = 600_000
NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-")
SESSION_MAX_AGE_S = 12 * 3600
# What an attempt naming nobody (or a token labeler) is hashed against: the same work as a
# real password hash, a digest nothing matches.
DUMMY_HASH = f"pbkdf2_sha256${PBKDF2_ITERATIONS}${os.urandom(16).hex()}${os.urandom(32).hex()}"


def _pbkdf2(password: str, salt: bytes, iterations: int) -> bytes:
    """PBKDF2-SHA256: the one slow step of a login (600 000 iterations), kept off the event loop."""
    return hashlib.pbkdf2_hmac("sha256", password.encode("utf-8", "surrogatepass"), salt, iterations)


def same_secret(a: str, b: str) -> bool:
    """Constant-time equality of two strings, any characters (``compare_digest`` on str accepts ASCII only)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def hash_password(password: str, iterations: int = PBKDF2_ITERATIONS, salt: bytes | None = None) -> str:
    """A ``password_hash`` for the labelers file (PBKDF2-SHA256).

    >>> h = hash_password("pw", iterations=1000, salt=b"salt")
    >>> h.split("$")[:3], check_password("pw", h), check_password("no", h)
    (['pbkdf2_sha256', '1000', '73616c74'], True, False)
    """
    salt = salt if salt is not None else os.urandom(16)
    digest = _pbkdf2(password, salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


def check_password(password: str, stored: str) -> bool:
    try:
        scheme, iterations, salt, digest = stored.split("$")
        if scheme != "pbkdf2_sha256":
            return False
        got = _pbkdf2(password, bytes.fromhex(salt), int(iterations))
    except ValueError:
        return False
    return same_secret(got.hex(), digest)


@dataclass(frozen=True)
class Labeler:
    name: str
    token: str | None = None
    password_hash: str | None = None

    def accepts(self, secret: str) -> bool:
        if self.token is not None and same_secret(self.token, secret):
            return True
        return self.password_hash is not None and check_password(secret, self.password_hash)


def authenticate(labelers: dict[str, Labeler], name: str, secret: str) -> Labeler | None:
    """The labeler ``name`` when ``secret`` is theirs, else None: blocking, one PBKDF2 whoever is named.

    An unknown name, or a labeler with a token only, is hashed against :data:`DUMMY_HASH`,
    so the time an answer takes does not tell a known name from an unknown one.
    """
    who = labelers.get(name.strip())
    stored = who.password_hash if who is not None and who.password_hash else DUMMY_HASH
    password_ok = check_password(secret, stored)
    if who is None or not secret:
        return None
    token_ok = who.token is not None and same_secret(who.token, secret)
    return who if token_ok or (who.password_hash is not None and password_ok) else None


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
        try:  # connecting authenticates: wrong credentials fail here
            return await kafka.start_producer(self.bootstrap, self.connection_of(name, password))
        except Exception as exc:
            log.info("ui: SASL login of %r refused (%s)", name, type(exc).__name__)
            return None


def session_secret(state_dir: Path) -> str:
    """The key that signs session cookies: created once, owner-readable only."""
    path = state_dir / "ui-secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


class Sessions:
    """The live sessions, by id, in the app's memory: a cookie is honoured only while its id is here.

    :func:`start_session` records one, logout ends it, and a restart of the app ends them
    all (labelers log in again). At most ``per_labeler`` live sessions per labeler (the
    oldest ends first) and none older than ``max_age_s``.
    """

    def __init__(
        self,
        max_age_s: float = SESSION_MAX_AGE_S,
        per_labeler: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_age_s = max_age_s
        self.per_labeler = per_labeler
        self.clock = clock
        self._live: dict[str, tuple[str, float]] = {}  # session id → (labeler, expiry)

    def start(self, labeler: str) -> str:
        now = self.clock()
        self._live = {sid: v for sid, v in self._live.items() if v[1] > now}
        theirs = [sid for sid, (who, _) in self._live.items() if who == labeler]
        for sid in theirs[: max(0, len(theirs) - self.per_labeler + 1)]:
            del self._live[sid]
        sid = secrets.token_urlsafe(18)
        self._live[sid] = (labeler, now + self.max_age_s)
        return sid

    def valid(self, sid: object, labeler: str) -> bool:
        if not isinstance(sid, str):
            return False
        live = self._live.get(sid)
        return live is not None and live[0] == labeler and live[1] > self.clock()

    def end(self, sid: object) -> None:
        if isinstance(sid, str):
            self._live.pop(sid, None)


def sessions_of(request: Request) -> Sessions | None:
    """The app's :class:`Sessions` (``app.state.sessions``, set by ``create_app``)."""
    sessions = getattr(request.app.state, "sessions", None)
    return sessions if isinstance(sessions, Sessions) else None


def current_labeler(request: Request) -> str | None:
    """The logged-in labeler: a signed cookie naming them and a session id the app still holds."""
    who = request.session.get("labeler")
    if not isinstance(who, str) or not who:
        return None
    sessions = sessions_of(request)
    return who if sessions is not None and sessions.valid(request.session.get("sid"), who) else None


def csrf_token(request: Request) -> str:
    """This session's CSRF token (created with the session)."""
    token = request.session.get("csrf")
    if not isinstance(token, str):
        token = request.session["csrf"] = secrets.token_urlsafe(24)
    return token


def csrf_ok(request: Request, form: Any) -> bool:
    """The form's CSRF token is this session's (any characters: a forged one is refused, never a crash)."""
    sent = form.get("csrf") if form is not None else None
    expected = request.session.get("csrf")
    return isinstance(sent, str) and isinstance(expected, str) and same_secret(sent, expected)


def start_session(request: Request, name: str) -> None:
    """A fresh session for ``name``: a new session id (recorded server-side) and a new CSRF token."""
    sessions = sessions_of(request)
    if sessions is None:
        raise RuntimeError("the app has no session registry (app.state.sessions)")
    end_session(request)
    request.session["labeler"] = name
    request.session["sid"] = sessions.start(name)
    csrf_token(request)


def end_session(request: Request) -> None:
    """Log out: the session id ends server-side (a copy of the cookie stops working) and the cookie is cleared."""
    sessions = sessions_of(request)
    if sessions is not None:
        sessions.end(request.session.get("sid"))
    request.session.clear()
