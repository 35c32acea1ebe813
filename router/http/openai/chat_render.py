"""Chat completions' rendering of the shared chat output (chat_output.py): the assistant message
of a whole turn, and the stream's encoders.

With a reasoning parser, the message carries the thinking twice, as `reasoning_content` (vLLM's
and SGLang's name, which most clients read) and `reasoning` (vLLM's newer name), null when the
turn did not think; `content` holds only the answer (null when the turn never reached one, e.g.
`max_tokens` cut the thinking); usage says `completion_tokens_details.reasoning_tokens`.
Streamed, each kind of delta is a chunk of its own; with `logprobs`, each token's entry rides
on the next chunk sent (a token that made no delta yet, such as half a tag, waits for one), so
every token's logprob is sent once. Without a parser and without tools the stream takes
`ChatEncoder`, the per-token fast path that splices each token's text into a pre-rendered
chunk.
"""

from __future__ import annotations

from typing import Any

from pytgi_router.core.errors import InferError
from pytgi_router.core.request_stream import End, Token, TokenInfo
from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.openai.chat_output import ChatAnswer, ChatOutputStream
from pytgi_router.http.openai.schemas import logprob_entry
from pytgi_router.http.openai.stream import ChatChunks, error_chunk
from pytgi_router.http.openai.tool_output import new_call_id, tool_call_json
from pytgi_router.http.openai.tool_stream import Delta
from pytgi_router.http.sse import DONE


def assistant_message(answer: ChatAnswer, reasoning: bool) -> dict[str, Any]:
    """The `message` of a whole turn: its tool call (content null, as OpenAI writes it), else
    its answer; the thinking when a parser serves (`reasoning`). Without a parser an empty
    answer is "" (TGI's), with one null: the turn may have only thought."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if not reasoning and answer.content is None:
        message["content"] = ""
    call = answer.end.tool_call
    if call is not None:
        message = {"role": "assistant", "content": None,
                   "tool_calls": [tool_call_json(new_call_id(), call)]}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = answer.reasoning
    return message


# The delta fields each kind of text goes to (the thinking under both of its names).
_TEXT_FIELDS = {"content": ("content",), "reasoning": ("reasoning_content", "reasoning")}


class ChatEncoder:
    """A plain chat stream (no reasoning parser, no tools): one pre-rendered chunk per token."""

    __slots__ = ("chunks", "include_usage", "input_length")

    def __init__(self, chunks: ChatChunks, include_usage: bool, input_length: int) -> None:
        self.chunks = chunks
        self.include_usage = include_usage
        self.input_length = input_length

    def token(self, index: int, ev: Token) -> bytes:
        return self.chunks.token(ev.token, ev.top_tokens)

    def end(self, index: int, ev: End) -> bytes:
        out = self.chunks.token(ev.token, ev.top_tokens, ev.finish_reason)
        if self.include_usage:
            out += self.chunks.usage(self.input_length, ev.generated_tokens)
        return out + DONE

    def error(self, err: InferError) -> bytes:
        return error_chunk(err) + DONE


class OutputChatEncoder:
    """A chat stream through the shared output path, as OpenAI (and vLLM) stream one: the role
    once, in the first delta; the thinking as `reasoning_content`/`reasoning` deltas; the
    answer as `content`; a tool call with its id, type and name once, then its arguments'
    fragments (accumulators such as the OpenAI SDK's stream helper join every string field
    they see again). The last chunk says "tool_calls" only when the whole answer is a call to
    an offered function, "length" when `max_tokens` cut it; a tool answer cut any other way
    ends the stream with an error event instead."""

    __slots__ = ("chunks", "include_usage", "input_length", "output", "reasoning", "call_id",
                 "logprobs", "_pending")

    def __init__(self, chunks: ChatChunks, include_usage: bool, input_length: int,
                 output: ChatOutputStream, reasoning: bool, logprobs: bool = False) -> None:
        self.chunks = chunks
        self.include_usage = include_usage
        self.input_length = input_length
        self.output = output
        self.reasoning = reasoning  # a parser serves: usage counts reasoning tokens
        self.call_id = new_call_id()
        self.logprobs = logprobs
        self._pending: list[dict[str, Any]] = []  # logprob entries no chunk carried yet

    def token(self, index: int, ev: Token) -> bytes:
        self._note(ev.token, ev.top_tokens)
        return self._render(self.output.token(ev.token))

    def end(self, index: int, ev: End) -> bytes:
        self._note(ev.token, ev.top_tokens)
        out = self._render(self.output.finish(ev.token, ev.generated_text))
        try:
            end = self.output.end(ev.finish_reason)
        except ToolError as err:
            return out + self.error(err)
        out += self.chunks.delta({}, end.finish_reason, self._carried())
        if self.include_usage:
            tokens = end.reasoning_tokens if self.reasoning else None
            out += self.chunks.usage(self.input_length, ev.generated_tokens, tokens)
        return out + DONE

    def error(self, err: InferError) -> bytes:
        return error_chunk(err) + DONE

    def _render(self, deltas: list[Delta]) -> bytes:
        return b"".join(self._chunk(d) for d in deltas)

    def _chunk(self, d: Delta) -> bytes:
        """Text (the thinking, the answer) spliced into a pre-rendered chunk; a tool call's
        pieces as a dict."""
        fields = _TEXT_FIELDS.get(d.kind)
        if fields is not None:
            return self.chunks.text(fields, d.text, self._carried())
        return self.chunks.delta(self._call_delta(d), None, self._carried())

    def _note(self, token: TokenInfo, top: list[TokenInfo]) -> None:
        """The token's logprob entry, for the next chunk to carry."""
        if self.logprobs:
            self._pending.append(logprob_entry(token, top))

    def _carried(self) -> list[dict[str, Any]] | None:
        """The entries the next chunk carries (None: logprobs were not asked)."""
        if not self.logprobs:
            return None
        carried, self._pending = self._pending, []
        return carried

    def _call_delta(self, d: Delta) -> dict[str, object]:
        if d.kind == "call":
            call = {"index": 0, "id": self.call_id, "type": "function",
                    "function": {"name": d.text, "arguments": ""}}
            return {"content": None, "tool_calls": [call]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]}
