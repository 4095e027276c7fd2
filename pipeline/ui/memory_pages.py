"""The memory pages: the searchable table, a memory's own page, and its "do not use" action.

"Do not use" sends a ``memory_choice`` label (contract 1.2, docs/contract.md §8) that
names the memory in ``harmful_memories``, with the sample id ``do-not-use:<slot>`` (one
per memory and labeler: marking twice is one label, and no queued sample's answer is
taken) and the query id and step of the newest retrieval step that read or dropped the
memory. It is a proposal: the worker counts it and ``causalmem status`` lists it, and only an
operator's ``causalmem suppress`` makes the learner pin the memory's mask near 0
(docs/operations.md, "Security").
Removing a memory is the memory store's own act, a ``remove`` record on ``memory-lifecycle``
(contract 1.3); the page says so.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from pipeline.labeling.queue import label_event_id
from pipeline.ui.memories import MemoryView
from pipeline.ui.web import error_page, guarded, render, state
from topics.labels import DO_NOT_USE_PREFIX, HumanLabel


def do_not_use_id(slot: int) -> str:
    """The sample id a "do not use" label carries: one per memory, so marking twice is one label.

    >>> do_not_use_id(17)
    'do-not-use:17'
    """
    return f"{DO_NOT_USE_PREFIX}{slot}"


def do_not_use_label(view: MemoryView, slot: int, labeler: str, ts: float) -> HumanLabel | None:
    """The label that marks ``slot`` harmful, about its newest step (None: no step seen yet)."""
    last = view.last_step(slot)
    if last is None:
        return None
    sample_id = do_not_use_id(slot)
    return HumanLabel(
        event_id=label_event_id(sample_id, labeler),
        query_id=last.query_id,
        ts=ts,
        labeler=labeler,
        kind="memory_choice",
        sample_id=sample_id,
        correct_memories=[],
        step=last.step,
        harmful_memories=[slot],
    )


@guarded
async def memories_page(request: Request, who: str, form: Any) -> Response:
    view = state(request).feeds.memories
    q = request.query_params.get("q", "")
    sort = request.query_params.get("sort", "harmful")
    return render(
        request,
        "memories.html",
        rows=view.rows(q, sort),
        q=q,
        sort=sort if sort in MemoryView.SORTS else "harmful",
        sorts=MemoryView.SORTS,
        total=len(view.memories),
        events=view.events,
        experiences=view.experiences,
        credit=view.per_memory_credit,
        by_id=view.by_id,
        evicted=view.evicted,
    )


def _slot(request: Request) -> int | None:
    try:
        return int(request.path_params["slot"])
    except ValueError:
        return None


@guarded
async def memory_page(request: Request, who: str, form: Any) -> Response:
    slot = _slot(request)
    detail = state(request).feeds.memories.detail(slot) if slot is not None else None
    if detail is None:
        return error_page(
            request, f"No memory {request.path_params['slot']} in what this app has read.", 404, "/memories"
        )
    return render(request, "memory.html", m=detail, page="memories", marked=request.query_params.get("marked"))


@guarded
async def do_not_use(request: Request, who: str, form: Any) -> Response:
    ui = state(request)
    slot = _slot(request)
    label = do_not_use_label(ui.feeds.memories, slot, who, time.time()) if slot is not None else None
    if label is None:
        return error_page(request, "No retrieval step has read this memory yet; nothing was sent.", 404, "/memories")
    await ui.pool.publish_label(label)
    return RedirectResponse(f"/memories/{slot}?marked=1", status_code=303)


routes = [
    Route("/memories", memories_page, methods=["GET"]),
    Route("/memories/{slot}", memory_page, methods=["GET"]),
    Route("/memories/{slot}/do-not-use", do_not_use, methods=["POST"]),
]
