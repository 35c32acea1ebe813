"""POST /v1/chat/completions (OpenAI) and POST /chat_tokenize."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytgi_router.core.errors import InferError, TemplateError
from pytgi_router.core.request_stream import End, Token
from pytgi_router.http.generate_flow import ClientDisconnected, GenerateFlow, StreamGroup
from pytgi_router.http.http_errors import ToolError
from pytgi_router.http.http_io import json_response, read_json, watching_disconnect
from pytgi_router.http.openai.schemas import (
    ChatRequest,
    Envelope,
    chat_completion,
    chat_logprobs,
    parse_chat,
)
from pytgi_router.http.openai.stream import ChatChunks, error_chunk
from pytgi_router.http.openai.tool_output import new_call_id, tool_answer, tool_call_json
from pytgi_router.http.openai.tool_stream import Delta, ToolCallStream
from pytgi_router.http.openai.tools import with_tool_prompt
from pytgi_router.http.routes_generate import CLIENT_CLOSED
from pytgi_router.http.routes_info import tokenize_answer
from pytgi_router.http.schemas import GenerateRequest
from pytgi_router.http.sse import DONE, EventStreamResponse
from pytgi_router.http.state import AppState
from pytgi_router.http.streaming import Encoder, encode_generation


class ChatRoutes:
    def __init__(self, state: AppState, flow: GenerateFlow) -> None:
        self.state = state
        self.flow = flow

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/chat_tokenize", self.chat_tokenize, methods=["POST"]),
        ]

    async def prompt(self, chat: ChatRequest) -> str:
        """Renders in the worker pool: a conversation near the payload limit takes a while.
        Offered tools go to the template's `tools` and TGI's tool prompt to the last message."""
        template = self.state.chat_template
        try:
            if template is None:
                raise TemplateError("template not found")
            messages, tools = chat.messages, None
            if chat.tools is not None:
                suffix = chat.tools.prompt_suffix(template.uses_tools)
                messages, tools = with_tool_prompt(messages, suffix), chat.tools.template_tools()
            return await self.state.validator.offload(template.apply, messages, tools)
        except TemplateError:
            m = self.state.metrics
            m.request_count.inc()
            m.request_failure.labels(err="template").inc()
            raise

    async def chat_tokenize(self, request: Request) -> Response:
        chat = parse_chat(await read_json(request))
        text = await self.prompt(chat)
        return await tokenize_answer(self.state, text, add_special_tokens=False, templated=True)

    async def chat(self, request: Request) -> Response:
        return await self.chat_body(request, await read_json(request))

    async def chat_body(self, request: Request, body: object) -> Response:
        chat = parse_chat(body)
        req = GenerateRequest(await self.prompt(chat), chat.parameters(), add_special_tokens=False)
        env = Envelope(
            model=chat.fields.model or self.state.model_id,
            system_fingerprint=self.state.system_fingerprint,
        )
        if chat.fields.stream:
            return await self._stream(request, chat, req, env)
        group = StreamGroup()
        with self.state.serving():
            async with watching_disconnect(request.receive, group.cancel):
                try:
                    result = await self.flow.generate(
                        req, route="chat_completions", headers=request.headers, group=group
                    )
                except ClientDisconnected:
                    return Response(status_code=CLIENT_CLOSED)
        seq = result.best
        logprobs = chat_logprobs(seq.tokens, seq.top_tokens) if chat.logprobs else None
        text, reason, tool_calls = seq.generated_text, seq.end.finish_reason, None
        if chat.tools is not None:
            text, reason, tool_calls = tool_message(text, reason, chat.tools.names())
        out = chat_completion(
            env, text, reason, logprobs, seq.input_length, seq.end.generated_tokens, tool_calls,
        )
        headers = result.timings.headers(self.state.settings.compute_type, len(req.inputs))
        return json_response(out, headers=headers)

    async def _stream(
        self, request: Request, chat: ChatRequest, req: GenerateRequest, env: Envelope
    ) -> Response:
        group = StreamGroup()
        generations = await self.flow.admit(
            req, stream=True, route="chat_completions", headers=request.headers, group=group
        )
        generation = generations[0]
        input_length = generation.valid.request.input_length
        enc: Encoder = ChatEncoder(
            ChatChunks(env, chat.logprobs), chat.fields.include_usage, input_length
        )
        if chat.tools is not None:
            enc = ToolChatEncoder(ChatChunks(env, False), chat.fields.include_usage, input_length,
                                  chat.tools.names())
        headers = {
            "x-compute-type": self.state.settings.compute_type,
            "x-compute-characters": str(len(req.inputs)),
        }
        events = encode_generation(self.state, generation, group, enc)
        return EventStreamResponse(events, headers, on_disconnect=group.cancel)


class ChatEncoder:
    __slots__ = ("chunks", "include_usage", "input_length")

    def __init__(self, chunks: ChatChunks, include_usage: bool, input_length: int) -> None:
        self.chunks = chunks
        self.include_usage = include_usage
        self.input_length = input_length

    def token(self, index: int, ev: Token) -> bytes:
        return self.chunks.token(ev.token, ev.top_tokens)

    def end(self, index: int, ev: End) -> bytes:
        out = self.chunks.token(ev.token, ev.top_tokens, ev.finish_reason)
        if self.include_usage:
            out += self.chunks.usage(self.input_length, ev.generated_tokens)
        return out + DONE

    def error(self, err: InferError) -> bytes:
        return error_chunk(err) + DONE


def tool_message(
    text: str, finish_reason: str, offered: frozenset[str]
) -> tuple[str, str, list[dict[str, object]] | None]:
    """(content, finish reason, tool_calls) of a tool-constrained output: a whole call is a
    tool call ("tool_calls"); no_tool's answer its content; one cut by `max_tokens` "length"
    with what it wrote (its partial call, no_tool's content so far, or nothing); any other cut
    a ToolError (422)."""
    answer = tool_answer(text, finish_reason, offered)
    output = answer.output
    if output is None or not output.is_call:
        return (output.content or "") if output else "", answer.finish_reason, None
    return "", answer.finish_reason, [tool_call_json(new_call_id(), output)]


class ToolChatEncoder:
    """A tool-constrained chat stream as OpenAI sends one: the role once, in the first delta;
    tool calls with their id, type and name once, then argument fragments (accumulators such
    as the OpenAI SDK's stream helper join every string field they see again); or no_tool's
    content. The last chunk says "tool_calls" only when the whole output is a call to an
    `offered` function, "length" when `max_tokens` cut it; any other cut ends the stream with
    an error event instead."""

    __slots__ = ("chunks", "include_usage", "input_length", "offered", "parser", "call_id",
                 "_started")

    def __init__(
        self, chunks: ChatChunks, include_usage: bool, input_length: int, offered: frozenset[str]
    ) -> None:
        self.chunks = chunks
        self.include_usage = include_usage
        self.input_length = input_length
        self.offered = offered
        self.parser = ToolCallStream()
        self.call_id = new_call_id()
        self._started = False

    def token(self, index: int, ev: Token) -> bytes:
        if ev.token.special:
            return b""
        return self._render(self.parser.push(ev.token.text))

    def end(self, index: int, ev: End) -> bytes:
        last = "" if ev.token.special else ev.token.text
        out = self._render(self.parser.finish(last, ev.generated_text))
        try:
            answer = tool_answer(ev.generated_text, ev.finish_reason, self.offered)
        except ToolError as err:
            return out + self.error(err)
        out += self.chunks.delta(self._role({}), answer.finish_reason)
        if self.include_usage:
            out += self.chunks.usage(self.input_length, ev.generated_tokens)
        return out + DONE

    def error(self, err: InferError) -> bytes:
        return error_chunk(err) + DONE

    def _render(self, deltas: list[Delta]) -> bytes:
        return b"".join(self.chunks.delta(self._role(self._delta(d))) for d in deltas)

    def _role(self, delta: dict[str, object]) -> dict[str, object]:
        if self._started:
            return delta
        self._started = True
        return {"role": "assistant", **delta}

    def _delta(self, d: Delta) -> dict[str, object]:
        if d.kind == "content":
            return {"content": d.text}
        if d.kind == "call":
            call = {"index": 0, "id": self.call_id, "type": "function",
                    "function": {"name": d.text, "arguments": ""}}
            return {"content": None, "tool_calls": [call]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]}
