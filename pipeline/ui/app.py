"""The web app (``causalmem ui``): a Starlette application over the product's topics.

:func:`create_app` wires the pages (:mod:`~pipeline.ui.labeling`,
:mod:`~pipeline.ui.agreement`, :mod:`~pipeline.ui.memory_pages`,
:mod:`~pipeline.ui.health_pages`), the login (:mod:`~pipeline.ui.auth`), the static files
and, for its lifetime, the labeling pool (:mod:`~pipeline.ui.pool`) and the topic reader
(:mod:`~pipeline.ui.feeds`). No database: the topics, and a state directory for the
session key.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from pipeline.config import UiConfig
from pipeline.ui import agreement, health_pages, labeling, memory_pages, metrics
from pipeline.ui.auth import (
    SESSION_MAX_AGE_S,
    Labeler,
    SaslLogin,
    Sessions,
    authenticate,
    csrf_ok,
    csrf_token,
    current_labeler,
    end_session,
    load_labelers,
    session_secret,
    start_session,
)
from pipeline.ui.feeds import Feeds
from pipeline.ui.pool import SamplePool
from pipeline.ui.throttle import LoginThrottle
from pipeline.ui.web import HERE, UiState, error_page, render, state

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def secure_cookie(config: UiConfig) -> bool:
    """Whether the session cookie is ``Secure`` (sent over HTTPS only): ``config.secure_cookie``, else
    on unless the app listens on loopback (beyond it, TLS is in front: docs/operations.md).

    >>> from pipeline.config import Settings
    >>> secure_cookie(Settings().ui()), secure_cookie(Settings().ui(host="0.0.0.0"))
    (False, True)
    >>> secure_cookie(Settings().ui(secure_cookie=True)), secure_cookie(Settings().ui(host="::", secure_cookie=False))
    (True, False)
    """
    return config.secure_cookie if config.secure_cookie is not None else config.host not in LOOPBACK


def _safe_next(target: str | None) -> str:
    """Only a path on this site (no scheme, no host): the login never redirects elsewhere.

    >>> _safe_next("/memories/3"), _safe_next("https://evil.example/"), _safe_next("//evil.example")
    ('/memories/3', '/queue', '/queue')
    """
    if not target or not target.startswith("/") or target.startswith("//") or urlparse(target).netloc:
        return "/queue"
    return target


async def login_page(request: Request) -> Response:
    return _login_form(request, next=_safe_next(request.query_params.get("next")))


def _login_form(request: Request, status_code: int = 200, **context: Any) -> Response:
    """The login page, with this (anonymous) session's CSRF token: a login needs the page first."""
    context.setdefault("failed", False)
    return render(request, "login.html", status_code=status_code, csrf=csrf_token(request), **context)


# The client address of every request that carries X-Forwarded-For when the app cannot tell
# whether the server took the client from it (it was not started by :func:`serve`).
FORWARDED_UNVERIFIED = "forwarded-unverified"


def client_address(peer: str | None, forwarded: bool, server_checks_forwarded: bool) -> str:
    """The address the login throttle counts a request under.

    ``peer`` is the ASGI client's host; ``forwarded``, whether the request carries
    ``X-Forwarded-For``. Started by :func:`serve`, the server itself replaces the peer with the
    forwarded client only when the peer is one of ``trusted_proxies`` (none by default), so
    the client it reports is believed. Started otherwise (uvicorn's defaults trust the header
    from loopback, so any local client could name a fresh address with each request), a
    request with the header is counted under one shared address, whatever it claims: the
    header never earns anyone a fresh allowance. The app never reads the header's value.

    >>> client_address("10.0.0.7", True, True), client_address("10.0.0.7", False, False)
    ('10.0.0.7', '10.0.0.7')
    >>> client_address("203.0.113.9", True, False), client_address(None, False, True)
    ('forwarded-unverified', 'unknown')
    """
    if forwarded and not server_checks_forwarded:
        return FORWARDED_UNVERIFIED
    return peer if peer is not None else "unknown"


def _address(request: Request) -> str:
    return client_address(
        request.client.host if request.client is not None else None,
        "x-forwarded-for" in request.headers,
        state(request).server_checks_forwarded,
    )


async def login(request: Request) -> Response:
    """Check a login: CSRF, then the throttle, then the password (off the event loop) or the broker.

    A form without this browser's token is refused (a page on another site cannot log the
    browser in); an attempt over the throttle is answered 429 with ``Retry-After`` and
    checks nothing.
    """
    form = await request.form()
    ui = state(request)
    target = _safe_next(str(form.get("next") or ""))
    if not csrf_ok(request, form):
        return _login_form(request, 403, next=target, stale=True)
    name, secret = str(form.get("name") or "").strip(), str(form.get("secret") or "")
    address = _address(request)
    verdict = ui.throttle.acquire(name, address)
    if not verdict.allowed:
        response = _login_form(request, 429, next=target, retry_after=verdict.retry_after)
        response.headers["Retry-After"] = verdict.retry_after
        return response
    if ui.sasl is not None:
        producer = await ui.sasl.log_in(name, secret)
        if producer is None:
            return _login_form(request, 401, next=target, failed=True)
        await ui.pool.set_producer(name, producer)  # this labeler's labels go through it
        ui.labelers[name] = Labeler(name)
    else:
        # PBKDF2 takes a few hundred milliseconds: in a worker thread, the pages stay responsive.
        who = await run_in_threadpool(authenticate, ui.labelers, name, secret)
        if who is None:
            return _login_form(request, 401, next=target, failed=True)
        name = who.name
    ui.throttle.give_back(name, address)
    start_session(request, name)
    return RedirectResponse(target, status_code=303)


