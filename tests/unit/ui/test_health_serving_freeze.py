"""The health page says why serving has not moved while candidates wait (pipeline/ui/health.py and
its template), as ``causalmem status`` does."""

from __future__ import annotations

from typing import Any

from pipeline.ui.health import Trends, health_page
from pipeline.ui.web import templates

LINE = (
    "serving v1 for 12m while 20 candidates waited: v20 waits: v20 over v0: gain in [-0.31, +0.42] after 380 decisions"
)


def page(freeze: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    snapshot = {"ts": 0.0, "checkpoints": {"serving": {"version": 1, "reason": "init", "created_ts": 0.0}}}
    if freeze is not None:
        snapshot["checkpoints"]["freeze"] = freeze  # type: ignore[index]
    h = health_page(snapshot, Trends(), [])
    html = templates.env.get_template("health_live.html").render(h={**h, "charts": []})
    return h, html


def test_the_health_page_shows_the_serving_freeze_line() -> None:
    h, html = page({"line": LINE, "frozen": False, "candidates_waiting": 20})
    assert h["serving_freeze"]["line"] == LINE  # also in /health/data
    assert 'id="serving-freeze" class="advice"' in html and LINE.replace("<", "&lt;") in html
    _, html = page({"line": LINE, "frozen": True})
    assert 'id="serving-freeze" class="error">Frozen: serving v1 for 12m' in html


def test_the_health_page_says_nothing_while_no_candidate_waits() -> None:
    for freeze in (None, {"line": None, "frozen": False}):
        h, html = page(freeze)
        assert 'id="serving-freeze"' not in html
    assert h["serving_freeze"] == {"line": None, "frozen": False}
