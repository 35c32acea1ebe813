"""The OpenAPI 3 document of the HTTP API, and the /docs Swagger UI page that renders it."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from pytgi_proto.parameters import openapi_properties
from pytgi_router.http import workers_openapi
from pytgi_router.http.anthropic import openapi as anthropic_openapi
from pytgi_router.http.http_io import json_response
from pytgi_router.http.openai import responses_openapi
from pytgi_router.http.state import AppState


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(kind: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "nullable": True, **extra}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


TOKEN = _obj({
    "id": {"type": "integer"}, "text": {"type": "string"},
    "logprob": _nullable("number"), "special": {"type": "boolean"},
}, ["id", "text", "special"])

# Derived from the parameter table (pytgi_proto.parameters): the document cannot drift from what
# the router parses and bounds.
PARAMETERS = _obj(openapi_properties())

DETAILS = _obj({
    "finish_reason": {"type": "string", "enum": ["length", "eos_token", "stop_sequence"]},
    "generated_tokens": {"type": "integer"},
    "seed": _nullable("integer"),
    "prefill": {"type": "array", "items": _ref("Token")},
    "tokens": {"type": "array", "items": _ref("Token")},
    "top_tokens": {"type": "array", "items": {"type": "array", "items": _ref("Token")}},
    "best_of_sequences": {"type": "array", "items": {"type": "object"}},
}, ["finish_reason", "generated_tokens", "prefill", "tokens"])

SCHEMAS: dict[str, Any] = {
    "Token": TOKEN,
    "GenerateParameters": PARAMETERS,
    "GenerateRequest": _obj({
        "inputs": {"type": "string", "example": "My name is Olivier and I"},
        "parameters": _ref("GenerateParameters"),
    }, ["inputs"]),
    "CompatGenerateRequest": _obj({
        "inputs": {"type": "string"}, "parameters": _ref("GenerateParameters"),
        "stream": {"type": "boolean", "default": False},
    }, ["inputs"]),
    "Details": DETAILS,
    "GenerateResponse": _obj({
        "generated_text": {"type": "string"}, "details": _ref("Details"),
    }, ["generated_text"]),
    "StreamResponse": _obj({
        "index": {"type": "integer", "minimum": 1}, "token": _ref("Token"),
        "top_tokens": {"type": "array", "items": _ref("Token")},
        "generated_text": _nullable("string"),
        "details": {"type": "object", "nullable": True},
    }, ["index", "token"]),
    "ErrorResponse": _obj({
        "error": {"type": "string"}, "error_type": {"type": "string"},
    }, ["error", "error_type"]),
    "ChatRequest": _obj({
        "model": {"type": "string"},
        "messages": {"type": "array", "items": _obj({
            "role": {"type": "string"}, "content": {"type": "string"},
        }, ["role"])},
        "max_tokens": _nullable("integer"), "temperature": _nullable("number"),
        "top_p": _nullable("number"), "seed": _nullable("integer"),
        "stop": {"type": "array", "items": {"type": "string"}},
        "stream": {"type": "boolean"}, "logprobs": {"type": "boolean"},
        "top_logprobs": _nullable("integer"), "presence_penalty": _nullable("number"),
        "frequency_penalty": _nullable("number"),
        "stream_options": _obj({"include_usage": {"type": "boolean"}}),
        "response_format": {
            "type": "object", "nullable": True,
            "description": "{type: text|json_object} or {type: json_schema, json_schema: "
                           "{name, schema, strict}} (or a `grammar` object)"},
        "tools": {"type": "array", "nullable": True, "items": _obj({
            "type": {"type": "string", "enum": ["function"]},
            "function": _obj({"name": {"type": "string"}, "description": {"type": "string"},
                              "parameters": {"type": "object"}}, ["name"]),
        }, ["function"])},
        "tool_choice": {"nullable": True, "description": '"auto" (default), "none", '
                        '"required", a function name or {type: function, function: {name}}',
                        "oneOf": [{"type": "string"}, {"type": "object"}]},
        "tool_prompt": {"type": "string", "nullable": True,
                        "description": "text appended to the last message with the tools"},
        "chat_template_kwargs": {
            "type": "object", "nullable": True,
            "description": "more variables for the chat template, e.g. {enable_thinking: false}"},
    }, ["messages"]),
    "ChatCompletion": {
        "type": "object",
        "description": "OpenAI `chat.completion`; with a reasoning parser (--reasoning-parser) "
                       "the message carries the thinking as `reasoning_content` and `reasoning` "
                       "(`content` only the answer) and usage "
                       "`completion_tokens_details.reasoning_tokens`; streamed, the thinking "
                       "comes in deltas of its own with the same two fields"},
    "CompletionRequest": _obj({
        "model": {"type": "string"},
        "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "max_tokens": _nullable("integer"), "temperature": _nullable("number"),
        "top_p": _nullable("number"), "seed": _nullable("integer"),
        "stop": {"type": "array", "items": {"type": "string"}}, "stream": {"type": "boolean"},
        "response_format": {"type": "object", "nullable": True},
    }, ["prompt"]),
    "Completion": {"type": "object", "description": "OpenAI `text_completion`"},
    "Info": {"type": "object"},
    "SimpleToken": _obj({
        "id": {"type": "integer"}, "text": {"type": "string"},
        "start": {"type": "integer"}, "stop": {"type": "integer"},
    }),
}

ERRORS = {
    str(code): {"description": text, "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    for code, text in [(400, "Malformed body"), (401, "Bad API key"), (413, "Payload too large"),
                       (422, "Input validation error"), (424, "Generation error"),
                       (429, "Model is overloaded"), (500, "Incomplete generation"),
                       (503, "Unhealthy or shutting down")]
}


def _post(summary: str, request: str, response: dict[str, Any], stream: bool = False) -> dict:
    media = "text/event-stream" if stream else "application/json"
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "OK", "content": {media: {"schema": response}}},
                      **ERRORS},
    }}


def _get(summary: str, response: dict[str, Any] | None = None) -> dict:
    ok: dict[str, Any] = {"description": "OK"}
    if response is not None:
        ok["content"] = {"application/json": {"schema": response}}
    return {"get": {"summary": summary, "responses": {"200": ok, **ERRORS}}}


def openapi_document(version: str) -> dict[str, Any]:
    paths = {
        "/": {**_post("Generate (compat: `stream` picks SSE)", "CompatGenerateRequest",
                      {"type": "array", "items": _ref("GenerateResponse")}),
              **_get("Health")},
        "/generate": _post("Generate tokens", "GenerateRequest", _ref("GenerateResponse")),
        "/generate_stream": _post("Generate a stream of tokens (SSE)", "GenerateRequest",
                                  _ref("StreamResponse"), stream=True),
        "/v1/chat/completions": _post("OpenAI chat completions", "ChatRequest",
                                      _ref("ChatCompletion")),
        "/v1/completions": _post("OpenAI completions", "CompletionRequest", _ref("Completion")),
        "/tokenize": _post("Tokenize (TGI's body, or vLLM's: `prompt` or `messages`)",
                           "GenerateRequest", {"oneOf": [
                               {"type": "array", "items": _ref("SimpleToken")},
                               _ref("VllmTokenizeResponse")]}),
        "/chat_tokenize": _post("Template and tokenize a chat", "ChatRequest", {"type": "object"}),
        "/invocations": _post("SageMaker: generate, chat or completions", "CompatGenerateRequest",
                              {"type": "object"}),
        "/health": _get("Health of the shards"),
        "/ping": _get("Health (SageMaker)"),
        "/info": _get("Model and router info", _ref("Info")),
        "/metrics": {"get": {"summary": "Prometheus metrics",
                             "responses": {"200": {"description": "Prometheus text"}}}},
        "/v1/models": _get("OpenAI model list", {"type": "object"}),
        **responses_openapi.PATHS,
        **anthropic_openapi.PATHS,
        **workers_openapi.PATHS,
    }
    # TGI's bodies, or the one SGLang's (/generate) or vLLM's router (/tokenize) sends.
    for path, other in (("/generate", "SglangGenerateRequest"), ("/tokenize", "VllmTokenizeRequest")):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]
        body["schema"] = {"oneOf": [body["schema"], _ref(other)]}
    return {
        "openapi": "3.0.3",
        "info": {"title": "pytgi", "version": version,
                 "description": "Text Generation Inference's HTTP API, served by pytgi",
                 "license": {"name": "Apache 2.0"}},
        "paths": paths,
        "components": {"schemas": {**SCHEMAS, **responses_openapi.SCHEMAS,
                                   **anthropic_openapi.SCHEMAS, **workers_openapi.SCHEMAS}},
    }


# Swagger UI from a CDN, pinned to one release and with Subresource Integrity: a browser runs the
# assets only when their bytes hash to these values (the hashes of swagger-ui-dist 5.35.0's files
# as published on npm, which unpkg serves), so a compromised or changed CDN file cannot run in
# the page. To upgrade: `npm pack swagger-ui-dist@X`, then
# `openssl dgst -sha384 -binary FILE | openssl base64 -A` for each file.
SWAGGER_UI = "https://unpkg.com/swagger-ui-dist@5.35.0"
SWAGGER_CSS_SRI = "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I"
SWAGGER_JS_SRI = "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9"

SWAGGER_PAGE = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>pytgi API</title>
<link rel="stylesheet" href="{SWAGGER_UI}/swagger-ui.css"
 integrity="{SWAGGER_CSS_SRI}" crossorigin="anonymous"></head>
<body><div id="swagger-ui"></div>
<script src="{SWAGGER_UI}/swagger-ui-bundle.js"
 integrity="{SWAGGER_JS_SRI}" crossorigin="anonymous"></script>
<script>window.ui = SwaggerUIBundle({{url: "/api-doc/openapi.json", dom_id: "#swagger-ui"}});</script>
</body></html>
"""


class DocsRoutes:
    def __init__(self, state: AppState) -> None:
        self.document = openapi_document(state.version)

    def routes(self) -> list[Route]:
        return [
            Route("/docs", self.docs, methods=["GET"]),
            Route("/api-doc/openapi.json", self.openapi, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]

    async def docs(self, request: Request) -> Response:
        return HTMLResponse(SWAGGER_PAGE)

    async def openapi(self, request: Request) -> Response:
        return json_response(self.document)
