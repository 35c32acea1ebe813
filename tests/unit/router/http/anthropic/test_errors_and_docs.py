"""Errors on the Anthropic routes have Anthropic's shape and the status its SDK maps to the
right exception class; the routes are in /docs with the fields the parser requires."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from anthropic._error_classes import make_status_error

from pytgi_router.core.errors import (
    GenerationError,
    InferError,
    OverloadedError,
    UnhealthyError,
    ValidationError,
)
from pytgi_router.http.anthropic.errors import error_body, owns
from pytgi_router.http.anthropic.request import parse_messages
from pytgi_router.http.anthropic.routes import MessagesRoutes
from pytgi_router.http.http_errors import (
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    ToolError,
    UnauthorizedError,
)
from pytgi_router.http.openapi import openapi_document


@pytest.mark.parametrize(("err", "kind", "sdk_class"), [
    (ValidationError("`inputs` must have less than 5 tokens"), "invalid_request_error",
     anthropic.BadRequestError),
    (ToolError("Tool with name x not found"), "invalid_request_error", anthropic.BadRequestError),
    (BadRequestError("bad JSON"), "invalid_request_error", anthropic.BadRequestError),
    (UnauthorizedError(), "authentication_error", anthropic.AuthenticationError),
    (NotFoundError("no route"), "not_found_error", anthropic.NotFoundError),
    (PayloadTooLargeError(10), "request_too_large", anthropic.ContentTooLargeError),
    (OverloadedError(), "overloaded_error", anthropic.OverloadedError),
    (InferError("boom"), "api_error", anthropic.InternalServerError),
    (GenerationError("shard lost"), "api_error", anthropic.InternalServerError),
    (UnhealthyError(), "api_error", anthropic.ServiceUnavailableError),
])
def test_the_sdk_raises_the_class_for_each_error(
        err: InferError, kind: str, sdk_class: type[Exception]) -> None:
    status, body = error_body(err)
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
    response = httpx.Response(status, json=body, request=httpx.Request("POST", "http://x/"))
    raised = make_status_error("e", body=body, response=response)  # type: ignore[arg-type]
    assert isinstance(raised, sdk_class), (status, type(raised))
    if status != 401:
        assert body["error"]["message"] == err.message


def test_owned_paths() -> None:
    assert owns("/v1/messages") and owns("/v1/messages/count_tokens")
    assert not owns("/v1/messages_x") and not owns("/v1/chat/completions")


def test_routes_are_documented_with_the_required_fields() -> None:
    none: Any = None
    doc = openapi_document("test")
    for route in MessagesRoutes(none, none, none).routes():
        assert set(route.methods or ()) - {"HEAD"} == {"POST"}
        assert "post" in doc["paths"][route.path]
    schemas = doc["components"]["schemas"]
    for name, counting in (("MessagesRequest", False), ("CountTokensRequest", True)):
        required = schemas[name]["required"]
        full = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        parse_messages({k: full[k] for k in required}, counting=counting)
        for field in required:
            with pytest.raises(ValidationError, match=f"missing field `{field}`"):
                parse_messages({k: full[k] for k in required if k != field}, counting=counting)
    error = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]
    assert error["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
