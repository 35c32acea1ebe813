"""think.py: `<think>` reasoning split as vLLM's deepseek_r1 and qwen3 split it, the same whether
the output comes whole or in any tokenization (a tag split across deltas at every position)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_router.http.reasoning import Split, reasoning_parser, split_text
from pytgi_router.http.reasoning.pieces import ReasoningParser, joined
from pytgi_router.http.reasoning.think import held_prefix, prompt_opens

R1 = reasoning_parser("deepseek_r1")
QWEN3 = reasoning_parser("qwen3")
OPENED = "<|im_start|>assistant\n<think>\n"  # a template that opens the thinking
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3, enable_thinking: false


@pytest.mark.parametrize(("parser", "prompt", "text", "expected"), [
    # Both tags in the output: the same for both parsers.
    (R1, "", "<think>a b</think>\n\nanswer", Split("a b", "answer")),
    (QWEN3, "", "<think>a b</think>\n\nanswer", Split("a b", "answer")),
    (QWEN3, "", "  <think>a</think>x", Split("a", "x")),
    # Only the closing tag: R1 thinks anyway; qwen3 needs its opening tag...
    (R1, "", "a b</think>answer", Split("a b", "answer")),
    (QWEN3, "", "a b</think>answer", Split(None, "a b</think>answer")),
    # ...unless the template opened it.
    (QWEN3, OPENED, "a b</think>answer", Split("a b", "answer")),
    (QWEN3, OPENED, "<think>a b</think>answer", Split("a b", "answer")),
    # Thinking closed in the prompt (enable_thinking: false): all answer, for both.
    (QWEN3, CLOSED, "plain", Split(None, "plain")),
    (R1, CLOSED, "plain", Split(None, "plain")),
    # No tags: R1's output is all thinking (cut short), qwen3's all answer.
    (R1, "", "thinking on", Split("thinking on", None)),
    (QWEN3, "", "just an answer", Split(None, "just an answer")),
    # Cut inside the thinking (max_tokens): reasoning only, a half tag kept as text.
    (QWEN3, "", "<think>so far</thi", Split("so far</thi", None)),
    (R1, "", "<think>so far", Split("so far", None)),
    (QWEN3, OPENED, "so far", Split("so far", None)),
    # Cut inside the opening tag.
    (QWEN3, "", "<thi", Split(None, "<thi")),
    (R1, "", "<thi", Split("<thi", None)),
    # Empty thinking; an empty answer.
    (QWEN3, "", "<think></think>x", Split(None, "x")),
    (QWEN3, "", "<think>t</think>\n\n", Split("t", None)),
    # Something that only looks like the tag is text.
    (QWEN3, "", "<thinking>x", Split(None, "<thinking>x")),
    (R1, "", "a </thin> b</think>c", Split("a </thin> b", "c")),
])
def test_whole_split(parser: ReasoningParser, prompt: str, text: str, expected: Split) -> None:
    assert split_text(parser, text, prompt) == expected


def streamed(parser: ReasoningParser, deltas: list[str], prompt: str = "") -> Split:
    splitter = parser.splitter(prompt)
    pieces = [p for d in deltas for p in splitter.push(d)]
    return joined(pieces + splitter.finish())


TEXTS = ["<think>a b</think>\n\nanswer", "a</think>b", "<think>cut</thi", " <think>x</think> y",
         "no tags", "<thi", "<think></think></think>z"]


@pytest.mark.parametrize("parser", [R1, QWEN3])
@pytest.mark.parametrize("prompt", ["", OPENED, CLOSED])
@pytest.mark.parametrize("text", TEXTS)
def test_every_split_point(parser: ReasoningParser, prompt: str, text: str) -> None:
    """Two deltas, split at every position (so every tag is split at every character)."""
    whole = split_text(parser, text, prompt)
    for i in range(len(text) + 1):
        assert streamed(parser, [text[:i], text[i:]], prompt) == whole, i


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "\n", " ",
                                    "ab", "<th", "ink>", "</th"]), max_size=12),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    parser=st.sampled_from([R1, QWEN3]),
    prompt=st.sampled_from(["", OPENED, CLOSED]),
)
def test_any_tokenization(parts: list[str], cuts: list[int], parser: ReasoningParser,
                          prompt: str) -> None:
    text = "".join(parts)
    points = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert streamed(parser, deltas, prompt) == split_text(parser, text, prompt)


def test_one_character_at_a_time_streams_reasoning_before_the_end() -> None:
    """Reasoning is streamed as it comes, never held back to the end: at most a tag's prefix
    waits for the next delta."""
    splitter = QWEN3.splitter("")
    out = [splitter.push(c) for c in "<think>abc</think>d"]
    assert [p.text for p in out[7]] == ["a"]  # the first character after the opening tag
    assert out[10] == []  # "<" of the closing tag: held
    assert [(p.kind, p.text) for p in out[-1]] == [("content", "d")]


def test_thinking_state_counts_the_tags() -> None:
    splitter = R1.splitter("")
    assert splitter.thinking  # R1 thinks from the first token
    splitter.push("x</think>")
    assert not splitter.thinking
    q = QWEN3.splitter("")
    assert not q.thinking
    q.push("<th")
    assert q.thinking  # a begun opening tag counts


def test_helpers() -> None:
    assert held_prefix("abc</th", "</think>") == 4
    assert held_prefix("abc", "</think>") == 0
    assert prompt_opens("x<think>\n", "<think>", "</think>") is True
    assert prompt_opens("<think></think>\n", "<think>", "</think>") is False
    assert prompt_opens("<think></think> hi", "<think>", "</think>") is None
