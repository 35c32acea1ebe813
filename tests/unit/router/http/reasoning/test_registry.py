"""registry.py: the parsers by vLLM's names, a clear refusal of any other, and detection from a
chat template only where the template names one family."""

from __future__ import annotations

import pytest

from pytgi_router.cli import parse_settings
from pytgi_router.http.reasoning import (
    PARSER_NAMES,
    chosen_parser,
    detect_reasoning_parser,
    reasoning_parser,
)
from pytgi_router.settings import RouterSettings


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


def test_the_flag_wins_over_detection_and_none_turns_it_off() -> None:
    parser, why = chosen_parser("deepseek_r1", QWEN3_TEMPLATE)
    assert parser is not None and parser.name == "deepseek_r1"
    assert "--reasoning-parser" in why
    parser, why = chosen_parser(None, QWEN3_TEMPLATE)
    assert parser is not None and parser.name == "qwen3"
    assert "detected" in why
    assert chosen_parser("none", QWEN3_TEMPLATE)[0] is None
    assert chosen_parser(None, "{{ messages }}")[0] is None


def test_router_flag_and_environment() -> None:
    base = ["--tokenizer-name", "m"]
    assert parse_settings(base, {}).reasoning_parser is None
    assert parse_settings([*base, "--reasoning-parser", "qwen3"], {}).reasoning_parser == "qwen3"
    assert parse_settings(base, {"REASONING_PARSER": "gpt_oss"}).reasoning_parser == "gpt_oss"
    with pytest.raises(SystemExit):
        parse_settings([*base, "--reasoning-parser", "r1"], {})
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        RouterSettings(tokenizer_name="m", reasoning_parser="r1")
