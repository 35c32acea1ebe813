"""The shared chat output path: one assistant turn's generated tokens read as typed deltas —
"reasoning" (the thinking, split off by the `--reasoning-parser`), then the answer as "content"
or, when tools were offered, as a tool call ("call": the function's name, then "arguments"
fragments) — and, at the end, how the turn ended (`ChatEnd`: finish reason, reasoning tokens,
the tool call).

Chat completions (`routes_chat.py`), the Responses API (`openai/responses*.py`) and Anthropic's
Messages API (`http/anthropic/`) are three renderings of these same deltas (issue 33's "one
path"): a route feeds `ChatOutputStream.push` each streamed token and `finish` the End event, or
calls `chat_answer` with a whole non-streamed sequence (which runs the very same stream, so the
two can never disagree), and renders what comes out in its own API's shape.

Order of reading: the reasoning splitter first (pytgi_router.http.reasoning), then what it calls
answer goes through the tool-call reader (`tool_stream.ToolCallStream`) when tools were offered,
else straight out as content. Without a reasoning parser every token is answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytgi_router.core.request_stream import TokenInfo
from pytgi_router.http.openai.schemas import FINISH_REASONS
from pytgi_router.http.openai.tool_output import ToolOutput, tool_answer
from pytgi_router.http.openai.tool_stream import Delta, ToolCallStream
from pytgi_router.http.reasoning import Piece, ReasoningParser, Splitter


@dataclass(frozen=True, slots=True)
class ChatEnd:
    """How a turn ended: OpenAI's finish reason ("stop", "length", "tool_calls"), the tokens
    spent thinking, and the tool call (whole, or as far as a "length" cut let it be written;
    None when there is none). A tool-constrained answer that ended otherwise before its call
    was whole raises ToolError from `ChatOutputStream.end` instead."""

    finish_reason: str
    reasoning_tokens: int
    tool_call: ToolOutput | None


@dataclass(frozen=True, slots=True)
class ChatAnswer:
    """A whole turn (non-streamed): the thinking and the answer text (None where there was
    none), and its end."""

    reasoning: str | None
    content: str | None
    end: ChatEnd


class ChatOutputStream:
    """One turn's output read token by token into deltas (see the module's docstring).

    `parser`: the reasoning parser (None: no thinking to split off); `prompt`: the rendered
    prompt (it says whether the template opened the thinking); `offered`: the functions the
    tool grammar let the model name (None: no tools, the answer is plain content)."""

    __slots__ = ("_splitter", "_parser", "_offered", "_tools", "_raw", "reasoning_tokens")

    def __init__(
        self, parser: ReasoningParser | None, prompt: str, offered: frozenset[str] | None
    ) -> None:
        self._splitter: Splitter | None = parser.splitter(prompt) if parser else None
        # Which special tokens' text is read (gpt-oss's channel markers are special tokens).
        self._parser = parser
        self._offered = offered
        self._tools = ToolCallStream() if offered is not None else None
        self._raw: list[str] = []  # every piece read, joined only at the end
        self.reasoning_tokens = 0

    def push(self, text: str, special: bool = False) -> list[Delta]:
        """The deltas one streamed token's text makes certain."""
        if special and (self._parser is None or not self._parser.reads_special(text)):
            return []
        return self._read(text, token=True)

    def token(self, token: TokenInfo) -> list[Delta]:
        """`push` of a streamed token."""
        return self.push(token.text, token.special)

    def finish(self, last: TokenInfo, generated_text: str) -> list[Delta]:
        """The last token's deltas, what the whole text adds beyond the streamed one (the
        detokenizer may hold back a last partial character until the end), and whatever the
        readers held back."""
        out = self.token(last)
        streamed = "".join(self._raw)
        if len(generated_text) > len(streamed) and generated_text.startswith(streamed):
            out += self._read(generated_text[len(streamed):], token=False)
        if self._splitter is not None:
            out += self._route(self._splitter.finish())
        if self._tools is not None:
            out += self._tools.finish("", self._tools.text)
        return out

    def end(self, finish_reason: str) -> ChatEnd:
        """How the turn ended, from TGI's finish reason, once `finish` ran. Raises ToolError
        for a tool-constrained answer that ended before its call was whole (not by length)."""
        if self._tools is None or self._offered is None:
            reason = FINISH_REASONS.get(finish_reason, finish_reason)
            return ChatEnd(reason, self.reasoning_tokens, None)
        answer = tool_answer(self._tools.text, finish_reason, self._offered)
        call = answer.output if answer.output is not None and answer.output.is_call else None
        return ChatEnd(answer.finish_reason, self.reasoning_tokens, call)

    def _read(self, text: str, token: bool) -> list[Delta]:
        """Text through the splitter, then the answer's reader; a `token` that was thinking
        (before or after it) counts as a reasoning token (the End's text beyond the streamed
        one is no token of its own)."""
        if self._splitter is None:
            return self._answer(text)
        self._raw.append(text)
        before = self._splitter.thinking
        pieces = self._splitter.push(text)
        if token and (before or self._splitter.thinking):
            self.reasoning_tokens += 1
        return self._route(pieces)

    def _route(self, pieces: list[Piece]) -> list[Delta]:
        """Reasoning out as it is; the answer's pieces through the answer's reader."""
        out: list[Delta] = []
        for piece in pieces:
            if piece.kind == "reasoning":
                out.append(Delta("reasoning", piece.text))
            else:
                out += self._answer(piece.text)
        return out

    def _answer(self, text: str) -> list[Delta]:
        if self._splitter is None:
            self._raw.append(text)
        if self._tools is not None:
            return self._tools.push(text)
        return [Delta("content", text)] if text else []


def read_whole(
    stream: ChatOutputStream, tokens: list[TokenInfo], generated_text: str, finish_reason: str
) -> tuple[list[Delta], ChatEnd]:
    """A finished generation's tokens (the End's last among them) through `stream`, as a
    streamed one is read: every delta, then the turn's end (ToolError as
    `ChatOutputStream.end` raises it)."""
    deltas: list[Delta] = []
    for token in tokens[:-1]:
        deltas += stream.token(token)
    last = tokens[-1] if tokens else TokenInfo(0, "", 0.0, True)
    deltas += stream.finish(last, generated_text)
    return deltas, stream.end(finish_reason)


def chat_answer(
    parser: ReasoningParser | None, prompt: str, offered: frozenset[str] | None,
    tokens: list[TokenInfo], generated_text: str, finish_reason: str,
) -> ChatAnswer:
    """A whole non-streamed turn read through the same stream as a streamed one: its tokens
    (the End's last among them) and the End's text and finish reason. Raises ToolError as
    `ChatOutputStream.end` does."""
    stream = ChatOutputStream(parser, prompt, offered)
    deltas, end = read_whole(stream, tokens, generated_text, finish_reason)
    reasoning = [d.text for d in deltas if d.kind == "reasoning"]
    content = [d.text for d in deltas if d.kind == "content"]
    return ChatAnswer(
        "".join(reasoning) if reasoning else None,
        "".join(content) if content else None,
        end,
    )
