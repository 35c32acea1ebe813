"""tool_stream.py and the chat's OutputChatEncoder (without a reasoning parser): a tool-constrained output streamed in any
tokenization reads as OpenAI's tool-call deltas whose argument fragments join into the call's
arguments (and no_tool's content into the answer), never sending what a later token unsays."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_router.core.request_stream import End, Token, TokenInfo
from pytgi_router.http.openai.chat_output import ChatOutputStream
from pytgi_router.http.openai.chat_render import OutputChatEncoder
from pytgi_router.http.openai.schemas import Envelope
from pytgi_router.http.openai.stream import ChatChunks
from pytgi_router.http.openai.tool_output import HEAD, arguments_text, json_string_prefix
from pytgi_router.http.openai.tool_stream import Delta, ToolCallStream

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


@settings(max_examples=100, deadline=None)
@given(args=arguments, layout=layouts, cuts=st.lists(st.integers(0, 300), max_size=20))
def test_each_token_sends_all_that_is_certain(
    args: dict[str, Any], layout: tuple[str, str], cuts: list[int]
) -> None:
    """Read a piece at a time, the fragments sent so far are always what the whole text so far
    makes certain: nothing held back longer than the wrapper's possible end."""
    text = render("f", args, layout, False)
    parser, sent, so_far = ToolCallStream(), "", ""
    for piece in split(text, cuts)[:-1]:
        so_far += piece
        sent += "".join(d.text for d in parser.push(piece) if d.kind == "arguments")
        head = HEAD.match(so_far)
        assert sent == (arguments_text(so_far[head.end():], final=False) if head else "")


def allocated_per_char(name: str, tokens: int) -> float:
    """Bytes the pushes of a `tokens`-token output allocate (each push's peak above what was
    held before it, summed), per character of the output. A push that copies the text so far
    allocates as much as that text: the sum grows with the square of the length."""
    body = ("abc \\u00e9 \u6771 " * tokens)[:tokens * 4]
    text = render(name, {"content": body[:body.rfind(" ")]}, (", ", ": "), False)
    parser, total = ToolCallStream(), 0
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        for piece in [text[i:i + 4] for i in range(0, len(text) - 4, 4)]:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            parser.push(piece)
            total += tracemalloc.get_traced_memory()[1] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return total / len(text)


@pytest.mark.parametrize("name", ["f", "no_tool"])
def test_streaming_reads_each_token_once(name: str) -> None:
    """Linear in the output: what a token costs does not grow with the text before it (the
    text re-copied per token cost 4,449 bytes a character at 4k tokens, 17,675 at 16k; a
    32k-token stream spent 1.4 s of the event loop)."""
    short, long = allocated_per_char(name, 1024), allocated_per_char(name, 8192)
    assert long < 1.5 * short and long < 512, (short, long)


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


OFFERED = frozenset({"get_weather", "f", "no_tool"})


def encode(pieces: list[str], finish_reason: str, include_usage: bool = False) -> list[Any]:
    enc = OutputChatEncoder(ChatChunks(Envelope("m", "fp"), False), include_usage, 7,
                            ChatOutputStream(None, "", OFFERED), reasoning=False)
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


def events_chunks(events: list[Any]) -> list[dict[str, Any]]:
    return [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]


def test_only_a_whole_call_to_an_offered_function_finishes_as_tool_calls() -> None:
    """An end its grammar did not allow (EOS inside the arguments, a function not offered,
    arguments that do not parse) or a stop sequence cutting the call: the deltas sent, then an
    error event, never "tool_calls". A whole call that happens to end at the token limit is
    still one."""
    for text, reason in [('{"function": {"_name": "get_weather", "location": "Pa', "eos_token"),
                         ('{"function": {"_name": "get_weather", "location": "Pa', "stop_sequence"),
                         ('{"function": {"_name": "nope", "location": "Paris"}}', "eos_token"),
                         ('{"function": {"_name": "f", "a": [1,}}', "eos_token"),
                         ('{"function": {"_name": "f"}} trailing', "eos_token")]:
        events = encode(split(text, [9, 30, 44]), reason)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "tool_error" and error["http_status_code"] == 422, text
        assert "before its tool call was complete" in error["message"]
        assert not any(c["finish_reason"] for c in events_chunks(events)), text
    whole = '{"function": {"_name": "f", "a": 1}}'
    chunks = events_chunks(encode(split(whole, [9, 30]), "length"))
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_a_cut_no_tool_answer_or_nothing_at_all_is_length() -> None:
    for text in ('{"function": {"_name": "no_tool", "content": "Hel', '{"funct'):
        events = encode(split(text, [5]), "length")
        assert events_chunks(events)[-1]["finish_reason"] == "length", text
        assert "".join(c["delta"].get("content") or "" for c in events_chunks(events)) in (
            "Hel", "")
