"""responses_stream.py and response_output.py: the Responses event sequence of scripted
generations (text, reasoning then text, a tool call, a cut, a failure), numbered in order, and
the same items as the non-streamed answer builds from the same tokens."""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

import pytest

from pytgi_router.core.errors import GenerationError
from pytgi_router.core.request_stream import End, Token, TokenInfo
from pytgi_router.http.openai.chat_output import ChatOutputStream
from pytgi_router.http.openai.response_object import ResponseHead
from pytgi_router.http.openai.response_output import (
    OutputBuilder,
    conversation_messages,
    whole_output,
)
from pytgi_router.http.openai.responses_stream import ResponsesEncoder, delta_head, sse_event
from pytgi_router.http.openai.tool_stream import Delta
from pytgi_router.http.reasoning import ReasoningParser, reasoning_parser

CALL = '{"function": {"_name": "get_weather", "city": "Paris"}}'
OFFERED = frozenset({"get_weather"})


def run(texts: list[str], reason: str = "eos_token", parser: ReasoningParser | None = None,
        offered: frozenset[str] | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """The stream's events, and what was handed to be stored."""
    stored: list[Any] = []
    enc = ResponsesEncoder(ResponseHead({"model": "m"}), ChatOutputStream(parser, "", offered),
                           5, stored.append)
    raw = enc.start()
    tokens = [TokenInfo(i, t, 0.0, False) for i, t in enumerate(texts)]
    for i, t in enumerate(tokens[:-1]):
        raw += enc.token(i + 1, Token(t))
    raw += enc.end(len(texts), End(tokens[-1], generated_text="".join(texts),
                                   finish_reason=reason, generated_tokens=len(texts)))
    return events(raw), stored


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        head, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def test_text_events_in_order() -> None:
    evs, stored = run(["Hel", "lo", "!"])
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    final = evs[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello!"
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["output_tokens"] == 3
    assert stored == [final]


def test_reasoning_item_then_message() -> None:
    texts = ["<think>", "hm", "</think>", "Hi"]
    evs, _ = run(texts, parser=reasoning_parser("deepseek_r1"))
    kinds = [e["type"] for e in evs]
    assert "response.reasoning_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    output = evs[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert evs[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] >= 2
    items, _ = whole_output(ChatOutputStream(reasoning_parser("deepseek_r1"), "", None),
                            [TokenInfo(i, t, 0.0, False) for i, t in enumerate(texts)],
                            "".join(texts), "eos_token")
    assert [(i["type"], i.get("content")) for i in items] == [
        (i["type"], i.get("content")) for i in output]


def test_a_tool_call_streams_its_arguments() -> None:
    pieces = [CALL[i:i + 7] for i in range(0, len(CALL), 7)]
    evs, _ = run(pieces, offered=OFFERED)
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    [done] = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(args) == {"city": "Paris"} and done["arguments"] == args
    [call] = evs[-1]["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert conversation_messages([call])[0]["tool_calls"][0]["id"] == call["call_id"]


def test_a_cut_is_incomplete_and_a_cut_call_by_a_stop_fails() -> None:
    evs, _ = run(["a", "b"], reason="length")
    final = evs[-1]["response"]
    assert evs[-1]["type"] == "response.incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    evs, stored = run([CALL[:20]], reason="stop_sequence", offered=OFFERED)
    assert evs[-1]["type"] == "response.failed"
    assert evs[-1]["response"]["error"]["code"] == "server_error"
    assert stored[0]["status"] == "failed"


def test_a_failure_after_the_start() -> None:
    enc = ResponsesEncoder(ResponseHead({}), ChatOutputStream(None, "", None), 1, lambda r: None)
    raw = enc.start() + enc.token(1, Token(TokenInfo(0, "a", 0.0, False)))
    raw += enc.error(GenerationError("shard lost"))
    evs = events(raw)
    assert [e["type"] for e in evs[-2:]] == ["response.output_item.done", "response.failed"]
    assert "shard lost" in evs[-1]["response"]["error"]["message"]


@pytest.mark.parametrize(("opening", "kind"), [
    (Delta("content", "a"), "content"), (Delta("reasoning", "a"), "reasoning"),
    (Delta("call", "f"), "arguments")])
def test_the_spliced_delta_is_the_serialized_event(opening: Delta, kind: str) -> None:
    """The per-token path's bytes are those of the builder's event through json.dumps."""
    text = 'a "q" \\ é\n\u2028\x00'
    builder = OutputBuilder()
    builder.feed(opening)
    [event] = builder.feed(Delta(kind, text))
    item = builder.extend(Delta(kind, "more"))
    assert item is not None
    head, tail = delta_head(item)
    spliced = f"{head}{encode_basestring(text)}{tail}7}}\n\n".encode()
    assert spliced == sse_event({**event, "sequence_number": 7})


def test_a_stream_left_early_is_stored_cancelled() -> None:
    stored: list[Any] = []
    enc = ResponsesEncoder(ResponseHead({}), ChatOutputStream(None, "", None), 1, stored.append)
    enc.start()
    enc.token(1, Token(TokenInfo(0, "partial", 0.0, False)))
    enc.abandon()
    [response] = stored
    assert response["status"] == "cancelled"
    assert response["output"][0]["status"] == "incomplete"
    assert response["output"][0]["content"][0]["text"] == "partial"
    enc.abandon()  # once only
    assert len(stored) == 1
    ended: list[Any] = []
    enc = ResponsesEncoder(ResponseHead({}), ChatOutputStream(None, "", None), 1, ended.append)
    enc.start()
    enc.end(1, End(TokenInfo(0, "a", 0.0, False), generated_text="a", finish_reason="eos_token",
                   generated_tokens=1))
    enc.abandon()  # the stream closing after the end changes nothing
    assert [r["status"] for r in ended] == ["completed"]
