"""The `ignore_eos` extension over real HTTP: a tiny Llama whose EOS is the very token it
generates first stops at once by default and runs to max_new_tokens with `ignore_eos`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.router_process import RouterProcess
from tests.shard_process import start_shards

PROMPT = "Hello world"


def _first_greedy_token(model_dir: Path) -> int:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return int(model(ids).logits[0, -1].argmax())


@pytest.fixture(scope="module")
def url(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    source = tiny_model("llama")
    model = tmp_path_factory.mktemp("eos-first") / "llama"
    shutil.copytree(source, model)
    eos = _first_greedy_token(model)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model / name).read_text())
        config["eos_token_id"] = eos
        (model / name).write_text(json.dumps(config))
    with start_shards(model) as shards, RouterProcess(shards.urls[0], model) as router:
        yield router.url


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_generate_stops_at_eos_unless_ignore_eos(url: str) -> None:
    params: dict[str, Any] = {"max_new_tokens": 6, "details": True}
    stopped = post(url, "/generate", {"inputs": PROMPT, "parameters": params})["details"]
    assert (stopped["finish_reason"], stopped["generated_tokens"]) == ("eos_token", 1)
    params["ignore_eos"] = True
    full = post(url, "/generate", {"inputs": PROMPT, "parameters": params})["details"]
    assert (full["finish_reason"], full["generated_tokens"]) == ("length", 6)


def test_openai_completions_take_ignore_eos_like_vllm(url: str) -> None:
    body: dict[str, Any] = {"model": "tgi", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    assert post(url, "/v1/completions", body)["usage"]["completion_tokens"] == 1
    body["ignore_eos"] = True
    done = post(url, "/v1/completions", body)
    assert done["usage"]["completion_tokens"] == 5
    assert done["choices"][0]["finish_reason"] == "length"


def test_ignore_eos_token_is_an_alias_as_vllms_tgi_backend_sends_it(url: str) -> None:
    """vLLM's benchmark (backend "tgi") streams /generate_stream with `ignore_eos_token`."""
    params = {"max_new_tokens": 6, "do_sample": True, "temperature": 0.01, "top_p": 0.99,
              "truncate": 8, "details": True, "ignore_eos_token": True}
    with httpx.stream("POST", f"{url}/generate_stream", timeout=60,
                      json={"inputs": PROMPT, "parameters": params}) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 6 and events[-1]["details"]["finish_reason"] == "length"
    body = {"model": "tgi", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
            "ignore_eos_token": True}
    assert post(url, "/v1/completions", body)["usage"]["completion_tokens"] == 5


def test_ignore_eos_must_be_a_boolean(url: str) -> None:
    r = httpx.post(f"{url}/generate", timeout=60,
                   json={"inputs": PROMPT, "parameters": {"ignore_eos": "yes"}})
    assert r.status_code == 422
    assert "ignore_eos" in r.json()["error"]
