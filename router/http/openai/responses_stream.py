"""A streamed `POST /v1/responses`: the Responses API's event sequence over SSE, each event with
its `sequence_number` (from 0) and an `event:` line naming its type, as OpenAI sends them.

`response.created` and `response.in_progress` first; then each output item's events as the
tokens write it (`response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`… or `response.function_call_arguments.delta`…, then their `.done`
events); last `response.completed`, `response.incomplete` (the token budget cut it) or
`response.failed`. No `[DONE]`: the terminal event ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring as _quote  # type: ignore[attr-defined]
from typing import Any

from pytgi_router.core.errors import InferError
from pytgi_router.core.request_stream import End, Token
from pytgi_router.http.openai.chat_output import ChatOutputStream
from pytgi_router.http.openai.response_object import ResponseHead, outcome, response_usage
from pytgi_router.http.openai.response_output import Event, OpenItem, OutputBuilder, item_status
from pytgi_router.http.openai.tool_stream import Delta

Finished = Callable[[dict[str, Any]], None]


def sse_event(event: Event) -> bytes:
    """One event in SSE framing: `event: <type>` and its JSON."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def delta_head(item: OpenItem) -> tuple[str, str]:
    """The text around a delta event's `delta` and `sequence_number` for `item`: the same bytes
    `sse_event` writes for the builder's delta event (the per-token path splices the text in
    instead of building and serializing a dict)."""
    kind = {"content": "output_text", "reasoning": "reasoning_text",
            "call": "function_call_arguments"}[item.kind]
    name = f"response.{kind}.delta"
    head = (f'event: {name}\ndata: {{"type":"{name}","item_id":{_quote(item.id)},'
            f'"output_index":{item.index},')
    if item.kind != "call":
        head += '"content_index":0,'
    tail = ',"logprobs":[]' if item.kind == "content" else ""
    return head + '"delta":', tail + ',"sequence_number":'


class ResponsesEncoder:
    """The events of one response (an `Encoder` of streaming.py, plus `start` and `abandon`).
    `finished` gets the final response object (completed, incomplete, failed, or cancelled when
    the client left first), to be stored."""

    __slots__ = ("head", "output", "input_length", "finished", "builder", "done", "_seq",
                 "_delta")

    def __init__(
        self, head: ResponseHead, output: ChatOutputStream, input_length: int, finished: Finished
    ) -> None:
        self.head = head
        self.output = output
        self.input_length = input_length
        self.finished = finished
        self.builder = OutputBuilder()
        self.done = False  # `finished` was called
        self._seq = 0
        self._delta: tuple[str, str, str] = ("", "", "")  # item id, then delta_head's

    def start(self) -> bytes:
        response = self.head.snapshot("in_progress", [])
        return self._render([{"type": "response.created", "response": response},
                             {"type": "response.in_progress", "response": response}])

    def token(self, index: int, ev: Token) -> bytes:
        return self._deltas(self.output.token(ev.token))

    def end(self, index: int, ev: End) -> bytes:
        out = self._deltas(self.output.finish(ev.token, ev.generated_text))
        try:
            turn = self.output.end(ev.finish_reason)
        except InferError as err:  # a tool call that ended before it was whole
            return out + self.error(err)
        end = outcome(turn.finish_reason)
        events = self.builder.finish(item_status(turn.finish_reason))
        usage = response_usage(self.input_length, ev.generated_tokens, turn.reasoning_tokens)
        response = self.head.final(end, self.builder.items, usage)
        self._finished(response)
        kind = "response.completed" if end.status == "completed" else "response.incomplete"
        events.append({"type": kind, "response": response})
        return out + self._render(events)

    def error(self, err: InferError) -> bytes:
        """A failure after the stream started: the open item ends incomplete, and
        `response.failed` carries the error."""
        events = self.builder.close("incomplete")
        response = self.head.failed(err, self.builder.items)
        self._finished(response)
        events.append({"type": "response.failed", "response": response})
        return self._render(events)

    def abandon(self) -> None:
        """The stream ended before the response did (the client left): it is `cancelled`,
        with what it had written."""
        if not self.done:
            self.builder.close("incomplete")
            self._finished(self.head.snapshot("cancelled", self.builder.items))

    def _finished(self, response: dict[str, Any]) -> None:
        self.done = True
        self.finished(response)

    def _deltas(self, deltas: list[Delta]) -> bytes:
        if len(deltas) == 1 and (item := self.builder.extend(deltas[0])) is not None:
            return self._spliced(item, deltas[0].text)
        events: list[Event] = []
        for delta in deltas:
            events += self.builder.feed(delta)
        return self._render(events)

    def _spliced(self, item: OpenItem, text: str) -> bytes:
        """The delta event of `text`, added to the open `item`, from its pre-rendered head."""
        if self._delta[0] != item.id:
            self._delta = (item.id, *delta_head(item))
        _, head, tail = self._delta
        seq, self._seq = self._seq, self._seq + 1
        return f"{head}{_quote(text)}{tail}{seq}}}\n\n".encode()

    def _render(self, events: list[Event]) -> bytes:
        out = []
        for event in events:
            event["sequence_number"] = self._seq
            self._seq += 1
            out.append(sse_event(event))
        return b"".join(out)
