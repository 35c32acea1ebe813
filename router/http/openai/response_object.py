"""The `response` object of OpenAI's Responses API, as the `openai` SDK parses it: the request's
echoed fields, the status a generation ended with, the output items and the usage."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pytgi_router.core.errors import InferError
from pytgi_router.http.openai.chat_output import ChatOutputStream
from pytgi_router.http.openai.response_output import new_id, whole_output
from pytgi_router.http.schemas import Sequence


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a response ended: its status and, when incomplete, why."""

    status: str
    incomplete_reason: str | None = None


COMPLETED = Outcome("completed")
# The only limit a generation of this server is cut by is its token budget.
CUT = Outcome("incomplete", "max_output_tokens")


def outcome(finish_reason: str) -> Outcome:
    """A TGI finish reason (or chat's, for tool outputs) as the response's status."""
    return CUT if finish_reason == "length" else COMPLETED


def response_usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0
                   ) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def error_object(err: InferError) -> dict[str, Any]:
    """A failed response's `error` (OpenAI's codes are a closed set: "server_error" for
    every failure of the generation; the message says which)."""
    return {"code": "server_error", "message": err.message}


@dataclass(slots=True)
class ResponseHead:
    """What every snapshot of one response repeats: its id, creation time and the request's
    echoed fields."""

    echo: dict[str, Any]
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def snapshot(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
        *, incomplete_reason: str | None = None, error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The response object at `status` ("in_progress" while streaming)."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            **self.echo,
            "output": output,
            "usage": usage,
        }

    def final(self, end: Outcome, output: list[dict[str, Any]], usage: dict[str, Any]
              ) -> dict[str, Any]:
        return self.snapshot(end.status, output, usage, incomplete_reason=end.incomplete_reason)

    def failed(self, err: InferError, output: list[dict[str, Any]]) -> dict[str, Any]:
        return self.snapshot("failed", output, error=error_object(err))


def final_response(head: ResponseHead, output: ChatOutputStream, seq: Sequence) -> dict[str, Any]:
    """The response of a finished, non-streamed generation (ToolError for a tool call that
    ended before it was whole)."""
    items, turn = whole_output(output, seq.tokens, seq.generated_text, seq.end.finish_reason)
    usage = response_usage(seq.input_length, seq.end.generated_tokens, turn.reasoning_tokens)
    return head.final(outcome(turn.finish_reason), items, usage)
