"""vLLM's live LoRA routes, served when the shards run with --enable-lora-runtime-updates (else
they do not exist: 404, as in vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING), behind --api-key
like every route but the probes:

- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`: 200 and vLLM's text, "Success: LoRA
  adapter 'x' added successfully."; 400 for a missing field, a name already loaded or an adapter
  that does not fit (the reason: the shards' start-up checks), 404 for a path that is not there.
- `POST /v1/unload_lora_adapter {"lora_name"}`: 200 "... removed successfully."; 404 for a name
  not loaded. Requests in flight under it finish; new ones get the unknown-adapter 422 at once.

Errors are vLLM's: `{"error": {"message", "type", "param", "code"}}` with its types
(InvalidUserInput, BadRequestError, NotFoundError) and the status as `code`.

Also here: `publish_lora_info`, vLLM's `vllm:lora_requests_info` gauge refreshed at each scrape.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from pytgi_router.core.errors import InferError
from pytgi_router.core.lora_updates import LoraUpdateError
from pytgi_router.http.http_io import json_response, read_json
from pytgi_router.http.state import AppState


def vllm_error(err: InferError) -> Response:
    """vLLM's ErrorResponse: the message, vLLM's error type, the status as `code`."""
    return json_response({"error": {"message": err.message, "type": err.error_type,
                                    "param": None, "code": err.status_code}},
                         status_code=err.status_code)


class LoraRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.updates = state.infer.lora_updates

    def routes(self) -> list[Route]:
        if not self.state.infer.adapters.runtime_updates:
            return []
        return [
            Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
        ]

    async def load(self, request: Request) -> Response:
        try:
            body = await _body(request)
            text = await self.updates.load(_text(body, "lora_name"), _text(body, "lora_path"))
        except LoraUpdateError as err:
            return vllm_error(err)
        return PlainTextResponse(text)

    async def unload(self, request: Request) -> Response:
        try:
            body = await _body(request)
            text = await self.updates.unload(_text(body, "lora_name"))
        except LoraUpdateError as err:
            return vllm_error(err)
        return PlainTextResponse(text)


async def _body(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or vLLM's InvalidUserInput 400: these routes answer only in
    vLLM's error shape, the body's own errors included."""
    try:
        body = await read_json(request)
    except InferError as err:
        raise LoraUpdateError(err.message, error_type="InvalidUserInput") from None
    if not isinstance(body, dict):
        raise LoraUpdateError("the body must be a JSON object", error_type="InvalidUserInput")
    return body


def _text(body: dict[str, Any], field: str) -> str:
    """A string field; absent or null is "" so that the caller's vLLM refusal ("must be
    provided") names it, as vLLM's does."""
    value = body.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise LoraUpdateError(f"'{field}' must be a string", error_type="InvalidUserInput")
    return value


def publish_lora_info(state: AppState) -> None:
    """Sets vllm:lora_requests_info from the requests now waiting and admitted (nothing when
    the shards serve no adapters)."""
    table = state.infer.adapters
    if table.max_loras <= 0:
        return
    waiting, running = state.infer.adapter_activity()

    def names(indices: set[int]) -> list[str]:
        refs = (table.by_index(i) for i in sorted(indices))
        return [r.name for r in refs if r is not None]

    state.metrics.lora_info(names(running), names(waiting), table.max_loras)
