"""Shard faults the router must survive without a restart, against a real router and shard:

- a Prefill the shard rejects fails that batch's requests with 424 and the router serves on, with
  no reconnection (the shards were fine);
- a wedged shard (SIGSTOP): /health stays up while the stuck step is within its deadline (a
  wedged shard and one slow CPU step look the same; issue 11 item 5: no flapping), the stuck
  call hits its deadline (--shard-step-timeout) and its requests end with 424 instead of
  hanging, /health then fails, and once the shard runs again the watchdog reconnects and
  service resumes.

The rejected Prefill comes from a realistic misconfiguration: a tokenizer with one more token
than the model's embedding, so a prompt with that token carries an id the shard refuses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.http_helpers import metric, sse_events
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses, start_shards

POISON = "<poison>"
STEP_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def model(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("poison") / "llama"
    shutil.copytree(tiny_model("llama"), path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 10**6, "content": POISON, "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False,
                                      "special": False})
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as s:
        yield s


@pytest.fixture(scope="module")
def url(shards: ShardProcesses, model: Path) -> Iterator[str]:
    # One decode step per call: a k-step call's deadline is k step timeouts (multi-step decode),
    # and these tests time a wedged shard against one.
    with RouterProcess(shards.urls[0], model, "--shard-step-timeout", str(STEP_TIMEOUT_S),
                       "--max-total-tokens", "400", "--max-decode-steps", "1") as router:
        yield router.url


class Stream:
    """A long /generate_stream read on a thread: its events and when it ended."""

    def __init__(self, url: str) -> None:
        self.events: list[Any] = []
        self.ended_at = 0.0
        self.started = threading.Event()
        body = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 300}}
        self._thread = threading.Thread(target=self._read, args=(url, body))
        self._thread.start()
        assert self.started.wait(60), "the stream never started"

    def _read(self, url: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as r:
            for event in sse_events(r):
                self.events.append(event)
                self.started.set()
        self.ended_at = time.monotonic()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream hung"


def health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=30).status_code


def wait_for_health(url: str, status: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health(url) == status:
            return True
        time.sleep(0.2)
    return False


def generate(url: str, inputs: str) -> httpx.Response:
    return httpx.post(f"{url}/generate", timeout=60,
                      json={"inputs": inputs, "parameters": {"max_new_tokens": 4}})


def test_an_id_past_the_vocabulary_is_refused_before_it_reaches_the_batch(url: str) -> None:
    """The router checks token ids against the shard's vocabulary (issue 11, item 6): the request
    gets its own 422 and the stream running beside it never notices (what happens when a shard
    still refuses a newcomer: tests/integration/test_rejected_newcomer.py)."""
    failures = metric(url, "tgi_batch_inference_failure", method="prefill")
    running = Stream(url)
    bad = generate(url, f"Hello {POISON} world")
    assert bad.status_code == 422, bad.text
    assert bad.json()["error_type"] == "validation"
    assert "outside the model's vocabulary" in bad.json()["error"]
    running.join(30)
    assert "error_type" not in running.events[-1], running.events[-1]
    assert metric(url, "tgi_batch_inference_failure", method="prefill") == failures
    ok = generate(url, "Hello world")
    assert ok.status_code == 200, ok.text
    assert health(url) == 200
    assert metric(url, "pytgi_shard_reconnects") == 0, "a healthy shard is not reconnected"
    assert metric(url, "pytgi_kv_blocks_free") == metric(url, "pytgi_kv_blocks_total")


def test_a_wedged_shard_fails_health_then_its_batch_then_recovers(
    url: str, shards: ShardProcesses
) -> None:
    pid = shards.procs[0].pid
    running = Stream(url)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        statuses = []
        while running.ended_at == 0.0 and time.monotonic() - stopped_at < 30:
            statuses.append((time.monotonic() - stopped_at, health(url)))
            time.sleep(0.2)
        running.join(5)
        # A step within its deadline is not a failure, even past the health timeout (5 s).
        assert all(code == 200 for t, code in statuses if t < STEP_TIMEOUT_S - 1), statuses
        # Past the deadline the batch failed and the frozen shard fails the watchdog's check.
        assert wait_for_health(url, 503, 10), "/health never failed while the shard was wedged"
        waited = running.ended_at - stopped_at
        assert STEP_TIMEOUT_S - 1 < waited < STEP_TIMEOUT_S + 5, waited
        assert running.events[-1]["error_type"] == "generation"
        busy = generate(url, "Hello")
        assert busy.status_code in (424, 503) and "error_type" in busy.json()
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while health(url) != 200:
        assert time.monotonic() < deadline, "the router never recovered"
        time.sleep(0.2)
    assert generate(url, "Hello world").status_code == 200
    assert metric(url, "pytgi_shard_reconnects") == 1
    assert metric(url, "pytgi_kv_blocks_free") == metric(url, "pytgi_kv_blocks_total")
