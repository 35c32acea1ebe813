"""Errors on the Anthropic routes in Anthropic's shape,
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`, with the status
its SDK maps to the matching exception class (400 BadRequestError, 401 AuthenticationError, 529
OverloadedError...).

The router's errors keep their meaning and message; only the status and the type follow
Anthropic's table: every refusal of the request itself (TGI's 400 and 422: a bad body, an
unknown tool, a prompt over the limits) is Anthropic's 400 `invalid_request_error`, and TGI's
429 (the concurrency limit) is its 529 `overloaded_error`, which its clients back off and retry.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from pytgi_router.core.errors import InferError
from pytgi_router.http.http_io import json_response

# The paths whose errors (the guard's 401 and 413, a 404 or 405 included) take this shape.
PATH_PREFIX = "/v1/messages"

# TGI status → (Anthropic status, Anthropic error type); other statuses keep theirs, as
# `invalid_request_error` (4xx) or `api_error` (5xx).
STATUSES: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    422: (400, "invalid_request_error"),
    424: (500, "api_error"),  # the generation failed on the shards
    429: (529, "overloaded_error"),
    500: (500, "api_error"),
}

UNAUTHORIZED = "invalid api key: send `x-api-key: <api key>` or `Authorization: Bearer <api key>`"


def owns(path: str) -> bool:
    """Whether `path` is an Anthropic route, whose errors (from the HTTP guard and the
    framework too) a client parses in Anthropic's shape."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def status_and_type(err: InferError) -> tuple[int, str]:
    """The Anthropic status and error type standing for `err`."""
    known = STATUSES.get(err.status_code)
    if known is not None:
        return known
    return err.status_code, "invalid_request_error" if err.status_code < 500 else "api_error"


def error_body(err: InferError) -> tuple[int, dict[str, Any]]:
    """(status, body) of `err` in Anthropic's shape; a 401 says how to send the key here."""
    status, kind = status_and_type(err)
    message = UNAUTHORIZED if status == 401 else err.message
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: InferError, headers: dict[str, str] | None = None) -> Response:
    status, body = error_body(err)
    return json_response(body, status_code=status, headers=headers)


def error_bytes(err: InferError) -> tuple[int, bytes]:
    """For the HTTP guard, which answers before any route (raw ASGI)."""
    status, body = error_body(err)
    return status, json.dumps(body, ensure_ascii=False).encode()
