"""The Prometheus text parsing shared by ``causalmem status``, the demo, the benches and the tests;
and the doctests of the operator packages (the Makefile's doctest run covers models/ and topics/)."""

from __future__ import annotations

import doctest
import importlib
import math

import pytest

from pipeline.metrics import Metrics
from pipeline.promtext import finite, labelled, metric, metrics_url, parse

OPERATOR_MODULES = [
    "pipeline.promtext",
    "pipeline.labeling.agreement",
    "pipeline.labeling.answers",
    "pipeline.status.render",
]


@pytest.mark.parametrize("name", OPERATOR_MODULES)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_parse_a_real_exposition() -> None:
    """What the processes serve parses into flat keys that metric() and labelled() sum."""
    from prometheus_client import generate_latest

    m = Metrics(role="worker")
    m.joins.inc(5)
    m.set_health(72.0, "healthy")
    values = parse(generate_latest(m.registry).decode())
    assert metric(values, "causalmem_joins_total") == 5.0
    assert metric(values, "causalmem_memory_health_score") == 72.0
    bands = labelled(values, "causalmem_memory_health_band", "band")
    assert bands["healthy"] == 1.0 and sum(bands.values()) == 1.0
    assert metric(values, "causalmem_no_such_metric") == 0.0


def test_metric_matches_every_given_label() -> None:
    values = {"x{a=1,b=2}": 1.0, "x{a=1,b=3}": 2.0, "x{a=2,b=2}": 4.0, "xy{a=1}": 8.0, "x": 16.0}
    assert metric(values, "x") == 23.0
    assert metric(values, "x", a="1") == 3.0
    assert metric(values, "x", a="1", b="3") == 2.0
    assert labelled(values, "x", "b") == {"2": 5.0, "3": 2.0}


def test_finite_and_urls() -> None:
    assert finite(math.nan) is None and finite(-math.inf) is None and finite(None) is None
    assert finite(2.5) == 2.5 and finite(1 / 3, 6) == 0.333333
    assert metrics_url("localhost:9100") == "http://localhost:9100/metrics"
    assert metrics_url("https://h:9/m") == "https://h:9/m"


def test_status_live_views_from_scraped_values() -> None:
    """``causalmem status`` turns two scrapes into rates, and a scrape into a worker's view."""
    from pipeline.status.live import WORKER_RATES, counter_rates, health_summary, worker_view

    before = {"causalmem_joins_total": 100.0, "causalmem_events_in_total": 40.0}
    after = {
        "causalmem_joins_total": 130.0,
        "causalmem_events_in_total": 10.0,  # a restarted process: its counters start again
        "causalmem_memory_health_score": 81.0,
        "causalmem_memory_health_band{band=healthy}": 1.0,
        "causalmem_memory_health_band{band=warning}": 0.0,
        "causalmem_utility_rating_correlation": math.nan,
        "causalmem_consumer_lag_messages{partition=0,topic=dev.outcomes}": 3.0,
        "causalmem_consumer_lag_messages{partition=1,topic=dev.outcomes}": 4.0,
    }
    rates = counter_rates(after, (10.0, before), 12.0, WORKER_RATES)
    assert rates == {"joins_per_s": 15.0, "events_in_per_s": 0.0}
    assert counter_rates(after, None, 12.0, WORKER_RATES) == {"joins_per_s": None, "events_in_per_s": None}
    view = worker_view("u", after, rates, "dev.")
    assert (view["health_score"], view["health_band"], view["correlation"]) == (81.0, "healthy", None)
    assert view["consumer_lag"] == {"outcomes": 7}
    assert worker_view("u", {}, rates, "dev.") == {"url": "u", "up": False}
    assert health_summary([view])["band"] == "healthy"
