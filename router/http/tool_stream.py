"""A tool-constrained chat streamed as OpenAI streams tool calls: the text is read as it grows;
once the function's name is written, a first delta names it (with the call's id and empty
arguments), then each token's share of the arguments' JSON follows as a fragment. For TGI's
`no_tool`, the decoded `content` streams as ordinary content instead.

The fragments, joined, are the arguments' JSON text: `{` and what the model wrote after the
name, less the brace that closes TGI's `{"function": ...}` wrapper (held back until the end).
"""

from __future__ import annotations

from dataclasses import dataclass

from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.tool_output import (
    CONTENT,
    HEAD,
    arguments_text,
    decode_json_string,
    json_string_prefix,
    parse_tool_output,
)
from pytgi_router.http.tools import NO_TOOL


@dataclass(frozen=True, slots=True)
class Delta:
    """"call" (text: the function's name), "arguments" (a fragment) or "content"."""

    kind: str
    text: str


class ToolCallStream:
    __slots__ = ("text", "name", "_rest_at", "_sent", "_content_at", "_content_done")

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._rest_at = 0  # where the text after the name starts
        self._sent = 0  # characters of the arguments' text already sent
        self._content_at: int | None = None  # where no_tool's content not yet decoded starts
        self._content_done = False

    @property
    def is_call(self) -> bool:
        return self.name is not None and self.name != NO_TOOL

    def push(self, piece: str) -> list[Delta]:
        self.text += piece
        return self._advance(final=False)

    def finish(self, last_piece: str, generated_text: str) -> list[Delta]:
        """The last token and the whole output (which replaces the streamed text when it
        extends it)."""
        self.text += last_piece
        if generated_text.startswith(self.text):
            self.text = generated_text
        out = self._advance(final=True)
        if self.name is None:
            out = self._whole()
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

    def _advance(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        if self.name is None:
            m = HEAD.match(self.text)
            if m is None:
                return out
            self.name = decode_json_string(m.group(1))
            self._rest_at = m.end()
            if self.name != NO_TOOL:
                out.append(Delta("call", self.name))
        if self.name != NO_TOOL:
            args = arguments_text(self.text[self._rest_at:], final)
            if len(args) > self._sent:
                out.append(Delta("arguments", args[self._sent:]))
                self._sent = len(args)
            return out
        content = self._content()
        if content:
            out.append(Delta("content", content))
        return out

    def _content(self) -> str:
        if self._content_done:
            return ""
        if self._content_at is None:
            c = CONTENT.match(self.text, self._rest_at)
            if c is None:
                return ""
            self._content_at = c.end()
        text, used, self._content_done = json_string_prefix(self.text[self._content_at:])
        self._content_at += used
        return text
