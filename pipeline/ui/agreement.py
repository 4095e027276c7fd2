"""The agreement pages: κ per pair of labelers, Fleiss' κ, the samples they disagree on, and a review.

Numbers come from :func:`pipeline.labeling.agreement.agreement` (what ``causalmem label
--stats`` prints) over the labels on ``human-labels``, with each sample's offered slots
from ``active-learning``. The review page of a disagreement shows the sample and every
answer side by side; the reviewer settles it by sending their own ``memory_choice``
label (the same record a labeler sends), which the worker applies like any answer.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from pipeline.labeling.agreement import agreement, latest_answers
from pipeline.labeling.answers import offered_slots
from pipeline.labeling.queue import memory_choice_label
from pipeline.ui.labeling import _ints, candidate_rows
from pipeline.ui.pool import LabelError
from pipeline.ui.web import error_page, guarded, render, state


def agreement_view(request: Request) -> dict[str, Any]:
    book = state(request).feeds.book
    offered = {sid: set(offered_slots(s)) for sid, s in book.samples.items()}
    return agreement(list(book.labels), offered)


@guarded
async def agreement_page(request: Request, who: str, form: Any) -> Response:
    return render(request, "agreement.html", result=agreement_view(request))


@guarded
async def review_page(request: Request, who: str, form: Any) -> Response:
    sid = request.path_params["sample_id"]
    book = state(request).feeds.book
    sample = book.samples.get(sid)
    if sample is None:
        return error_page(
            request, f"Unknown sample {sid}: it is not (or no longer) on the queue topic.", 404, "/agreement"
        )
    answers = [a for (s, _), a in latest_answers(list(book.labels)).items() if s == sid]
    return render(
        request,
        "review.html",
        sample=sample,
        candidates=candidate_rows(sample),
        answers=sorted(answers, key=lambda a: a.labeler),
        page="agreement",
    )


@guarded
async def settle(request: Request, who: str, form: Any) -> Response:
    ui = state(request)
    sid = request.path_params["sample_id"]
    sample = ui.feeds.book.samples.get(sid)
    if sample is None:
        return error_page(request, f"Unknown sample {sid}; nothing was sent.", 404, "/agreement")
    if sid in ui.pool.answered.get(who, set()):
        return error_page(
            request,
            "You have answered this sample already; a settlement must come from a reviewer who has not "
            "(the worker applies one answer per labeler). Nothing was sent.",
            409,
            f"/review/{sid}",
        )
    try:
        correct = _ints(form, "correct")
    except LabelError as exc:
        return error_page(request, str(exc), 409, f"/review/{sid}")
    if set(correct) - set(offered_slots(sample)):
        return error_page(request, "Those slots are not among the sample's candidates; nothing was sent.", 409)
    label = memory_choice_label(sample, who, sorted(set(correct)))
    await ui.pool.publish_label(label)
    return RedirectResponse("/agreement?settled=" + sid, status_code=303)


routes = [
    Route("/agreement", agreement_page, methods=["GET"]),
    Route("/review/{sample_id}", review_page, methods=["GET"]),
    Route("/review/{sample_id}", settle, methods=["POST"]),
]
