"""An Anthropic body is read as the chat body it means: the same ChatRequest (messages for the
template, tools, grammar, sampling) as parse_chat gives for the OpenAI body a client would
send for the same conversation; and each bad body is refused with a message naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytgi_router.core.errors import InferError, ValidationError
from pytgi_router.http.anthropic.request import parse_messages
from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.openai.schemas import parse_chat

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = {"id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
ANTHROPIC: dict[str, Any] = {
    "model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
    "temperature": 0.5, "top_p": 0.9, "stop_sequences": ["\n\n"], "stream": True,
    "tools": [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}],
    "tool_choice": {"type": "auto"},
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Let me look."}, {"type": "tool_use", **CALL}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
            {"type": "text", "text": "And now?"}]},
    ],
}
OPENAI: dict[str, Any] = {
    "model": "m", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stop": ["\n\n"],
    "stream": True, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": SCHEMA}}],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(CALL["input"])}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": "And now?"},
    ],
}


def test_the_same_chat_request_as_the_openai_body() -> None:
    msg = parse_messages(ANTHROPIC)
    chat = parse_chat(OPENAI)
    assert msg.chat.messages == chat.messages
    assert msg.chat.tools == chat.tools
    assert msg.parameters() == chat.parameters()
    assert (msg.model, msg.stream, msg.stop_sequences) == ("m", True, ["\n\n"])


@pytest.mark.parametrize(("choice", "offered"), [
    ({"type": "auto"}, {"get_weather", "get_time", "no_tool"}),
    ({"type": "any"}, {"get_weather", "get_time"}),
    ({"type": "tool", "name": "get_time"}, {"get_time"}),
    ({"type": "none"}, None),
])
def test_tool_choice(choice: dict[str, Any], offered: set[str] | None) -> None:
    tools = [{"name": n, "input_schema": SCHEMA} for n in ("get_weather", "get_time")]
    chat = parse_messages({**ANTHROPIC, "tools": tools, "tool_choice": choice}).chat
    assert (chat.tools.names() if chat.tools else None) == (
        frozenset(offered) if offered else None)


def test_top_k_unless_greedy_and_output_format() -> None:
    assert parse_messages({**ANTHROPIC, "top_k": 5}).parameters().top_k == 5
    assert parse_messages({**ANTHROPIC, "top_k": 5, "temperature": 0}).parameters().top_k is None
    fmt = {"format": {"type": "json_schema", "schema": SCHEMA}}
    body = {**ANTHROPIC, "output_config": fmt}
    del body["tools"], body["tool_choice"]
    assert parse_messages(body).parameters().grammar == {
        "type": "json_schema", "value": {"name": "output", "schema": SCHEMA}}


def test_count_tokens_needs_no_max_tokens_and_images_are_parts() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [
        image, {"type": "text", "text": " hi"}]}]}
    msg = parse_messages(body, counting=True)
    assert msg.chat.messages == [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": " hi"}]}]
    # The image is named by its place in the Messages body.
    assert [(r.where, r.url) for r in msg.chat.images] == [
        ("messages[0].content[0]", "data:image/png;base64,AAAA")]
    with pytest.raises(ValidationError, match="missing field `max_tokens`"):
        parse_messages(body)


def turn(content: Any, role: str = "user") -> dict[str, Any]:
    return {**ANTHROPIC, "messages": [{"role": role, "content": content}]}


@pytest.mark.parametrize(("body", "error", "words"), [
    ({"max_tokens": 1, "messages": []}, ValidationError, "missing field `model`"),
    ({**ANTHROPIC, "messages": []}, ValidationError, "`messages` cannot be empty"),
    (turn("x", role="system"), ValidationError, '`messages[0].role` must be "user" or'),
    (turn([{"type": "document", "source": {}}]), ValidationError,
     "`messages[0].content[0].type` 'document' is not supported"),
    (turn([{"type": "tool_use", "id": "t", "name": "f"}], role="assistant"), ValidationError,
     "missing field `messages[0].content[0].input`"),
    (turn([{"type": "tool_result"}]), ValidationError,
     "missing field `messages[0].content[0].tool_use_id`"),
    ({**ANTHROPIC, "system": 3}, ValidationError, "`system` must be a string or an array"),
    ({**ANTHROPIC, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     ValidationError, "is a server tool"),
    ({**ANTHROPIC, "tools": [{"name": "f"}]}, ValidationError,
     "missing field `tools[0].input_schema`"),
    ({**ANTHROPIC, "tool_choice": {"type": "required"}}, ValidationError,
     '`tool_choice.type` must be "auto", "any", "tool" or "none"'),
    ({**ANTHROPIC, "tool_choice": {"type": "tool", "name": "nope"}}, ToolError,
     "Tool with name nope not found"),
    ({**ANTHROPIC, "thinking": {"type": "on"}}, ValidationError, "`thinking.type` must be"),
    ({**ANTHROPIC, "metadata": "u"}, ValidationError, "`metadata` must be a JSON object"),
    ({**ANTHROPIC, "top_k": "5"}, ValidationError, "`top_k` must be"),
    ({**ANTHROPIC, "stop_sequences": [1]}, ValidationError, "`stop_sequences` must be"),
    ({**ANTHROPIC, "output_config": {"format": {"type": "regex"}}}, ValidationError,
     '`output_config.format.type` must be "json_schema"'),
])
def test_bad_bodies(body: dict[str, Any], error: type[InferError], words: str) -> None:
    with pytest.raises(error) as err:
        parse_messages(body)
    assert words in err.value.message


def test_thinking_reaches_the_template_as_enable_thinking() -> None:
    def kwargs(**extra: Any) -> Any:
        return parse_messages({**ANTHROPIC, **extra}).chat.template_kwargs

    assert kwargs() is None
    assert kwargs(thinking={"type": "disabled"}) == {"enable_thinking": False}
    assert kwargs(thinking={"type": "enabled", "budget_tokens": 1024},
                  chat_template_kwargs={"x": 1}) == {"x": 1, "enable_thinking": True}
