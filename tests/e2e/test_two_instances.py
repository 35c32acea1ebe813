"""Two pytgi instances on one host (issue 11 item 1), with real launchers.

Before the fix both used /tmp/text-generation-server-0 and rendezvous port 29500 by default: the
second instance's shard unlinked the first one's socket and took over its path, its readiness
could pass on the first instance's shard, and its exit deleted the socket the first one's router
reconnects through. Now the defaults are derived from the HTTP port, a shard refuses a path a
live server answers on, the launcher only counts its own children as ready, and a shard deletes
only the socket it bound.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.launcher_process import Launcher

REQUESTS = 16


def generate_ok(url: str) -> int:
    """How many of REQUESTS short generations succeed."""
    ok = 0
    for _ in range(REQUESTS):
        reply = httpx.post(f"{url}/generate", timeout=60,
                           json={"inputs": "hello", "parameters": {"max_new_tokens": 2}})
        ok += reply.status_code == 200 and bool(reply.json().get("generated_text") is not None)
    return ok


def answers(path: str) -> bool:
    """Whether a process accepts connections on the unix socket `path` (a fresh connection, as a
    reconnecting router would make)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def test_second_instance_with_default_flags_leaves_the_first_alone(
    tiny_model: Callable[..., Path],
) -> None:
    model = str(tiny_model("llama"))
    first = Launcher("--model-id", model, "--num-shard", "1", private=False).wait_ready()
    try:
        # The second one also sets a shard token (item 10): launcher, shard and router share it
        # through SHARD_TOKEN, and its requests pass the shard's check.
        second = Launcher("--model-id", model, "--num-shard", "1", "--max-batch-total-tokens",
                          "1024", private=False, env={"SHARD_TOKEN": "t0k"}).wait_ready()
        try:
            assert first.uds != second.uds
            assert generate_ok(second.url) == REQUESTS
            assert generate_ok(first.url) == REQUESTS
        finally:
            second.proc.terminate()
            assert second.wait() == 0, second.output
            second.close()
        assert answers(f"{first.uds}-0"), "the second instance's exit took the first's socket"
        assert not Path(f"{second.uds}-0").exists()
        assert generate_ok(first.url) == REQUESTS
    finally:
        first.proc.terminate()
        first.wait()
        first.close()


def test_a_shard_refuses_a_socket_path_another_instance_serves(
    tiny_model: Callable[..., Path],
) -> None:
    model = str(tiny_model("llama"))
    first = Launcher("--model-id", model, "--num-shard", "1").wait_ready()
    try:
        # The collision reproduced: the same socket base name as the running instance.
        second = Launcher("--model-id", model, "--num-shard", "1", "--max-batch-total-tokens",
                          "1024", "--shard-uds-path", first.uds)
        try:
            assert second.wait(120) == 1, second.output
        finally:
            second.close()
        assert "ready: http://" not in second.output
        assert f"{first.uds}-0 is already served by another live process" in second.output
        assert "--shard-uds-path" in second.output
        assert answers(f"{first.uds}-0"), "the refused instance deleted the first one's socket"
        assert generate_ok(first.url) == REQUESTS
    finally:
        first.proc.terminate()
        first.wait()
        first.close()
