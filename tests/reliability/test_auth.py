"""The API key through `pytgi-launcher`: every route but the health probes and /metrics needs
`Authorization: Bearer <key>`, and the key shows up in no log line of any process (at DEBUG),
in no process's command line, and in no shard's environment.

The key is given the way that keeps it out of `ps`: the API_KEY variable (the --api-key flag is
equivalent, but then the launcher's own command line holds it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.launcher_process import Launcher, child_pid

KEY = "pytgi-test-key-7f3a9c"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
GUARDED: list[tuple[str, str, object]] = [
    ("POST", "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/tokenize", {"inputs": "Hi"}),
    ("POST", "/chat_tokenize", CHAT),
    ("GET", "/info", None),
    ("GET", "/v1/models", None),
    ("GET", "/docs", None),
    ("GET", "/api-doc/openapi.json", None),
    ("GET", "/openapi.json", None),
    ("GET", "/no-such-route", None),  # no route discovery without the key either
]
OPEN = ["/health", "/metrics", "/ping", "/"]


@pytest.fixture(scope="module")
def launcher(tiny_model: Callable[..., Path]) -> Iterator[Launcher]:
    launcher = Launcher("--model-id", str(tiny_model("llama")), "--num-shard", "1",
                        env={"API_KEY": KEY, "LOG_LEVEL": "DEBUG"})
    try:
        yield launcher.wait_ready()
    finally:
        launcher.close()


def call(url: str, method: str, path: str, body: object, headers: dict[str, str]) -> httpx.Response:
    return httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
def test_every_other_route_needs_the_key(
    launcher: Launcher, method: str, path: str, body: object
) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
                    {"X-Api-Key": KEY}):
        r = call(launcher.url, method, path, body, headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error_type"] == "unauthorized"
    r = call(launcher.url, method, path, body, {"Authorization": f"bearer {KEY}"})
    assert r.status_code == (404 if path == "/no-such-route" else 200), r.text


def test_probes_and_metrics_are_open(launcher: Launcher) -> None:
    for path in OPEN:
        assert httpx.get(f"{launcher.url}{path}", timeout=30).status_code == 200, path


def test_the_key_is_in_no_log_no_command_line_and_no_shard_environment(
    launcher: Launcher,
) -> None:
    url = launcher.url
    # Some traffic first, good and bad, so that every code path had a chance to log.
    call(url, "POST", "/generate", GUARDED[0][2], {"Authorization": f"Bearer {KEY}"})
    call(url, "POST", "/generate", GUARDED[0][2], {"Authorization": f"Bearer {KEY}-wrong"})
    call(url, "POST", "/generate", {"inputs": ""}, {"Authorization": f"Bearer {KEY}"})
    output = launcher.output
    assert "DEBUG" in output, "the test must see DEBUG logging"
    assert KEY not in output
    router, shard = child_pid(launcher, "router"), child_pid(launcher, "shard 0")
    for pid in (launcher.proc.pid, router, shard):
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    assert KEY.encode() not in Path(f"/proc/{shard}/environ").read_bytes()
