"""A response's `output` items, built from the generation's deltas (reasoning, content, a
function call and its arguments: the shared chat output path, chat_output.py), with the stream
events that tell each step.

One builder serves both ways of answering: the stream sends its events as they come; the
non-streaming answer feeds the whole output through the same builder and keeps only the items.
So an output is never read two ways.
"""

from __future__ import annotations

import uuid
from typing import Any

from pytgi_router.core.request_stream import TokenInfo
from pytgi_router.http.openai.chat_output import ChatEnd, ChatOutputStream, read_whole
from pytgi_router.http.openai.tool_output import new_call_id
from pytgi_router.http.openai.tool_stream import Delta

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """OpenAI's ids are a prefix and random hex (`resp_`, `msg_`, `fc_`, `rs_`)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


class OpenItem:
    """The item being written: its kind, index in `output`, id, and its text so far (the
    message's or the reasoning's text, or the call's arguments)."""

    __slots__ = ("kind", "index", "id", "name", "call_id", "parts")

    def __init__(self, kind: str, index: int, name: str = "") -> None:
        self.kind = kind
        self.index = index
        self.id = new_id({"content": "msg", "call": "fc", "reasoning": "rs"}[kind])
        self.name = name
        self.call_id = new_call_id() if kind == "call" else ""
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def item(self, status: str) -> dict[str, Any]:
        """The item as `output` holds it, with its text so far."""
        if self.kind == "content":
            return {"id": self.id, "type": "message", "role": "assistant", "status": status,
                    "content": [text_part(self.text)] if status != "in_progress" else []}
        if self.kind == "reasoning":
            content = [reasoning_part(self.text)] if status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content,
                    "status": status}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id,
                "name": self.name, "arguments": self.text if status != "in_progress" else "",
                "status": status}


class OutputBuilder:
    """The output items of one response and the events of their progress (without
    `sequence_number`, which the stream numbers)."""

    __slots__ = ("items", "_open")

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: OpenItem | None = None

    def feed(self, delta: Delta) -> list[Event]:
        """The events of one delta: the item it opens (closing the one before, which the
        delta's kind ends) and its text."""
        kind = delta.kind
        if kind == "arguments":
            open_call = self._open is not None and self._open.kind == "call"
            return self._append(delta.text) if open_call and delta.text else []
        events: list[Event] = []
        if kind == "call" or self._open is None or self._open.kind != kind:
            events += self.close("completed")
            events += self._start(kind, delta.text if kind == "call" else "")
        if kind != "call" and delta.text:
            events += self._append(delta.text)
        return events

    def extend(self, delta: Delta) -> OpenItem | None:
        """The open item when `delta` only adds text to it (the per-token case: the stream
        spells that event itself), with the text recorded; None otherwise (`feed` it)."""
        item = self._open
        if item is None or not delta.text:
            return None
        same = delta.kind == item.kind or (delta.kind == "arguments" and item.kind == "call")
        if not same or delta.kind == "call":
            return None
        item.parts.append(delta.text)
        return item

    def close(self, status: str) -> list[Event]:
        """Ends the open item with `status` ("completed" or "incomplete")."""
        item, self._open = self._open, None
        if item is None:
            return []
        done = item.item(status)
        self.items.append(done)
        where = {"item_id": item.id, "output_index": item.index}
        events: list[Event] = []
        if item.kind == "call":
            events.append({"type": "response.function_call_arguments.done", **where,
                           "arguments": item.text})
        else:
            part = done["content"][0]
            kind = "output_text" if item.kind == "content" else "reasoning_text"
            text_done: Event = {"type": f"response.{kind}.done", **where, "content_index": 0,
                                "text": item.text}
            if item.kind == "content":
                text_done["logprobs"] = []
            events += [text_done, {"type": "response.content_part.done", **where,
                                   "content_index": 0, "part": part}]
        events.append({"type": "response.output_item.done", "output_index": item.index,
                       "item": done})
        return events

    def finish(self, status: str) -> list[Event]:
        """Closes the output: an output with no item at all is one empty message."""
        events = self.close(status)
        if not self.items:
            events += self._start("content", "") + self.close(status)
        return events

    def _start(self, kind: str, name: str) -> list[Event]:
        item = self._open = OpenItem(kind, len(self.items), name)
        events: list[Event] = [{"type": "response.output_item.added", "output_index": item.index,
                                "item": item.item("in_progress")}]
        if kind != "call":
            part = text_part("") if kind == "content" else reasoning_part("")
            events.append({"type": "response.content_part.added", "item_id": item.id,
                           "output_index": item.index, "content_index": 0, "part": part})
        return events

    def _append(self, text: str) -> list[Event]:
        item = self._open
        assert item is not None
        item.parts.append(text)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "call":
            return [{"type": "response.function_call_arguments.delta", **where, "delta": text}]
        kind = "output_text" if item.kind == "content" else "reasoning_text"
        event: Event = {"type": f"response.{kind}.delta", **where, "content_index": 0,
                        "delta": text}
        if item.kind == "content":
            event["logprobs"] = []
        return [event]


def conversation_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output as the chat messages a follow-up continues: its text as the assistant's
    content, its calls as the assistant's tool_calls (reasoning is not shown again)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


# ---- a whole generation ------------------------------------------------------------------------


def item_status(finish_reason: str) -> str:
    """The last item's status: an output the token budget cut is incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def whole_output(
    stream: ChatOutputStream, tokens: list[TokenInfo], generated_text: str, finish_reason: str
) -> tuple[list[dict[str, Any]], ChatEnd]:
    """The output items of a finished generation (its tokens, the End's last among them), read
    by the chat output stream and built by the builder a streamed response uses; and the
    turn's end (ToolError for a tool call that ended before it was whole)."""
    deltas, end = read_whole(stream, tokens, generated_text, finish_reason)
    builder = OutputBuilder()
    for delta in deltas:
        builder.feed(delta)
    builder.finish(item_status(end.finish_reason))
    return builder.items, end
