"""What a tool-constrained generation said: `{"function": {"_name": name, <arguments>}}` read
back as an OpenAI tool call (name, arguments as a JSON string, a fresh id), or, for TGI's
`no_tool`, as the plain answer in its `content`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.tools import NO_TOOL

# The constrained output's head, up to the end of the function name's string.
HEAD = re.compile(r'\s*\{\s*"function"\s*:\s*\{\s*"_name"\s*:\s*"((?:[^"\\]|\\.)*)"')


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


def parse_tool_output(text: str) -> ToolOutput:
    """The complete output, parsed as JSON; arguments re-serialized compactly."""
    try:
        data = json.loads(text)
        function = data["function"]
        name = function.pop("_name")
    except (ValueError, KeyError, TypeError) as err:
        raise ToolError(f"Failed to parse generated text: {err} {text!r}") from None
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
CONTENT = re.compile(r'\s*,\s*"content"\s*:\s*"')

_TAIL = " \t\r\n}\ufffd"


def decode_json_string(body: str) -> str:
    """The value of a JSON string's body (the text between its quotes)."""
    try:
        value = json.loads(f'"{body}"')
    except ValueError:
        return body
    return value if isinstance(value, str) else body


def arguments_text(rest: str, final: bool) -> str:
    """The arguments' JSON text within `rest` (what follows the function name): `{` plus the
    rest without its leading comma; until the end, without the trailing braces and spaces (the
    last of which closes the wrapper), so that what it returns only ever grows."""
    body = rest.lstrip()
    if body.startswith(","):
        body = body[1:].lstrip()
    if not final:
        return "{" + body.rstrip(_TAIL)
    body = body.rstrip()
    if body.endswith("}"):
        body = body[:-1].rstrip()
    return "{" + body


def json_string_prefix(raw: str) -> tuple[str, int, bool]:
    """Decodes the longest complete prefix of a JSON string's body (never half an escape or half
    a surrogate pair): (text, characters of `raw` consumed, whether the closing quote came)."""
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c == '"':
            return decode_json_string(raw[:i]), i, True
        if c != "\\":
            i += 1
            continue
        if i + 1 >= n:
            break
        if raw[i + 1] != "u":
            i += 2
            continue
        if i + 6 > n:
            break
        if _high_surrogate(raw[i + 2:i + 6]):  # it needs its pair
            if i + 12 > n:
                break
            i += 12
        else:
            i += 6
    return decode_json_string(raw[:i]), i, False


def _high_surrogate(hex4: str) -> bool:
    try:
        return 0xD800 <= int(hex4, 16) <= 0xDBFF
    except ValueError:
        return False
