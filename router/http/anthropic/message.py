"""The `message` object of a finished generation, as Anthropic's API answers one: its content
blocks (`thinking`, then `text` or a `tool_use` with its `input`), `stop_reason`,
`stop_sequence` and `usage`.

The output is read by the shared chat output path (openai/chat_output.py, as chat completions
read it): a whole call is a `tool_use` block ("tool_use"), TGI's `no_tool` answer a text block;
a call cut by `max_tokens` has no block (its arguments are not yet an object); an answer with
no block at all has an empty text block, as a stream that wrote nothing ends with.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pytgi_router.http.anthropic.stop_text import cut_at_stop
from pytgi_router.http.openai.chat_output import ChatAnswer, ChatEnd
from pytgi_router.http.openai.tool_output import ToolOutput

# TGI's finish reasons, as Anthropic names them.
STOP_REASONS = {"eos_token": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


def message_id() -> str:
    """Anthropic's `msg_` form, unique per answer."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id() -> str:
    """Anthropic's `toolu_` form, unique per call."""
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str) -> str:
    return STOP_REASONS.get(finish_reason, "end_turn")


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def thinking_block(thinking: str) -> dict[str, Any]:
    """No signature to give: an empty one (the SDK's ThinkingBlock requires the field)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


@dataclass(slots=True)
class Outcome:
    """What a finished answer says: its blocks and why it stopped."""

    content: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = "end_turn"
    stop_sequence: str | None = None


def anthropic_stop_reason(end: ChatEnd, finish_reason: str) -> str:
    """"tool_use" for a whole call, else TGI's finish reason in Anthropic's words."""
    return "tool_use" if end.finish_reason == "tool_calls" else stop_reason(finish_reason)


def ended_by(finish_reason: str, generated_text: str, stops: list[str]) -> str | None:
    """The stop sequence that ended the output, if one did."""
    if finish_reason != "stop_sequence":
        return None
    return cut_at_stop(generated_text, stops)[1]


def outcome(
    answer: ChatAnswer, finish_reason: str, generated_text: str, stops: list[str]
) -> Outcome:
    """A whole answer read by the shared chat output path: its thinking, its text (without
    the stop sequence that ended it) or its tool call."""
    blocks: list[dict[str, Any]] = []
    if answer.reasoning is not None:
        blocks.append(thinking_block(answer.reasoning))
    if answer.content is not None:
        text = answer.content
        if finish_reason == "stop_sequence":
            text = cut_at_stop(text, stops)[0]
        blocks.append(text_block(text))
    blocks += _call_blocks(answer.end.tool_call)
    reason = anthropic_stop_reason(answer.end, finish_reason)
    sequence = ended_by(finish_reason, generated_text, stops)
    return Outcome(blocks or [text_block("")], reason, sequence)


def _call_blocks(call: ToolOutput | None) -> list[dict[str, Any]]:
    if call is None:
        return []
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return []  # cut by max_tokens inside its arguments
    return [tool_use_block(tool_use_id(), call.name, arguments)]


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message(
    msg_id: str, model: str, outcome: Outcome, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """The whole `message` object (its content empty, stop_reason null while it streams)."""
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": outcome.content,
        "stop_reason": outcome.stop_reason,
        "stop_sequence": outcome.stop_sequence,
        "usage": usage(input_tokens, output_tokens),
    }
