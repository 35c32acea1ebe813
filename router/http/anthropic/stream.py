"""The streaming Encoder (http/streaming.py) of /v1/messages: each token read by the shared chat
output path (openai/chat_output.py: the thinking split off by the reasoning parser, the answer
as text or a tool call, as chat completions read it), rendered as Anthropic's events by
MessageEvents. The answer's text is sent less any stop sequence (stop_text.StopText).
"""

from __future__ import annotations

from pytgi_router.core.errors import InferError
from pytgi_router.core.request_stream import End, Token
from pytgi_router.http.anthropic.events import MessageEvents, error_event
from pytgi_router.http.anthropic.message import anthropic_stop_reason, ended_by, tool_use_id
from pytgi_router.http.anthropic.stop_text import StopText
from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.openai.chat_output import ChatOutputStream
from pytgi_router.http.openai.tool_stream import Delta


class MessageEncoder:
    """http/streaming.py's Encoder for one streamed message (its `message_start` is sent by the
    route before the first token)."""

    __slots__ = ("events", "output", "text", "call_id")

    def __init__(self, events: MessageEvents, output: ChatOutputStream, stops: list[str]) -> None:
        self.events = events
        self.output = output
        self.text = StopText(stops)
        self.call_id = tool_use_id()

    def token(self, index: int, ev: Token) -> bytes:
        return self._render(self.output.token(ev.token))

    def end(self, index: int, ev: End) -> bytes:
        deltas = self.output.finish(ev.token, ev.generated_text)
        try:
            turn = self.output.end(ev.finish_reason)
        except ToolError as err:
            return self._render(deltas) + self.error(err)
        out = self._render(deltas)
        rest = self.text.flush(ev.finish_reason == "stop_sequence")
        out += self.events.render([Delta("content", rest)], self.call_id)
        reason = anthropic_stop_reason(turn, ev.finish_reason)
        sequence = ended_by(ev.finish_reason, ev.generated_text, self.text.stops)
        return out + self.events.finish(reason, sequence, ev.generated_tokens)

    def error(self, err: InferError) -> bytes:
        return error_event(err)

    def _render(self, deltas: list[Delta]) -> bytes:
        """The answer's text less what may begin a stop sequence (held until later)."""
        if not self.text.stops:
            return self.events.render(deltas, self.call_id)
        kept = [Delta(d.kind, self.text.push(d.text)) if d.kind == "content" else d
                for d in deltas]
        return self.events.render(kept, self.call_id)
