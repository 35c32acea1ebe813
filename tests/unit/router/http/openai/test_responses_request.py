"""responses_request.py: a Responses body read as the chat request it means (messages, tools,
tool_choice, text.format, sampling), its history continued, and what it cannot do refused by
name."""

from __future__ import annotations

from typing import Any

import pytest

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.openai.responses_request import input_messages, parse_responses

TOOL = {"type": "function", "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}


def parse(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> Any:
    return parse_responses(body, history or [], "served")


def test_a_string_input_with_instructions_is_system_then_user() -> None:
    r = parse({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7,
               "temperature": 0, "top_p": 0.5})
    assert r.chat.messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi"}]
    assert r.conversation == [{"role": "user", "content": "Hi"}]  # instructions not carried
    p = r.chat.parameters()
    assert (p.max_new_tokens, p.do_sample, p.top_p) == (7, False, 0.5)
    assert r.store and not r.stream and r.echo["model"] == "served"
    assert r.echo["instructions"] == "Be brief." and r.echo["tools"] == []
    kwargs = {"enable_thinking": False}
    assert parse({"input": "Hi", "chat_template_kwargs": kwargs}).chat.template_kwargs == kwargs


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather"},
                     {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        CALL,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    assert parse({"input": items}).chat.messages == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
    ]


def test_a_call_output_may_answer_a_call_of_the_history() -> None:
    history = input_messages([{"role": "user", "content": "Hi"}, CALL], [])
    out = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    r = parse({"input": [out]}, history)
    assert r.conversation[:2] == history and r.conversation[2]["role"] == "tool"
    with pytest.raises(ValidationError, match=r"`input\[0\].call_id` 'call_1'"):
        parse({"input": [out]})


def test_function_tools_and_tool_choice_in_chat_spelling() -> None:
    r = parse({"input": "Hi", "tools": [TOOL],
               "tool_choice": {"type": "function", "name": "get_weather"}})
    assert r.chat.tools is not None and r.chat.tools.names() == frozenset({"get_weather"})
    assert r.echo["tools"][0]["name"] == "get_weather"
    auto = parse({"input": "Hi", "tools": [TOOL]})
    assert auto.chat.tools is not None and "no_tool" in auto.chat.tools.names()
    assert parse({"input": "Hi", "tools": [TOOL], "tool_choice": "none"}).chat.tools is None
    with pytest.raises(ToolError, match="nope"):
        parse({"input": "Hi", "tools": [TOOL], "tool_choice": {"type": "function",
                                                               "name": "nope"}})


def test_allowed_tools_narrow_what_is_offered() -> None:
    other = {**TOOL, "name": "get_time"}
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "get_time"}]}
    r = parse({"input": "Hi", "tools": [TOOL, other], "tool_choice": choice})
    assert r.chat.tools is not None and r.chat.tools.names() == frozenset({"get_time"})
    assert [t["name"] for t in r.echo["tools"]] == ["get_weather", "get_time"]
    with pytest.raises(ToolError, match="nope"):
        parse({"input": "Hi", "tools": [TOOL], "tool_choice": {
            **choice, "tools": [{"type": "function", "name": "nope"}]}})
    with pytest.raises(ValidationError, match="`tool_choice.mode`"):
        parse({"input": "Hi", "tools": [TOOL], "tool_choice": {**choice, "mode": "none"}})


def test_text_formats_are_chat_grammars() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    grammar = parse({"input": "Hi", "text": {"format": fmt}}).chat.grammar
    assert grammar == {"type": "json_schema",
                       "value": {"name": "x", "schema": schema, "strict": True}}
    assert parse({"input": "Hi", "text": {"format": {"type": "json_object"}}}).chat.grammar
    assert parse({"input": "Hi", "text": {"format": {"type": "text"}}}).chat.grammar is None
    regex = {"type": "regex", "value": "[a-z]+"}
    assert parse({"input": "Hi", "text": {"format": regex}}).chat.grammar == regex


@pytest.mark.parametrize(("body", "message"), [
    ({}, "`input` must hold"),
    ({"input": 3}, "`input` must be a string or an array"),
    ({"input": [{"role": "tool", "content": "x"}]}, r"`input\[0\].role` must be"),
    ({"input": [{"type": "file_search_call"}]}, r"`input\[0\].type` 'file_search_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     r"`input\[0\].content\[0\].type` 'input_file'"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, r"`tools\[0\].type` 'web_search'"),
    ({"input": "x", "tools": [{"type": "function"}]}, r"missing field `tools\[0\].name`"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "`tool_choice` must be"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "`text.format.schema`"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "`text.format.type` must be"),
    ({"input": "x", "background": True, "stream": True}, "`background` with `stream`"),
    ({"input": "x", "background": True, "store": False}, "`background` needs `store`"),
    ({"input": "x", "conversation": "conv_1"}, "`conversation` is not supported"),
    ({"input": "x", "max_output_tokens": -1}, "`max_output_tokens` must be"),
])
def test_refusals_name_the_field(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        parse(body)
