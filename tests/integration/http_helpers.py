"""Small readers shared by the HTTP integration tests: SSE events and Prometheus samples."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """The JSON of each `data:` event ("[DONE]" as the string itself)."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            yield payload if payload == "[DONE]" else json.loads(payload)


def metric(base_url: str, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when absent)."""
    text = httpx.get(f"{base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