async def logout(request: Request) -> Response:
    form = await request.form()
    who = current_labeler(request)
    if who is not None:
        if not csrf_ok(request, form):
            return error_page(request, "This form is out of date (CSRF check failed); reload the page.", 403)
        ui = state(request)
        ui.pool.release(who)  # the lease ends with the session
        if ui.sasl is not None:
            await ui.pool.flush(who, force=True)  # a held answer goes out with the labeler's credentials
            await ui.pool.set_producer(who, None)
            ui.labelers.pop(who, None)
    end_session(request)  # the session id ends here: a copy of the cookie no longer logs anyone in
    return RedirectResponse("/login", status_code=303)


async def home(request: Request) -> Response:
    return RedirectResponse("/queue", status_code=303)


async def metrics_page(request: Request) -> Response:
    """The app's Prometheus metrics (counts only; no login, like every role's ``/metrics``)."""
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)


async def healthz(request: Request) -> Response:
    """Liveness (no login, like every role's ``/healthz``): the app answers."""
    return PlainTextResponse("ok\n")


async def readyz(request: Request) -> Response:
    """Readiness (no login): 200 once the app has read the topics, so its pages show them; 503 before."""
    if not request.app.state.ui.feeds.refreshed.is_set():
        return PlainTextResponse("not ready: the topics have not been read yet\n", status_code=503)
    return PlainTextResponse("ok\n")


def uvicorn_options(config: UiConfig) -> dict[str, Any]:
    """How :func:`serve` starts uvicorn: on ``config``'s host and port, taking the client from
    ``X-Forwarded-For`` (and the scheme from ``X-Forwarded-Proto``) only when the connection
    comes from one of ``config.trusted_proxies``; with none (the default), never.

    >>> from pipeline.config import Settings
    >>> o = uvicorn_options(Settings().ui())
    >>> o["proxy_headers"], o["forwarded_allow_ips"]
    (False, [])
    >>> uvicorn_options(Settings().ui(trusted_proxies=("127.0.0.1",)))["forwarded_allow_ips"]
    ['127.0.0.1']
    """
    proxies = list(config.trusted_proxies)
    return {
        "host": config.host,
        "port": config.port,
        "log_level": "warning",
        "proxy_headers": bool(proxies),
        "forwarded_allow_ips": proxies,  # never uvicorn's default (loopback, or $FORWARDED_ALLOW_IPS)
    }


def serve(app: Starlette, config: UiConfig) -> None:
    """Run ``app`` (from :func:`create_app`) under uvicorn until it is stopped: ``causalmem ui``'s server."""
    import uvicorn

    app.state.ui.server_checks_forwarded = True
    uvicorn.run(app, **uvicorn_options(config))


def create_app(
    config: UiConfig,
    bootstrap: str,
    labelers: dict[str, Labeler] | None = None,
    pool: Any = None,
    feeds: Any = None,
) -> Starlette:
    """The ASGI app. ``pool`` and ``feeds`` default to the Kafka-backed ones (tests pass stand-ins).

    Without ``labelers`` and a labelers file, labelers log in with their SASL principal
    (the connection must be SASL).
    """
    sasl = None
    if labelers is None:
        if config.labelers_file is not None:
            labelers = load_labelers(config.labelers_file)
        elif config.connection.security.security_protocol.startswith("SASL"):
            sasl, labelers = SaslLogin(bootstrap, config.connection), {}
        else:
            raise ValueError("no labelers: pass --labelers FILE, or use a SASL connection (see docs/ui.md)")
    pool = pool or SamplePool(
        bootstrap, config.connection, overlap=config.overlap, lease_s=config.lease_s, undo_s=config.undo_s
    )
    feeds = feeds or Feeds(bootstrap, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for service in (feeds, pool):
                if hasattr(service, "start"):
                    await service.start()
                    stack.push_async_callback(service.stop)
            yield

    routes = [
        Route("/", home),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        *labeling.routes,
        *agreement.routes,
        *memory_pages.routes,
        *health_pages.routes,
        Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    middleware = [
        Middleware(
            SessionMiddleware,
            secret_key=session_secret(config.state_dir),
            session_cookie="causalmem_ui",
            max_age=SESSION_MAX_AGE_S,
            same_site="strict",
            https_only=secure_cookie(config),
        )
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.ui = UiState(config, labelers, pool, feeds, sasl, LoginThrottle.of(config))
    app.state.metrics = metrics.registry(app.state.ui)
    app.state.sessions = Sessions(SESSION_MAX_AGE_S)
    return app
