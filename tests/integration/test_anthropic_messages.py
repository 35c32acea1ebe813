"""Anthropic's Messages API through the real `anthropic` SDK against a real pytgi-router (with
--api-key: the SDK sends it as `x-api-key`) and shard on the tiny random Llama. Greedy
(`temperature: 0`), so each answer is the chat route's answer to the same conversation: one
path, checked token for token. Tools are forced (`tool_choice: tool`), so the grammar makes the
call deterministic, and the round trip (tool_use → tool_result) renders through the template as
OpenAI's assistant `tool_calls` and `tool` message do (same token count as /chat_tokenize)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message

from tests.integration.structured_cases import TOOL_PROMPT, WEATHER
from tests.router_process import RouterProcess
from tests.shard_process import start_shards

KEY = "secret-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
# Renders tools (their count), an assistant's tool calls and each message's content; the turn
# it opens thinks (`<think>` left open) only under `enable_thinking`, as Qwen3's template does.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{{ tools | length }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>\n"
    "{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
USER = [{"role": "user", "content": "Hello, how are you?"}]
SYSTEM = "Be brief."


def greedy(**extra: Any) -> dict[str, Any]:
    """`temperature: 0` (and TGI's extensions) in the body: this SDK has no sampling
    arguments."""
    return {"model": "tiny", "extra_body": {"temperature": 0, **extra}}


GREEDY = greedy()


@pytest.fixture(scope="module")
def url(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[str]:
    model = tiny_model("llama")
    config = json.loads((model / "tokenizer_config.json").read_text())
    path = tmp_path_factory.mktemp("config") / "tokenizer_config.json"
    path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with start_shards(model) as shards, RouterProcess(
            shards.urls[0], model, "--max-input-tokens", "150", "--max-total-tokens", "256",
            "--api-key", KEY, "--tokenizer-config-path", str(path),
            "--reasoning-parser", "qwen3") as router:
        yield router.url


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


def chat(url: str, messages: list[Any], max_tokens: int, **extra: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, headers=BEARER, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def chat_tokens(url: str, messages: list[Any], **extra: Any) -> int:
    r = httpx.post(f"{url}/chat_tokenize", timeout=60, headers=BEARER,
                   json={"messages": messages, **extra})
    assert r.status_code == 200, r.text
    return len(r.json()["tokenize_response"])


def test_create_is_the_chat_answer(client: anthropic.Anthropic, url: str) -> None:
    """The same text as chat completions for the same conversation; usage counted as
    count_tokens counts the prompt; top_k and metadata accepted."""
    out = client.messages.create(max_tokens=10, system=SYSTEM, messages=USER,
                                 metadata={"user_id": "u1"}, **greedy(top_k=5))
    expected = chat(url, [{"role": "system", "content": SYSTEM}, *USER], 10)
    [block] = out.content
    assert block.type == "text" and block.text == expected["choices"][0]["message"]["content"]
    assert out.id.startswith("msg_") and out.role == "assistant" and out.model == "tiny"
    assert out.stop_reason in ("max_tokens", "end_turn") and out.stop_sequence is None
    counted = client.messages.count_tokens(system=SYSTEM, messages=USER, model="tiny")
    assert out.usage.input_tokens == counted.input_tokens == expected["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == expected["usage"]["completion_tokens"]
    prefill = [*USER, {"role": "assistant", "content": "Fine"}]  # continued, as chat does
    out = client.messages.create(max_tokens=4, messages=prefill, **GREEDY)  # type: ignore[arg-type]
    expected = chat(url, prefill, 4)
    assert out.content[0].text == expected["choices"][0]["message"]["content"]  # type: ignore[union-attr]


def test_stream_is_the_created_answer(client: anthropic.Anthropic) -> None:
    """client.messages.stream and stream=True: Anthropic's event sequence, the same text."""
    out = client.messages.create(max_tokens=12, messages=USER, **GREEDY)
    with client.messages.stream(max_tokens=12, messages=USER, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == out.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == out.stop_reason and final.usage == out.usage
    events = list(client.messages.create(max_tokens=12, messages=USER, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"], kinds
    assert events[-2].usage.output_tokens == out.usage.output_tokens  # type: ignore[union-attr]


def test_a_stop_sequence_ends_the_text_before_it(client: anthropic.Anthropic) -> None:
    """stop_reason "stop_sequence", `stop_sequence` set, and the text (streamed too) ends where
    the sequence began."""
    whole = client.messages.create(max_tokens=16, messages=USER, **GREEDY).content[0].text  # type: ignore[union-attr]
    at = next(i for i in range(3, len(whole) - 2) if whole.find(whole[i:i + 2]) == i)
    stop = whole[at:at + 2]
    out = client.messages.create(max_tokens=16, messages=USER, stop_sequences=[stop], **GREEDY)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == whole[:at]  # type: ignore[union-attr]
    with client.messages.stream(max_tokens=16, messages=USER, stop_sequences=[stop],
                                **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole[:at] and final.stop_sequence == stop


def test_tool_use_then_tool_result(client: anthropic.Anthropic, url: str) -> None:
    """A forced call: a tool_use block whose input is the tool's JSON ("tool_use"), streamed the
    same; its result in the next turn renders as OpenAI's tool_calls + tool message do."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced: dict[str, Any] = {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
                              **greedy(tool_prompt=TOOL_PROMPT)}
    out = client.messages.create(max_tokens=100, messages=question, **forced)
    assert out.stop_reason == "tool_use", out
    [call] = out.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, TOOL["input_schema"])
    with client.messages.stream(max_tokens=100, messages=question, **forced) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.input) for b in final.content] == [("tool_use", call.input)]  # type: ignore[union-attr]
    turns = [*question, {"role": "assistant", "content": out.content},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": call.id, "content": "18C"}]}]
    answer = client.messages.create(max_tokens=5, messages=turns, **GREEDY)  # type: ignore[arg-type]
    assert answer.stop_reason in ("max_tokens", "end_turn") and answer.content[0].type == "text"
    openai_turns = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(call.input, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    counted = client.messages.count_tokens(model="tiny", messages=turns)  # type: ignore[arg-type]
    assert counted.input_tokens == chat_tokens(url, openai_turns)
    with_tools = client.messages.count_tokens(model="tiny", messages=question, tools=[TOOL],  # type: ignore[list-item]
                                              extra_body={"tool_prompt": TOOL_PROMPT})
    assert with_tools.input_tokens == chat_tokens(url, question, tools=[WEATHER],
                                                   tool_prompt=TOOL_PROMPT)


def test_errors_are_anthropic_errors(client: anthropic.Anthropic, url: str) -> None:
    """Each refusal raises the SDK's class for it, the body in Anthropic's shape (posted as
    they are: the SDK's own arguments would refuse the first before sending it)."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": USER}, "max_tokens"),  # required, as Anthropic
        ({"max_tokens": 5, "messages": USER, "tools": [TOOL],
          "tool_choice": {"type": "tool", "name": "nope"}}, "Tool with name nope not found"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "fox " * 400}]},
         "`inputs` tokens"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ]
    for body, words in cases:
        with pytest.raises(anthropic.BadRequestError, match=words) as err:
            client.post("/v1/messages", body={"model": "tiny", **body}, cast_to=Message)
        assert err.value.body["type"] == "error"  # type: ignore[index]
        assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(max_tokens=5, messages=USER, **GREEDY)  # type: ignore[arg-type]
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model="tiny", messages=USER).input_tokens > 0  # type: ignore[arg-type]
    r = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{url}/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    # Anthropic's header on Anthropic's routes only: TGI's keep their one way to send the key.
    r = httpx.post(f"{url}/v1/chat/completions", headers={"x-api-key": KEY}, json={})
    assert r.status_code == 401 and r.json()["error_type"] == "unauthorized"


def test_thinking_blocks(client: anthropic.Anthropic, url: str) -> None:
    """`thinking` enabled: the template leaves `<think>` open, so (the tiny model never closes
    it) all of the output is thinking, split off by the qwen3 parser: one thinking block,
    streamed as thinking_delta, the text chat completions gives as `reasoning_content`."""
    thinking: dict[str, Any] = {"type": "enabled", "budget_tokens": 1024}
    out = client.messages.create(max_tokens=8, messages=USER, thinking=thinking, **GREEDY)
    [block] = out.content
    assert block.type == "thinking" and block.thinking and out.stop_reason == "max_tokens"
    expected = chat(url, USER, 8, chat_template_kwargs={"enable_thinking": True})
    assert block.thinking == expected["choices"][0]["message"]["reasoning_content"]
    with client.messages.stream(max_tokens=8, messages=USER, thinking=thinking,
                                **GREEDY) as stream:
        deltas = [e.delta.thinking for e in stream  # type: ignore[union-attr]
                  if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == block.thinking
    assert final.content == out.content
