"""What the structured-output integration tests share: schemas and regexes that a random model
can finish within its 256 positions, tools, and a chat template that renders `tools` itself."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "enum_and_bounded_array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                 "minItems": 1, "maxItems": 3}},
        "required": ["color", "tags"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer"}, {"type": "boolean"},
                            {"type": "string", "maxLength": 4}]}},
        "required": ["value"], "additionalProperties": False},
    "string_bounds": {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 4, "pattern": "^[a-z]+$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["code", "n"], "additionalProperties": False},
}
# Rust's regex syntax (llguidance): `\d` is any Unicode digit, some of them newer than Python's
# own Unicode tables, so ASCII digits are spelled [0-9].
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}},
                   "required": ["zone"]}}}
TOOLS: list[Any] = [WEATHER, CLOCK]
PARAMETERS: dict[str, Any] = {
    t["function"]["name"]: t["function"]["parameters"] for t in TOOLS
}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]

# The tiny model has 256 positions and a 384-token vocabulary, in which the tools' JSON alone
# is hundreds of tokens: the chat routes here use a template that renders `tools` itself (so
# only the tool prompt is appended, TGI's rule) and a short tool prompt. The other path (the
# tools' JSON appended to the last message) is checked through /chat_tokenize.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{{ tools | length }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOOL_PROMPT = "Call one."
LIMITS = ("--max-input-tokens", "90", "--max-total-tokens", "256")
