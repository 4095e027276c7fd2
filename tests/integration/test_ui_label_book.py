"""The UI's label store (``Feeds.book``) is bounded in bytes (issue: trust boundaries).

Labels reach it through the app's own topic reader (:meth:`Feeds._apply`, what each refresh
does with a ``human-labels`` message). Before: it kept up to 200 000 labels whatever their
size, about 32 KiB each for a 5 KiB label naming every slot (~6.5 GB at the cap).
"""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient

from pipeline.config import Settings
from pipeline.ui.app import create_app
from pipeline.ui.feeds import Feeds

MiB = 1024 * 1024
DEFAULT_BUDGET = 64 * MiB  # docs/operations.md, "The web app"


def big_label(i: int, slots: int = 1024) -> SimpleNamespace:
    """A valid ``memory_choice`` label as large as the contract lets it be: every slot named, a long skip reason."""
    every = list(range(slots))
    query_id = f"q-{i:06d}-" + "x" * 100
    value = {
        "schema": "human_label/v1",
        "event_id": f"label-{i:06d}-" + "x" * 100,
        "query_id": query_id,
        "ts": 1_767_225_600.0 + i,
        "labeler": "ann",
        "kind": "memory_choice",
        "sample_id": f"s-{i:06d}-" + "x" * 100,
        "step": 1,
        "correct_memories": every[: slots // 2],
        "harmful_memories": every[slots // 2 :],
        "skip_reason": "r" * 1024,
    }
    return SimpleNamespace(value=orjson.dumps(value), key=query_id.encode(), offset=i, partition=0)


@pytest.mark.slow  # about 6 s: 2 500 labels read under tracemalloc
def test_the_label_store_stays_within_its_byte_budget_by_default(tmp_path: Path) -> None:
    """Before: 2 500 of these labels held ~78 MB (the count cap, 200 000, was nowhere near)."""
    feeds = Feeds("127.0.0.1:1", Settings(state_dir=str(tmp_path)).ui())  # nothing connects until started
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2_500):
            feeds._apply("labels", big_label(i))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= DEFAULT_BUDGET * 1.1, f"{held / MiB:.0f} MiB held"
    assert 0 < len(feeds.book.labels) < 2_500  # the newest kept, the oldest forgotten
    assert feeds.book.labels[-1].event_id.startswith("label-002499")


def test_the_oldest_labels_and_samples_are_shed_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = Settings(state_dir=str(tmp_path)).ui(label_book_bytes=1 * MiB)
    feeds = Feeds("127.0.0.1:1", config)
    with caplog.at_level(logging.WARNING, logger="pipeline.ui.feeds"):
        for i in range(100):
            feeds._apply("labels", big_label(i))
    book = feeds.book
    assert book.bytes <= 1 * MiB
    kept = len(book.labels)
    assert 0 < kept < 100 and book.shed["label"] == 100 - kept
    assert [lb.event_id[:12] for lb in book.labels] == [f"label-{i:06d}" for i in range(100 - kept, 100)]
    shed_lines = [r for r in caplog.records if "label store" in r.getMessage()]
    assert shed_lines and len(shed_lines) < 5  # said, not once per label
    assert "label_book_bytes" in shed_lines[0].getMessage()

    # The app exports the count with its other Prometheus metrics.
    labelers = tmp_path / "labelers.toml"
    labelers.write_text('[labelers.ann]\ntoken = "a-long-enough-token"\n')
    app = create_app(
        Settings(state_dir=str(tmp_path)).ui(labelers_file=labelers, label_book_bytes=1 * MiB),
        "127.0.0.1:1",
        pool=SimpleNamespace(),
        feeds=feeds,
    )
    text = TestClient(app, base_url="http://127.0.0.1").get("/metrics").text
    assert f'causalmem_ui_label_book_shed_total{{kind="label"}} {100 - kept}.0' in text
    assert "causalmem_ui_label_book_bytes " in text
    assert 'causalmem_ui_label_book_shed_total{kind="sample"} 0.0' in text


def test_a_sample_read_again_is_charged_once(tmp_path: Path) -> None:
    from tests.integration.test_ui_pages import sample

    feeds = Feeds("127.0.0.1:1", Settings(state_dir=str(tmp_path), embedding_dim=8, slots=64).ui())
    book = feeds.book
    book.add_sample(sample("s1"))
    once = book.bytes
    book.add_sample(sample("s1"))
    assert book.bytes == once and list(book.samples) == ["s1"]
    book.add_sample(sample("s2"))
    book.add_sample(sample("s1"))  # read again: now the newest
    assert list(book.samples) == ["s2", "s1"]
