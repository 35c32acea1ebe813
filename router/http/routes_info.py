"""Routes about the server rather than generation: health, info, metrics, models, tokenize."""

from __future__ import annotations

import json

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tokenizers import Encoding

from pytgi_router.core.errors import UnhealthyError
from pytgi_router.http.http_errors import NotReadyError, ShuttingDownError
from pytgi_router.http.http_io import error_response, json_response, read_json
from pytgi_router.http.openai.schemas import models_list
from pytgi_router.http.routes_lora import publish_lora_info
from pytgi_router.http.schemas import parse_generate
from pytgi_router.http.state import AppState

# Tokens per slice of the /tokenize answer, joined and encoded at once.
CHUNK_TOKENS = 4096


def simple_tokens(text: str, encoding: Encoding, base: int = 0) -> bytes:
    """TGI's `[{id, text, start, stop}]` as JSON; start/stop are UTF-8 byte offsets as in TGI,
    `base` bytes after the start of the input when `text` is its tail (a truncated prompt).

    Written as text, token by token, rather than through a million dicts and one json.dumps:
    that many tracked objects set off full garbage collections, and one C call over all of them,
    each holding the GIL for a second while the event loop waits (a megabyte prompt)."""
    ascii_only = text.isascii()
    byte_at: list[int] = []
    if not ascii_only:
        byte_at = [0]
        for ch in text:
            byte_at.append(byte_at[-1] + len(ch.encode()))
    quote = _encode_string
    ids, offsets = encoding.ids, encoding.offsets
    chunks: list[bytes] = []
    for first in range(0, len(ids), CHUNK_TOKENS):
        out = []
        for token_id, (start, stop) in zip(ids[first:first + CHUNK_TOKENS],
                                           offsets[first:first + CHUNK_TOKENS], strict=True):
            piece = quote(text[start:stop])
            if not ascii_only:
                start, stop = byte_at[start], byte_at[stop]
            if base and stop:  # special tokens stand for no text: (0, 0) wherever they are
                start, stop = start + base, stop + base
            out.append(f'{{"id":{token_id},"text":{piece},"start":{start},"stop":{stop}}}')
        chunks.append(",".join(out).encode())  # one short C call per slice, not one for all
    return b"[" + b",".join(chunks) + b"]"


def tokens_response(
    text: str, encoding: Encoding, templated: bool = False, start: int = 0
) -> Response:
    """The /tokenize (or /chat_tokenize) answer; `encoding` is of `text[start:]`. Callers run
    this in the worker pool so that building it does not block the event loop."""
    base = len(text[:start].encode()) if start else 0
    tokens = simple_tokens(text[start:] if start else text, encoding, base)
    if templated:
        text_json = _encode_string(text).encode()
        body = b'{"tokenize_response":' + tokens + b',"templated_text":' + text_json + b"}"
        return Response(body, media_type="application/json")
    return Response(tokens, media_type="application/json")


async def tokenize_answer(
    state: AppState, text: str, *, add_special_tokens: bool, truncate: int | None = None,
    templated: bool = False,
) -> Response:
    """/tokenize and /chat_tokenize: under a max_concurrent_requests permit (429 without one)
    and bounded as a prompt is (Validator.tokenize), so that a body near the payload limit is
    neither answered with tens of megabytes nor tokenized by many callers at once."""
    validator = state.validator
    with state.infer.permit():
        tokenized = await validator.tokenize(text, add_special_tokens, truncate)
        return await validator.offload(
            tokens_response, text, tokenized.encoding, templated, tokenized.start
        )


def _encode_string(value: str) -> str:
    """A JSON string literal without ASCII escaping, as JSONBody writes them."""
    return json.dumps(value, ensure_ascii=False)


class InfoRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    def routes(self) -> list[Route]:
        return [
            Route("/", self.health, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET"]),
            Route("/info", self.info, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
        ]

    async def health(self, request: Request) -> Response:
        """200 with an empty body when the shards answer, else 503 (also from SIGTERM on: first
        not ready while still serving, then shutting down)."""
        if self.state.draining:
            return error_response(ShuttingDownError())
        if self.state.not_ready:
            return error_response(NotReadyError(self.state.settings.drain_grace_seconds))
        if await self.state.infer.health():
            return Response(status_code=200)
        return error_response(UnhealthyError("unhealthy"))

    async def info(self, request: Request) -> Response:
        return json_response(self.state.info_json())

    async def metrics(self, request: Request) -> Response:
        publish_lora_info(self.state)
        return Response(self.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        return json_response(models_list(self.state.model_id,
                                         tuple(self.state.infer.adapters.names())))

    async def tokenize(self, request: Request) -> Response:
        req = parse_generate(await read_json(request))
        return await tokenize_answer(
            self.state, req.inputs, add_special_tokens=True, truncate=req.parameters.truncate
        )
