"""A tool-constrained chat streamed as OpenAI streams tool calls: the text is read as it grows;
once the function's name is written, a first delta names it (with the call's id and empty
arguments), then each token's share of the arguments' JSON follows as a fragment. For TGI's
`no_tool`, the decoded `content` streams as ordinary content instead.

The fragments, joined, are the arguments' JSON text: `{` and what the model wrote after the
name, less the brace that closes TGI's `{"function": ...}` wrapper (held back until the end).

Each token is read once, from where the previous one ended (the event loop runs this per
token: a stream of n tokens costs O(n), never the whole text again per token). The pieces are
joined only at the end, when an output whose name did not come first is parsed whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.openai.tool_output import (
    ARGUMENTS_TAIL,
    CONTENT_TOKENS,
    HEAD_TOKENS,
    WHITESPACE,
    json_string_prefix,
    parse_tool_output,
    without_closing_brace,
)
from pytgi_router.http.openai.tools import NO_TOOL


@dataclass(frozen=True, slots=True)
class Delta:
    """"call" (text: the function's name), "arguments" (a fragment) or "content"."""

    kind: str
    text: str


class Literals:
    """Reads fixed tokens that JSON whitespace may precede (`{`, `"function"`, `:`...) a piece
    at a time, so that the head is found, or known absent, without reading any text twice."""

    __slots__ = ("_tokens", "_k", "_at", "failed")

    def __init__(self, tokens: tuple[str, ...]) -> None:
        self._tokens = tokens
        self._k = 0  # the token being read
        self._at = 0  # its characters read so far
        self.failed = False

    def feed(self, piece: str) -> int | None:
        """Where in `piece` the last token ends (just past it); None until then, or forever
        once the text is something else (`failed`)."""
        if self.failed:
            return None
        for i, c in enumerate(piece):
            token = self._tokens[self._k]
            if self._at == 0 and c in WHITESPACE:
                continue
            if c != token[self._at]:
                self.failed = True
                return None
            self._at += 1
            if self._at == len(token):
                self._k, self._at = self._k + 1, 0
                if self._k == len(self._tokens):
                    return i + 1
        return None


class JsonString:
    """A JSON string's body read a piece at a time: the decoded text as soon as no later piece
    can change it (an escape is decoded whole), and where the closing quote ends it."""

    __slots__ = ("_raw", "done")

    def __init__(self) -> None:
        self._raw = ""  # an escape begun but not finished
        self.done = False

    def feed(self, piece: str) -> tuple[str, int | None]:
        """(decoded text, where in `piece` the string ended (past its quote) or None)."""
        raw = self._raw + piece
        text, used, self.done = json_string_prefix(raw)
        if self.done:
            return text, used - len(self._raw) + 1
        self._raw = raw[used:]
        return text, None


class Arguments:
    """The arguments' JSON text as it grows: `{`, then what follows the name less its leading
    comma; what may yet turn out to be the wrapper's closing (trailing spaces and braces) is
    held back until a later piece or the end decides."""

    __slots__ = ("_lead", "_held")

    def __init__(self) -> None:
        self._lead = 0  # 0: before the comma, 1: after it, 2: in the arguments
        self._held: list[str] = []

    def feed(self, piece: str) -> str:
        """The fragment `piece` makes certain ("" for none)."""
        body = piece if self._lead == 2 else self._skip_lead(piece)
        if not body:
            return ""
        end = len(body.rstrip(ARGUMENTS_TAIL))
        if end == 0:
            self._held.append(body)
            return ""
        out = "".join(self._held) + body[:end]
        self._held = [body[end:]]
        return out

    def _skip_lead(self, piece: str) -> str:
        for i, c in enumerate(piece):
            if c in WHITESPACE:
                continue
            if c == "," and self._lead == 0:
                self._lead = 1
                continue
            self._lead = 2
            return piece[i:]
        return ""

    def finish(self) -> str:
        """The held text less the wrapper's closing brace (and the spaces around it)."""
        rest, self._held = "".join(self._held), []
        return without_closing_brace(rest)


class Content:
    """no_tool's `content`, decoded as it streams; what follows its closing quote is ignored."""

    __slots__ = ("_open", "_string")

    def __init__(self) -> None:
        self._open = Literals(CONTENT_TOKENS)
        self._string: JsonString | None = None

    def feed(self, piece: str) -> str:
        if self._string is None:
            at = self._open.feed(piece)
            if at is None:
                return ""
            self._string, piece = JsonString(), piece[at:]
        if self._string.done:
            return ""
        return self._string.feed(piece)[0]


class ToolCallStream:
    """One tool-constrained output read as deltas while it streams: its head, then the name,
    then the arguments' fragments (or no_tool's content)."""

    __slots__ = ("name", "_pieces", "_head", "_name", "_name_parts", "_arguments", "_content")

    def __init__(self) -> None:
        self.name: str | None = None
        self._pieces: list[str] = []  # the text so far, joined only at the end
        self._head = Literals(HEAD_TOKENS)
        self._name: JsonString | None = None  # once the head is read: the name's string
        self._name_parts: list[str] = []
        self._arguments = Arguments()
        self._content = Content()

    @property
    def is_call(self) -> bool:
        return self.name is not None and self.name != NO_TOOL

    @property
    def text(self) -> str:
        """Everything streamed so far (joined on each call: for the end, not per token)."""
        return "".join(self._pieces)

    def push(self, piece: str) -> list[Delta]:
        self._pieces.append(piece)
        return self._read(piece)

    def finish(self, last_piece: str, generated_text: str) -> list[Delta]:
        """The last token and the whole output (which replaces the streamed text when it
        extends it)."""
        out = self.push(last_piece)
        streamed = self.text
        if len(generated_text) > len(streamed) and generated_text.startswith(streamed):
            out += self.push(generated_text[len(streamed):])
        if self.name is None:
            return self._whole()
        if self.is_call:
            rest = self._arguments.finish()
            if rest:
                out.append(Delta("arguments", rest))
        return out

    def _whole(self) -> list[Delta]:
        """An output whose name did not come first (or at all): parsed whole at the end."""
        try:
            parsed = parse_tool_output(self.text)
        except ToolError:
            return []
        self.name = parsed.name
        if not parsed.is_call:
            return [Delta("content", parsed.content or "")]
        return [Delta("call", parsed.name), Delta("arguments", parsed.arguments)]

    def _read(self, piece: str) -> list[Delta]:
        if self.name is None:
            return self._read_head(piece)
        if self.is_call:
            fragment = self._arguments.feed(piece)
            return [Delta("arguments", fragment)] if fragment else []
        content = self._content.feed(piece)
        return [Delta("content", content)] if content else []

    def _read_head(self, piece: str) -> list[Delta]:
        """Until the name's closing quote: the head, then the name; what follows it is read
        as the arguments (or no_tool's content)."""
        if self._name is None:
            at = self._head.feed(piece)
            if at is None:
                return []
            self._name, piece = JsonString(), piece[at:]
        text, end = self._name.feed(piece)
        self._name_parts.append(text)
        if end is None:
            return []
        self.name = "".join(self._name_parts)
        rest = piece[end:]
        if self.name == NO_TOOL:
            content = self._content.feed(rest)
            return [Delta("content", content)] if content else []
        return [Delta("call", self.name), Delta("arguments", "{" + self._arguments.feed(rest))]
