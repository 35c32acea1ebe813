"""Two pytgi replicas behind the real vLLM router (`vllm-router`, the Rust gateway from PyPI).

Before each OpenAI request it forwards, the gateway renders it on a worker
(`POST /v1/chat/completions/render`, `/v1/completions/render`; vLLM's `/tokenize` when render
fails) and routes on the token ids (cache_aware). Here every one of those calls succeeds: its own
metrics count each request's routing input as "render" and none as unavailable, its circuit
breaker records no failure; the model is listed by name and the OpenAI routes, TGI's
/generate_stream and SGLang's /generate body pass through."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.integration.replica_gateways import (
    VLLM,
    Replicas,
    binary_runs,
    replicas_fixture,  # noqa: F401 (the module's `replicas` fixture)
    vllm_gateway,
)
from tests.shard_process import free_port

pytestmark = pytest.mark.skipif(binary_runs(VLLM) is not None, reason=str(binary_runs(VLLM)))

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}]}
SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} ([0-9.e+-]+)$')


def samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """The gateway's Prometheus samples: (name, labels, value)."""
    out = []
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def test_render_tokenize_detokenize_in_vllm_shapes(replicas: Replicas) -> None:
    url = replicas.urls[0]
    templated = httpx.post(f"{url}/chat_tokenize", json=CHAT).json()
    chat_ids = [t["id"] for t in templated["tokenize_response"]]
    rendered = httpx.post(f"{url}/v1/chat/completions/render",
                          json={**CHAT, "max_tokens": 7, "temperature": 0.5})
    assert rendered.status_code == 200, rendered.text
    body = rendered.json()
    assert body["token_ids"] == chat_ids and body["request_id"].startswith("chatcmpl-")
    assert body["model"] == "tiny" and body["stream"] is False
    assert body["sampling_params"]["max_tokens"] == 7
    assert body["sampling_params"]["temperature"] == 0.5

    tgi_ids = [t["id"] for t in httpx.post(f"{url}/tokenize", json={"inputs": "Hello world"}).json()]
    listed = httpx.post(f"{url}/v1/completions/render",
                        json={"model": "tiny", "prompt": ["Hello world", "Bye"]}).json()
    assert [r["token_ids"][:len(tgi_ids)] for r in listed][:1] == [tgi_ids]
    assert len(listed) == 2 and all(r["request_id"].startswith("cmpl-") for r in listed)

    counted = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
    assert counted == {"count": len(tgi_ids), "max_model_len": 420, "tokens": tgi_ids,
                       "token_strs": None}
    chat = httpx.post(f"{url}/tokenize", json=CHAT).json()
    assert chat["tokens"] == chat_ids
    bare = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                               "return_token_strs": True}).json()
    assert len(bare["token_strs"]) == bare["count"] == len(tgi_ids) - 1  # no BOS
    text = httpx.post(f"{url}/detokenize", json={"tokens": bare["tokens"]}).json()
    assert text == {"prompt": "Hello world"}

    # Errors in OpenAI's shape; a body of both shapes is refused, not guessed.
    for path, bad in [("/detokenize", {"tokens": [-1]}), ("/tokenize", {"inputs": "a", "prompt": "a"}),
                      ("/v1/chat/completions/render", {"messages": []}),
                      ("/v1/chat/completions/render", {**CHAT, "continue_final_message": True})]:
        refused = httpx.post(f"{url}{path}", json=bad)
        assert refused.status_code == 422, (path, refused.text)
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (path, error)


def test_through_the_vllm_gateway(replicas: Replicas) -> None:
    prometheus = free_port()
    gateway = vllm_gateway(replicas.urls, "cache_aware", prometheus)
    metrics = f"http://127.0.0.1:{prometheus}"
    try:
        g = gateway.url
        assert [m["id"] for m in httpx.get(f"{g}/v1/models").json()["data"]] == ["tiny"]
        openai_calls = 0
        for _ in range(2):  # the second of each is a prefix hit on the replica that served it
            chat = httpx.post(f"{g}/v1/chat/completions", timeout=60, json={**CHAT, "max_tokens": 4})
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["message"]["role"] == "assistant"
            comp = httpx.post(f"{g}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Once upon a time", "max_tokens": 4})
            assert comp.status_code == 200, comp.text
            openai_calls += 2
        with httpx.stream("POST", f"{g}/v1/chat/completions", timeout=60,
                          json={**CHAT, "max_tokens": 4, "stream": True}) as streamed:
            lines = [ln for ln in streamed.iter_lines() if ln.startswith("data: ")]
        assert streamed.status_code == 200 and lines[-1] == "data: [DONE]", lines
        openai_calls += 1
        # TGI's /generate_stream passes through unchanged.
        with httpx.stream("POST", f"{g}/generate_stream", timeout=60, json={
                "inputs": "Hello", "parameters": {"max_new_tokens": 3}}) as tgi_stream:
            events = [json.loads(ln[5:]) for ln in tgi_stream.iter_lines()
                      if ln.startswith("data:")]
        assert tgi_stream.status_code == 200 and len(events) == 3, events
        assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
        # /generate is re-serialized in SGLang's shape by this gateway too (TGI's `inputs` is
        # dropped): SGLang's body passes.
        sgl = httpx.post(f"{g}/generate", timeout=60, json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert sgl.status_code == 200, sgl.text
        assert sgl.json()["meta_info"]["completion_tokens"] == 3

        seen = samples(metrics)
        inputs = {s[1]["result"]: s[2] for s in seen if s[0] == "vllm_router_kv_routing_inputs_total"}
        # Every OpenAI request was rendered (counted per routing stage); none fell back to
        # /tokenize or found render unavailable. The /generate routes are not rendered
        # ("unsupported_route"/"unsupported_input": no worker call).
        assert inputs["render"] >= openai_calls, inputs
        assert set(inputs) <= {"render", "unsupported_route", "unsupported_input"}, inputs
        outcomes = {s[1]["outcome"] for s in seen if s[0] == "vllm_router_cb_outcomes_total"}
        assert outcomes == {"success"}, outcomes
        decisions = {s[1]["outcome"]: s[2] for s in seen
                     if s[0] == "vllm_router_prefix_routing_decisions_total"}
        assert decisions.get("prefix_hit", 0) >= 2, decisions
    finally:
        gateway.stop()
