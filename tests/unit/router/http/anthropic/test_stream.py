"""A streamed message, token by token through the shared chat output path and MessageEncoder,
read back by the anthropic SDK's own accumulator (what `client.messages.stream` builds): the
event order and indexes it requires, and the same blocks as the non-streamed message for the
same tokens — text (less its stop sequence), thinking from a reasoning parser, a tool call."""

from __future__ import annotations

import json
from typing import Any

from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_router.core.request_stream import End, Token, TokenInfo
from pytgi_router.http.anthropic.events import MessageEvents
from pytgi_router.http.anthropic.message import outcome
from pytgi_router.http.anthropic.stop_text import StopText, cut_at_stop, held_suffix
from pytgi_router.http.anthropic.stream import MessageEncoder
from pytgi_router.http.openai.chat_output import ChatOutputStream, chat_answer
from pytgi_router.http.reasoning import ReasoningParser, reasoning_parser

OFFERED = frozenset({"get_weather"})
CALL = '{"function": {"_name": "get_weather", "city": "Paris"}}'


def run(pieces: list[str], reason: str = "eos_token", *, parser: ReasoningParser | None = None,
        offered: frozenset[str] | None = None, stops: list[str] | None = None,
        ) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """(the events, the SDK's message built from them, the non-streamed message's outcome)."""
    events = MessageEvents("msg_1", "m", 3)
    enc = MessageEncoder(events, ChatOutputStream(parser, "", offered), stops or [])
    infos = [TokenInfo(i, p, -0.1, False) for i, p in enumerate(pieces)]
    text = "".join(pieces)
    raw = events.start() + b"".join(enc.token(i, Token(t)) for i, t in enumerate(infos[:-1]))
    raw += enc.end(len(pieces), End(infos[-1], generated_text=text, finish_reason=reason,
                                    generated_tokens=len(pieces)))
    parsed = [parse(chunk) for chunk in raw.decode().split("\n\n") if chunk]
    snapshot, json_bufs = None, {}  # type: ignore[var-annotated]
    for event in parsed:
        if event["type"] != "error":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot,  # type: ignore[arg-type]
                                        json_bufs=json_bufs)
    if parsed[-1]["type"] == "error":
        return parsed, snapshot, {}
    answer = chat_answer(parser, "", offered, infos, text, reason)
    whole = outcome(answer, reason, text, stops or [])
    return parsed, snapshot, {"content": whole.content, "stop_reason": whole.stop_reason,
                              "stop_sequence": whole.stop_sequence}


def parse(chunk: str) -> dict[str, Any]:
    """One event: its `event:` line must name its data's type."""
    name, data = chunk.split("\n")
    event = json.loads(data.removeprefix("data: "))
    assert name == f"event: {event['type']}"
    return event


def blocks(snapshot: Any) -> list[dict[str, Any]]:
    return [b.to_dict(exclude_none=True) for b in snapshot.content]


def test_text_stream() -> None:
    events, message, whole = run(["Hel", "lo", " world"])
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                     "content_block_stop", "message_delta", "message_stop"]
    assert blocks(message) == whole["content"] == [{"type": "text", "text": "Hello world"}]
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == (
        "end_turn", 3, 3)
    assert events[0]["message"]["stop_reason"] is None


def test_thinking_then_text() -> None:
    _, message, whole = run(["<think>", "let me", " see", "</think>", "Four"], "length",
                            parser=reasoning_parser("qwen3"))
    assert blocks(message) == whole["content"] == [
        {"type": "thinking", "thinking": "let me see", "signature": ""},
        {"type": "text", "text": "Four"}]
    assert message.stop_reason == whole["stop_reason"] == "max_tokens"


def test_tool_call() -> None:
    events, message, whole = run([CALL[i:i + 4] for i in range(0, len(CALL), 4)],
                                 offered=OFFERED)
    [block] = blocks(message)
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["input"] == whole["content"][0]["input"] == {"city": "Paris"}
    assert message.stop_reason == whole["stop_reason"] == "tool_use"
    assert any(e.get("delta", {}).get("type") == "input_json_delta" for e in events)


def test_a_call_cut_short_is_an_error_event() -> None:
    events, _, _ = run(['{"function": {"_name": "get_', 'weather", "ci'], "stop_sequence",
                       offered=OFFERED, stops=['"ci'])
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["type"] == "invalid_request_error"


def test_the_stop_sequence_is_never_sent() -> None:
    """Split over tokens, or whole inside the last one (with text after it)."""
    for pieces in (["Hel", "lo", " w"], ["Hel", "lo wor"], ["H", "e", "l", "l", "o", " ", "w"]):
        events, message, whole = run(pieces, "stop_sequence", stops=["lo w"])
        sent = "".join(e["delta"].get("text", "") for e in events if "delta" in e)
        assert sent == "Hel", pieces
        assert blocks(message) == whole["content"] == [{"type": "text", "text": "Hel"}]
        assert message.stop_sequence == whole["stop_sequence"] == "lo w"
    _, message, _ = run(["Hel", "lo"], "length", stops=["lo w"])  # held, then sent
    assert blocks(message) == [{"type": "text", "text": "Hello"}]


def test_held_suffix_and_cut() -> None:
    assert held_suffix("abcab", ["abd"]) == 2 and held_suffix("abc", ["xyz"]) == 0
    assert held_suffix("xa", ["ab", "aab"]) == 1
    assert cut_at_stop("one two three", ["three", "two"]) == ("one ", "two")
    assert cut_at_stop("abcd", ["bcd", "cd", "abcdx"]) == ("a", "bcd")  # first to end
    assert cut_at_stop("abc", ["x"]) == ("abc", None)


@settings(max_examples=100, deadline=None)
@given(st.text("ab", min_size=1, max_size=12), st.text("ab", min_size=1, max_size=3),
       st.lists(st.integers(0, 12), max_size=6))
def test_streamed_text_is_the_cut_text(text: str, stop: str, cuts: list[int]) -> None:
    """However the text is split into tokens, what is sent is the text before the first
    stop sequence to end in it (all of it when none does)."""
    end = text.find(stop)
    if end >= 0:
        text = text[:end + len(stop)]  # the shard stops where the sequence ends
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    reader = StopText([stop])
    sent = "".join(reader.push(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    sent += reader.flush(end >= 0)
    assert sent == cut_at_stop(text, [stop])[0]


@settings(max_examples=100, deadline=None)
@given(st.text("abc", max_size=8), st.lists(st.text("abc", min_size=1, max_size=5), max_size=3))
def test_held_suffix_is_the_longest_proper_prefix_at_the_end(text: str, stops: list[str]) -> None:
    longest = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
                  default=0)
    assert held_suffix(text, stops) == longest


def test_thinking_then_a_tool_call() -> None:
    pieces = ["<think>", "weather?", "</think>", *[CALL[i:i + 6] for i in range(0, len(CALL), 6)]]
    events, message, whole = run(pieces, parser=reasoning_parser("qwen3"), offered=OFFERED)
    assert [b["type"] for b in blocks(message)] == ["thinking", "tool_use"]
    assert blocks(message)[0]["thinking"] == whole["content"][0]["thinking"] == "weather?"
    assert blocks(message)[1]["input"] == whole["content"][1]["input"] == {"city": "Paris"}
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    assert starts == [0, 1] and message.stop_reason == "tool_use"
