"""The labeling pages: one queued sample per screen, answered with the mouse or the keyboard.

The screen shows the question, the memories that were read (their texts) and every
candidate with the serving policy's probability of being drawn first. The labeler marks
the memories that should have been read (keys 1–9 toggle the n-th candidate) and those
that are harmful (Shift+1–9), gives a 1–5 rating (r then 1–5), and sends (Enter), skips
(s) or leaves the sample for others (Esc). ``u`` undoes the last mark; ``z`` takes back
the answer just given while it is held (``--undo`` seconds, nothing sent yet). A label
once sent is final (the worker applies one answer per labeler and sample). Progress is shown against the
queue's depth. What is sent: :mod:`pipeline.ui.pool`.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from pipeline.labeling.answers import offered_slots
from pipeline.ui.pool import LabelError
from pipeline.ui.web import error_page, guarded, render, state
from topics.labels import ActiveLearningSample

GUIDELINES = (
    "Mark as correct the memories the answer needed, whether or not they were read.",
    "Mark as harmful a memory that misleads: wrong, outdated, or about something else.",
    "Rate 1–5 how much the question needed memory at all (1: not at all, 5: impossible without).",
    "Skip when you cannot judge; leave (Esc) to hand the sample to someone else.",
)


def candidate_rows(sample: ActiveLearningSample) -> list[dict[str, Any]]:
    """Every candidate, most likely first: slot, first-draw probability, text, whether it was read.

    The logged top slots carry their probabilities; for the others the probability is
    softmax(scores / temperature) when the sample has its scores, else unknown (None).
    """
    probs: dict[int, float] = {int(t["slot"]): float(t["prob"]) for t in sample.top_slots}
    if sample.scores is not None and len(sample.scores) == len(sample.candidates):
        z = [float(v) / (sample.temperature or 1.0) for v in sample.scores]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = sum(e)
        for slot, v in zip(sample.candidates, e, strict=True):
            probs.setdefault(int(slot), v / total)
    texts = sample.memory_texts or {}
    return [
        {"slot": s, "prob": probs.get(s), "text": texts.get(s, ""), "read": s in sample.selected}
        for s in offered_slots(sample)
    ]


def _ints(form: Any, name: str) -> list[int]:
    out = []
    for v in form.getlist(name):
        try:
            out.append(int(v))
        except (TypeError, ValueError):
            raise LabelError(f"{name}: {v!r} is not a slot number; nothing was sent.") from None
    return out


@guarded
async def queue_page(request: Request, who: str, form: Any) -> Response:
    ui = state(request)
    leased = await ui.pool.lease(who, wait_s=0.5)
    snapshot = ui.feeds.snapshot or {}
    depth = (snapshot.get("active_learning") or {}).get("depth")
    progress = {**ui.pool.progress(who), "depth": depth}
    if leased is None:
        return render(request, "queue.html", sample=None, progress=progress, guidelines=GUIDELINES)
    entry, lease = leased
    s = entry.sample
    return render(
        request,
        "queue.html",
        sample=s,
        lease=lease.token,
        candidates=candidate_rows(s),
        read=[(slot, (s.memory_texts or {}).get(slot, "")) for slot in s.selected],
        progress=progress,
        guidelines=GUIDELINES,
        sent=request.query_params.get("sent"),
        undone=request.query_params.get("undone"),
    )


@guarded
async def answer(request: Request, who: str, form: Any) -> Response:
    ui = state(request)
    action = form.get("action", "answer")
    try:
        rating_raw = (form.get("rating") or "").strip()
        rating = int(rating_raw) if rating_raw else None
        skip = action == "skip"
        await ui.pool.submit(
            who,
            str(form.get("sample_id", "")),
            str(form.get("lease", "")),
            correct=[] if skip else _ints(form, "correct"),
            harmful=[] if skip else _ints(form, "harmful"),
            rating=None if skip else rating,
            skip_reason=(str(form.get("skip_reason") or "").strip() or "skipped") if skip else None,
        )
    except ValueError as exc:  # LabelError, or a rating that is not a number
        message = str(exc) if isinstance(exc, LabelError) else "A rating is a number 1–5; nothing was sent."
        return error_page(request, message, 409)
    return RedirectResponse(f"/queue?sent={'skip' if action == 'skip' else 'answer'}", status_code=303)


@guarded
async def undo(request: Request, who: str, form: Any) -> Response:
    """Take back the answer just given (within the undo time): the sample comes back."""
    try:
        entry = state(request).pool.undo(who)
    except LabelError as exc:
        return error_page(request, str(exc), 409)
    if entry is None:
        return error_page(request, "Taken back, nothing was sent; the sample has moved to another labeler.", 409)
    return RedirectResponse("/queue?undone=1", status_code=303)


@guarded
async def leave(request: Request, who: str, form: Any) -> Response:
    """Release this labeler's lease (the Esc key, the page's unload beacon, or the button)."""
    state(request).pool.release(who, str(form.get("sample_id") or "") or None)
    if form.get("beacon"):
        return Response(status_code=204)
    return RedirectResponse("/memories", status_code=303)


routes = [
    Route("/queue", queue_page, methods=["GET"]),
    Route("/queue/answer", answer, methods=["POST"]),
    Route("/queue/undo", undo, methods=["POST"]),
    Route("/queue/leave", leave, methods=["POST"]),
]
