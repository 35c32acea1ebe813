"""tool_stream.py and the chat's ToolChatEncoder: a tool-constrained output streamed in any
tokenization reads as OpenAI's tool-call deltas whose argument fragments join into the call's
arguments (and no_tool's content into the answer), never sending what a later token unsays."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_router.core.request_stream import End, Token, TokenInfo
from pytgi_router.http.openai_schemas import Envelope
from pytgi_router.http.openai_stream import ChatChunks
from pytgi_router.http.routes_chat import ToolChatEncoder
from pytgi_router.http.tool_output import arguments_text, json_string_prefix
from pytgi_router.http.tool_stream import Delta, ToolCallStream

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k != "_name"),
                            json_values, max_size=4)
# How the model may space its JSON (llguidance's flexible whitespace allows any of these).
layouts = st.sampled_from([(", ", ": "), (",", ":"), (" , ", " : "), (",\n  ", ":  ")])


def render(name: str, args: dict[str, Any], layout: tuple[str, str], ascii_only: bool) -> str:
    inner = json.dumps({"_name": name, **args}, separators=layout, ensure_ascii=ascii_only)
    return "{" + f'"function"{layout[1]}{inner}' + layout[0].replace(",", "") + "}"


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


def stream(pieces: list[str], whole: str, final: bool = True) -> list[Delta]:
    parser = ToolCallStream()
    out = [d for p in pieces[:-1] for d in parser.push(p)]
    last = pieces[-1] if pieces else ""
    out += parser.finish(last, whole) if final else parser.push(last)
    return out


@settings(max_examples=150, deadline=None)
@given(name=st.text(min_size=1, max_size=6).filter(lambda n: n != "no_tool"), args=arguments,
       layout=layouts, ascii_only=st.booleans(),
       cuts=st.lists(st.integers(0, 400), max_size=30))
def test_fragments_join_into_the_arguments(
    name: str, args: dict[str, Any], layout: tuple[str, str], ascii_only: bool, cuts: list[int]
) -> None:
    text = render(name, args, layout, ascii_only)
    deltas = stream(split(text, cuts), text)
    assert deltas[0] == Delta("call", name)
    assert all(d.kind == "arguments" for d in deltas[1:])
    assert json.loads("".join(d.text for d in deltas[1:])) == args


@settings(max_examples=150, deadline=None)
@given(content=st.text(max_size=40), layout=layouts, ascii_only=st.booleans(),
       cuts=st.lists(st.integers(0, 300), max_size=30))
def test_no_tool_streams_its_decoded_content(
    content: str, layout: tuple[str, str], ascii_only: bool, cuts: list[int]
) -> None:
    text = render("no_tool", {"content": content}, layout, ascii_only)
    deltas = stream(split(text, cuts), text)
    assert all(d.kind == "content" for d in deltas)
    assert "".join(d.text for d in deltas) == content


@settings(max_examples=100, deadline=None)
@given(args=arguments, cut=st.integers(0, 300), cuts=st.lists(st.integers(0, 300), max_size=20))
def test_a_cut_output_sends_a_prefix_of_its_arguments(
    args: dict[str, Any], cut: int, cuts: list[int]
) -> None:
    text = render("f", args, (", ", ": "), False)
    whole = arguments_text(text[text.index('"f"') + 3:], final=True)
    sent = "".join(d.text for d in stream(split(text[:cut], cuts), text[:cut], final=False)
                   if d.kind == "arguments")
    assert whole.startswith(sent)


def test_json_string_prefix_never_splits_an_escape() -> None:
    assert json_string_prefix('ab\\') == ("ab", 2, False)
    assert json_string_prefix('ab\\u00') == ("ab", 2, False)
    assert json_string_prefix('\\ud83d\\ude0') == ("", 0, False)  # half a surrogate pair
    assert json_string_prefix('\\ud83d\\ude00!"x') == ("\U0001F600!", 13, True)
    assert json_string_prefix('a\\"b"') == ('a"b', 4, True)


def test_a_name_written_after_the_arguments_is_read_at_the_end() -> None:
    text = '{"function": {"location": "Paris", "_name": "get_weather"}}'
    deltas = stream(split(text, [5, 20, 40]), text)
    assert deltas[0] == Delta("call", "get_weather")
    assert json.loads(deltas[1].text) == {"location": "Paris"}


def sse(data: bytes) -> list[Any]:
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def encode(pieces: list[str], finish_reason: str, include_usage: bool = False) -> list[Any]:
    enc = ToolChatEncoder(ChatChunks(Envelope("m", "fp"), False), include_usage, 7)
    out = b""
    for i, piece in enumerate(pieces[:-1]):
        out += enc.token(i + 1, Token(TokenInfo(i, piece, -0.1, False)))
    eos = TokenInfo(99, "</s>", -0.1, True)
    out += enc.token(len(pieces), Token(TokenInfo(len(pieces), pieces[-1], -0.1, False)))
    out += enc.end(len(pieces) + 1, End(eos, generated_text="".join(pieces),
                                        finish_reason=finish_reason,
                                        generated_tokens=len(pieces) + 1))
    return sse(out)


def test_the_encoder_streams_tool_calls_as_openai_does() -> None:
    text = '{"function": {"_name": "get_weather", "location": "Paris", "days": 3}}'
    pieces = split(text, list(range(0, len(text), 3)))
    events = encode(pieces, "eos_token", include_usage=True)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    n = len(pieces) + 1
    assert events[-2]["usage"] == {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
    chunks = [e["choices"][0] for e in events[:-2]]
    assert chunks[0]["delta"]["role"] == "assistant"  # once: accumulators join repeated strings
    assert not any("role" in c["delta"] for c in chunks[1:])
    first = chunks[0]["delta"]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    later = [c["delta"]["tool_calls"][0] for c in chunks[1:-1]]
    assert all(set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
               for t in later)
    assert json.loads("".join(t["function"]["arguments"] for t in later)) == {
        "location": "Paris", "days": 3}
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


def test_the_encoder_streams_no_tool_as_content_and_a_cut_call_as_length() -> None:
    text = '{"function": {"_name": "no_tool", "content": "Bonjour \\u00e0 tous"}}'
    chunks = [e["choices"][0] for e in encode(split(text, [7, 30, 50, 55]), "eos_token")[:-1]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Bonjour à tous"
    assert chunks[-1]["finish_reason"] == "stop"
    assert not any("tool_calls" in c["delta"] for c in chunks)
    cut = '{"function": {"_name": "f", "a": "xy'
    chunks = [e["choices"][0] for e in encode(split(cut, [10, 30]), "length")[:-1]]
    assert chunks[-1]["finish_reason"] == "length"
    args = "".join(c["delta"]["tool_calls"][0]["function"]["arguments"]
                   for c in chunks if "tool_calls" in c["delta"])
    assert args == '{"a": "xy'
