"""Multi-LoRA over real HTTP: one shard process of the tiny Llama serving two random PEFT
adapters (--lora-adapters) behind a router.

The oracle is transformers on the base model with each adapter merged (W + scale·B·A): greedy
tokens and logprobs under `adapter_id` must equal it; concurrent requests of both adapters and
the base model must each give their own answer; the same prompt under one adapter and then
another must not reuse the first one's cached KV; an unknown adapter_id is a 422 naming the
loaded ones, while OpenAI's `model` naming nothing known keeps the base model (TGI).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hf_reference import hf_greedy
from tests.lora_adapters import merged_model, write_adapter
from tests.router_process import RouterProcess
from tests.shard_process import start_shards

# Longer than a KV block of 16 tokens, so that it leaves cached blocks behind.
PROMPT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods"
NEW = 8


@pytest.fixture(scope="module")
def adapters(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "alpha": write_adapter(root / "alpha", model, rank=8, alpha=16, seed=11),
        "beta": write_adapter(root / "beta", model, rank=4, alpha=8, rslora=True, seed=12,
                              modules=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")),
    }


@pytest.fixture(scope="module")
def url(model: Path, adapters: dict[str, Path]) -> Iterator[str]:
    spec = ",".join(f"{name}={path}" for name, path in adapters.items())
    with start_shards(model, extra_args=["--lora-adapters", spec]) as shards, RouterProcess(
        shards.urls[0], model
    ) as router:
        yield router.url


def generate(url: str, adapter: str | None, inputs: str = PROMPT, prompt_details: bool = False
             ) -> dict[str, Any]:
    """Greedy; `prompt_details` asks for the prompt's tokens too (then no cached block is
    reused: every prompt logprob is computed)."""
    params: dict[str, Any] = {"max_new_tokens": NEW, "details": True,
                              "decoder_input_details": prompt_details}
    if adapter is not None:
        params["adapter_id"] = adapter
    r = httpx.post(f"{url}/generate", json={"inputs": inputs, "parameters": params}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def tokens(answer: dict[str, Any]) -> list[int]:
    return [t["id"] for t in answer["details"]["tokens"]]


def test_info_and_models_list_the_adapters(url: str, model: Path) -> None:
    assert httpx.get(f"{url}/info", timeout=30).json()["lora_adapters"] == ["alpha", "beta"]
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["parent"]) for m in data[1:]] == [
        ("alpha", data[0]["id"]), ("beta", data[0]["id"])]
    assert data[0]["parent"] is None


def test_an_unknown_adapter_id_is_a_422_naming_the_loaded_ones(url: str) -> None:
    body = {"inputs": "hello", "parameters": {"adapter_id": "gamma", "max_new_tokens": 2}}
    for route in ("generate", "generate_stream"):
        r = httpx.post(f"{url}/{route}", json=body, timeout=30)
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "validation"
        assert "'gamma' is not a loaded adapter; loaded adapters: alpha, beta" in r.json()["error"]


def test_each_adapter_matches_transformers_merged_and_the_cache_is_per_adapter(
    url: str, model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The base model (its prompt's tokens asked for), then alpha, then beta on the same prompt
    (the base's and alpha's blocks are cached by then): each equals its own oracle, and none
    found a cached block; the base and alpha again hit their own."""
    first = generate(url, None, prompt_details=True)
    prompt = [t["id"] for t in first["details"]["prefill"]]
    assert len(prompt) > 16
    answers = {name: generate(url, name) for name in ("alpha", "beta")}
    assert cached_tokens(url) == 0
    answers["base"] = generate(url, None)
    hit = cached_tokens(url)
    assert hit >= 16
    for name, answer in answers.items():
        path = model if name == "base" else merged_model(tmp_path / name, model, adapters[name])
        expected, lps = hf_greedy(path, prompt, NEW, ignore_eos=True)
        got = tokens(answer)
        assert got == expected[:len(got)], name
        logprobs = [t["logprob"] for t in answer["details"]["tokens"]]
        assert logprobs == pytest.approx(lps[:len(got)], abs=1e-3), name
    assert len({tuple(tokens(a)) for a in answers.values()}) == 3
    assert tokens(generate(url, "alpha")) == tokens(answers["alpha"])
    assert cached_tokens(url) == 2 * hit


def cached_tokens(url: str) -> float:
    """Prompt tokens found in the prefix cache so far, over all requests."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pytgi_request_cached_tokens_sum "):
            return float(line.split()[1])
    raise AssertionError("pytgi_request_cached_tokens_sum not in /metrics")


def test_concurrent_requests_of_each_adapter_get_their_own_answers(url: str) -> None:
    prompts = [PROMPT, "a small cat sat on the mat", "hello world and good morning"]
    cases = [(a, p) for a in ("alpha", "beta", None) for p in prompts]
    alone = {case: tokens(generate(url, *case)) for case in cases}
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda case: tokens(generate(url, *case)), cases))
    assert together == [alone[case] for case in cases]


def test_openai_model_selects_an_adapter_or_keeps_the_base(url: str) -> None:
    def completion(name: str) -> str:
        body = {"model": name, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    assert completion("beta") == generate(url, "beta")["generated_text"]
    assert completion("some-other-name") == generate(url, None)["generated_text"]


def test_chat_model_selects_an_adapter(url: str) -> None:
    def chat(name: str | None) -> str:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPT}],
                                "max_tokens": NEW, "temperature": 0}
        if name is not None:
            body["model"] = name
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    base = chat(None)
    assert chat("not-an-adapter") == base
    assert chat("alpha") == chat("alpha") != base
    assert chat("beta") not in (base, chat("alpha"))


def test_live_lora_routes_do_not_exist_without_runtime_updates(url: str, adapters: dict[str, Path]
                                                                ) -> None:
    """vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: no such routes (404)."""
    body = {"lora_name": "gamma", "lora_path": str(adapters["alpha"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30).status_code == 404
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "alpha"},
                      timeout=30).status_code == 404
    assert httpx.get(f"{url}/info", timeout=30).json()["lora_adapters"] == ["alpha", "beta"]
