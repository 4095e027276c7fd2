"""What every page shares: the app's state, templates, and the login and CSRF guard.

A page handler is ``async def handler(request, labeler, form)``, wrapped by :func:`guarded`:
without a session the browser is sent to the login page (a write gets 403), and a POST
whose CSRF token is not the session's is refused with a page that says so, writing
nothing.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from pipeline.config import UiConfig
from pipeline.ui.auth import Labeler, SaslLogin, csrf_ok, csrf_token, current_labeler
from pipeline.ui.feeds import Feeds
from pipeline.ui.pool import SamplePool
from pipeline.ui.throttle import LoginThrottle

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=str(HERE / "templates"))


def _num(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "–"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


templates.env.filters["num"] = _num
templates.env.filters["when"] = _when


@dataclass
class UiState:
    """What the handlers reach through ``request.app.state.ui``."""

    config: UiConfig
    labelers: dict[str, Labeler]
    pool: SamplePool
    feeds: Feeds
    sasl: SaslLogin | None = None  # labelers log in with their SASL principal (no labelers file)
    throttle: LoginThrottle = field(default_factory=LoginThrottle)  # login attempts, by address and name
    # True once :func:`pipeline.ui.app.serve` started the server: the client address it reports is the
    # connection's peer, or what a configured proxy forwarded (pipeline.ui.app.client_address).
    server_checks_forwarded: bool = False


def state(request: Request) -> UiState:
    ui: UiState = request.app.state.ui
    return ui


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
    context.setdefault("labeler", current_labeler(request))
    context.setdefault("csrf", csrf_token(request) if context["labeler"] else "")
    context.setdefault("page", name.split(".")[0])
    return templates.TemplateResponse(request, name, context, status_code=status_code)


def error_page(request: Request, message: str, status_code: int, back: str = "/queue") -> Response:
    """A clear message on the page; the handler wrote nothing."""
    return render(request, "error.html", status_code=status_code, message=message, back=back, page="error")


Handler = Callable[[Request, str, Any], Awaitable[Response]]


def guarded(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Login for every page; a CSRF token that matches the session's for every POST."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        who = current_labeler(request)
        if who is None or who not in state(request).labelers:
            if request.method != "GET":
                return error_page(request, "Log in first: every change needs a logged-in labeler.", 403, "/login")
            return RedirectResponse(f"/login?next={quote(request.url.path)}", status_code=303)
        form = None
        if request.method == "POST":
            form = await request.form()
            if not csrf_ok(request, form):
                return error_page(
                    request, "This form is out of date (CSRF check failed); reload the page and try again.", 403
                )
        return await handler(request, who, form)

    return endpoint
