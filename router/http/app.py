"""The Starlette application: routes, the HTTP guard (payload limit, API key), CORS, and every
error in the `{"error", "error_type"}` shape (404 and 405 included)."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytgi_router.core.errors import InferError, ValidationError
from pytgi_router.http.anthropic.errors import error_bytes as anthropic_error_bytes
from pytgi_router.http.anthropic.errors import error_response as anthropic_error_response
from pytgi_router.http.anthropic.errors import owns as anthropic_owns
from pytgi_router.http.anthropic.routes import MessagesRoutes
from pytgi_router.http.generate_flow import GenerateFlow
from pytgi_router.http.http_errors import (
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from pytgi_router.http.http_io import error_response, read_json
from pytgi_router.http.openai.errors import error_bytes as openai_error_bytes
from pytgi_router.http.openai.errors import openai_error_response
from pytgi_router.http.openai.errors import owns as responses_owns
from pytgi_router.http.openai.response_store import ResponseStore
from pytgi_router.http.openai.routes_chat import ChatRoutes
from pytgi_router.http.openai.routes_completions import CompletionRoutes
from pytgi_router.http.openai.routes_responses import ResponsesRoutes
from pytgi_router.http.openapi import DocsRoutes
from pytgi_router.http.routes_generate import GenerateRoutes
from pytgi_router.http.routes_info import InfoRoutes
from pytgi_router.http.routes_lora import LoraRoutes
from pytgi_router.http.routes_workers import WorkerRoutes
from pytgi_router.http.state import AppState
from pytgi_router.http.vllm_render import VllmRoutes

log = logging.getLogger("pytgi.router")

# Reachable without the API key: health probes and metrics scraping, which carry no key in
# Kubernetes or SageMaker. GET / and /ping are health aliases (POST / generates and needs the
# key); everything else, the docs and /info included, needs it.
PUBLIC = frozenset({
    ("GET", "/"), ("GET", "/health"), ("GET", "/ping"), ("GET", "/metrics"),
    ("HEAD", "/"), ("HEAD", "/health"), ("HEAD", "/ping"),
})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def _send_error(send: Any, err: InferError, path: str = "") -> None:
    """`err` in TGI's shape, or in Anthropic's or OpenAI's on their routes (/v1/messages,
    /v1/responses: their clients parse no other)."""
    status, body = err.status_code, json.dumps(err.to_json()).encode()
    if anthropic_owns(path):
        status, body = anthropic_error_bytes(err)
    elif responses_owns(path):
        status, body = openai_error_bytes(err)
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "http.response.body", "body": body})


class HttpGuard:
    """Pure ASGI (no per-request task, streaming untouched): API key, then the payload limit on
    both the declared Content-Length and the bytes actually received."""

    def __init__(self, app: Any, payload_limit: int, api_key: str | None) -> None:
        self.app = app
        self.limit = payload_limit
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        guarded = self.expected is not None and (method, scope["path"]) not in PUBLIC
        if guarded and not self._authorized(scope):
            await _send_error(send, UnauthorizedError(), scope["path"])
            return
        if method not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        body = await self._read_body(scope, receive, send, scope["path"])
        if body is None:
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Any) -> bool:
        expected = self.expected
        assert expected is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, key = value.partition(b" ")
                # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
                if scheme.lower() == b"bearer" and hmac.compare_digest(
                    b"Bearer " + key.strip(), expected
                ):
                    return True
            elif name == b"x-api-key" and anthropic_owns(scope["path"]) and hmac.compare_digest(
                b"Bearer " + value.strip(), expected
            ):
                return True  # Anthropic's header, on its routes: its SDK sends the key there
        return False

    async def _read_body(self, scope: Any, receive: Any, send: Any, path: str) -> bytes | None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limit:
                    await _send_error(send, PayloadTooLargeError(self.limit), path)
                    return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await _send_error(send, PayloadTooLargeError(self.limit), path)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect

    return replay


def _error(request: Request, err: InferError, headers: Any = None) -> Response:
    """`err` in TGI's shape, or in Anthropic's or OpenAI's on their routes."""
    if anthropic_owns(request.url.path):
        return anthropic_error_response(err, headers)
    if responses_owns(request.url.path):
        return openai_error_response(err, headers)
    return error_response(err, headers)


async def _infer_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InferError)
    return _error(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return _error(request, NotFoundError(f"Route not found: {where}"))
    if exc.status_code == 405:
        return _error(request, MethodNotAllowedError(f"Method not allowed: {where}"), exc.headers)
    err = InferError(str(exc.detail))
    err.status_code = exc.status_code
    err.error_type = "http"
    return _error(request, err, exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    err = InferError("Internal server error")
    err.error_type = "internal"
    return error_response(err)


class Invocations:
    """SageMaker's POST /invocations: compat generate, then chat, then completions."""

    def __init__(self, gen: GenerateRoutes, chat: ChatRoutes, comp: CompletionRoutes) -> None:
        self.gen, self.chat, self.comp = gen, chat, comp

    async def handle(self, request: Request) -> Response:
        body = await read_json(request)
        if isinstance(body, dict):
            if "inputs" in body:
                return await self.gen.compat_body(request, body)
            if "messages" in body:
                return await self.chat.chat_body(request, body)
            if "prompt" in body:
                return await self.comp.completions_body(request, body)
        raise ValidationError(
            "the body must be a generate (`inputs`), chat (`messages`) or completions "
            "(`prompt`) request"
        )


def create_app(state: AppState) -> Starlette:
    settings = state.settings
    flow = GenerateFlow(state)
    gen = GenerateRoutes(state, flow)
    chat = ChatRoutes(state, flow)
    comp = CompletionRoutes(state, flow)
    info = InfoRoutes(state)
    routes = [
        *VllmRoutes(state, chat, info).routes(),  # its /tokenize first: TGI's body goes to info
        *info.routes(),
        *WorkerRoutes(state).routes(),
        *LoraRoutes(state).routes(),
        *gen.routes(),
        *chat.routes(),
        *comp.routes(),
        *ResponsesRoutes(state, flow, chat, ResponseStore(settings.responses_store_bytes)).routes(),
        *MessagesRoutes(state, flow, chat).routes(),
        Route("/invocations", Invocations(gen, chat, comp).handle, methods=["POST"]),
        *DocsRoutes(state).routes(),
    ]
    origins = list(settings.cors_allow_origin) or ["*"]
    middleware = [
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["content-type", "authorization", "x-api-key", "anthropic-version"],
        ),
        Middleware(HttpGuard, payload_limit=settings.payload_limit, api_key=settings.api_key),
    ]
    handlers: dict[Any, Any] = {
        InferError: _infer_error,
        HTTPException: _http_error,
        Exception: _server_error,
    }
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)
    app.state.pytgi = state
    return app
