"""TGI's launcher flags of issue "Hardening II" item 13, through one real `pytgi-launcher`:
--served-model-name in /v1/models and a chat response (/info keeps the model id),
--rope-scaling with ROPE_FACTOR from the environment changing the model's tokens exactly as the
same rope_scaling in config.json changes transformers', --disable-custom-kernels reaching the
shard, --enable-prefill-logprobs accepted with prompt logprobs served."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from pytgi_proto.version import version_line
from tests.hf_reference import hf_greedy
from tests.launcher_process import Launcher

SERVED = "tiny-chat"
PROMPT = "To be, or not to be, that is the question. The quick brown fox jumps over the lazy dog."
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def launcher(tiny_model: Callable[..., Path]) -> Iterator[Launcher]:
    launcher = Launcher("--model-id", str(tiny_model("llama")), "--num-shard", "1",
                        "--served-model-name", SERVED, "--rope-scaling", "linear",
                        "--disable-custom-kernels", "--enable-prefill-logprobs",
                        env={"ROPE_FACTOR": "2"})
    try:
        yield launcher.wait_ready()
    finally:
        launcher.close()


def test_served_model_name_names_the_openai_side_only(
    launcher: Launcher, tiny_model: Callable[..., Path]
) -> None:
    models = httpx.get(f"{launcher.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [SERVED]
    chat = httpx.post(f"{launcher.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0,
    }).json()
    assert chat["model"] == SERVED, chat
    assert httpx.get(f"{launcher.url}/info", timeout=10).json()["model_id"] == str(
        tiny_model("llama"))


def test_rope_scaling_changes_the_model_as_config_json_would(
    launcher: Launcher, tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """The tiny Llama's own llama3 scaling and linear x2 give different greedy tokens here;
    pytgi with the flags gives transformers' tokens on a copy whose config.json says linear x2."""
    model = tiny_model("llama")
    scaled = tmp_path / "scaled"
    shutil.copytree(model, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(config))
    prompt = Tokenizer.from_file(str(model / "tokenizer.json")).encode(PROMPT).ids
    expected, _ = hf_greedy(scaled, prompt, NEW_TOKENS, ignore_eos=True)
    unscaled, _ = hf_greedy(model, prompt, NEW_TOKENS, ignore_eos=True)
    assert expected != unscaled, "the check needs a prompt the scaling changes"
    body = httpx.post(f"{launcher.url}/generate", timeout=60, json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": NEW_TOKENS, "details": True, "decoder_input_details": True}}).json()
    assert [t["id"] for t in body["details"]["tokens"]] == expected
    # --enable-prefill-logprobs is accepted; the prompt's logprobs are there (first: none).
    prefill = body["details"]["prefill"]
    assert [t["id"] for t in prefill] == prompt
    assert prefill[0]["logprob"] is None or math.isnan(prefill[0]["logprob"])
    assert all(t["logprob"] <= 0 for t in prefill[1:])


def test_flags_reach_the_shard_log(launcher: Launcher) -> None:
    rope = [line for line in launcher.lines if "pytgi_shard.service.startup: rope scaling" in line]
    assert len(rope) == 1, launcher.output
    overridden = "{'rope_type': 'linear', 'type': 'linear', 'factor': 2.0} in place of config.json's"
    assert overridden in rope[0] and "'rope_type': 'llama3'" in rope[0]
    assert "reference attention, plain PyTorch only" in launcher.output


def test_version() -> None:
    for module in ("pytgi_launcher.cli", "pytgi_router.cli", "pytgi_shard.service.cli"):
        done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                              text=True, timeout=60, check=False)
        assert (done.returncode, done.stdout) == (0, version_line() + "\n"), module
