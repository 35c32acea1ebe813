"""The clients people use against TGI work unchanged against pytgi: huggingface_hub's
InferenceClient, the `text-generation` client (sync and async), and the OpenAI SDK — each against a
real pytgi-router in front of a real shard process on the tiny Llama."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import AsyncClient, Client
from text_generation.errors import ValidationError as TGValidationError

from tests.router_process import RouterProcess
from tests.shard_process import start_shards

PROMPT = "The quick brown fox"
N = 8


@pytest.fixture(scope="module")
def url(tiny_model: Callable[..., Path]) -> Iterator[str]:
    model = tiny_model("llama")
    with start_shards(model) as shards, RouterProcess(shards.urls[0], model) as router:
        yield router.url


@pytest.fixture(scope="module")
def reference(url: str) -> dict:
    """What /generate answers greedily: every client must see the same tokens."""
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": N, "details": True}})
    return r.json()


def test_inference_client(url: str, reference: dict) -> None:
    client = InferenceClient(model=url)
    out = client.text_generation(PROMPT, max_new_tokens=N, details=True, do_sample=False,
                                 return_full_text=False)
    assert out.generated_text == reference["generated_text"]
    assert [t.id for t in out.details.tokens] == [t["id"] for t in reference["details"]["tokens"]]
    assert out.details.finish_reason == reference["details"]["finish_reason"]
    chunks = list(client.text_generation(PROMPT, max_new_tokens=N, stream=True, details=True,
                                         do_sample=False, return_full_text=False))
    assert [c.token.id for c in chunks] == [t["id"] for t in reference["details"]["tokens"]]
    assert chunks[-1].generated_text == reference["generated_text"]
    assert chunks[-1].details is not None and chunks[-1].details.generated_tokens == len(chunks)
    # The client posts to TGI's compat route, which (without a Hub pipeline tag, as TGI) returns
    # the full text unless told otherwise.
    text = client.text_generation(PROMPT, max_new_tokens=N, do_sample=False)
    assert text == PROMPT + reference["generated_text"]


def test_text_generation_client(url: str, reference: dict) -> None:
    client = Client(url, timeout=60)
    out = client.generate(PROMPT, max_new_tokens=N, decoder_input_details=True, top_n_tokens=2)
    assert out.generated_text == reference["generated_text"]
    assert out.details.prefill and out.details.prefill[0].logprob is None
    assert out.details.top_tokens is not None and len(out.details.top_tokens) == len(
        out.details.tokens)
    stream = list(client.generate_stream(PROMPT, max_new_tokens=N))
    assert "".join(r.token.text for r in stream if not r.token.special).startswith(
        reference["generated_text"].rstrip("\ufffd"))
    assert stream[-1].generated_text == reference["generated_text"]
    with pytest.raises(TGValidationError, match="`top_k` must be strictly positive"):
        client.generate(PROMPT, top_k=0)


def test_text_generation_async_client(url: str, reference: dict) -> None:
    async def main() -> tuple[str, list[int]]:
        client = AsyncClient(url, timeout=60)
        out = await client.generate(PROMPT, max_new_tokens=N)
        ids = [r.token.id async for r in client.generate_stream(PROMPT, max_new_tokens=N)]
        return out.generated_text, ids

    text, ids = asyncio.run(main())
    assert text == reference["generated_text"]
    assert ids == [t["id"] for t in reference["details"]["tokens"]]


def test_openai_sdk(url: str, reference: dict) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="tgi", messages=messages, max_tokens=N,
                                          temperature=0, logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens <= N
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert all(len(lp.top_logprobs) >= 2 for lp in choice.logprobs.content)
    chunks = list(client.chat.completions.create(
        model="tgi", messages=messages, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert choice.message.content is not None
    assert choice.message.content.rstrip("\ufffd") == streamed
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # The SDK's stream helper merges the deltas into one message (a role repeated in every
    # chunk came out as "assistantassistant...").
    with client.chat.completions.stream(model="tgi", messages=messages, max_tokens=N,
                                        temperature=0) as helper:
        for _ in helper:
            pass
        # (get_final_completion refuses a "length" finish: read the merged snapshot.)
        merged = helper.current_completion_snapshot.choices[0].message
    assert merged.role == "assistant" and merged.content == choice.message.content

    comp = client.completions.create(model="tgi", prompt=[PROMPT, "Hello"], max_tokens=N,
                                     temperature=0)
    assert comp.choices[0].text == reference["generated_text"]
    assert [c.index for c in comp.choices] == [0, 1]
    parts = list(client.completions.create(model="tgi", prompt=PROMPT, max_tokens=N,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == reference["generated_text"].rstrip(
        "\ufffd")
    # stream_options.include_usage: OpenAI's usage-only last chunk, summed over the prompts
    # (vLLM's serving benchmark reads its token counts there).
    usage_parts = list(client.completions.create(
        model="tgi", prompt=[PROMPT, "Hello"], max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    last = usage_parts[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == comp.usage.completion_tokens
    assert last.usage.prompt_tokens == comp.usage.prompt_tokens
    assert all(p.usage is None for p in usage_parts[:-1])
    by_prompt = ["".join(p.choices[0].text for p in usage_parts[:-1] if p.choices[0].index == i)
                 for i in (0, 1)]
    assert by_prompt == [c.text.rstrip("\ufffd") for c in comp.choices]
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tgi", messages=[], max_tokens=1)
