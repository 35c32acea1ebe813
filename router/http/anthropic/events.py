"""A streamed answer as Anthropic streams one: `message_start`; for each content block
`content_block_start`, its deltas (`text_delta`, `input_json_delta`, `thinking_delta`) and
`content_block_stop`; then `message_delta` (stop_reason, stop_sequence, usage) and
`message_stop`. Each event is written with its `event:` line, as Anthropic writes them (its SDK
skips events without one); an error after the start is an `error` event.

`MessageEvents` renders the blocks from the answer's deltas (tool_stream.Delta: "content",
"call", "arguments"; "reasoning" for thinking): a block opens when a delta of another kind
comes, so that the indexes count up from 0 as the SDK's accumulator expects.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring as _quote  # type: ignore[attr-defined]
from typing import Any

from pytgi_router.core.errors import InferError
from pytgi_router.http.anthropic.errors import error_body
from pytgi_router.http.anthropic.message import Outcome, message, text_block, tool_use_block
from pytgi_router.http.openai.tool_stream import Delta

# A block's `type` per delta kind, and its delta's type and text field.
BLOCKS = {"content": "text", "call": "tool_use", "reasoning": "thinking"}
DELTAS = {"content": ("text_delta", "text"), "arguments": ("input_json_delta", "partial_json"),
          "reasoning": ("thinking_delta", "thinking")}


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One event: its `event:` line (the event's `type`), then its JSON."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


def error_event(err: InferError) -> bytes:
    """An error once the stream began (its 200 sent): the `error` event, which the SDK raises
    as the exception the status would have been."""
    return sse_event("error", error_body(err)[1])


class MessageEvents:
    """The events of one streamed message."""

    __slots__ = ("msg_id", "model", "input_tokens", "_index", "_open")

    def __init__(self, msg_id: str, model: str, input_tokens: int) -> None:
        self.msg_id = msg_id
        self.model = model
        self.input_tokens = input_tokens
        self._index = -1  # the latest block's index
        self._open: str | None = None  # the open block's type

    def start(self) -> bytes:
        """`message_start`: the message without content, stop_reason null."""
        head = message(self.msg_id, self.model, Outcome(), self.input_tokens, 0)
        head["stop_reason"] = None
        return sse_event("message_start", {"type": "message_start", "message": head})

    def render(self, deltas: list[Delta], call_id: str = "") -> bytes:
        """The events of `deltas`; `call_id` names a tool_use block a "call" delta opens."""
        return b"".join(self._delta(d, call_id) for d in deltas)

    def _delta(self, d: Delta, call_id: str) -> bytes:
        if d.kind == "call":
            return self._open_block(tool_use_block(call_id, d.text, {}))
        kind, field = DELTAS[d.kind]
        if not d.text:
            return b""
        out = b""
        block = BLOCKS.get(d.kind)
        if block is not None and self._open != block:
            out = self._open_block(self._empty(block))
        return out + self._delta_event(kind, field, d.text)

    def _delta_event(self, kind: str, field: str, text: str) -> bytes:
        """A `content_block_delta` (hot path: one per token) spliced as text, as json.dumps
        would write it (compact, no ASCII escaping), at a fraction of its cost."""
        return (
            'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
            f'{self._index},"delta":{{"type":"{kind}","{field}":{_quote(text)}}}}}\n\n'
        ).encode()

    @staticmethod
    def _empty(block: str) -> dict[str, Any]:
        if block == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        return text_block("")

    def _open_block(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        event = {"type": "content_block_start", "index": self._index, "content_block": block}
        return out + sse_event("content_block_start", event)

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        event = {"type": "content_block_stop", "index": self._index}
        return sse_event("content_block_stop", event)

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes:
        """The last block's stop (an empty text block when the answer had none, as the
        non-streamed message has), `message_delta` and `message_stop`."""
        out = b""
        if self._index < 0:
            out = self._open_block(text_block(""))
        out += self._close()
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = {"output_tokens": output_tokens}
        out += sse_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        return out + sse_event("message_stop", {"type": "message_stop"})
