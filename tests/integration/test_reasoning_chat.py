"""Reasoning output end to end: a real pytgi-router and shard on the tiny random Llama, read
with the `openai` SDK. The model knows nothing, so what it writes is a grammar's doing: a Lark
grammar (which constrains the whole output, thinking included) makes it think and answer; a
JSON schema, a regex or tools (which constrain only the answer) leave it thinking freely until
`max_tokens` cuts it. The chat template is Qwen3-style (ChatML, `<think>` opened in the generation prompt,
an empty thinking block under `enable_thinking: false`), so the router detects `qwen3` by
itself (the template renders `tools` itself, which keeps the tool prompt short), and `chat_template_kwargs` decide whether the turn thinks."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses

TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | length }}\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Two plus two?"}]
# The template opened <think>: the output thinks, closes it and answers.
THOUGHT = r'start: /[a-z]{2,6}( [a-z]{2,6}){1,3}/ "</think>\n\n" /[A-Z][a-z]{1,6}\./'
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"]}}}


@pytest.fixture(scope="module")
def router(model: Path, shards: ShardProcesses, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[RouterProcess]:
    config = json.loads((model / "tokenizer_config.json").read_text())
    path = tmp_path_factory.mktemp("config") / "tokenizer_config.json"
    path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    with RouterProcess(shards.urls[0], model, "--max-input-tokens", "150", "--max-total-tokens",
                       "256", "--tokenizer-config-path", str(path)) as r:
        yield r


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", timeout=120)


def lark(grammar: str) -> dict[str, Any]:
    """TGI's grammar object in `response_format` (pytgi's `lark` type)."""
    return {"response_format": {"type": "lark", "value": grammar}}


def test_the_parser_is_detected_from_the_template(router: RouterProcess) -> None:
    assert "reasoning parser: qwen3, detected" in router.output


def test_reasoning_content_apart_from_the_answer(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=60, seed=1,
                                         extra_body=lark(THOUGHT))  # type: ignore[arg-type]
    choice = out.choices[0]
    reasoning = choice.message.reasoning_content  # type: ignore[attr-defined]
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", reasoning)
    assert choice.message.reasoning == reasoning  # type: ignore[attr-defined]
    assert re.fullmatch(r"[A-Z][a-z]{1,6}\.", choice.message.content or "")
    assert choice.finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens_details is not None
    thinking = out.usage.completion_tokens_details.reasoning_tokens
    assert thinking is not None and 0 < thinking < out.usage.completion_tokens


def test_streamed_reasoning_deltas_then_content(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=60, seed=2, stream=True,
        stream_options={"include_usage": True}, extra_body=lark(THOUGHT),  # type: ignore[arg-type]
    )
    kinds, reasoning, content, usage, finish = [], [], [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            kinds.append("reasoning")
            reasoning.append(extra["reasoning_content"])
        if delta.content:
            kinds.append("content")
            content.append(delta.content)
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", "".join(reasoning))
    assert re.fullmatch(r"[A-Z][a-z]{1,6}\.", "".join(content))
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # thinking first
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens_details is not None
    assert (usage.completion_tokens_details.reasoning_tokens or 0) > 0


@pytest.mark.parametrize("stream", [False, True])
def test_cut_inside_the_thinking(client: openai.OpenAI, stream: bool) -> None:
    """max_tokens inside the thinking: what was thought, no answer, "length"."""
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "seed": 3,
                            "extra_body": lark(r'start: /[a-z]{40,50}/ "</think>Yes."')}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        reasoning, content = choice.message.reasoning_content, choice.message.content  # type: ignore[attr-defined]
        finish = choice.finish_reason
    else:
        parts: dict[str, str] = {"reasoning_content": "", "content": ""}
        finish = None
        for chunk in client.chat.completions.create(**body, stream=True):
            delta = chunk.choices[0].delta
            parts["content"] += delta.content or ""
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content", "")
            finish = chunk.choices[0].finish_reason or finish
        reasoning, content = parts["reasoning_content"], parts["content"] or None
    assert re.fullmatch(r"[a-z]+", reasoning) and not content
    assert finish == "length"


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    {"type": "regex", "value": "[A-Z][a-z]{1,6}/[0-9]"},
])
def test_the_format_constrains_the_answer_after_free_thinking(
    client: openai.OpenAI, fmt: Any
) -> None:
    """response_format constrains the answer, not the thinking: the random model thinks
    freely (and never closes its thinking within 12 tokens); with thinking off, the same
    request answers in the format at once."""
    thinking = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12,
                                              seed=4, response_format=fmt).choices[0]
    assert thinking.message.reasoning_content  # type: ignore[attr-defined]
    assert thinking.message.content is None and thinking.finish_reason == "length"
    off = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, seed=4,
                                         response_format=fmt, extra_body=OFF).choices[0]
    assert off.message.reasoning_content is None  # type: ignore[attr-defined]
    assert off.finish_reason == "stop"
    if fmt["type"] == "regex":
        assert re.fullmatch(fmt["value"], off.message.content or "")
    else:
        assert isinstance(json.loads(off.message.content or "")["n"], int)


def test_tool_calls_after_the_thinking(client: openai.OpenAI) -> None:
    """Tools constrain the answer: thinking on, the turn thinks until cut (no call); off, it
    calls the tool at once and the call parses."""
    common: dict[str, Any] = {"model": "m", "messages": MESSAGES, "seed": 5,
                              "tools": [WEATHER], "tool_choice": "required",
                              "extra_body": {"tool_prompt": "Call one."}}
    cut = client.chat.completions.create(max_tokens=12, **common).choices[0]
    assert cut.message.reasoning_content and not cut.message.tool_calls  # type: ignore[attr-defined]
    assert cut.finish_reason == "length"
    common["extra_body"] = {**common["extra_body"], **OFF}
    call = client.chat.completions.create(max_tokens=80, **common).choices[0]
    assert call.finish_reason == "tool_calls" and call.message.tool_calls
    assert call.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(call.message.tool_calls[0].function.arguments)["city"], str)


