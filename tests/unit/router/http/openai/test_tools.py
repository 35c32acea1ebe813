"""tools.py / tool_output.py: `tools` and `tool_choice` become TGI's tool grammar and prompt; the
constrained output reads back as OpenAI tool calls (or no_tool's content)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest

from pytgi_router.core.errors import ValidationError
from pytgi_router.core.request_stream import TokenInfo
from pytgi_router.http.grammar import GrammarChecker, parse_grammar
from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.openai.chat_output import chat_answer
from pytgi_router.http.openai.chat_render import assistant_message
from pytgi_router.http.openai.chat_template import ChatTemplate
from pytgi_router.http.openai.schemas import parse_chat
from pytgi_router.http.openai.tool_output import (
    new_call_id,
    parse_tool_output,
    read_partial_output,
    tool_call_json,
)
from pytgi_router.http.openai.tools import (
    DEFAULT_TOOL_PROMPT,
    NO_TOOL,
    ToolChoice,
    chat_tools,
    parse_tool_choice,
    parse_tools,
    with_tool_prompt,
)
from tests.tiny_models import _CORPUS, EOS, train_tokenizer

# The checker validation runs (compiles as the shards will, within the limits).
CHECKER = GrammarChecker()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "$defs": {"zone": {"type": "string", "maxLength": 5}}}}}
TOOLS = parse_tools([WEATHER, TIME])
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def schema_for(choice: Any) -> dict[str, Any]:
    offered = chat_tools(TOOLS, parse_tool_choice(choice), None)
    assert offered is not None
    grammar = offered.grammar()
    CHECKER.check(parse_grammar(grammar))  # the constraint library compiles it
    return dict(grammar["value"])


def valid(schema: dict[str, Any], output: dict[str, Any]) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(output)


def test_auto_offers_every_tool_and_no_tool() -> None:
    schema = schema_for("auto")
    assert list(schema["$functions"]) == ["get_weather", "get_time", NO_TOOL]
    call = {"function": {"_name": "get_weather", "location": "Paris", "unit": "celsius"}}
    assert valid(schema, call)
    assert valid(schema, {"function": {"_name": NO_TOOL, "content": "hi"}})
    assert valid(schema, {"function": {"_name": "get_time", "zone": "UTC"}})
    for bad in ({}, {"function": {"_name": "get_weather"}},  # a required argument missing
                {"function": {"_name": "get_weather", "location": "P", "extra": 1}},
                {"function": {"_name": "get_time", "zone": "too long"}},  # its own $defs
                {"function": {"_name": "nope"}},
                {"function": {"_name": "get_time"}, "more": 1}):
        assert not valid(schema, bad), bad
    weather = schema["$functions"]["get_weather"]
    assert list(weather["properties"])[0] == "_name"
    assert weather["required"] == ["_name", "location"]
    assert weather["additionalProperties"] is False


def test_required_and_a_named_function_narrow_the_choice() -> None:
    assert list(schema_for("required")["$functions"]) == ["get_weather", "get_time"]
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "get_time"):
        schema = schema_for(choice)
        assert list(schema["$functions"]) == ["get_time"]
        assert not valid(schema, {"function": {"_name": "get_weather", "location": "x"}})


def test_none_or_no_tools_offer_nothing() -> None:
    assert chat_tools(TOOLS, ToolChoice("none"), None) is None
    assert chat_tools([], ToolChoice("auto"), None) is None
    with pytest.raises(ToolError) as info:
        chat_tools(TOOLS, ToolChoice("function", "nope"), None)
    assert info.value.message == "Tool error: Tool with name nope not found"
    assert info.value.status_code == 422 and info.value.error_type == "tool_error"


@pytest.mark.parametrize(("value", "message"), [
    ({"type": "function"}, "`tool_choice` must be"),
    (3, "`tool_choice` must be"),
])
def test_bad_tool_choice(value: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        parse_tool_choice(value)


@pytest.mark.parametrize(("tools", "message"), [
    ({"type": "function"}, "`tools` must be an array"),
    ([{"type": "function"}], "`tools[0]` must be"),
    ([{"function": {"name": ""}}], "`tools[0].function.name` must be a non-empty string"),
    ([{"function": {"name": "f", "parameters": []}}], "`tools[0].function.parameters` must be"),
])
def test_bad_tools(tools: Any, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse_tools(tools)
    assert message in info.value.message


def test_tgi_arguments_alias_and_no_parameters() -> None:
    [alias, bare] = parse_tools([
        {"function": {"name": "a", "arguments": {"type": "object", "properties": {}}}},
        {"function": {"name": "b"}}])
    assert alias.parameters == {"type": "object", "properties": {}}
    assert bare.openai() == {"type": "function", "function": {
        "name": "b", "parameters": {"type": "object", "properties": {}}}}


def test_tool_prompt_goes_after_the_last_message() -> None:
    offered = chat_tools(TOOLS, ToolChoice("required"), None)
    assert offered is not None and offered.prompt == DEFAULT_TOOL_PROMPT
    plain = offered.prompt_suffix(template_uses_tools=False)
    assert plain == f"\n---\n{json.dumps([WEATHER, TIME])}\n{DEFAULT_TOOL_PROMPT}"
    assert offered.prompt_suffix(template_uses_tools=True) == f"\n---\n{DEFAULT_TOOL_PROMPT}"
    mine = chat_tools(TOOLS, ToolChoice("auto"), "Use a tool.")
    assert mine is not None and mine.prompt_suffix(True) == "\n---\nUse a tool."
    out = with_tool_prompt([{"role": "system", "content": "s"}, *MESSAGES], "!")
    assert out[-1] == {"role": "user", "content": "Weather in Paris?!"} and out[0]["content"] == "s"
    assert MESSAGES[0]["content"] == "Weather in Paris?"  # the request's messages untouched


def test_chat_templates_say_whether_they_render_tools() -> None:
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    with_tools = ChatTemplate("{% if tools %}{{ tools | tojson }}{% endif %}"
                              "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not plain.uses_tools and with_tools.uses_tools
    assert with_tools.apply(MESSAGES, [WEATHER]).startswith('[{"type": "function"')


def test_parse_chat_tools_and_response_format() -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER]}
    chat = parse_chat(body)
    assert chat.tools is not None and [t.name for t in chat.tools.tools] == ["get_weather", NO_TOOL]
    assert chat.parameters().grammar == chat.tools.grammar()
    assert parse_chat({**body, "tool_choice": "none"}).parameters().grammar is None
    with pytest.raises(ToolError, match="Tool error: Grammar and tools are mutually exclusive"):
        parse_chat({**body, "response_format": {"type": "json_object"}})
    text = parse_chat({**body, "response_format": {"type": "text"}})  # constrains nothing
    assert text.tools is not None
    fmt = parse_chat({"messages": MESSAGES, "response_format": {"type": "json_object"}})
    assert fmt.tools is None and fmt.parameters().grammar == {
        "type": "json", "value": {"type": "object"}}


def test_outputs_read_back_as_tool_calls() -> None:
    out = parse_tool_output('{"function": {"_name": "get_weather", "location": "Paris"}}')
    assert out.is_call and out.name == "get_weather"
    assert json.loads(out.arguments) == {"location": "Paris"}
    none = parse_tool_output('{ "function" : { "_name" : "no_tool", "content": "Hi \\u00e9" } }')
    assert not none.is_call and none.content == "Hi é"
    call_id = new_call_id()
    assert call_id.startswith("call_") and len(call_id) == 29 and call_id != new_call_id()
    assert tool_call_json(call_id, out) == {"id": call_id, "type": "function", "function": {
        "description": None, "name": "get_weather", "arguments": '{"location": "Paris"}'}}
    with pytest.raises(ToolError, match="Tool error: Failed to parse generated text"):
        parse_tool_output('{"function": {"location"')


def test_outputs_of_other_shapes_are_tool_errors() -> None:
    for text in ('{"function": "x"}', "[1]", '{"function": {"_name": "f"}, "more": 1}',
                 '{"function": {"_name": 3}}'):
        with pytest.raises(ToolError, match="Tool error: Failed to parse generated text"):
            parse_tool_output(text)


OFFERED = frozenset({"get_weather", NO_TOOL})
CALL = '{"function": {"_name": "get_weather", "location": "Paris"}}'


def tool_message(
    text: str, reason: str, offered: frozenset[str]
) -> tuple[str, str, list[Any] | None]:
    """(content, finish reason, tool_calls) of the chat message the shared output path makes
    of a whole tool-constrained output (no reasoning parser)."""
    answer = chat_answer(None, "", offered, [TokenInfo(0, text, -0.1, False)], text, reason)
    message = assistant_message(answer, reasoning=False)
    return message["content"] or "", answer.end.finish_reason, message.get("tool_calls")


@pytest.mark.parametrize("reason", ["eos_token", "length", "stop_sequence"])
def test_a_whole_call_is_a_tool_call_however_it_ended(reason: str) -> None:
    content, finish, calls = tool_message(CALL, reason, OFFERED)
    assert (content, finish) == ("", "tool_calls") and calls is not None
    assert json.loads(calls[0]["function"]["arguments"]) == {"location": "Paris"}
    answer = '{"function": {"_name": "no_tool", "content": "Hi"}}'
    assert tool_message(answer, reason, OFFERED) == ("Hi", "stop", None)


def test_a_call_cut_by_max_tokens_is_length_with_what_it_wrote() -> None:
    """OpenAI's way: `finish_reason: "length"`, the call as far as it went (its arguments are
    not JSON); no_tool's content so far; nothing when not even the name was written (TGI's 422
    before: the client's own limit is not an error)."""
    content, finish, calls = tool_message(CALL[:-6], "length", OFFERED)
    assert (content, finish) == ("", "length") and calls is not None
    assert calls[0]["function"]["arguments"] == '{"location": "Pa'
    cut_answer = '{"function": {"_name": "no_tool", "content": "Hel'
    assert tool_message(cut_answer, "length", OFFERED) == ("Hel", "length", None)
    assert tool_message('{"function": {"_na', "length", OFFERED) == ("", "length", None)


