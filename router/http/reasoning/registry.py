"""The reasoning parsers by name (vLLM's names), and their detection from a chat template."""

from __future__ import annotations

from dataclasses import dataclass

from pytgi_router.http.reasoning.harmony import CHANNEL, GPT_OSS, MESSAGE
from pytgi_router.http.reasoning.pieces import ReasoningParser
from pytgi_router.http.reasoning.think import CLOSE, DEEPSEEK_R1, OPEN, QWEN3

PARSERS: dict[str, ReasoningParser] = {p.name: p for p in (DEEPSEEK_R1, QWEN3, GPT_OSS)}
PARSER_NAMES = tuple(sorted(PARSERS))
# The flag's value that turns reasoning parsing (and its detection) off.
NO_PARSER = "none"


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; a ValueError listing the known names otherwise (the router
    refuses to start with it, before any request)."""
    parser = PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}: expected one of {', '.join(PARSER_NAMES)}"
        )
    return parser


@dataclass(frozen=True, slots=True)
class Detection:
    """A parser chosen from a template's text, and the evidence, for the log line that says so."""

    parser: ReasoningParser
    evidence: str


# The template texts that name one family unambiguously: (markers all present, parser).
_SIGNS: tuple[tuple[tuple[str, ...], ReasoningParser], ...] = (
    ((CHANNEL, MESSAGE, "analysis"), GPT_OSS),
    ((OPEN, CLOSE, "<|im_start|>"), QWEN3),
    ((OPEN, CLOSE, "<｜Assistant｜>"), DEEPSEEK_R1),
)


def detect_reasoning_parser(template_source: str | None) -> Detection | None:
    """The parser a chat template's text shows the model needs: gpt-oss's harmony channels,
    `<think>` tags in a ChatML template (Qwen3, QwQ: `qwen3`, which also reads the QwQ style
    of a prompt that opens `<think>`), or in DeepSeek's (`deepseek_r1`). None for any other
    template, including one with `<think>` tags in a format not listed (ambiguous: the flag
    decides)."""
    if not template_source:
        return None
    for markers, parser in _SIGNS:
        if all(m in template_source for m in markers):
            return Detection(parser, f"the chat template holds {', '.join(markers)}")
    return None


def chosen_parser(
    flag: str | None, template_source: str | None
) -> tuple[ReasoningParser | None, str]:
    """The parser a router serves with, and the log line that says why: the flag's (an
    explicit name wins; "none" turns parsing off), else the template's detection, else none."""
    if flag == NO_PARSER:
        return None, "reasoning parser: none (--reasoning-parser none)"
    if flag is not None:
        return reasoning_parser(flag), f"reasoning parser: {flag} (--reasoning-parser)"
    found = detect_reasoning_parser(template_source)
    if found is None:
        return None, ("reasoning parser: none (the chat template names no reasoning format; "
                      "--reasoning-parser sets one)")
    return found.parser, (f"reasoning parser: {found.parser.name}, detected: {found.evidence} "
                          "(--reasoning-parser overrides)")
