"""The routes SGLang's and vLLM's routers call on a replica are each in the OpenAPI document
(/docs), method by method, every reference resolving; /generate and /tokenize document both
bodies they take."""

from __future__ import annotations

import json
from typing import Any

from pytgi_router.http.openapi import openapi_document
from pytgi_router.http.routes_workers import WorkerRoutes
from pytgi_router.http.vllm_render import VllmRoutes


def test_every_worker_route_is_documented() -> None:
    none: Any = None
    doc = openapi_document("test")
    routes = [*WorkerRoutes(none).routes(), *VllmRoutes(none, none, none).routes()]
    assert {r.path for r in routes} >= {"/server_info", "/get_load", "/flush_cache",
                                       "/v1/chat/completions/render", "/detokenize"}
    for route in routes:
        for method in route.methods or ():
            if method != "HEAD":
                assert method.lower() in doc["paths"][route.path], (route.path, method)


def test_every_reference_resolves_and_both_bodies_are_documented() -> None:
    doc = openapi_document("test")
    schemas = doc["components"]["schemas"]
    for ref in set(json.dumps(doc).split('"$ref": "')[1:]):
        name = ref.split('"', 1)[0].rsplit("/", 1)[1]
        assert name in schemas, name
    for path, other in (("/generate", "SglangGenerateRequest"),
                        ("/tokenize", "VllmTokenizeRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        refs = [s["$ref"].rsplit("/", 1)[1] for s in body["schema"]["oneOf"]]
        assert refs == ["GenerateRequest", other], path
