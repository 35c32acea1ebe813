"""Bodies near --payload-limit do not freeze the router (issue 11, item 3).

Tokenizing ~2 MB takes a worker thread seconds; with `Tokenizer.encode` the GIL was held the
whole time, so every stream and /health stalled 1.2-1.7 s per such body. Here a real router and
shard serve a stream and /health while megabyte prompts arrive on every route that tokenizes
or renders a template: the stream's longest inter-token gap and /health's slowest answer stay
under half a second, and each big body still gets its correct answer.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.router_checks import assert_unharmed
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses
from tests.tiny_models import _CORPUS

MAX_GAP_S = 0.5
BODY_BYTES = 1_950_000


@pytest.fixture(scope="module")
def router(shard: ShardProcesses, llama: Path) -> Iterator[RouterProcess]:
    with RouterProcess(shard.urls[0], llama) as process:
        yield process


def big_text(seed: int) -> str:
    rnd = random.Random(seed)
    words = " ".join(_CORPUS).split()
    parts: list[str] = []
    size = 0
    while size < BODY_BYTES - 1000:
        word = rnd.choice(words)
        parts.append(word)
        size += len(word.encode()) + 1
    return " ".join(parts)


def big_bodies() -> list[tuple[str, dict[str, Any], int]]:
    """(path, body, expected status): refused by length alone, only its end tokenized
    (`truncate` keeps the prompt's end, so its length proves nothing), a chat template rendered
    first."""
    text = big_text(0)
    return [
        ("/generate", {"inputs": text, "parameters": {"max_new_tokens": 1}}, 422),
        ("/generate", {"inputs": text, "parameters": {"max_new_tokens": 1, "truncate": 8}}, 200),
        ("/v1/completions", {"prompt": text, "max_tokens": 1}, 422),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": text}], "max_tokens": 1}, 422),
        ("/generate", {"inputs": text, "parameters": {"max_new_tokens": 1, "truncate": 8}}, 200),
    ]


class Watch:
    """Streams and polls /health in threads until stopped, keeping the worst delays seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.worst_gap = 0.0
        self.worst_health = 0.0
        self.tokens = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._health)]

    def __enter__(self) -> Watch:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _stream(self) -> None:
        body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 150, "ignore_eos": True}}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                with client.stream("POST", f"{self.url}/generate_stream", json=body) as r:
                    if r.status_code != 200:
                        self.errors.append(f"stream {r.status_code}")
                        return
                    last = time.monotonic()
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            now = time.monotonic()
                            self.worst_gap = max(self.worst_gap, now - last)
                            last = now
                            self.tokens += 1
                        if self.stop.is_set():
                            break

    def _health(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                status = client.get(f"{self.url}/health").status_code
                self.worst_health = max(self.worst_health, time.monotonic() - start)
                if status != 200:
                    self.errors.append(f"health {status}")
                time.sleep(0.05)


def test_megabyte_prompts_do_not_stall_streams_or_health(router: RouterProcess) -> None:
    bodies = [(path, json.dumps(body, ensure_ascii=False).encode(), status) for path, body, status in big_bodies()]
    assert all(len(raw) < 2_000_000 for _, raw, _ in bodies)
    with httpx.Client(timeout=120) as client:
        client.post(f"{router.url}/generate", json={"inputs": "warm", "parameters": {
            "max_new_tokens": 2}}).raise_for_status()
        with Watch(router.url) as watch:
            time.sleep(0.5)
            for path, raw, status in bodies:
                r = client.post(f"{router.url}{path}", content=raw,
                                headers={"content-type": "application/json"})
                assert r.status_code == status, (path, r.text[:300])
                if status == 422:
                    assert "`inputs` tokens + `max_new_tokens` must be <=" in r.json()["error"]
            # The bodies may be done in a second or two (none is tokenized whole): stream on a
            # while, so that the stream's progress is checked, not the bodies' duration.
            deadline = time.monotonic() + 30
            while watch.tokens <= 50 and time.monotonic() < deadline:
                time.sleep(0.1)
        assert not watch.errors, watch.errors
        assert watch.tokens > 50
        assert watch.worst_gap <= MAX_GAP_S, f"a stream stalled {watch.worst_gap:.2f} s"
        assert watch.worst_health <= MAX_GAP_S, f"/health took {watch.worst_health:.2f} s"
        assert_unharmed(router, client)
