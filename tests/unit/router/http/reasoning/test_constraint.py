"""constraint.py: with a reasoning parser a JSON or regex grammar constrains the answer after
the thinking (checked with llguidance over the byte vocabulary, as the router's grammar check
compiles it); Lark grammars, and prompts that closed the thinking, keep theirs."""

from __future__ import annotations

from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.grammar import GrammarChecker, _ByteVocabulary
from pytgi_router.http.openai.tools import chat_tools, parse_tool_choice, parse_tools
from pytgi_router.http.reasoning import reasoning_parser
from pytgi_router.http.reasoning.constraint import answer_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
JSON = {"type": "json", "value": SCHEMA}
OPENED = "<|im_start|>assistant\n<think>\n"
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
BYTES = LLTokenizer(TokenizerWrapper(_ByteVocabulary()))
CHECKER = GrammarChecker()


def accepts(grammar: dict[str, Any], text: str) -> bool:
    CHECKER.check(CHECKER.parse(grammar))
    matcher = LLMatcher(BYTES, LLMatcher.grammar_from_lark(grammar["value"]), log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize(("name", "prompt", "text", "ok"), [
    ("qwen3", "", '<think>so: {"a": "x"} </thi</think>\n\n{"a": 1}', True),
    ("qwen3", "", '{"a": 1}', True),  # qwen3 may answer without thinking
    ("qwen3", "", '<think>x</think>{"a": "x"}', False),  # the answer is held to the schema
    ("qwen3", "", '<think>x</think>{"a":  1}', False),  # JSON whitespace as the shards' (one)
    ("qwen3", OPENED, 'thinking</think>{"a": 2}', True),  # the template opened it
    ("qwen3", OPENED, '{"a": 2}', False),  # ...so the thinking must be closed first
    ("deepseek_r1", "", 'no tag</think>{"a": 3}', True),
    ("deepseek_r1", "", '<think>tag</think>{"a": 3}', True),
    ("deepseek_r1", "", '{"a": 3}', False),  # R1 always thinks
])
def test_json_answers_after_thinking(name: str, prompt: str, text: str, ok: bool) -> None:
    grammar = answer_grammar(reasoning_parser(name), prompt, JSON)
    assert grammar is not None and grammar["type"] == "lark"
    assert accepts(grammar, text) is ok


@pytest.mark.parametrize(("text", "ok"), [
    ("<think>a/b</think>\n\nyes/42", True),
    ("no/12", True),
    ("<think>x</think>maybe", False),
])
def test_regex_answers_after_thinking(text: str, ok: bool) -> None:
    """The regex (with a `/`, which its Lark terminal must quote) holds the answer alone."""
    regex = {"type": "regex", "value": "(yes|no)/[0-9]{2}"}
    grammar = answer_grammar(reasoning_parser("qwen3"), "", regex)
    assert grammar is not None and grammar["type"] == "lark"
    assert accepts(grammar, text) is ok


def test_tool_calls_follow_the_thinking() -> None:
    tools = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    offered = chat_tools(tools, parse_tool_choice("auto"), None)
    assert offered is not None
    grammar = answer_grammar(reasoning_parser("qwen3"), "", offered.grammar())
    assert grammar is not None
    call = '{"function": {"_name": "get_weather", "city": "Paris"}}'
    assert accepts(grammar, "<think>Paris?</think>\n" + call)
    assert not accepts(grammar, '<think>x</think>{"function": {"_name": "nope"}}')


@pytest.mark.parametrize(("name", "prompt", "grammar"), [
    (None, "", JSON),  # no parser
    ("qwen3", CLOSED, JSON),  # thinking closed in the prompt: nothing to allow
    ("gpt_oss", "", JSON),  # harmony's markers are special tokens: left as it is
    ("qwen3", "", {"type": "lark", "value": 'start: "<think>" /[a-z]+/ "</think>"'}),  # whole
    ("qwen3", "", None),
])
def test_left_as_they_are(name: str | None, prompt: str, grammar: dict[str, Any] | None) -> None:
    parser = reasoning_parser(name) if name else None
    assert answer_grammar(parser, prompt, grammar) == grammar


def test_a_schema_over_the_limit_is_refused_before_it_is_written_out() -> None:
    big = {"type": "json", "value": {"enum": ["x" * 100] * 100}}
    with pytest.raises(ValidationError, match="longer than 1000 bytes"):
        answer_grammar(reasoning_parser("qwen3"), "", big, max_bytes=1000)


class _TagVocabulary:
    """The bytes, an end token, and the tags and an answer as tokens of their own (Qwen3's and
    DeepSeek's vocabularies hold `<think>` and `</think>` whole)."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"", b"<think>", b"</think>", b'{"a": 1}']
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


def test_the_tags_as_whole_tokens() -> None:
    grammar = answer_grammar(reasoning_parser("qwen3"), "", JSON)
    assert grammar is not None
    matcher = LLMatcher(LLTokenizer(TokenizerWrapper(_TagVocabulary())),
                        LLMatcher.grammar_from_lark(grammar["value"]), log_level=0)
    assert matcher.consume_tokens([257, *b"hmm", 258, 259])  # <think> hmm </think> {"a": 1}
    assert matcher.is_accepting()
