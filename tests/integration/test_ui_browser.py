"""``causalmem ui`` in a real browser: headless Chromium (Debian's package) driven by Playwright.

A worker and a learner run as child processes on the test broker; a few hours of traffic
over a small memory bank give the memory and health pages something to show, and one bad
answer queues a sample. The browser logs in, labels the sample with the keyboard, and the
test checks that the ``human_label`` arrives and that the learner publishes a ``label``
checkpoint (an answer taken back with ``z`` first is never sent); then it opens a
memory's page, the health page and the agreement page.

With ``CAUSALMEM_UI_SCREENSHOTS=DIR`` the four pages are saved there as PNG (the images
in docs/ui.md come from this test).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from causalmem_lab.procs import Child

from pipeline import kafka
from pipeline.client.publisher import EventPublisher
from pipeline.config import Settings
from pipeline.labeling.queue import memory_choice_label
from pipeline.modeltopic import scan_model_topic
from pipeline.promtext import metric
from tests.conftest import settings_env
from tests.helpers import until
from topics.events import Features, RetrievalEvent
from topics.feedback import LLMFeedback
from topics.labels import HumanLabel, decode_active_learning_sample, decode_human_label

pytestmark = [pytest.mark.broker, pytest.mark.slow]  # ~50 s: a worker, a learner and a browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BASE_TS = 1_767_225_600.0
MEMORIES = {
    0: "The broker listens on port 9092.",
    1: "Deployments run in the eu-west cluster.",
    2: "The on-call rotation changes on Mondays.",
    3: "The broker listens on port 2181 (outdated: that was ZooKeeper).",
    4: "Backups run nightly at 02:00 UTC.",
    5: "The learner publishes a checkpoint at most every 30 seconds.",
    6: "Labels are answered in the browser or the terminal.",
    7: "The staging cluster has three brokers.",
}
QUESTIONS = [
    "Which port does the broker listen on?",
    "Where do deployments run?",
    "When does the on-call rotation change?",
    "When do backups run?",
    "How often does the learner publish?",
]
EFFECT = {0: 0.5, 1: 0.3, 2: 0.2, 3: -0.6, 4: 0.25, 5: 0.1, 6: 0.05, 7: -0.05}  # what each memory does to answers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def traffic(s: Settings, n: int = 40) -> list[tuple[RetrievalEvent, LLMFeedback]]:
    """``n`` steps over ten hours: two memories read, one dropped, per-memory effects measured."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(n):
        slots = [int(x) for x in rng.permutation(len(MEMORIES))]
        if i % 5 == 0:  # the outdated memory is read often
            slots = [3, *(x for x in slots if x != 3)]
        selected, dropped, rest = slots[:2], slots[2:3], slots[3:6]
        candidates = selected + rest
        ts = BASE_TS + i * 900.0
        qid = f"q{i:03d}"
        ev = RetrievalEvent(
            event_id=uuid.uuid4().hex, query_id=qid, step=0, ts=ts,
            features=Features(rng.normal(size=s.embedding_dim).astype(np.float32), 0.0, 0.0),
            candidates=candidates, scores=rng.uniform(0.1, 0.9, size=len(candidates)), selected=selected,
            temperature=0.5, logprob=-2.5, fallback=i % 13 == 0, policy=s.policy, dropped=dropped,
            query_text=QUESTIONS[i % len(QUESTIONS)], memory_texts={m: MEMORIES[m] for m in candidates + dropped},
        )  # fmt: skip
        effects = {m: EFFECT[m] + float(rng.normal(0, 0.1)) for m in selected}
        utility = -0.8 if qid == "q005" else float(np.clip(sum(effects.values()), -1, 1))
        nll_with = 2.0 - utility
        fb = LLMFeedback(
            uuid.uuid4().hex, qid, 0, ts + 1, utility, nll_with=nll_with, nll_without=2.0,
            nll_without_slot={m: nll_with + e for m, e in effects.items()},
        )  # fmt: skip
        out.append((ev, fb))
    return out


class UiServer:
    """``causalmem ui``'s app under uvicorn, in a thread."""

    def __init__(self, app: Any, port: int) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> UiServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started, "the ui did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(15)


