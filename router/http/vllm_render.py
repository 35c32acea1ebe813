"""The worker endpoints that vLLM's router (`vllm-router`, PyPI) calls on each worker it balances
besides the OpenAI routes it forwards: `POST /v1/chat/completions/render` and
`POST /v1/completions/render` (the request rendered to the token ids the worker would run:
its cache-aware policy routes on them), and vLLM's `/tokenize` (its fallback when render
fails) and `/detokenize`.

Shapes are vLLM's: render answers a GenerateRequest (`request_id`, `token_ids`,
`sampling_params`, `model`, `stream`...) for a chat and a list of them for completions (one per
prompt); `/tokenize` takes `prompt` or `messages` and answers `{count, max_model_len, tokens,
token_strs}`; `/detokenize` takes `tokens` and answers `{prompt}`. The chat is parsed and
templated as /v1/chat/completions does it (ChatRoutes.prompt), a completions prompt tokenized as
/v1/completions does it, so the ids are those the generation would run. Errors take OpenAI's
shape, as vLLM's do.

`/tokenize` is also TGI's route: a body with `inputs` is TGI's (answered by InfoRoutes); one
with `prompt` or `messages` and no `inputs` is vLLM's; one with both is a 422."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pytgi_router.core.errors import InferError, ValidationError
from pytgi_router.http.http_io import json_response, other_api_body, read_json
from pytgi_router.http.openai.errors import in_openai_shape, openai_error_response
from pytgi_router.http.openai.routes_chat import ChatRoutes
from pytgi_router.http.openai.schemas import ChatRequest, parse_chat, parse_completion
from pytgi_router.http.routes_info import InfoRoutes
from pytgi_router.http.schemas import GenerateParameters
from pytgi_router.http.state import AppState

# vLLM's tokenize/render flags that pytgi follows only at their default (the chat template
# always adds the generation prompt; a final assistant message is never continued).
CHAT_DEFAULTS = {"add_generation_prompt": True, "continue_final_message": False}



def is_vllm_tokenize(body: Any) -> bool:
    """vLLM's /tokenize body: `prompt` or `messages`, and no TGI `inputs` (both: a 422)."""
    return other_api_body(body, ("prompt", "messages"), "vLLM")


def sampling_params(p: GenerateParameters) -> dict[str, Any]:
    """vLLM's SamplingParams fields for the parameters the request would run with (None: the
    server's default), so that a router forwarding the rendered request keeps its sampling."""
    return {
        "n": 1, "temperature": p.temperature if p.do_sample else 0.0, "top_p": p.top_p,
        "top_k": p.top_k, "seed": p.seed, "max_tokens": p.max_new_tokens, "stop": list(p.stop),
        "repetition_penalty": p.repetition_penalty, "frequency_penalty": p.frequency_penalty,
        "ignore_eos": p.ignore_eos,
    }


def generate_request(prefix: str, ids: list[int], params: GenerateParameters, model: str,
                     body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's GenerateRequest, the answer of its render routes."""
    stream = body.get("stream") is True
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}", "token_ids": ids,
        "sampling_params": sampling_params(params), "model": model, "stream": stream,
        "stream_options": body.get("stream_options") if stream else None,
        "features": None, "cache_salt": None, "priority": 0, "kv_transfer_params": None,
        "token_offsets": None,
    }


def chat_flags(body: dict[str, Any]) -> None:
    """Refuses vLLM's chat flags at values pytgi's template rendering does not do."""
    for key, default in CHAT_DEFAULTS.items():
        if body.get(key, default) not in (default, None):
            raise ValidationError(f"`{key}` must be {str(default).lower()} on pytgi")


