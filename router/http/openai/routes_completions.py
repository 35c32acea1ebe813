"""POST /v1/completions (OpenAI): one independent generate request per prompt."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytgi_router.core.errors import InferError
from pytgi_router.core.request_stream import End, Token
from pytgi_router.http.generate_flow import (
    ClientDisconnected,
    GenerateFlow,
    GenerateResult,
    StreamGroup,
    summed_headers,
)
from pytgi_router.http.http_errors import CompletionRequestError
from pytgi_router.http.http_io import json_response, read_json, watching_disconnect
from pytgi_router.http.openai.schemas import Envelope, completion, parse_completion
from pytgi_router.http.openai.stream import CompletionChunks, error_chunk
from pytgi_router.http.routes_generate import CLIENT_CLOSED
from pytgi_router.http.schemas import GenerateRequest
from pytgi_router.http.sse import DONE, EventStreamResponse
from pytgi_router.http.state import AppState
from pytgi_router.http.streaming import encode_generation, merge


class CompletionRoutes:
    def __init__(self, state: AppState, flow: GenerateFlow) -> None:
        self.state = state
        self.flow = flow

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.completions, methods=["POST"])]

    async def completions(self, request: Request) -> Response:
        return await self.completions_body(request, await read_json(request))

    async def completions_body(self, request: Request, body: object) -> Response:
        comp = parse_completion(body)
        limit = self.state.settings.max_client_batch_size
        if len(comp.prompts) > limit:
            raise CompletionRequestError(
                "batch size exceeded",
                f"Number of prompts exceeds the maximum allowed batch size of {limit}",
            )
        env = Envelope(
            model=comp.fields.model or self.state.model_id,
            system_fingerprint=self.state.system_fingerprint,
        )
        requests = [GenerateRequest(p, comp.parameters(), adapter_from_model=True)
                    for p in comp.prompts]
        if comp.fields.stream:
            return await self._stream(request, requests, env, comp.fields.include_usage)
        group = StreamGroup()
        with self.state.serving():
            async with watching_disconnect(request.receive, group.cancel):
                try:
                    results = await self._generate_all(request, requests, group)
                except ClientDisconnected:
                    return Response(status_code=CLIENT_CLOSED)
        out = completion(
            env,
            [(r.best.generated_text, r.best.end.finish_reason) for r in results],
            sum(r.best.input_length for r in results),
            sum(r.best.end.generated_tokens for r in results),
        )
        characters = sum(len(p) for p in comp.prompts)
        headers = summed_headers(
            [r.timings for r in results], self.state.settings.compute_type, characters
        )
        return json_response(out, headers=headers)

    async def _generate_all(
        self, request: Request, requests: list[GenerateRequest], group: StreamGroup
    ) -> list[GenerateResult]:
        tasks = [
            asyncio.ensure_future(self.flow.generate(
                req, route="completions", headers=request.headers, group=group
            ))
            for req in requests
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            group.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _stream(
        self, request: Request, requests: list[GenerateRequest], env: Envelope,
        include_usage: bool,
    ) -> Response:
        """Every prompt is validated and admitted before the stream starts (HTTP errors). With
        `stream_options.include_usage` the stream ends, before `[DONE]`, with OpenAI's
        usage-only chunk over all prompts (clients such as vLLM's benchmark count tokens from
        it); otherwise each prompt's last chunk carries its own usage, as TGI does."""
        group = StreamGroup()
        generations = []
        try:
            for req in requests:
                generations += await self.flow.admit(
                    req, stream=True, route="completions", headers=request.headers, group=group
                )
        except InferError:
            group.cancel()
            for generation in generations:
                generation.dropped()
            raise
        chunks = CompletionChunks(env)
        tally = UsageTally() if include_usage else None
        streams: list[AsyncIterator[bytes]] = [
            encode_generation(self.state, generation, group, CompletionEncoder(
                chunks, i, generation.valid.request.input_length, tally))
            for i, generation in enumerate(generations)
        ]
        headers = {
            "x-compute-type": self.state.settings.compute_type,
            "x-compute-characters": str(sum(len(r.inputs) for r in requests)),
        }
        events = merge(streams, DONE) if tally is None else usage_last(merge(streams), chunks, tally)
        return EventStreamResponse(events, headers, on_disconnect=group.cancel)


@dataclass(slots=True)
class UsageTally:
    """Tokens of every prompt of one completions stream, for the final usage-only chunk."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


async def usage_last(
    events: AsyncIterator[bytes], chunks: CompletionChunks, tally: UsageTally
) -> AsyncIterator[bytes]:
    """The merged events, then the usage-only chunk and `[DONE]` once every prompt ended."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for chunk in events:
            yield chunk
    yield chunks.usage(tally.prompt_tokens, tally.completion_tokens) + DONE


class CompletionEncoder:
    __slots__ = ("chunks", "index", "input_length", "tally")

    def __init__(
        self, chunks: CompletionChunks, index: int, input_length: int,
        tally: UsageTally | None = None,
    ) -> None:
        self.chunks = chunks
        self.index = index
        self.input_length = input_length
        self.tally = tally

    def token(self, index: int, ev: Token) -> bytes:
        return self.chunks.token(self.index, ev.token)

    def end(self, index: int, ev: End) -> bytes:
        if self.tally is not None:
            self.tally.prompt_tokens += self.input_length
            self.tally.completion_tokens += ev.generated_tokens
        return self.chunks.last(
            self.index, ev.token, ev.finish_reason, self.input_length, ev.generated_tokens,
            inline_usage=self.tally is None,
        )

    def error(self, err: InferError) -> bytes:
        return error_chunk(err)
