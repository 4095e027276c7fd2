"""Reading the processes' Prometheus ``/metrics`` text, and numbers fit for a JSON report.

A scrape becomes a flat ``{"name{label=value,...}": value}`` dict (labels sorted, no
quotes), which :func:`metric` and :func:`labelled` sum over. Used by ``causalmem status``,
the demo, the benchmarks and the tests that run the real processes.

>>> values = parse('''
... # TYPE causalmem_joins_total counter
... causalmem_joins_total{stage="join",partition="0"} 3.0
... causalmem_joins_total{stage="join",partition="1"} 4.0
... causalmem_consumer_lag_messages{topic="dev.experiences"} 7.0
... ''')
>>> values["causalmem_joins_total{partition=0,stage=join}"]
3.0
>>> metric(values, "causalmem_joins_total"), metric(values, "causalmem_joins_total", partition="1")
(7.0, 4.0)
>>> labelled(values, "causalmem_consumer_lag_messages", "topic")
{'dev.experiences': 7.0}
"""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition: ``{"name{k=v,...}": value}``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def scrape(url: str, timeout: float = 2.0) -> dict[str, float]:
    """Scrape one ``/metrics`` endpoint (see :func:`parse`); empty if unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    return parse(text)


def _split(key: str) -> tuple[str, dict[str, str]]:
    base, _, rest = key.partition("{")
    return base, dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples matching the given labels (0 when there are none)."""
    total = 0.0
    for key, value in values.items():
        base, have = _split(key)
        if base == name and all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def labelled(values: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``{label value: sum}`` of a metric's samples, grouped by one label."""
    out: dict[str, float] = {}
    for key, value in values.items():
        base, have = _split(key)
        if base == name and label in have:
            out[have[label]] = out.get(have[label], 0.0) + value
    return out


def metrics_url(address: str) -> str:
    """Accept ``HOST:PORT`` or a full URL; the path defaults to ``/metrics``.

    >>> metrics_url("127.0.0.1:9100"), metrics_url("http://h:1/custom")
    ('http://127.0.0.1:9100/metrics', 'http://h:1/custom')
    """
    if "://" not in address:
        address = "http://" + address
    scheme, _, rest = address.partition("://")
    if "/" not in rest:
        address = f"{scheme}://{rest}/metrics"
    return address


def finite(x: float | None, digits: int | None = None) -> float | None:
    """A number for a JSON report: None where it is missing, NaN or infinite (JSON has neither).

    >>> finite(float("nan")), finite(None), finite(float("inf")), finite(0.1234567, 6)
    (None, None, None, 0.123457)
    """
    if x is None or not math.isfinite(x):
        return None
    return x if digits is None else round(x, digits)
