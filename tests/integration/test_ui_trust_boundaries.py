"""Whom the login throttle believes (docs/operations.md, "The web app"; issue: trust boundaries).

Against a real uvicorn on a free loopback port: ``causalmem ui`` itself (its ``run``, with
stand-ins for the Kafka-backed pool and topic reader, and uvicorn started with the verb's
own arguments), and :func:`pipeline.ui.app.serve` with and without configured proxies.
Before: uvicorn trusted ``X-Forwarded-For`` from loopback, so each attempt naming a fresh
address got a fresh allowance (30 attempts, 0 refused; 86 attempts over 43 names, 2
refused), and five guesses from anywhere locked the real labeler out (429).
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx
import uvicorn
from starlette.testclient import TestClient

import pipeline.cli as cli
from pipeline.cli import ui as ui_verb
from pipeline.config import Settings
from pipeline.ui import app as app_module
from pipeline.ui import auth

TOKEN = "ann-token-0123"


@pytest.fixture(autouse=True)
def _cheap_hashes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every attempt still hashes once; at 1 iteration instead of 600 000, and the dummy never matches."""
    real = auth._pbkdf2
    monkeypatch.setattr(auth, "_pbkdf2", lambda pw, salt, it: real(pw, salt, 1) if it <= 1000 else b"\0" * 32)
    monkeypatch.setenv("HOME", str(tmp_path))


def _labelers(tmp_path: Path) -> Path:
    path = tmp_path / "labelers.toml"
    path.write_text(f'[labelers.ann]\ntoken = "{TOKEN}"\n')
    return path


