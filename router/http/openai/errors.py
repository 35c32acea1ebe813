"""Errors in OpenAI's own shape, `{"error": {"message", "type", "param", "code"}}`, for the routes
whose clients parse only that shape (the Responses API: the `openai` SDK and the agents built on
it read `error.message`). The status is the router's (API.md: 422 for validation, 424 for a
failed generation...); `code` is the router's `error_type`, so nothing the TGI shape says is
lost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pytgi_router.core.errors import InferError
from pytgi_router.http.http_errors import NotFoundError
from pytgi_router.http.http_io import json_response

# The paths whose errors (the guard's 401 and 413, a 404 or 405 included) take this shape.
PATH_PREFIX = "/v1/responses"
# vLLM's worker routes (vllm_render.py), whose callers (vLLM's router and clients) parse it too;
# its /tokenize is TGI's route as well, so its shape follows the body, not the path.
VLLM_PATHS = frozenset({"/v1/chat/completions/render", "/v1/completions/render", "/detokenize"})

# OpenAI's `type` by status (424: the generation failed, not the request); anything else
# under 500 is the client's request.
TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         424: "server_error", 429: "rate_limit_error"}
# The field a validation message names first (`input[0].role`), OpenAI's `param`.
FIELD = re.compile(r"`([A-Za-z_][\w.\[\]]*)`")
# The generate and chat fields a shared validation message names, as the Responses API calls
# them.
RESPONSES_NAMES = {"inputs": "input", "messages": "input", "max_new_tokens": "max_output_tokens",
                   "max_tokens": "max_output_tokens", "response_format": "text.format"}


class BadRequest(InferError):
    """A request that names something it cannot do (cancel a response that is not running)."""

    status_code = 400
    error_type = "invalid_request"
    metric_label = "validation"


class ResponseNotFound(NotFoundError):
    """A response id this replica does not hold: stored responses are per-replica, in memory.
    `param` names the field that held the id (`previous_response_id`), if any."""

    def __init__(self, response_id: str, param: str | None = None) -> None:
        what = "Previous response" if param else "Response"
        super().__init__(
            f"{what} with id {response_id!r} not found: responses are kept in memory by the "
            "replica that created them (with `store: true`), within --responses-store-bytes"
        )
        self.param = param


def openai_error(err: InferError) -> dict[str, Any]:
    kind = TYPES.get(err.status_code)
    if kind is None:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
    return {"error": {"message": err.message, "type": kind, "param": _param(err),
                      "code": err.error_type}}


def _param(err: InferError) -> str | None:
    if isinstance(err, ResponseNotFound):
        return err.param
    match = FIELD.search(err.message) if err.status_code in (400, 422) else None
    if match is None:
        return None
    return RESPONSES_NAMES.get(match.group(1), match.group(1))


def owns(path: str) -> bool:
    """Whether `path` is a Responses API route (or one of vLLM's worker routes), whose errors
    from the HTTP guard and the framework its clients parse in OpenAI's shape too."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/") or path in VLLM_PATHS


def openai_error_response(err: InferError, headers: Any = None) -> Response:
    return json_response(openai_error(err), status_code=err.status_code, headers=headers)


Handler = Callable[[Request], Awaitable[Response]]


def in_openai_shape(handler: Handler) -> Handler:
    """The handler with its errors answered in OpenAI's shape instead of TGI's (the Responses
    API's routes, vLLM's worker routes: their clients parse only that shape)."""

    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except InferError as err:
            return openai_error_response(err)

    return answer


def error_bytes(err: InferError) -> tuple[int, bytes]:
    """(status, body) for the guard, which answers below the framework."""
    return err.status_code, json.dumps(openai_error(err), ensure_ascii=False).encode()