class VllmRoutes:
    def __init__(self, state: AppState, chat: ChatRoutes, info: InfoRoutes) -> None:
        self.state = state
        self.chat = chat
        self.info = info

    def routes(self) -> list[Route]:
        """Before InfoRoutes' routes: this /tokenize hands TGI's body to InfoRoutes."""
        return [
            Route("/v1/chat/completions/render", in_openai_shape(self.render_chat),
                  methods=["POST"]),
            Route("/v1/completions/render", in_openai_shape(self.render_completions),
                  methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", in_openai_shape(self.detokenize), methods=["POST"]),
        ]

    async def ids(self, text: str, add_special_tokens: bool, truncate: int | None = None
                  ) -> list[int]:
        """`text`'s token ids, under a permit and bounded as a prompt is (Validator.tokenize)."""
        with self.state.infer.permit():
            tokenized = await self.state.validator.tokenize(text, add_special_tokens, truncate)
        return list(tokenized.encoding.ids)

    async def chat_ids(self, chat: ChatRequest, add_special_tokens: bool = False) -> list[int]:
        """The ids /v1/chat/completions would run: the templated chat, no special tokens added
        (the template writes them) unless vLLM's /tokenize asks for them."""
        if chat.images:
            raise ValidationError("images are not rendered to token ids by pytgi")
        return await self.ids(await self.chat.prompt(chat), add_special_tokens)

    def model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) and model else self.state.model_id

    async def render_chat(self, request: Request) -> Response:
        body = await read_json(request)
        chat = parse_chat(body)
        chat_flags(body)
        ids = await self.chat_ids(chat)
        return json_response(
            generate_request("chatcmpl", ids, chat.parameters(), self.model(body), body))

    async def render_completions(self, request: Request) -> Response:
        body = await read_json(request)
        comp = parse_completion(body)
        params = comp.parameters()
        out = [generate_request("cmpl", await self.ids(p, True, params.truncate), params,
                                self.model(body), body) for p in comp.prompts]
        return json_response(out)

    async def tokenize(self, request: Request) -> Response:
        """One path, two bodies: TGI's goes to InfoRoutes (its answer and error shape), vLLM's
        is answered here in OpenAI's shape, as vLLM's clients parse it."""
        body = await read_json(request)
        try:
            vllm = is_vllm_tokenize(body)
        except InferError as err:
            return openai_error_response(err)
        if not vllm:
            return await self.info.tokenize(request)
        try:
            return await self.vllm_tokenize(body)
        except InferError as err:
            return openai_error_response(err)

    async def vllm_tokenize(self, body: dict[str, Any]) -> Response:
        """vLLM's TokenizeCompletionRequest (`prompt`; special tokens added unless
        `add_special_tokens: false`) or TokenizeChatRequest (`messages`, templated; special
        tokens only with `add_special_tokens: true`)."""
        add = body.get("add_special_tokens")
        if add is not None and not isinstance(add, bool):
            raise ValidationError("`add_special_tokens` must be a boolean")
        if "messages" in body:
            chat_flags(body)
            ids = await self.chat_ids(parse_chat(body), bool(add))
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ValidationError("`prompt` must be a string")
            ids = await self.ids(prompt, add is not False)
        strs = None
        if body.get("return_token_strs") is True:
            tokenizer = self.state.validator.tokenizer
            strs = [tokenizer.id_to_token(i) or "" for i in ids]
        return json_response({"count": len(ids), "tokens": ids, "token_strs": strs,
                              "max_model_len": self.state.infer.info.max_total_tokens})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: the ids are checked against the vocabulary first (an id past it
        is the client's 422, not a tokenizer error); decoding runs in the worker pool."""
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ValidationError("the body must be an object with `tokens`")
        tokens = body.get("tokens")
        size = self.state.validator.tokenizer.get_vocab_size(with_added_tokens=True)
        if not (isinstance(tokens, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < size
                for t in tokens)):
            raise ValidationError(f"`tokens` must be a list of token ids in [0, {size})")
        with self.state.infer.permit():
            text = await self.state.validator.offload(
                self.state.validator.tokenizer.decode, tokens, False)
        return json_response({"prompt": text})