@pytest.mark.parametrize(("text", "reason"), [
    (CALL[:-6], "eos_token"),  # an end the grammar did not allow
    (CALL[:-6], "stop_sequence"),
    (CALL[:-1], "eos_token"),
    (CALL.replace("get_weather", "get_time"), "eos_token"),  # not offered
    ('{"function": {"_name": "no_tool", "content": "Hi"}}', "eos_token"),  # not offered
    ('{"function": {"_na', "eos_token"),
])
def test_an_output_cut_otherwise_is_an_error_not_a_call(text: str, reason: str) -> None:
    offered = OFFERED - {NO_TOOL} if NO_TOOL in text else OFFERED
    with pytest.raises(ToolError) as info:
        tool_message(text, reason, offered)
    assert info.value.status_code == 422 and info.value.error_type == "tool_error"
    assert "before its tool call was complete" in info.value.message


def test_outputs_cut_short_read_as_far_as_they_go() -> None:
    cut = read_partial_output('{"function": {"_name": "get_weather", "location": "Pa')
    assert cut is not None and (cut.name, cut.arguments) == ("get_weather", '{"location": "Pa')
    said = read_partial_output('{"function": {"_name": "no_tool", "content": "Hel')
    assert said is not None and said.content == "Hel"
    assert read_partial_output('{"function": {"_na') is None


