"""POST /v1/chat/completions (OpenAI) and POST /chat_tokenize.

A turn's output goes through the shared chat output path (chat_output.py: the thinking split off
by the reasoning parser, the answer as content or a tool call) and is rendered by chat_render.py;
the Responses and Anthropic Messages routes build their requests with `ChatRoutes.prompt` and
`ChatRoutes.generate_request` and render the same deltas in their own shapes.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytgi_router.core.errors import TemplateError
from pytgi_router.http.generate_flow import ClientDisconnected, GenerateFlow, StreamGroup
from pytgi_router.http.http_io import json_response, read_json, watching_disconnect
from pytgi_router.http.media.source import ImageRef
from pytgi_router.http.openai.chat_output import ChatOutputStream, chat_answer
from pytgi_router.http.openai.chat_render import ChatEncoder, OutputChatEncoder, assistant_message
from pytgi_router.http.openai.schemas import (
    ChatRequest,
    Envelope,
    chat_completion,
    chat_logprobs,
    parse_chat,
    usage,
)
from pytgi_router.http.openai.stream import ChatChunks
from pytgi_router.http.openai.tools import with_tool_prompt
from pytgi_router.http.reasoning.constraint import answer_grammar
from pytgi_router.http.routes_generate import CLIENT_CLOSED
from pytgi_router.http.routes_info import tokenize_answer
from pytgi_router.http.schemas import GenerateParameters, GenerateRequest
from pytgi_router.http.sse import EventStreamResponse
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
        Offered tools go to the template's `tools` and TGI's tool prompt to the last message;
        `chat_template_kwargs` are the template's too."""
        self.state.images.refuse_unless_accepted(self.state.model_id, chat.images)
        template = self.state.chat_template
        try:
            if template is None:
                raise TemplateError("template not found")
            messages, tools = chat.messages, None
            if chat.tools is not None:
                suffix = chat.tools.prompt_suffix(template.uses_tools)
                messages, tools = with_tool_prompt(messages, suffix), chat.tools.template_tools()
            return await self.state.validator.offload(
                template.apply, messages, tools, chat.template_kwargs
            )
        except TemplateError:
            m = self.state.metrics
            m.request_count.inc()
            m.request_failure.labels(err="template").inc()
            raise

    def generate_request(self, prompt: str, params: GenerateParameters,
                         images: list[ImageRef] | None = None) -> GenerateRequest:
        """The request a chat-shaped route submits: with a reasoning parser, a JSON grammar
        (tools, response_format) constrains the answer after the thinking, not the thinking
        (reasoning/constraint.py); the conversation's images go with it (the validator prepares
        them where the template placed them)."""
        params.grammar = answer_grammar(
            self.state.reasoning, prompt, params.grammar, self.state.settings.max_grammar_bytes
        )
        return GenerateRequest(prompt, params, add_special_tokens=False, adapter_from_model=True,
                               images=list(images or ()))

    async def counted_prompt(self, chat: ChatRequest) -> str:
        """The prompt as the model reads it, for counting: with images (a vision-language
        model), each one's image tokens in place, as the request itself would run."""
        text = await self.prompt(chat)
        preparer = self.state.validator.images
        if chat.images and preparer is not None:
            prepared = await preparer.prepare(text, chat.images)
            if prepared is not None:
                return prepared.text
        return text

    async def chat_tokenize(self, request: Request) -> Response:
        chat = parse_chat(await read_json(request))
        text = await self.counted_prompt(chat)
        return await tokenize_answer(self.state, text, add_special_tokens=False, templated=True)

    async def chat(self, request: Request) -> Response:
        return await self.chat_body(request, await read_json(request))

    async def chat_body(self, request: Request, body: object) -> Response:
        chat = parse_chat(body)
        prompt = await self.prompt(chat)
        req = self.generate_request(prompt, chat.parameters(), chat.images)
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
        parser = self.state.reasoning
        offered = chat.tools.names() if chat.tools is not None else None
        answer = chat_answer(parser, prompt, offered, seq.tokens, seq.generated_text,
                             seq.end.finish_reason)
        logprobs = chat_logprobs(seq.tokens, seq.top_tokens) if chat.logprobs else None
        reasoning_tokens = answer.end.reasoning_tokens if parser is not None else None
        out = chat_completion(
            env, assistant_message(answer, parser is not None), answer.end.finish_reason,
            logprobs, usage(seq.input_length, seq.end.generated_tokens, reasoning_tokens),
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
        enc = self._encoder(chat, req.inputs, env, input_length)
        headers = {
            "x-compute-type": self.state.settings.compute_type,
            "x-compute-characters": str(len(req.inputs)),
        }
        events = encode_generation(self.state, generation, group, enc)
        return EventStreamResponse(events, headers, on_disconnect=group.cancel)

    def _encoder(self, chat: ChatRequest, prompt: str, env: Envelope, input_length: int
                 ) -> Encoder:
        """The per-token fast path for a plain chat; the shared output path when there is
        thinking to split off or a tool call to read."""
        parser = self.state.reasoning
        include_usage = chat.fields.include_usage
        if parser is None and chat.tools is None:
            return ChatEncoder(ChatChunks(env, chat.logprobs), include_usage, input_length)
        offered = chat.tools.names() if chat.tools is not None else None
        output = ChatOutputStream(parser, prompt, offered)
        return OutputChatEncoder(ChatChunks(env, False), include_usage, input_length, output,
                                 parser is not None, chat.logprobs)
