"""The Responses API's routes are each in the OpenAPI document (/docs), method by method, with
their request body and OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from pytgi_router.http.openai.response_store import ResponseStore
from pytgi_router.http.openai.routes_responses import ResponsesRoutes
from pytgi_router.http.openapi import openapi_document


def test_every_responses_route_is_documented() -> None:
    none: Any = None
    routes = ResponsesRoutes(none, none, none, ResponseStore(0)).routes()
    doc = openapi_document("test")
    for route in routes:
        for method in route.methods or ():
            if method != "HEAD":
                assert method.lower() in doc["paths"][route.path], (route.path, method)
    schemas = doc["components"]["schemas"]
    assert schemas["ResponsesRequest"]["required"] == ["input"]
    create = doc["paths"]["/v1/responses"]["post"]
    error = create["responses"]["422"]["content"]["application/json"]["schema"]["$ref"]
    assert schemas[error.rsplit("/", 1)[1]]["properties"]["error"]["type"] == "object"
