"""TGI's generate routes: POST /generate, /generate_stream and the compat POST /."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytgi_router.core.errors import InferError
from pytgi_router.core.request_stream import End, Token
from pytgi_router.http.generate_flow import (
    ClientDisconnected,
    GenerateFlow,
    StreamGroup,
    Submission,
)
from pytgi_router.http.http_io import json_response, read_json, watching_disconnect
from pytgi_router.http.schemas import (
    GenerateRequest,
    error_event,
    generate_response,
    parse_generate,
    stream_end_event,
    stream_token_event,
)
from pytgi_router.http.sglang_generate import (
    SglangEncoder,
    is_sglang,
    parse_sglang,
    sglang_response,
)
from pytgi_router.http.sse import EventStreamResponse
from pytgi_router.http.state import AppState
from pytgi_router.http.streaming import encode_generation, merge

# The status nginx uses for "client closed the request": nobody reads it, the logs do.
CLIENT_CLOSED = 499


class GenerateRoutes:
    def __init__(self, state: AppState, flow: GenerateFlow) -> None:
        self.state = state
        self.flow = flow

    def routes(self) -> list[Route]:
        return [
            Route("/generate", self.generate, methods=["POST"]),
            Route("/generate_stream", self.generate_stream, methods=["POST"]),
            Route("/", self.compat, methods=["POST"]),
        ]

    async def generate(self, request: Request) -> Response:
        """TGI's body, or SGLang's (sglang_generate.py: what SGLang's router forwards)."""
        body = await read_json(request)
        if is_sglang(body):
            return await self.sglang(request, parse_sglang(body))
        req = parse_generate(body)
        return await self.respond(request, req, route="generate")

    async def sglang(self, request: Request, req: GenerateRequest) -> Response:
        """SGLang's answer shape (a JSON object, or SSE ending in `data: [DONE]`)."""
        rid = uuid.uuid4().hex
        started = time.monotonic()
        if not req.stream:
            group = StreamGroup()
            with self.state.serving():
                async with watching_disconnect(request.receive, group.cancel):
                    try:
                        result = await self.flow.generate(
                            req, route="generate", headers=request.headers, group=group
                        )
                    except ClientDisconnected:
                        return Response(status_code=CLIENT_CLOSED)
            return json_response(sglang_response(rid, result.best, started))
        group = StreamGroup()
        submission = (await self.flow.admit(
            req, stream=True, route="generate_stream", headers=request.headers, group=group
        ))[0]
        enc = SglangEncoder(rid, submission.valid.request.input_length)
        events = merge([encode_generation(self.state, submission, group, enc)],
                       trailer=b"data: [DONE]\n\n")
        return EventStreamResponse(events, {"x-compute-type": self.state.settings.compute_type},
                                   on_disconnect=group.cancel)

    async def generate_stream(self, request: Request) -> Response:
        req = parse_generate(await read_json(request))
        return await self.stream(request, req, route="generate_stream")

    async def compat(self, request: Request) -> Response:
        return await self.compat_body(request, await read_json(request))

    async def compat_body(self, request: Request, body: object) -> Response:
        """`stream` picks the route; without a model pipeline tag TGI returns the full text."""
        req = parse_generate(body)
        if req.parameters.return_full_text is None:
            req.parameters.return_full_text = True
        if req.stream:
            return await self.stream(request, req, route="compat_generate")
        return await self.respond(request, req, route="compat_generate", as_list=True)

    # ---- non-streaming -----------------------------------------------------------------------

    async def respond(
        self, request: Request, req: GenerateRequest, *, route: str, as_list: bool = False
    ) -> Response:
        group = StreamGroup()
        with self.state.serving():
            async with watching_disconnect(request.receive, group.cancel):
                try:
                    result = await self.flow.generate(
                        req, route=route, headers=request.headers, group=group
                    )
                except ClientDisconnected:
                    return Response(status_code=CLIENT_CLOSED)
        body = generate_response(result.best, result.others, details=result.valid.details)
        headers = result.timings.headers(self.state.settings.compute_type, len(req.inputs))
        return json_response([body] if as_list else body, headers=headers)

    # ---- streaming ---------------------------------------------------------------------------

    async def stream(self, request: Request, req: GenerateRequest, *, route: str) -> Response:
        """Validation and admission errors are HTTP errors (raised before the stream starts)."""
        group = StreamGroup()
        submissions = await self.flow.admit(
            req, stream=True, route=route, headers=request.headers, group=group
        )
        headers = {
            "x-compute-type": self.state.settings.compute_type,
            "x-compute-characters": str(len(req.inputs)),
        }
        submission = submissions[0]
        enc = GenerateEncoder(submission)
        events = encode_generation(self.state, submission, group, enc)
        return EventStreamResponse(events, headers, on_disconnect=group.cancel)


class GenerateEncoder:
    """TGI's StreamResponse events."""

    __slots__ = ("details", "prefix", "input_length")

    def __init__(self, submission: Submission) -> None:
        valid = submission.valid
        self.details = valid.details
        self.prefix = valid.request.inputs if valid.return_full_text else ""
        self.input_length = valid.request.input_length

    def token(self, index: int, ev: Token) -> bytes:
        return stream_token_event(index, ev.token, ev.top_tokens)

    def end(self, index: int, ev: End) -> bytes:
        text = self.prefix + ev.generated_text
        return stream_end_event(index, ev, text, self.input_length, details=self.details)

    def error(self, err: InferError) -> bytes:
        return error_event(err.to_json())
