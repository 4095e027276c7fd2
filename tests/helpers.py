"""Small builders and waits shared by the integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

import numpy as np
from causalmem_lab.procs import Child, wait_until

from pipeline.config import Settings
from pipeline.promtext import metric
from topics.events import Features, RetrievalEvent
from topics.feedback import LLMFeedback
from topics.internal import Experience
from topics.labels import HumanLabel


def retrieval_event(
    s: Settings,
    query_id: str,
    step: int = 0,
    ts: float = 1_767_225_600.0,
    rng: np.random.Generator | None = None,
    selected: list[int] | None = None,
    event_id: str | None = None,
) -> RetrievalEvent:
    rng = rng or np.random.default_rng(abs(hash((query_id, step))) % 2**32)
    candidates = [int(c) for c in rng.choice(s.slots, size=min(6, s.slots), replace=False)]
    return RetrievalEvent(
        event_id=event_id or uuid.uuid4().hex,
        query_id=query_id,
        step=step,
        ts=ts,
        features=Features(rng.normal(size=s.embedding_dim).astype(np.float32), 0.0, 0.0),
        candidates=candidates,
        scores=rng.uniform(0.1, 0.9, size=len(candidates)),
        selected=selected if selected is not None else candidates[:2],
        temperature=0.5,
        logprob=-2.5,
        fallback=False,
        policy=s.policy,
    )


def feedback(query_id: str, step: int = 0, ts: float = 1_767_225_601.0, utility: float = 0.5) -> LLMFeedback:
    return LLMFeedback(uuid.uuid4().hex, query_id, step, ts, utility, nll_with=2.0 - utility, nll_without=2.0)


def label(query_id: str, kind: str, ts: float = 1_767_225_602.0, **fields: Any) -> HumanLabel:
    return HumanLabel(uuid.uuid4().hex, query_id, ts, "tester", kind, **fields)


def experience(s: Settings, i: int, utility: float | None = None, ts: float | None = None) -> Experience:
    rng = np.random.default_rng(i)
    ev = retrieval_event(s, f"q{i}", 0, ts=ts if ts is not None else 1_767_225_600.0 + i, rng=rng, event_id=f"e{i}")
    return Experience(ev.event_id, "feedback", ev, float(rng.normal()) if utility is None else utility)


class Runnable(Protocol):
    async def start(self) -> Any: ...
    async def run(self) -> Any: ...
    async def stop(self) -> Any: ...


R = TypeVar("R", bound=Runnable)


@contextlib.asynccontextmanager
async def running(component: R) -> AsyncIterator[R]:
    """``component`` started, its ``run`` loop in a task; stopped and the task ended on the way out."""
    await component.start()
    task = asyncio.create_task(component.run())
    try:
        yield component
    finally:
        await component.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(
    pred: Callable[[], bool], timeout: float = 30.0, what: str = "condition", interval: float = 0.05
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def publish_tensors(pub: Any, tensors: dict[str, Any], *, arch: Any, **kwargs: Any) -> Any:
    """Serialize a policy's tensors and publish them with a CheckpointPublisher (as the learner does)."""
    from models.policy.weights import to_safetensors

    alpha = float(tensors["alpha"].reshape(-1)[0])
    return await pub.publish(to_safetensors(tensors), alpha=alpha, arch=arch.to_dict(), **kwargs)


def wait_metric(child: Child, name: str, at_least: float, timeout: float, **labels: str) -> float:
    """Wait until ``child``'s metric ``name`` (with ``labels``) reaches ``at_least``; its value then.

    A child that exits meanwhile, or a timeout, fails the test with the child's log tail.
    """
    seen = [0.0]

    def reached() -> bool:
        if not child.alive():
            raise AssertionError(f"{child.verb} exited with {child.proc.returncode}:\n{child.log_tail()}")
        seen[0] = metric(child.metrics(), name, **labels)
        return seen[0] >= at_least

    try:
        wait_until(reached, timeout, interval=0.25, what=f"{name}{labels} >= {at_least}")
    except TimeoutError as exc:
        raise AssertionError(f"{exc} (last {seen[0]})\n{child.verb} log:\n{child.log_tail()}") from None
    return seen[0]


def form_field(html: str, name: str) -> str:
    """The value of the form field ``name`` in a page (a CSRF token, a sample's id)."""
    m = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert m, f"no {name} field"
    return m.group(1)
