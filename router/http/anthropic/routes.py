"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API on the chat
route's path (the chat template through ChatRoutes.prompt, the GenerateFlow, the streaming
Encoder protocol), answered in Anthropic's shapes, errors included."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytgi_router.core.errors import InferError
from pytgi_router.http.anthropic.errors import error_response
from pytgi_router.http.anthropic.events import MessageEvents
from pytgi_router.http.anthropic.message import message, message_id, outcome
from pytgi_router.http.anthropic.request import MessagesRequest, parse_messages
from pytgi_router.http.anthropic.stream import MessageEncoder
from pytgi_router.http.generate_flow import ClientDisconnected, GenerateFlow, StreamGroup
from pytgi_router.http.http_io import json_response, read_json, watching_disconnect
from pytgi_router.http.openai.chat_output import ChatOutputStream, chat_answer
from pytgi_router.http.openai.routes_chat import ChatRoutes
from pytgi_router.http.routes_generate import CLIENT_CLOSED
from pytgi_router.http.schemas import GenerateRequest
from pytgi_router.http.sse import EventStreamResponse
from pytgi_router.http.state import AppState
from pytgi_router.http.streaming import encode_generation

log = logging.getLogger("pytgi.router")
ROUTE = "messages"


class MessagesRoutes:
    def __init__(self, state: AppState, flow: GenerateFlow, chat: ChatRoutes) -> None:
        self.state = state
        self.flow = flow
        self.chat = chat

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def messages(self, request: Request) -> Response:
        return await _anthropic_errors(self._messages, request)

    async def count_tokens(self, request: Request) -> Response:
        return await _anthropic_errors(self._count_tokens, request)

    async def _count_tokens(self, request: Request) -> Response:
        """The prompt's tokens as /v1/messages would send them: the same template, tools and
        tool prompt (bounded as /chat_tokenize is: 422 past `max_input_tokens`)."""
        msg = parse_messages(await read_json(request), counting=True)
        text = await self.chat.counted_prompt(msg.chat)
        validator = self.state.validator
        with self.state.infer.permit():
            tokenized = await validator.tokenize(text, add_special_tokens=False, truncate=None)
        return json_response({"input_tokens": len(tokenized.encoding.ids)})

    async def _messages(self, request: Request) -> Response:
        msg = parse_messages(await read_json(request))
        prompt = await self.chat.prompt(msg.chat)
        req = self.chat.generate_request(prompt, msg.parameters(), msg.chat.images)
        if msg.stream:
            return await self._stream(request, msg, req, prompt)
        return await self._create(request, msg, req, prompt)

    async def _create(
        self, request: Request, msg: MessagesRequest, req: GenerateRequest, prompt: str
    ) -> Response:
        """The whole message at once: the output read by the same chat output path as a
        stream's (chat_answer)."""
        group = StreamGroup()
        with self.state.serving():
            async with watching_disconnect(request.receive, group.cancel):
                try:
                    result = await self.flow.generate(
                        req, route=ROUTE, headers=request.headers, group=group
                    )
                except ClientDisconnected:
                    return Response(status_code=CLIENT_CLOSED)
        seq, end = result.best, result.best.end
        answer = chat_answer(self.state.reasoning, prompt, _offered(msg), seq.tokens,
                             end.generated_text, end.finish_reason)
        said = outcome(answer, end.finish_reason, end.generated_text, msg.stop_sequences)
        body = message(message_id(), msg.model, said, seq.input_length, end.generated_tokens)
        headers = result.timings.headers(self.state.settings.compute_type, len(req.inputs))
        return json_response(body, headers=headers)

    async def _stream(
        self, request: Request, msg: MessagesRequest, req: GenerateRequest, prompt: str
    ) -> Response:
        group = StreamGroup()
        [submission] = await self.flow.admit(
            req, stream=True, route=ROUTE, headers=request.headers, group=group
        )
        events = MessageEvents(message_id(), msg.model, submission.valid.request.input_length)
        output = ChatOutputStream(self.state.reasoning, prompt, _offered(msg))
        encoder = MessageEncoder(events, output, msg.stop_sequences)
        body = encode_generation(self.state, submission, group, encoder)
        headers = {
            "x-compute-type": self.state.settings.compute_type,
            "x-compute-characters": str(len(req.inputs)),
        }
        return EventStreamResponse(_after(events.start(), body), headers,
                                   on_disconnect=group.cancel)


def _offered(msg: MessagesRequest) -> frozenset[str] | None:
    """The functions the tool grammar lets the model name (None: no tools offered)."""
    return msg.chat.tools.names() if msg.chat.tools is not None else None


async def _after(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`message_start` at once, then the generation's events; closing this closes them (their
    end releases the request)."""
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        aclose = getattr(rest, "aclose", None)  # an async generator's: its `finally` runs now
        if aclose is not None:
            await aclose()


async def _anthropic_errors(
    handler: Callable[[Request], Awaitable[Response]], request: Request
) -> Response:
    """The handler's answer, or its error in Anthropic's shape; an unexpected exception is
    logged and answered as Anthropic's `api_error` (500), never in another API's shape."""
    try:
        return await handler(request)
    except InferError as err:
        return error_response(err)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(InferError("Internal server error"))
