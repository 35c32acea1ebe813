"""What the speculation-over-HTTP tests (n-gram --speculate, --speculator-model) share: the
server they run (one shard process of the tiny Llama behind a router that prefills in chunks
of 16 tokens, with or without speculation), their prompts, and readers of /generate and
/metrics, so a speculating server and its reference are always built alike."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.router_process import RouterProcess
from tests.shard_process import start_shards

REPEATING = "the quick fox jumps over the lazy dog. " * 4
PLAIN = "Hello world! café 東京 and then something else entirely"


@contextmanager
def chunked_server(model: Path, shard_args: Sequence[str] = (),
                   env: dict[str, str] | None = None) -> Iterator[str]:
    """The router's URL over one shard of `model` started with `shard_args` and `env`;
    without them, the reference server the speculating ones are compared with."""
    with start_shards(model, extra_args=shard_args, env=env) as shards, RouterProcess(
        shards.urls[0], model, "--max-batch-prefill-tokens", "16"
    ) as router:
        yield router.url


def generate(url: str, inputs: str, **params: Any) -> dict[str, Any]:
    body = {"inputs": inputs, "parameters": {"details": True, **params}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def ids(answer: dict[str, Any]) -> list[int]:
    return [t["id"] for t in answer["details"]["tokens"]]


def metric(url: str, name: str) -> float:
    """One unlabelled sample of /metrics; absent is a failure (the series must exist)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
