"""End to end through `pytgi-launcher`: real shard and router processes, real HTTP, real clients.

Two launchers: one on the tiny Llama with two shards and JSON logs (greedy text equals
transformers', then SIGTERM leaves nothing behind); one on the bundled demo model, exactly what
`make run` starts, whose shard is then SIGKILLed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from text_generation import Client

from tests.launcher_process import (
    START_TIMEOUT,
    Launcher,
    assert_all_gone,
    child_pid,
)


@pytest.fixture(scope="module")
def tiny_launcher(tiny_model: Callable[..., Path]) -> Iterator[Launcher]:
    launcher = Launcher("--model-id", str(tiny_model("llama")), "--num-shard", "2",
                        "--json-output")
    try:
        yield launcher.wait_ready()
    finally:
        launcher.close()


def transformers_greedy(model_dir: Path, prompt: str, new_tokens: int) -> tuple[list[int], str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype="float32")
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return new, tok.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("prompt", ["The quick brown fox", "To be, or not to be"])
def test_two_shard_greedy_text_equals_transformers(
    tiny_launcher: Launcher, tiny_model: Callable[..., Path], prompt: str
) -> None:
    response = Client(tiny_launcher.url, timeout=60).generate(
        prompt, max_new_tokens=12, do_sample=False
    )
    ids, text = transformers_greedy(tiny_model("llama"), prompt, 12)
    assert [t.id for t in response.details.tokens] == ids
    assert response.generated_text == text


def test_json_output_covers_every_process(tiny_launcher: Launcher) -> None:
    records = [json.loads(line) for line in tiny_launcher.lines]
    assert all(isinstance(r, dict) and "message" in r for r in records)
    assert {r["process"] for r in records} == {"launcher", "shard-0", "shard-1", "router"}


def test_sigterm_drains_and_leaves_no_orphans(tiny_launcher: Launcher) -> None:
    """Last test of the module: it stops the shared launcher."""
    children = tiny_launcher.children
    assert len(children) >= 3, "two shards and a router"
    tiny_launcher.proc.send_signal(signal.SIGTERM)
    assert tiny_launcher.wait() == 0, tiny_launcher.output
    assert_all_gone(children)
    assert not list(tiny_launcher.workdir.glob("s-*")), "shard sockets removed"
    messages = [json.loads(line)["message"] for line in tiny_launcher.lines]
    assert "received SIGTERM: shutting down" in messages
    assert messages.index("router exited with code 0") < messages.index("shard-0 exited with code 0")


@pytest.fixture(scope="module")
def demo_launcher() -> Iterator[Launcher]:
    """What `make run` starts (no --model-id: the bundled demo), here on two shards, with TGI's
    policy of stopping on any death (restarts: tests/reliability/test_shard_restart.py), the
    prefill budget measured as `make run` does."""
    launcher = Launcher("--num-shard", "2", "--max-shard-restarts", "0", measure_prefill=True)
    try:
        yield launcher.wait_ready()
    finally:
        launcher.close()


def test_demo_model_is_the_default_and_writes_text(demo_launcher: Launcher) -> None:
    client = Client(demo_launcher.url, timeout=60)
    response = client.generate("ROMEO.\n", max_new_tokens=40, do_sample=True, temperature=0.8,
                               seed=7)
    assert response.details.generated_tokens == 40 or response.details.finish_reason == "eos_token"
    words = re.findall(r"[A-Za-z']+", response.generated_text)
    assert len(words) >= 10, response.generated_text
    info = httpx.get(f"{demo_launcher.url}/info", timeout=10).json()
    assert info["model_id"].endswith("demo_model")


def test_killed_shard_stops_everything_with_a_clear_message(demo_launcher: Launcher) -> None:
    children = demo_launcher.children
    os.kill(child_pid(demo_launcher, "shard 1"), signal.SIGKILL)
    assert demo_launcher.wait() == 1, demo_launcher.output
    assert ("shard 1 was killed by SIGKILL and no shard restart is left (--max-shard-restarts=0);"
            " the other processes were stopped") in demo_launcher.output
    assert_all_gone(children)


def test_shard_startup_failure_is_reported_with_its_error(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    launcher = Launcher("--model-id", str(broken), "--num-shard", "1")
    try:
        assert launcher.wait(START_TIMEOUT) == 1, launcher.output
    finally:
        launcher.close()
    assert "shard 0 exited with code 1 during start-up" in launcher.output
    tail = launcher.output.split("Last lines of its log:", 1)[1]
    assert "Error" in tail, "the shard's error is quoted"


def test_startup_timeout_names_the_shard(tiny_model: Callable[..., Path]) -> None:
    launcher = Launcher("--model-id", str(tiny_model("llama")), "--num-shard", "1",
                        "--shard-startup-timeout", "0.5")
    try:
        assert launcher.wait(START_TIMEOUT) == 1, launcher.output
    finally:
        launcher.close()
    assert "shard 0 did not become ready within 0.5s (--shard-startup-timeout)" in launcher.output
    assert_all_gone({child_pid(launcher, "shard 0")})


def test_sigint_during_startup_stops_cleanly(tiny_model: Callable[..., Path]) -> None:
    launcher = Launcher("--model-id", str(tiny_model("llama")), "--num-shard", "2")
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "started shard 1" not in launcher.output and time.monotonic() < deadline:
            time.sleep(0.05)
        shards = {child_pid(launcher, "shard 0"), child_pid(launcher, "shard 1")}
        launcher.proc.send_signal(signal.SIGINT)
        assert launcher.wait(START_TIMEOUT) == 0, launcher.output
    finally:
        launcher.close()
    assert "received SIGINT: shutting down" in launcher.output
    assert "started router" not in launcher.output, "no router is started after a stop signal"
    assert_all_gone(shards)


def test_port_in_use_fails_before_loading_anything() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pytgi_launcher.cli", "--hostname", "127.0.0.1",
             "--port", str(port)], capture_output=True, text=True, timeout=60,
        )
    assert done.returncode == 1
    assert done.stderr.strip() == (f"pytgi-launcher: error: cannot serve on 127.0.0.1:{port}: "
                                   "the address is in use (choose another --port)")
    assert "started shard" not in done.stdout
