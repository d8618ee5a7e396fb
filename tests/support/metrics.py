"""The metric reader: a Prometheus series' value, summed over the series whose labels include
the given ones (0 when none is exposed yet), from text, a live server or an engine."""

from __future__ import annotations

import re
from typing import Any

import httpx

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_in(text: str, name: str, /, **labels: str) -> float:
    """The sum of the `name` series in Prometheus `text` whose labels include `labels`."""
    series = re.compile(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)")
    total = 0.0
    for line in text.splitlines():
        match = series.fullmatch(line)
        if match and labels.items() <= dict(_LABEL.findall(match.group(1) or "")).items():
            total += float(match.group(2))
    return total


def metric(server: Any, name: str, /, **labels: str) -> float:
    """`metric_in` of GET /metrics of `server` (anything with a `url`: a LiveServer, a
    ServerProcess)."""
    return metric_in(httpx.get(f"{server.url}/metrics", timeout=30).text, name, **labels)


def engine_metric(engine: Any, name: str, /, **labels: str) -> float:
    """`metric_in` of an in-process engine's own registry (no HTTP)."""
    from prometheus_client import generate_latest

    return metric_in(generate_latest(engine.metrics.registry).decode(), name, **labels)
