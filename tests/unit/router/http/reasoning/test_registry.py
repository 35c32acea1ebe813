"""registry.py: the parsers by vLLM's names, a clear refusal of any other, and detection from a
chat template only where the template names one family."""

from __future__ import annotations

import pytest

from pytgi_router.http.reasoning import PARSER_NAMES, detect_reasoning_parser, reasoning_parser


def test_names() -> None:
    assert PARSER_NAMES == ("deepseek_r1", "gpt_oss", "qwen3")
    for name in PARSER_NAMES:
        assert reasoning_parser(name).name == name


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1': expected one of "
                                         "deepseek_r1, gpt_oss, qwen3"):
        reasoning_parser("r1")


QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
R1_TEMPLATE = "{{ '<｜Assistant｜>' }}{% if x %}<think>\n{% endif %}{{ c.split('</think>')[-1] }}"
HARMONY_TEMPLATE = "<|start|>assistant<|channel|>analysis<|message|>{{ t }}<|end|>"


@pytest.mark.parametrize(("source", "name"), [
    (QWEN3_TEMPLATE, "qwen3"),
    (R1_TEMPLATE, "deepseek_r1"),
    (HARMONY_TEMPLATE, "gpt_oss"),
    ("<|im_start|>{{ m.content }}<|im_end|>", None),  # ChatML without thinking
    ("<think>{{ x }}</think>", None),  # tags, but no family: ambiguous
    (None, None),
])
def test_detection(source: str | None, name: str | None) -> None:
    found = detect_reasoning_parser(source)
    assert (found.parser.name if found else None) == name
    if found:
        assert "the chat template holds" in found.evidence
