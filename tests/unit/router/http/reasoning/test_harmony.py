"""harmony.py: gpt-oss's channels (analysis = reasoning, final = answer), whole or streamed in
any tokenization, markers split across deltas included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_router.http.reasoning import Split, reasoning_parser, split_text
from pytgi_router.http.reasoning.harmony import prompt_channel
from pytgi_router.http.reasoning.pieces import joined

GPT_OSS = reasoning_parser("gpt_oss")
FULL = ("<|channel|>analysis<|message|>Think <|x|> it.<|end|><|start|>assistant"
        "<|channel|>final<|message|>The answer.<|return|>")


@pytest.mark.parametrize(("prompt", "text", "expected"), [
    ("", FULL, Split("Think <|x|> it.", "The answer.")),
    # Cut inside the thinking, inside a marker, and before any message.
    ("", "<|channel|>analysis<|message|>so far", Split("so far", None)),
    ("", "<|channel|>analysis<|message|>so far<|en", Split("so far<|en", None)),
    ("", "<|channel|>analy", Split(None, None)),
    # No markers at all: the answer.
    ("", "plain text", Split(None, "plain text")),
    # A preamble on the commentary channel is answer text.
    ("", "<|channel|>commentary<|message|>Let me look.<|end|>", Split(None, "Let me look.")),
    # A header with a recipient and a constraint.
    ("", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
     Split(None, "{}")),
    # A template that ends inside the analysis message.
    ("<|start|>assistant<|channel|>analysis<|message|>", "t<|end|><|start|>assistant"
     "<|channel|>final<|message|>a", Split("t", "a")),
])
def test_whole_split(prompt: str, text: str, expected: Split) -> None:
    assert split_text(GPT_OSS, text, prompt) == expected


def streamed(deltas: list[str], prompt: str = "") -> Split:
    splitter = GPT_OSS.splitter(prompt)
    return joined([p for d in deltas for p in splitter.push(d)] + splitter.finish())


def test_every_split_point() -> None:
    whole = split_text(GPT_OSS, FULL)
    for i in range(len(FULL) + 1):
        assert streamed([FULL[:i], FULL[i:]]) == whole, i


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["<|channel|>", "<|message|>", "<|end|>", "<|start|>",
                                    "analysis", "final", "assistant", "hi ", "<", "|", "<|",
                                    "|>", "<|return|>"]), max_size=14),
    cuts=st.lists(st.integers(0, 120), max_size=8),
)
def test_any_tokenization(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    points = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert streamed(deltas) == split_text(GPT_OSS, text)


def test_thinking_and_the_prompt_channel() -> None:
    splitter = GPT_OSS.splitter("")
    splitter.push("<|channel|>analysis")
    assert splitter.thinking
    splitter.push("<|message|>x<|end|>")
    assert not splitter.thinking
    assert prompt_channel("<|start|>assistant") is None
    assert prompt_channel("<|channel|>final <|constrain|>json<|message|>") == "final"
