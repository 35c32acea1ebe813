"""chat_output.py, the shared chat output path: reasoning split off first, then the answer as
content or through the tool-call reader; streamed token by token or whole, with the same
result, and the turn's end (finish reason, reasoning tokens, tool call)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_router.core.request_stream import TokenInfo
from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.openai.chat_output import ChatOutputStream, chat_answer
from pytgi_router.http.reasoning import reasoning_parser

QWEN3 = reasoning_parser("qwen3")
GPT_OSS = reasoning_parser("gpt_oss")
OFFERED = frozenset({"get_weather", "no_tool"})
CALL = '{"function": {"_name": "get_weather", "city": "Paris"}}'


def tokens(*texts: str, special: frozenset[str] = frozenset()) -> list[TokenInfo]:
    return [TokenInfo(i, t, -0.1, t in special) for i, t in enumerate(texts)]


def test_reasoning_then_content() -> None:
    toks = tokens("<think>", "Let me", " see", "</think>", "\n\n", "Four", ".", "</s>",
                  special=frozenset({"</s>"}))
    answer = chat_answer(QWEN3, "", None, toks, "<think>Let me see</think>\n\nFour.", "eos_token")
    assert (answer.reasoning, answer.content) == ("Let me see", "Four.")
    assert answer.end.finish_reason == "stop"
    assert answer.end.reasoning_tokens == 4  # <think>, 2 words, </think>; the EOS not read
    assert answer.end.tool_call is None


def test_reasoning_then_a_tool_call() -> None:
    toks = tokens("<think>", "weather?", "</think>", *[CALL[i:i + 5] for i in range(0, len(CALL), 5)])
    answer = chat_answer(QWEN3, "", OFFERED, toks, "<think>weather?</think>" + CALL, "eos_token")
    assert answer.reasoning == "weather?"
    assert answer.content is None
    assert answer.end.finish_reason == "tool_calls"
    call = answer.end.tool_call
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_no_tool_answer_after_thinking_is_content() -> None:
    out = '{"function": {"_name": "no_tool", "content": "Hi!"}}'
    answer = chat_answer(QWEN3, "", OFFERED, tokens("<think>x</think>", out),
                         "<think>x</think>" + out, "eos_token")
    assert (answer.reasoning, answer.content, answer.end.finish_reason) == ("x", "Hi!", "stop")


def test_cut_inside_the_thinking() -> None:
    """max_tokens inside the thinking: reasoning so far, no answer, "length" (with tools too:
    no call was begun)."""
    for offered in (None, OFFERED):
        answer = chat_answer(QWEN3, "", offered, tokens("<think>", "still", " going"),
                             "<think>still going", "length")
        assert (answer.reasoning, answer.content) == ("still going", None)
        assert answer.end.finish_reason == "length"
        assert answer.end.reasoning_tokens == 3
        assert answer.end.tool_call is None


def test_tool_answer_that_ended_early_is_an_error() -> None:
    stream = ChatOutputStream(QWEN3, "", OFFERED)
    stream.finish(TokenInfo(0, "<think>x</think>{", 0.0, False), "<think>x</think>{")
    with pytest.raises(ToolError):
        stream.end("eos_token")


def test_special_tokens_read_only_by_a_parser_that_needs_them() -> None:
    """gpt-oss's markers are special tokens: its parser reads them; the others skip specials
    (the answer's decoded text omits them)."""
    markers = frozenset({"<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"})
    toks = tokens("<|channel|>", "analysis", "<|message|>", "hm", "<|end|>", "<|start|>",
                  "assistant", "<|channel|>", "final", "<|message|>", "Yes", "<|return|>",
                  special=markers)
    answer = chat_answer(GPT_OSS, "", None, toks, "analysishmassistantfinalYes", "eos_token")
    assert (answer.reasoning, answer.content) == ("hm", "Yes")
    plain = chat_answer(None, "", None, tokens("a", "<|end|>", special=markers), "a", "eos_token")
    assert plain.content == "a"


def test_think_tags_marked_special_are_read() -> None:
    """A tokenizer may mark `<think>` special: the tags are read, other specials are not."""
    toks = tokens("<think>", "x", "</think>", "y", "</s>",
                  special=frozenset({"<think>", "</think>", "</s>"}))
    answer = chat_answer(QWEN3, "", None, toks, "xy", "eos_token")
    assert (answer.reasoning, answer.content) == ("x", "y")


def test_the_whole_text_completes_a_withheld_end() -> None:
    """The detokenizer may withhold a last partial character until the end: the End's text
    adds it."""
    stream = ChatOutputStream(QWEN3, "", None)
    deltas = stream.push("<think>a</think>b")
    deltas += stream.finish(TokenInfo(1, "", 0.0, False), "<think>a</think>bé")
    assert "".join(d.text for d in deltas if d.kind == "content") == "bé"
    thinking = ChatOutputStream(QWEN3, "", None)
    deltas = thinking.push("<think>a")
    deltas += thinking.finish(TokenInfo(1, "", 0.0, False), "<think>aé")
    assert "".join(d.text for d in deltas if d.kind == "reasoning") == "aé"
    assert thinking.reasoning_tokens == 2  # the withheld text is no token of its own


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=10), tools=st.booleans())
def test_streamed_equals_whole(cuts: list[int], tools: bool) -> None:
    """Deltas of any tokenization join into the whole answer, the call's fragments into its
    arguments."""
    answer_text = CALL if tools else "The answer."
    text = "<think>a <b> </thin</think>\n" + answer_text
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    offered = OFFERED if tools else None
    stream = ChatOutputStream(QWEN3, "", offered)
    deltas = [d for p in pieces[:-1] for d in stream.push(p)]
    deltas += stream.finish(TokenInfo(0, pieces[-1], 0.0, False), text)
    by_kind = {k: "".join(d.text for d in deltas if d.kind == k)
               for k in ("reasoning", "content", "call", "arguments")}
    assert by_kind["reasoning"] == "a <b> </thin"
    if tools:
        assert by_kind["call"] == "get_weather"
        assert json.loads(by_kind["arguments"]) == {"city": "Paris"}
        assert stream.end("eos_token").finish_reason == "tool_calls"
    else:
        assert by_kind["content"] == "The answer."
