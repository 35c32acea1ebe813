"""Reading JSON bodies and writing JSON responses, errors included, in one shape."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pytgi_router.errors import InferError
from pytgi_router.json_fields import decode_body


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
