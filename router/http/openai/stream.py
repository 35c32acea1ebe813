"""SSE chunks of the OpenAI streams (hot path): each chunk is a pre-rendered head and tail with the
token's escaped text spliced in, instead of a dict through `json.dumps` per token.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring as _quote  # type: ignore[attr-defined]
from typing import Any

from pytgi_router.core.errors import InferError
from pytgi_router.core.request_stream import TokenInfo
from pytgi_router.http.openai.schemas import FINISH_REASONS, Envelope, chat_logprobs, usage


def _head(env: Envelope, kind: str) -> str:
    head = env.head(kind)
    return json.dumps(head, separators=(",", ":"), ensure_ascii=False)[:-1]


class ChatChunks:
    """`chat.completion.chunk` events of one chat stream.

    The role is in the first delta only, as OpenAI (and vLLM) send it: TGI repeats it in every
    chunk, and clients that merge deltas by concatenating their strings (the OpenAI SDK's
    `.stream()` helper) then report the role as "assistantassistant...".
    """

    __slots__ = ("_head", "logprobs", "_role")

    def __init__(self, env: Envelope, logprobs: bool) -> None:
        self._head = _head(env, "chat.completion.chunk")
        self.logprobs = logprobs
        self._role = '"role":"assistant",'

    def token(
        self, token: TokenInfo, top: list[TokenInfo], finish_reason: str | None = None
    ) -> bytes:
        text = "" if token.special else token.text
        lp = "null"
        if self.logprobs:
            lp = json.dumps(chat_logprobs([token], [top]), separators=(",", ":"),
                            ensure_ascii=False)
        fr = "null" if finish_reason is None else f'"{FINISH_REASONS.get(finish_reason, finish_reason)}"'
        role, self._role = self._role, ""
        return (
            f'data: {self._head},"choices":[{{"index":0,"delta":{{{role}'
            f'"content":{_quote(text)}}},"logprobs":{lp},"finish_reason":{fr}}}],'
            '"usage":null}\n\n'
        ).encode()

    def usage(
        self, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None
    ) -> bytes:
        body = json.dumps(usage(prompt_tokens, completion_tokens, reasoning_tokens),
                          separators=(",", ":"))
        return f'data: {self._head},"choices":[],"usage":{body}}}\n\n'.encode()

    def text(self, fields: tuple[str, ...], text: str,
             logprobs: list[dict[str, Any]] | None = None) -> bytes:
        """A delta of `text` under each of `fields` (`content`; `reasoning_content` and
        `reasoning` for thinking), spliced into the pre-rendered chunk as `token` splices its
        text: the per-token path of a chat read through the shared output path. `logprobs`:
        the entries of the tokens this chunk carries (None: `null`)."""
        quoted = _quote(text)
        body = ",".join(f'"{name}":{quoted}' for name in fields)
        role, self._role = self._role, ""
        lp = "null" if logprobs is None else _logprobs_json(logprobs)
        return (
            f'data: {self._head},"choices":[{{"index":0,"delta":{{{role}{body}}},'
            f'"logprobs":{lp},"finish_reason":null}}],"usage":null}}\n\n'
        ).encode()

    def delta(self, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> bytes:
        """A chunk with any delta (tool calls, the last one), off the per-token fast path
        (the role first when no chunk sent it yet); `finish_reason` as OpenAI names it."""
        if self._role:
            delta, self._role = {"role": "assistant", **delta}, ""
        lp = None if logprobs is None else {"content": logprobs}
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        body = json.dumps([choice], separators=(",", ":"), ensure_ascii=False)
        return f'data: {self._head},"choices":{body},"usage":null}}\n\n'.encode()


def _logprobs_json(entries: list[dict[str, Any]]) -> str:
    return json.dumps({"content": entries}, separators=(",", ":"), ensure_ascii=False)


class CompletionChunks:
    """`text_completion` events of one completions stream (several prompts interleave)."""

    __slots__ = ("_head",)

    def __init__(self, env: Envelope) -> None:
        self._head = _head(env, "text_completion")

    def token(self, index: int, token: TokenInfo) -> bytes:
        text = "" if token.special else token.text
        return (
            f'data: {self._head},"choices":[{{"index":{index},"text":{_quote(text)},'
            '"logprobs":null,"finish_reason":null}]}\n\n'
        ).encode()

    def last(
        self, index: int, token: TokenInfo, finish_reason: str, prompt_tokens: int,
        completion_tokens: int, inline_usage: bool = True,
    ) -> bytes:
        """The prompt's final chunk; its own usage inline (TGI), or `null` when the stream ends
        with the usage-only chunk instead (`stream_options.include_usage`, as OpenAI does)."""
        text = "" if token.special else token.text
        reason = FINISH_REASONS.get(finish_reason, finish_reason)
        body = "null"
        if inline_usage:
            body = json.dumps(usage(prompt_tokens, completion_tokens), separators=(",", ":"))
        return (
            f'data: {self._head},"choices":[{{"index":{index},"text":{_quote(text)},'
            f'"logprobs":null,"finish_reason":"{reason}"}}],"usage":{body}}}\n\n'
        ).encode()

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """OpenAI's usage-only chunk (`"choices": []`), summed over every prompt."""
        body = json.dumps(usage(prompt_tokens, completion_tokens), separators=(",", ":"))
        return f'data: {self._head},"choices":[],"usage":{body}}}\n\n'.encode()


def error_chunk(err: InferError) -> bytes:
    """An error after an OpenAI stream started (a `data: [DONE]` still follows)."""
    body: dict[str, Any] = {
        "error": {
            "message": err.message,
            "type": err.error_type,
            "http_status_code": err.status_code,
        }
    }
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"
