"""The HTTP side's I/O: JSON bodies in, JSON responses (errors included) out in one shape, and
noticing that a client went away, so that its requests leave the batch within one step."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pytgi_router.core.errors import InferError, ValidationError
from pytgi_router.http.json_fields import decode_body


class JSONBody(Response):
    """JSON without ASCII escaping; NaN is a bug upstream, so it raises rather than leaks."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8")


def json_response(
    content: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return JSONBody(content, status_code=status_code, headers=dict(headers or {}))


def error_response(err: InferError, headers: Mapping[str, str] | None = None) -> Response:
    return JSONBody(err.to_json(), status_code=err.status_code, headers=dict(headers or {}))


async def read_json(request: Request) -> Any:
    """The decoded body (the payload limit was enforced by the HTTP guard middleware)."""
    return decode_body(await request.body())


def other_api_body(body: Any, fields: tuple[str, ...], api: str) -> bool:
    """Whether `body` is another API's shape on a route TGI shares with it (SGLang's /generate,
    vLLM's /tokenize): an object with one of `fields` and no TGI `inputs`. Both at once is a
    422, never a guess: either reading would ignore half of what the client sent."""
    if not isinstance(body, dict) or not any(f in body for f in fields):
        return False
    if "inputs" in body:
        names = "/".join(f"`{f}`" for f in fields)
        raise ValidationError(f"the body mixes TGI's `inputs` with {api}'s {names}: "
                              "send one shape")
    return True


Receive = Callable[[], Any]


async def wait_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Reads ASGI messages (the body is already consumed) until `http.disconnect`."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


@contextlib.asynccontextmanager
async def watching_disconnect(
    receive: Receive, on_disconnect: Callable[[], None]
) -> AsyncIterator[None]:
    """While the block runs (a non-streaming generation), a disconnect calls `on_disconnect`."""
    watcher = asyncio.ensure_future(wait_disconnect(receive, on_disconnect))
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
