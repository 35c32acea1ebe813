"""Constrained output as the shards receive it: TGI's `grammar` object and OpenAI's
`response_format` turned into one (grammar_type, grammar) pair — a JSON Schema as JSON text, or a
regex that the whole output must match.

Every grammar is compiled here once with the constraint library's own compiler (llguidance, with
no tokenizer and no torch), so a schema that is not valid, uses a feature the engine does not
implement, or a regex that does not parse is a 422 naming the problem before any shard sees it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from pytgi_proto import generate_pb2
from pytgi_router.core.errors import ValidationError

GRAMMAR_NONE = generate_pb2.GRAMMAR_TYPE_NONE
GRAMMAR_JSON = generate_pb2.GRAMMAR_TYPE_JSON
GRAMMAR_REGEX = generate_pb2.GRAMMAR_TYPE_REGEX

# OpenAI's `{"type": "json_object"}` (and TGI's json types given no schema): any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}

JSON_KINDS = ("json", "json_object", "json_schema")

# llguidance's messages for schemas it parses but cannot enforce.
_UNSUPPORTED = ("Unimplemented keys", "Unknown format")


@dataclass(frozen=True, slots=True)
class Grammar:
    """What goes on the wire: `grammar_type` (the proto enum) and its `value`."""

    grammar_type: int
    value: str


def parse_grammar(grammar: dict[str, Any]) -> Grammar:
    """TGI's shapes: `{"type": "json" | "json_object", "value": <schema or JSON text>}`,
    `{"type": "json_schema", "value": {"name"?, "schema"}}`, `{"type": "regex", "value": str}`.
    Only the shape is checked here; `check_grammar` compiles it."""
    kind = grammar.get("type")
    value = grammar.get("value")
    if kind == "regex":
        if not isinstance(value, str):
            raise ValidationError("grammar is not valid: a regex grammar needs a string value")
        return Grammar(GRAMMAR_REGEX, value)
    if kind not in JSON_KINDS:
        raise ValidationError(
            f"grammar is not valid: unknown type {kind!r} (expected json, json_object, "
            "json_schema or regex)"
        )
    schema = _schema_of(kind, value)
    return Grammar(GRAMMAR_JSON, json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def _schema_of(kind: str, value: Any) -> dict[str, Any]:
    if kind == "json_schema":
        if value is not None and not isinstance(value, dict):
            raise ValidationError("grammar is not valid: a json_schema value must be an object "
                                  "with a `schema`")
        value = (value or {}).get("schema")
    if value is None:
        return ANY_JSON_OBJECT
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValidationError(f"grammar is not valid: {err}") from None
    if not isinstance(value, dict):
        raise ValidationError("grammar is not valid: the JSON schema must be an object")
    return value


def check_grammar(grammar: Grammar) -> None:
    """Compiles the grammar as the shards will (without a vocabulary): 422 if it fails."""
    if grammar.grammar_type == GRAMMAR_REGEX:
        compiled = LLMatcher.grammar_from_regex(grammar.value)
    else:
        compiled = LLMatcher.grammar_from_json_schema(grammar.value)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(compiled)
    if is_error:
        raise ValidationError(f"grammar is not valid: {_reason(grammar, messages[0])}")


def _reason(grammar: Grammar, message: str) -> str:
    """The library's message, on one line: for a regex its `error:` line, for a schema what it
    names, marked as unsupported when the schema is valid but not enforceable."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    error = next((line[len("error: "):] for line in lines if line.startswith("error: ")), None)
    if grammar.grammar_type == GRAMMAR_REGEX:
        return f"invalid regex {grammar.value!r}: {error or lines[0]}"
    if error is not None:  # a `pattern` inside the schema
        return f"invalid regex in the JSON schema: {error}"
    if message.startswith(_UNSUPPORTED):
        return f"unsupported JSON Schema feature: {lines[0]}"
    return lines[0] if lines else message


def response_format_grammar(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's `response_format` as a TGI grammar object: `text` (or none) is unconstrained,
    `json_object` any JSON object, `json_schema` its `json_schema.schema` (`strict` or not:
    the output always follows it). TGI's own grammar objects pass through unchanged."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if "value" in fmt:
        return fmt
    if kind == "json_object":
        return {"type": "json", "value": ANY_JSON_OBJECT}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValidationError(
                "`response_format.json_schema` must be an object with a `schema`"
            )
        return {"type": "json_schema", "value": spec}
    return fmt
