"""What a tool-constrained generation said: `{"function": {"_name": name, <arguments>}}` read
back as an OpenAI tool call (name, arguments as a JSON string, a fresh id), or, for TGI's
`no_tool`, as the plain answer in its `content`.

A call is reported as one (`finish_reason: "tool_calls"`) only when the whole output parses as
the grammar's JSON and names an offered function. An output its token limit cut short says
`length` with what it wrote so far (the partial call, as OpenAI sends one); one that ended any
other way before it was complete (a stop sequence, or an end of sequence its grammar did not
allow) is an error, never a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.openai.tools import NO_TOOL

# JSON's whitespace: what the grammar lets the model write between tokens.
WHITESPACE = " \t\n\r"
# The constrained output's head, up to the opening quote of the function's name; and, after
# no_tool's name, up to the opening quote of its `content`.
HEAD_TOKENS = ("{", '"function"', ":", "{", '"_name"', ":", '"')
CONTENT_TOKENS = (",", '"content"', ":", '"')


def _tokens_pattern(tokens: tuple[str, ...]) -> str:
    """A regex of `tokens` with JSON whitespace before each (the streaming reader's rule)."""
    return "".join(r"[ \t\n\r]*" + re.escape(t) for t in tokens)


# The head through the end of the name's string (its body is group 1).
HEAD = re.compile(_tokens_pattern(HEAD_TOKENS) + r'((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A tool call (`arguments` is JSON text), or `no_tool`'s answer (`content`)."""

    name: str
    arguments: str = "{}"
    content: str | None = None

    @property
    def is_call(self) -> bool:
        return self.name != NO_TOOL


def new_call_id() -> str:
    """OpenAI's `call_` form, unique per call."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """What a chat reports of a tool-constrained output: the output as far as it was written
    (None: not even the function's name) and OpenAI's finish reason."""

    output: ToolOutput | None
    finish_reason: str


# Why an output that is not a whole call ended, for the error that says so.
_CUT_BY = {
    "eos_token": "the model ended its output where its grammar did not allow it",
    "stop_sequence": "a stop sequence ended the output",
}


def tool_answer(text: str, finish_reason: str, offered: frozenset[str]) -> ToolAnswer:
    """A whole output is a call ("tool_calls") or no_tool's answer ("stop"), however the
    generation ended; one cut by the token limit is "length" with what it wrote (OpenAI's
    way); one that ended otherwise before it was whole is a ToolError, never a call."""
    output = complete_output(text, offered)
    if output is not None:
        return ToolAnswer(output, "tool_calls" if output.is_call else "stop")
    if finish_reason == "length":
        return ToolAnswer(read_partial_output(text), "length")
    why = _CUT_BY.get(finish_reason, f"the output ended ({finish_reason})")
    raise ToolError(f"Failed to parse generated text: {why} before its tool call was complete")


def complete_output(text: str, offered: frozenset[str]) -> ToolOutput | None:
    """The output when it is an answer the grammar allows whole: it parses, holds nothing but
    `function`, and names an offered function (no_tool only where "auto" offered it)."""
    try:
        output = parse_tool_output(text)
    except ToolError:
        return None
    return output if output.name in offered else None


def parse_tool_output(text: str) -> ToolOutput:
    """The complete output, parsed as JSON; arguments re-serialized compactly."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ToolError(f"Failed to parse generated text: {err} {text!r}") from None
    function = data.get("function") if isinstance(data, dict) else None
    if not isinstance(function, dict) or len(data) != 1:
        raise ToolError(f"Failed to parse generated text: not a {{\"function\": {{...}}}} object "
                        f"{text!r}")
    name = function.pop("_name", None)
    if not isinstance(name, str):
        raise ToolError(f"Failed to parse generated text: `_name` is not a string {text!r}")
    if name == NO_TOOL:
        content = function.get("content")
        return ToolOutput(name, content=content if isinstance(content, str) else "")
    return ToolOutput(name, json.dumps(function, ensure_ascii=False))


def tool_call_json(call_id: str, output: ToolOutput) -> dict[str, Any]:
    """One entry of `message.tool_calls` (TGI adds `description: null`)."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"description": None, "name": output.name, "arguments": output.arguments},
    }


def read_partial_output(text: str) -> ToolOutput | None:
    """What an output cut short (e.g. by `max_tokens`) says so far: its function name and the
    arguments' text as written (not valid JSON when cut), or no_tool's content so far; None
    when not even the name was written."""
    m = HEAD.match(text)
    if m is None:
        return None
    name = decode_json_string(m.group(1))
    rest = text[m.end():]
    if name == NO_TOOL:
        c = CONTENT.match(rest)
        return ToolOutput(name, content=json_string_prefix(rest[c.end():])[0] if c else "")
    return ToolOutput(name, arguments_text(rest, final=True))


# ---- the pieces the stream reads as the text grows ---------------------------------------------

# After no_tool's name: the start of its `content` string.
CONTENT = re.compile(_tokens_pattern(CONTENT_TOKENS))

# What the arguments' text may end with that a later token may still show to be the wrapper's
# end (spaces, closing braces) or half a character (the detokenizer's replacement character).
ARGUMENTS_TAIL = " \t\r\n}\ufffd"
# Where a string's body stops being plain text: its closing quote or an escape.
_QUOTE_OR_ESCAPE = re.compile(r'["\\]')


def decode_json_string(body: str) -> str:
    """The value of a JSON string's body (the text between its quotes); without an escape, the
    body itself (the stream decodes each token's share: no parser call for plain text)."""
    if "\\" not in body:
        return body
    try:
        value = json.loads(f'"{body}"')
    except ValueError:
        return body
    return value if isinstance(value, str) else body


def arguments_text(rest: str, final: bool) -> str:
    """The arguments' JSON text within `rest` (what follows the function name): `{` plus the
    rest without its leading comma; until the end, without the trailing braces and spaces (the
    last of which closes the wrapper), so that what it returns only ever grows."""
    body = rest.lstrip(WHITESPACE)
    if body.startswith(","):
        body = body[1:].lstrip(WHITESPACE)
    if not final:
        return "{" + body.rstrip(ARGUMENTS_TAIL)
    return "{" + without_closing_brace(body)


def without_closing_brace(body: str) -> str:
    """The arguments' text at the end, less the brace that closes TGI's wrapper."""
    body = body.rstrip(WHITESPACE)
    return body[:-1].rstrip(WHITESPACE) if body.endswith("}") else body


def json_string_prefix(raw: str) -> tuple[str, int, bool]:
    """Decodes the longest complete prefix of a JSON string's body (never half an escape or half
    a surrogate pair): (text, characters of `raw` consumed, whether the closing quote came).
    Runs without quotes or escapes are skipped at once: the stream calls this per token."""
    i = 0
    while (special := _QUOTE_OR_ESCAPE.search(raw, i)) is not None:
        i = special.start()
        if raw[i] == '"':
            return decode_json_string(raw[:i]), i, True
        end = _escape_end(raw, i)
        if end is None:
            return decode_json_string(raw[:i]), i, False
        i = end
    return decode_json_string(raw), len(raw), False


def _escape_end(raw: str, i: int) -> int | None:
    """Where the escape at `raw[i]` (a backslash) ends; None when `raw` ends inside it (a
    `\\uD83D` also needs the low half of its surrogate pair)."""
    n = len(raw)
    if i + 1 >= n:
        return None
    if raw[i + 1] != "u":
        return i + 2
    if i + 6 > n:
        return None
    if not _high_surrogate(raw[i + 2:i + 6]):
        return i + 6
    return i + 12 if i + 12 <= n else None


def _high_surrogate(hex4: str) -> bool:
    try:
        return 0xD800 <= int(hex4, 16) <= 0xDBFF
    except ValueError:
        return False