async def test_label_in_the_browser_reaches_the_learner(settings: Settings, tmp_path: Path) -> None:
    async_api = pytest.importorskip("playwright.async_api", reason="playwright is in the test extra")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (make chromium)")
    from pipeline.ui.app import create_app

    s = settings.replace(topic_prefix=f"ui{uuid.uuid4().hex[:6]}.", join_window_s=86400.0)
    env = {**settings_env(s), "CAUSALMEM_LABEL_WINDOW_S": str(30 * 86400)}
    await kafka.create_topics(s.bootstrap or "", s)
    worker = Child("worker", s.bootstrap or "", env, log_path=tmp_path / "worker.log")
    learner = Child("learner", s.bootstrap or "", env, log_path=tmp_path / "learner.log")
    shots = os.environ.get("CAUSALMEM_UI_SCREENSHOTS")
    labelers = tmp_path / "labelers.toml"
    labelers.write_text('[labelers.ann]\ntoken = "ann-token-for-the-test"\n')
    port = _free_port()
    config = s.ui(port=port, labelers_file=labelers, refresh_s=1.0, undo_s=1.0, worker_urls=(worker.url,))
    base = f"http://127.0.0.1:{port}"
    try:
        # the app starts (joins the labelers' group, reads the topics) while the worker does
        with UiServer(create_app(config, s.bootstrap or ""), port):
            await until(lambda: metric(worker.metrics(), "causalmem_partitions_owned", stage="join") > 0, 60, "worker")
            async with EventPublisher(s.bootstrap or "", s) as pub:
                for ev, fb in traffic(s):
                    await pub.publish(ev)
                    await pub.publish(fb)
                await pub.flush()
                await asyncio.sleep(1.0)
                # a person says the answer to q005 was wrong: its bad step becomes a sample
                verdict = HumanLabel(
                    uuid.uuid4().hex, "q005", BASE_TS + 5000, "support", "verdict", answer_correct=False
                )
                await pub.publish(verdict)
            await until(lambda: metric(worker.metrics(), "causalmem_al_samples_total") >= 1, 60, "a queued sample")
            msgs = await kafka.read_all(s.bootstrap or "", s, s.topics().active_learning.name)
            queued = decode_active_learning_sample(msgs[0].value, s.limits(), msgs[0].key)

            async with async_api.async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
                page = await browser.new_page(viewport={"width": 1280, "height": 860})
                await page.goto(f"{base}/queue")
                assert "/login" in page.url
                await page.fill("#name", "ann")
                await page.fill("#secret", "ann-token-for-the-test")
                await page.press("#secret", "Enter")
                await page.wait_for_selector("#label-form", timeout=20_000)
                assert queued.query_text and queued.query_text in await page.inner_text("h1.question")
                rows = await page.query_selector_all("tr[data-slot]")
                first, second = [int(await r.get_attribute("data-slot") or -1) for r in rows[:2]]

                async def answer() -> None:
                    await page.keyboard.press("1")  # the first candidate is correct
                    await page.keyboard.press("Shift+2")  # the second is harmful
                    await page.keyboard.press("r")
                    await page.keyboard.press("4")

                await answer()
                await page.keyboard.press("Enter")
                await page.wait_for_url("**/queue?sent=answer", timeout=20_000)
                await page.keyboard.press("z")  # take it back while it is held: nothing is sent
                await page.wait_for_url("**/queue?undone=1", timeout=20_000)
                assert await page.get_attribute("#label-form", "data-sample") == queued.sample_id
                await answer()
                if shots:
                    await page.screenshot(path=f"{shots}/ui-queue.png", full_page=True)
                await page.keyboard.press("Enter")
                await page.wait_for_url("**/queue?sent=answer", timeout=20_000)

                async def labels_of(who: str) -> list[HumanLabel]:
                    msgs = await kafka.read_all(s.bootstrap or "", s, s.topics().human_labels.name)
                    return [x for m in msgs if (x := decode_human_label(m.value, s.limits(), m.key)).labeler == who]

                deadline = time.monotonic() + 20
                while not (mine := await labels_of("ann")):
                    assert time.monotonic() < deadline, "the label did not arrive"
                    await asyncio.sleep(0.5)
                assert len(mine) == 1  # the answer taken back, held before this one, was never sent
                assert (mine[0].sample_id, mine[0].correct_memories, mine[0].harmful_memories, mine[0].rating) == (
                    queued.sample_id,
                    [first],
                    [second],
                    4,
                )

                async def label_checkpoint() -> bool:
                    index = await scan_model_topic(s.bootstrap or "", s)
                    return any(m.reason == "label" for m in index.manifests.values())

                deadline = time.monotonic() + 45
                while not await label_checkpoint():
                    assert time.monotonic() < deadline, "no label checkpoint from the learner"
                    await asyncio.sleep(0.5)

                await page.goto(f"{base}/memories")
                await page.wait_for_selector("#memories tbody tr")
                assert "#3" in await page.inner_text("#memories tbody tr:first-child")  # probably harmful first
                if shots:
                    await page.screenshot(path=f"{shots}/ui-memories.png", full_page=True)
                await page.click("#memories tbody tr:first-child a")
                await page.wait_for_selector("#recent tbody tr")
                assert MEMORIES[3] in await page.inner_text("#memory-text")

                await page.goto(f"{base}/health")
                await page.wait_for_selector("#health-band", timeout=20_000)
                assert (await page.inner_text("#health-band")).lower() in (
                    "efficient",
                    "healthy",
                    "warning",
                    "critical",
                )
                for _ in range(40):  # the served checkpoint versions follow the model topic
                    if "label" in await page.inner_text("#checkpoints"):
                        break
                    await asyncio.sleep(0.5)
                assert "label" in await page.inner_text("#checkpoints")
                if shots:
                    await page.screenshot(path=f"{shots}/ui-health.png", full_page=True)

                # bob answers the same sample from the terminal, differently: the agreement page shows it
                async with EventPublisher(s.bootstrap or "", s) as pub:
                    await pub.publish(memory_choice_label(queued, "bob", [second], rating=2))
                await page.goto(f"{base}/agreement")
                for _ in range(40):
                    if await page.locator("#disagreements").count():
                        break
                    await asyncio.sleep(0.5)
                    await page.reload()
                assert "ann" in await page.inner_text("#disagreements")
                if shots:
                    await page.screenshot(path=f"{shots}/ui-agreement.png", full_page=True)
                await browser.close()
    finally:
        await asyncio.gather(asyncio.to_thread(worker.stop), asyncio.to_thread(learner.stop))
