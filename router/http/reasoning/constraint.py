"""Constraints on the answer, not the thinking (as vLLM applies them): with a reasoning parser, a
JSON grammar (`response_format` json_object/json_schema, tools, TGI's json grammar) or a regex
becomes an llguidance Lark grammar that lets the model think freely first — `<think>`, any text
up to `</think>`, whitespace — and then holds it to the schema (embedded whole with `%json`) or
the regex (as a terminal, quoted by llguidance itself).

Which thinking the grammar allows follows the parser's reading of the prompt (think.py): after
a prompt that opened `<think>`, thinking without the tag; for `deepseek_r1`, thinking with or
without its opening tag; for `qwen3`, an optional `<think>…</think>` block; after a prompt that
closed the thinking (`enable_thinking: false`), none (the grammar is left as it is).

Left as they are: Lark grammars (a whole grammar: it constrains the whole output, thinking
included, and can spell the tags itself), and every grammar under `gpt_oss`, whose channel
markers are special tokens that the router's grammar check cannot spell (its answer is then the
constrained text alone, with no thinking).
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from pytgi_proto.contracts import JSON_WHITESPACE
from pytgi_router.http.grammar import GRAMMAR_JSON, GRAMMAR_REGEX, Grammar, parse_grammar
from pytgi_router.http.reasoning.pieces import ReasoningParser
from pytgi_router.http.reasoning.think import ThinkParser, prompt_opens

# What the thinking is: any text, ended (lazily) by the closing tag.
_THINK_RULE = 'think[stop="{close}"]: /(?s:.*)/'
# What may separate the closing tag from the answer (the models write `</think>\n\n`).
_GAP = r"/[ \t\r\n]*/"


def thinking_lead(parser: ReasoningParser, prompt: str) -> str | None:
    """The Lark expression of the thinking that may precede the answer (the `think` rule's
    reference), None when this output cannot think before a constrained answer."""
    if not isinstance(parser, ThinkParser):
        return None
    opened = prompt_opens(prompt, parser.open_tag, parser.close_tag)
    if opened is False:
        return None
    if opened:
        return "think"
    tag = json.dumps(parser.open_tag)
    return f"{tag}? think" if parser.implicit else f"({tag} think)?"


def answer_grammar(
    parser: ReasoningParser | None, prompt: str, grammar: dict[str, Any] | None,
    max_bytes: int | None = None,
) -> dict[str, Any] | None:
    """`grammar` (a TGI grammar object) as it applies to a reasoning model's answer: a JSON or
    regex one wrapped in a Lark grammar that allows the thinking first; a Lark one as it is.
    `max_bytes` refuses a schema surely over the limit before it is written out (validation
    checks the Lark text's size again)."""
    if parser is None or grammar is None:
        return grammar
    parsed = parse_grammar(grammar, max_bytes)
    if parsed.grammar_type not in (GRAMMAR_JSON, GRAMMAR_REGEX):
        return grammar
    lead = thinking_lead(parser, prompt)
    if lead is None or not isinstance(parser, ThinkParser):
        return grammar
    return {"type": "lark", "value": lark_text(lead, parser.close_tag, answer_expression(parsed))}


def answer_expression(grammar: Grammar) -> str:
    """The answer as a Lark expression: a JSON Schema embedded with `%json` (its whitespace as
    the shards constrain JSON: `JSON_WHITESPACE`, unless the schema sets its own), or a regex
    as a terminal."""
    if grammar.grammar_type == GRAMMAR_REGEX:
        return regex_terminal(grammar.value)
    schema = json.loads(grammar.value)
    guidance = {"whitespace_pattern": JSON_WHITESPACE, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": guidance}, separators=(",", ":"),
                                 ensure_ascii=False)


def regex_terminal(regex: str) -> str:
    """`regex` as a Lark terminal (`/.../`), quoted by llguidance itself: its grammar of a
    regex is the Lark rule `start: /<regex quoted>/`."""
    source = json.loads(LLMatcher.grammar_from_regex(regex))
    return str(source["grammars"][0]["lark_grammar"]).removeprefix("start: ")


def lark_text(lead: str, close_tag: str, answer: str) -> str:
    """The grammar: the thinking, whitespace, then the answer."""
    return "\n".join([
        "%llguidance {}",
        f"start: {lead} answer",
        _THINK_RULE.format(close=close_tag),
        f"answer: {_GAP} {answer}",
    ])