# ---- each tool's schema resolves within itself -------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    tok = train_tokenizer(_CORPUS)
    return llguidance.LLTokenizer(tok.to_str(), eos_token=tok.token_to_id(EOS))


def enforced(tokenizer: llguidance.LLTokenizer, grammar: dict[str, Any], text: str) -> bool:
    """Whether the shards' constraint (llguidance, compiling this grammar) lets the model write
    `text` and end there."""
    compiled = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(grammar["value"]))
    matcher = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
    tokens = tokenizer.tokenize_str(text)
    if matcher.validate_tokens(tokens) < len(tokens):
        return False
    assert matcher.consume_tokens(tokens)
    return bool(matcher.is_accepting())


def required_grammar(tools: list[Any]) -> dict[str, Any]:
    offered = chat_tools(parse_tools(tools), ToolChoice("required"), None)
    assert offered is not None
    grammar = offered.grammar()
    CHECKER.check(parse_grammar(grammar))
    return grammar


def defs_tool(name: str, x: dict[str, Any], key: str = "$defs") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"x": {"$ref": f"#/{key}/X"},
                                         "y": {"$ref": "#/properties/x"}},
        "required": ["x"], key: {"X": x}}}}


@pytest.mark.parametrize("key", ["$defs", "definitions"])
def test_each_tool_resolves_its_own_definitions(
    tokenizer: llguidance.LLTokenizer, key: str
) -> None:
    """Two tools that both define `X` (an integer, an enum): each call follows its own tool's
    `X`, through `#/{key}/X` and through `#/properties/x` alike."""
    grammar = required_grammar([defs_tool("a", {"type": "integer"}, key),
                                defs_tool("b", {"enum": ["SURPRISE"]}, key)])
    for text, ok in [('{"function": {"_name": "a", "x": 3, "y": 4}}', True),
                     ('{"function": {"_name": "a", "x": "SURPRISE"}}', False),
                     ('{"function": {"_name": "a", "x": 3, "y": "SURPRISE"}}', False),
                     ('{"function": {"_name": "b", "x": "SURPRISE", "y": "SURPRISE"}}', True),
                     ('{"function": {"_name": "b", "x": 3}}', False)]:
        assert valid(grammar["value"], json.loads(text)) is ok, text
        assert enforced(tokenizer, grammar, text) is ok, text


