"""The health page and its live part: ``/health`` draws it, ``/health/live`` is the part the page polls,
``/health/data`` the same numbers as JSON (see :mod:`pipeline.ui.health`)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline.ui.health import health_page
from pipeline.ui.web import guarded, render, state

CHARTS = (
    ("u_system", "U_system (mean utility per step)"),
    ("intervention_rate", "Intervention rate (share of candidates dropped)"),
    ("fallback_rate", "Fallback rate"),
)


def trend_svg(points: list[dict[str, Any]], key: str, width: int = 360, height: int = 90) -> str:
    """A small line chart of one trend (inline SVG; empty text when fewer than two points).

    >>> trend_svg([{"ts": 0, "u": 0.1}, {"ts": 1, "u": None}, {"ts": 2, "u": 0.3}], "u").startswith("<svg")
    True
    """
    values = [(float(p["ts"]), float(p[key])) for p in points if p.get(key) is not None]
    if len(values) < 2:
        return ""
    t0, t1 = values[0][0], values[-1][0]
    lo, hi = min(0.0, *(v for _, v in values)), max(*(v for _, v in values), 0.0)
    span_t, span_v = (t1 - t0) or 1.0, (hi - lo) or 1.0

    def y(v: float) -> float:
        return round(height - 14 - (v - lo) / span_v * (height - 24), 1)

    zero = y(0.0)
    line = " ".join(f"{round(4 + (t - t0) / span_t * (width - 8), 1)},{y(v)}" for t, v in values)
    return (
        f'<svg class="trend" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{key}"><line class="zero" x1="0" x2="{width}" y1="{zero}" y2="{zero}"/>'
        f'<polyline fill="none" stroke="#1f5fbf" stroke-width="2" points="{line}"/>'
        f'<text x="4" y="{height - 2}" class="axis">min {lo:.3g} · max {hi:.3g} · last {values[-1][1]:.3g}</text></svg>'
    )


def view(request: Request) -> dict[str, Any]:
    feeds = state(request).feeds
    data = health_page(feeds.snapshot, feeds.trends, list(feeds.manifests.values()))
    data["charts"] = [(label, trend_svg(data["trends"], key)) for key, label in CHARTS]
    return data


@guarded
async def health(request: Request, who: str, form: Any) -> Response:
    return render(request, "health.html", h=view(request), refresh_s=state(request).config.refresh_s)


@guarded
async def health_live(request: Request, who: str, form: Any) -> Response:
    return render(request, "health_live.html", h=view(request))


@guarded
async def health_data(request: Request, who: str, form: Any) -> Response:
    data = view(request)
    data.pop("charts")
    return JSONResponse(data)


routes = [
    Route("/health", health, methods=["GET"]),
    Route("/health/live", health_live, methods=["GET"]),
    Route("/health/data", health_data, methods=["GET"]),
]
