"""The three streaming APIs the load tool speaks: TGI, OpenAI chat and OpenAI completions.

Each API builds the request body for a workload item and reads one SSE `data:` payload into the
per-request `StreamState`. Greedy decoding everywhere, so runs are reproducible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pytgi_bench.workload import WorkloadItem


@dataclass(slots=True)
class StreamState:
    # Payloads that carried generated text (one token each on TGI; a chunk elsewhere).
    chunks: int = 0
    # Token counts the server reported (details / usage); None when it did not say.
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False


class Api:
    path: str

    def payload(self, item: WorkloadItem, model: str, ignore_eos: bool) -> dict[str, Any]:
        raise NotImplementedError

    def on_data(self, data: bytes, state: StreamState) -> bool:
        """Reads one `data:` payload; True when it carried generated tokens."""
        raise NotImplementedError


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


# Every intermediate /generate_stream event of TGI (serde) and pytgi ends like this, compactly.
_TGI_TOKEN_TAIL = b',"generated_text":null,"details":null}'


class TgiApi(Api):
    """`/generate_stream`: one event per token, `details` on the last one."""

    path = "/generate_stream"

    def payload(self, item: WorkloadItem, model: str, ignore_eos: bool) -> dict[str, Any]:
        parameters: dict[str, Any] = {
            "max_new_tokens": item.max_new_tokens,
            "details": True,
            "do_sample": False,
            "stop": [],
        }
        if ignore_eos:
            parameters["ignore_eos"] = True
        return {"inputs": item.prompt, "parameters": parameters}

    def on_data(self, data: bytes, state: StreamState) -> bool:
        # Hot path: an intermediate token event needs no parsing to be counted.
        if data.endswith(_TGI_TOKEN_TAIL) and data.startswith(b'{"index":'):
            state.chunks += 1
            return True
        event = json.loads(data)
        if "error" in event:
            state.error = _error_text(event["error"])
            state.done = True
            return False
        details = event.get("details")
        if details is not None:
            state.output_tokens = details.get("generated_tokens")
            state.prompt_tokens = details.get("input_length", state.prompt_tokens)
            state.finish_reason = details.get("finish_reason")
            state.done = True
        elif event.get("generated_text") is not None:
            state.done = True
        if event.get("token") is not None:
            state.chunks += 1
            return True
        return False


class _OpenAIApi(Api):
    def on_data(self, data: bytes, state: StreamState) -> bool:
        if data == b"[DONE]":
            state.done = True
            return False
        event = json.loads(data)
        if "error" in event:
            state.error = _error_text(event["error"])
            return False
        usage = event.get("usage")
        if usage:
            state.output_tokens = usage.get("completion_tokens", state.output_tokens)
            state.prompt_tokens = usage.get("prompt_tokens", state.prompt_tokens)
        choices = event.get("choices")
        if not choices:
            return False
        reason = choices[0].get("finish_reason")
        if reason:
            state.finish_reason = reason
        if self._has_text(choices[0]):
            state.chunks += 1
            return True
        return False

    def _has_text(self, choice: dict[str, Any]) -> bool:
        raise NotImplementedError


class OpenAIChatApi(_OpenAIApi):
    path = "/v1/chat/completions"

    def payload(self, item: WorkloadItem, model: str, ignore_eos: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": item.prompt}],
            "max_tokens": item.max_new_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        return body

    def _has_text(self, choice: dict[str, Any]) -> bool:
        delta = choice.get("delta") or {}
        # TGI sends one chunk per token ("" for special tokens); a role-only opener is no token.
        return delta.get("content") is not None or bool(delta.get("tool_calls"))


class OpenAICompletionsApi(_OpenAIApi):
    path = "/v1/completions"

    def payload(self, item: WorkloadItem, model: str, ignore_eos: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": item.prompt,
            "max_tokens": item.max_new_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        if ignore_eos:
            body["ignore_eos"] = True
        return body

    def _has_text(self, choice: dict[str, Any]) -> bool:
        return choice.get("text") is not None


def api_for(name: str) -> Api:
    apis: dict[str, type[Api]] = {
        "tgi": TgiApi,
        "openai-chat": OpenAIChatApi,
        "openai-completions": OpenAICompletionsApi,
    }
    return apis[name]()
