"""The web app's Prometheus metrics (``causalmem_ui_*``), served at ``/metrics`` on the app's port.

They are read at each scrape from the counts the app's parts keep anyway (the label store's
shed entries, the memory view's evictions, the login throttle's refusals), so the parts stay
plain classes that tests build without a registry. Counts only: nothing a label, a memory or
a login says.

>>> from types import SimpleNamespace
>>> from prometheus_client import generate_latest
>>> ui = SimpleNamespace(feeds=SimpleNamespace(), throttle=None)
>>> generate_latest(registry(ui)).decode().count("causalmem_ui_")
0
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class UiCollector(Collector):
    """The app's counts, from ``ui`` (the app's :class:`~pipeline.ui.web.UiState`) at each scrape."""

    def __init__(self, ui: Any) -> None:
        self.ui = ui

    def collect(self) -> Iterator[Metric]:
        book = getattr(self.ui.feeds, "book", None)
        if book is not None and hasattr(book, "shed"):
            shed = CounterMetricFamily(
                "causalmem_ui_label_book_shed",
                "Labels and samples the UI forgot, oldest first, to stay within label_book_bytes",
                labels=["kind"],
            )
            for kind, n in book.shed.items():
                shed.add_metric([kind], n)
            yield shed
            yield GaugeMetricFamily(
                "causalmem_ui_label_book_bytes", "Estimated bytes of the labels and samples the UI keeps", book.bytes
            )
        memories = getattr(self.ui.feeds, "memories", None)
        if memories is not None:
            yield CounterMetricFamily(
                "causalmem_ui_memories_evicted",
                "Memories the memory pages forgot, least recently seen first, to stay within memory_view_bytes",
                memories.evicted,
            )
        throttle = self.ui.throttle
        if throttle is not None:
            refused = CounterMetricFamily(
                "causalmem_ui_logins_refused",
                "Login attempts answered 429, by the limit that held (address, name, name_all)",
                labels=["limit"],
            )
            for limit, n in throttle.refused_by.items():
                refused.add_metric([limit], n)
            yield refused


def registry(ui: Any) -> CollectorRegistry:
    """A registry holding only the app's metrics (one per app: tests run several in one process)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(UiCollector(ui))
    return reg