def _stand_ins() -> dict[str, Any]:
    """No broker: the login pages need neither the labeling pool nor the topic reader."""
    return {"pool": SimpleNamespace(), "feeds": SimpleNamespace()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _serving(start: Any) -> Iterator[tuple[str, list[uvicorn.Server]]]:
    """Run ``start()`` (which ends in ``uvicorn.run``) on a thread; yield the base URL once it listens."""
    servers: list[uvicorn.Server] = []
    ports: list[int] = []
    real_run = uvicorn.run

    def run(app: Any, **kwargs: Any) -> None:  # uvicorn.run, keeping a handle to stop it
        ports.append(kwargs["port"])
        server = uvicorn.Server(uvicorn.Config(app, **kwargs))
        servers.append(server)
        server.run()

    uvicorn.run = run  # type: ignore[assignment]
    try:
        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not (servers and servers[0].started):
            assert thread.is_alive() and time.monotonic() < deadline, "the app did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{ports[0]}", servers
        servers[0].should_exit = True
        thread.join(10)
    finally:
        uvicorn.run = real_run  # type: ignore[assignment]


@contextlib.contextmanager
def causalmem_ui(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    """``causalmem ui --labelers FILE --port P`` as an operator runs it (the Kafka clients stood in for)."""
    apps: list[Any] = []
    real_create = app_module.create_app

    def create_app(config: Any, bootstrap: str, **kw: Any) -> Any:
        apps.append(real_create(config, bootstrap, **_stand_ins()))
        return apps[-1]

    monkeypatch.setattr(app_module, "create_app", create_app)
    argv = ["ui", "--labelers", str(_labelers(tmp_path)), "--port", str(_free_port())]
    argv += ["--bootstrap", "127.0.0.1:1", "--state-dir", str(tmp_path)]
    args = cli.build_parser(argv).parse_args(argv)
    with _serving(lambda: ui_verb.run(args)) as (url, _):
        yield url, apps[0]


def _attempt(client: Any, url: str, name: str, secret: str, **headers: str) -> int:
    page = client.get(f"{url}/login", headers=headers)
    csrf = re.search(r'name="csrf" value="([^"]*)"', page.text)
    assert csrf, page.text[:300]
    data = {"csrf": csrf.group(1), "name": name, "secret": secret, "next": "/queue"}
    status: int = client.post(f"{url}/login", data=data, headers=headers, follow_redirects=False).status_code
    return status


def test_causalmem_ui_takes_no_client_address_from_x_forwarded_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: 30 attempts, each naming a fresh address in X-Forwarded-For, 0 refused; a spray of
    86 attempts over 43 names, 2 refused."""
    with causalmem_ui(tmp_path, monkeypatch) as (url, app), httpx.Client() as c:
        statuses = [_attempt(c, url, f"user{i}", "guess", **{"X-Forwarded-For": f"203.0.113.{i}"}) for i in range(30)]
        assert statuses == [401] * 20 + [429] * 10  # one client, held by its address whatever it claims
        app.state.ui.throttle = type(app.state.ui.throttle).of(app.state.ui.config)  # a fresh throttle
        spray = [
            _attempt(c, url, f"name{i % 43}", "guess", **{"X-Forwarded-For": f"198.51.100.{i}"}) for i in range(86)
        ]
        assert spray.count(429) == 66 and spray[:20] == [401] * 20


def test_guesses_from_elsewhere_do_not_lock_a_labeler_out(tmp_path: Path) -> None:
    """Before: five wrong guesses at ann's name from any address, and ann, from her own, got 429."""
    config = Settings(state_dir=str(tmp_path)).ui(labelers_file=_labelers(tmp_path))
    app = app_module.create_app(config, "127.0.0.1:1", **_stand_ins())
    now = [0.0]
    app.state.ui.throttle.clock = lambda: now[0]

    def browser(address: str) -> TestClient:
        return TestClient(app, base_url="http://127.0.0.1", client=(address, 5000))

    for i in range(5):
        assert _attempt(browser(f"10.0.0.{i}"), "", "ann", "guess") == 401
    ann = browser("192.168.1.20")
    assert _attempt(ann, "", "ann", TOKEN) == 303
    # A guesser spread over many addresses slows the name, briefly: ann waits seconds, not minutes.
    statuses = [_attempt(browser(f"10.0.1.{i}"), "", "ann", "guess") for i in range(60)]
    assert 401 in statuses and 429 in statuses
    elsewhere = browser("192.168.7.7")
    r = elsewhere.post(
        "/login", data={"csrf": _csrf(elsewhere), "name": "ann", "secret": TOKEN}, follow_redirects=False
    )
    assert r.status_code == 429 and int(r.headers["Retry-After"]) <= config.login_name_all_refill_s
    now[0] += config.login_name_all_refill_s
    assert _attempt(elsewhere, "", "ann", TOKEN) == 303
    # From an address she has logged in from, the spray does not hold her at all.
    assert [_attempt(browser(f"10.0.2.{i}"), "", "ann", "guess") for i in range(3)][-1] == 429
    assert _attempt(ann, "", "ann", TOKEN) == 303


def _csrf(c: TestClient) -> str:
    m = re.search(r'name="csrf" value="([^"]*)"', c.get("/login").text)
    assert m
    return m.group(1)


@pytest.mark.parametrize(
    ("proxies", "trusted"),
    [((), False), (("10.1.2.3",), False), (("127.0.0.1",), True), (("127.0.0.0/8", "::1"), True)],
)
def test_serve_believes_x_forwarded_for_only_from_a_configured_proxy(
    tmp_path: Path, proxies: tuple[str, ...], trusted: bool
) -> None:
    config = Settings(state_dir=str(tmp_path)).ui(
        labelers_file=_labelers(tmp_path), port=_free_port(), trusted_proxies=proxies
    )
    app = app_module.create_app(config, "127.0.0.1:1", **_stand_ins())
    with _serving(lambda: app_module.serve(app, config)) as (url, servers), httpx.Client() as c:
        assert servers[0].config.forwarded_allow_ips == list(proxies)
        statuses = [_attempt(c, url, f"user{i}", "guess", **{"X-Forwarded-For": f"203.0.113.{i}"}) for i in range(30)]
    if trusted:  # each client behind the proxy has its own allowance
        assert statuses == [401] * 30
    else:  # the header is nobody's word: the peer is the client
        assert statuses == [401] * 20 + [429] * 10


def test_a_proxy_list_of_anything_but_addresses_is_refused(tmp_path: Path) -> None:
    for bad in (("*",), ("proxy.example",), ("",)):
        with pytest.raises(ValueError, match="trusted_proxies"):
            Settings(state_dir=str(tmp_path)).ui(trusted_proxies=bad)
