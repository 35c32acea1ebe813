"""A shard process that dies, through `pytgi-launcher`: requests in flight end with an error within
seconds, /health turns 503, the launcher restarts the whole shard group (both ranks) while the
router process stays up, reconnects and serves again; once no restart is left, the launcher exits 1
naming the shard and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.frozen_process import frozen
from tests.integration.http_helpers import metric
from tests.launcher_process import Launcher, alive, assert_all_gone, child_pid, descendants


def wait_status(url: str, status: int, timeout: float) -> float:
    """Seconds until GET /health answers `status`."""
    start = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == status:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        assert time.monotonic() - start < timeout, f"/health never answered {status}"
        time.sleep(0.1)


def wait_metric(url: str, name: str, value: float, timeout: float = 60) -> None:
    """Until the router's /metrics shows `name` at `value`."""
    deadline = time.monotonic() + timeout
    while metric(url, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


class InFlight:
    """One streaming and one non-streaming generation, each on its own thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.first_token = threading.Event()
        self.stream_events: list[Any] = []
        self.stream_done_at = 0.0
        self.plain: httpx.Response | None = None
        self.plain_done_at = 0.0
        body = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 180}}
        self.threads = [threading.Thread(target=self._stream, args=(body,)),
                        threading.Thread(target=self._plain, args=(body,))]
        for thread in self.threads:
            thread.start()

    def _stream(self, body: dict[str, Any]) -> None:
        with httpx.stream("POST", f"{self.url}/generate_stream", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.stream_events.append(json.loads(line[5:]))
                    self.first_token.set()
        self.stream_done_at = time.monotonic()

    def _plain(self, body: dict[str, Any]) -> None:
        self.plain = httpx.post(f"{self.url}/generate", json=body, timeout=60)
        self.plain_done_at = time.monotonic()

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a request in flight hung after its shard died"


CACHED_PROMPT = "Paged attention stores keys and values in fixed-size blocks. " * 3


def test_a_killed_shard_restarts_the_group_and_the_router_reconnects(
    tiny_model: Callable[..., Path],
) -> None:
    launcher = Launcher("--model-id", str(tiny_model("llama")), "--num-shard", "2",
                        "--max-shard-restarts", "1", "--max-total-tokens", "200",
                        "--max-input-tokens", "100")
    try:
        url = launcher.wait_ready().url
        # A prompt of several KV blocks, now in the router's prefix cache.
        cached_body = {"inputs": CACHED_PROMPT, "parameters": {"max_new_tokens": 8}}
        before = httpx.post(f"{url}/generate", json=cached_body, timeout=60)
        assert before.status_code == 200, before.text
        router = child_pid(launcher, "router")
        ranks = [child_pid(launcher, f"shard {r}") for r in (0, 1)]
        submitted = metric(url, "tgi_request_count")
        with frozen(ranks[1]):  # no step runs: both requests start together, once both are in
            flight = InFlight(url)
            wait_metric(url, "tgi_request_count", submitted + 2)
        assert flight.first_token.wait(60), "the stream never started"
        # Both in the batch, far from their 180th token: the kill lands mid-generation (a fixed
        # sleep here raced the tiny model, which can finish 180 tokens in 0.2 s).
        wait_metric(url, "tgi_batch_current_size", 2)
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        flight.join(30)
        # Both end with a generation error within seconds, not at their 60 s client timeout.
        assert flight.plain is not None and flight.plain.status_code == 424, flight.plain.text
        assert flight.plain.json()["error_type"] == "generation"
        assert flight.stream_events[-1]["error_type"] == "generation"
        assert max(flight.plain_done_at, flight.stream_done_at) - killed_at < 10
        wait_status(url, 503, 5)
        busy = httpx.post(f"{url}/generate", json={"inputs": "x"}, timeout=10)
        assert busy.status_code in (424, 503) and "error_type" in busy.json()
        wait_status(url, 200, 120)
        ok = httpx.post(f"{url}/generate", timeout=60,
                        json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}})
        assert ok.status_code == 200 and ok.json()["generated_text"] is not None
        # The new shards' KV memory holds nothing of the old cache: the router dropped its
        # prefix cache with them, so the same prompt is computed again, to the same tokens.
        after = httpx.post(f"{url}/generate", json=cached_body, timeout=60)
        assert after.status_code == 200 and after.json() == before.json()
        # The same router process; a new process for every rank of the group.
        assert child_pid(launcher, "router", latest=True) == router and alive(router)
        new_ranks = [child_pid(launcher, f"shard {r}", latest=True) for r in (0, 1)]
        assert set(new_ranks).isdisjoint(ranks) and not any(alive(p) for p in ranks)
        assert metric(url, "pytgi_shard_reconnects") >= 1
        assert metric(url, "pytgi_kv_blocks_free") == metric(url, "pytgi_kv_blocks_total")
        assert "restarting the shard group in 1s (restart 1 of 1)" in launcher.output

        children = descendants(launcher.proc.pid)
        os.kill(new_ranks[0], signal.SIGKILL)
        assert launcher.wait(60) == 1, launcher.output
        assert ("shard 0 was killed by SIGKILL and no shard restart is left "
                "(--max-shard-restarts=1)") in launcher.output
        assert_all_gone(children)
    finally:
        launcher.close()