def test_a_tool_may_refer_to_its_own_root(tokenizer: llguidance.LLTokenizer) -> None:
    """`#` is the tool's parameters (recursion), not the grammar nor the function object: a
    nested node needs no `_name`. References inside `enum` are data, left as they are."""
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "$id": "https://example.com/tree", "type": "object",
        "properties": {"v": {"enum": [{"$ref": "#"}, 1]},
                       "kid": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["v", "kid"], "additionalProperties": False}}}
    grammar = required_grammar([tree, defs_tool("a", {"type": "integer"})])
    good = '{"function": {"_name": "tree", "v": 1, "kid": {"v": {"$ref": "#"}, "kid": null}}}'
    for text, ok in [(good, True),
                     ('{"function": {"_name": "tree", "v": 1, "kid": {"v": 1}}}', False),
                     ('{"function": {"_name": "tree", "v": 1, "kid": {"_name": "tree", '
                      '"v": 1, "kid": null}}}', False)]:
        assert valid(grammar["value"], json.loads(text)) is ok, text
        assert enforced(tokenizer, grammar, text) is ok, text


@pytest.mark.parametrize("name", ["a%20b", "a b", "a/b~c", 'say "hi"', "été", "#x?y"])
def test_any_tool_name_is_a_valid_reference(tokenizer: llguidance.LLTokenizer, name: str) -> None:
    """A name is one JSON-pointer token, percent-encoded in the reference's fragment (a tool
    named `a%20b` was refused: its reference decoded to `a b`)."""
    grammar = required_grammar([defs_tool(name, {"type": "integer"}),
                                defs_tool("other", {"type": "string"})])
    call = {"function": {"_name": name, "x": 3}}
    text = json.dumps(call, ensure_ascii=False)
    assert valid(grammar["value"], call) and enforced(tokenizer, grammar, text)
    assert not enforced(tokenizer, grammar, text.replace("3", '"s"'))


def test_function_names_must_be_unique() -> None:
    with pytest.raises(ValidationError) as info:
        parse_tools([WEATHER, TIME, {"function": {"name": "get_time"}}])
    assert info.value.message == (
        "Input validation error: `tools[2].function.name` 'get_time' is already the name of "
        "`tools[1]`: function names must be unique")
