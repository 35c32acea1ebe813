"""OpenAI-compatible bodies: chat/completions requests mapped onto generate requests the way TGI
maps them, and the response objects exactly as the OpenAI SDK parses them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pytgi_proto.parameters import BY_NAME, REPETITION_PENALTY_RANGE
from pytgi_router.core.errors import ValidationError
from pytgi_router.core.request_stream import TokenInfo
from pytgi_router.http.grammar import response_format_grammar
from pytgi_router.http.http_errors import CompletionRequestError, ToolError
from pytgi_router.http.json_fields import (
    obj,
    opt_bool,
    opt_float,
    opt_int,
    opt_obj,
    opt_str,
    required,
    wrong_type,
)
from pytgi_router.http.media.source import ImageRef
from pytgi_router.http.openai.tools import ChatTools, chat_tools, parse_tool_choice, parse_tools
from pytgi_router.http.schemas import GenerateParameters, logprob_or_none, reader

# TGI's finish reasons, as OpenAI names them.
FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


@dataclass(slots=True)
class SamplingFields:
    """What chat and completions share, before mapping onto GenerateParameters."""

    model: str | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: list[str]
    frequency_penalty: float | None
    presence_penalty: float | None
    repetition_penalty: float | None
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # vLLM's extension, see GenerateParameters.ignore_eos

    def parameters(self, *, top_n_tokens: int | None = None) -> GenerateParameters:
        # TGI: temperature 0 means greedy; any other value (or none) samples.
        greedy = self.temperature == 0.0
        repetition = self.repetition_penalty
        if self.presence_penalty is not None:
            repetition = self.presence_penalty + 2.0  # TGI's mapping, kept for parity
        return GenerateParameters(
            temperature=None if greedy else self.temperature,
            repetition_penalty=repetition,
            frequency_penalty=self.frequency_penalty,
            top_p=self.top_p,
            do_sample=not greedy,
            max_new_tokens=self.max_tokens,
            stop=self.stop,
            details=True,
            seed=self.seed,
            top_n_tokens=top_n_tokens,
            adapter_id=self.model if self.model not in (None, "tgi") else None,
            ignore_eos=self.ignore_eos,
        )


def _sampling_fields(data: dict[str, Any]) -> SamplingFields:
    max_tokens = opt_int(data, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = opt_int(data, "max_tokens")
    options = opt_obj(data, "stream_options") or {}
    return SamplingFields(
        model=opt_str(data, "model"),
        max_tokens=max_tokens,
        temperature=_as_tgi(data, "temperature"),
        top_p=_as_tgi(data, "top_p"),
        seed=_as_tgi(data, "seed"),
        stop=_as_tgi(data, "stop"),
        frequency_penalty=_as_tgi(data, "frequency_penalty"),
        presence_penalty=_presence_penalty(data),
        repetition_penalty=_as_tgi(data, "repetition_penalty"),
        stream=bool(opt_bool(data, "stream")),
        include_usage=bool(opt_bool(options, "include_usage", "stream_options.")),
        ignore_eos=_as_tgi(data, "ignore_eos"),
    )


def _as_tgi(data: dict[str, Any], name: str) -> Any:
    """An OpenAI field spelled as TGI's, read by its row of the parameter table (type, range,
    aliases): the two APIs cannot parse it differently."""
    return reader(BY_NAME[name])(data, name, "")


def _presence_penalty(data: dict[str, Any]) -> float | None:
    """OpenAI's range, then TGI's mapping onto `repetition_penalty` (+ 2.0) held to the range
    the validator accepts, with a message about the field the client sent: -1.9999999 would run
    as a penalty of 1e-7."""
    value = opt_float(data, "presence_penalty")
    if value is None:
        return None
    if not -2.0 <= value <= 2.0:
        raise ValidationError("`presence_penalty` must be >= -2.0 and <= 2.0")
    lowest = REPETITION_PENALTY_RANGE[0]
    if value + 2.0 < lowest:
        raise ValidationError(
            f"`presence_penalty` must be > {lowest - 2.0}: it runs as `repetition_penalty` = "
            f"presence_penalty + 2.0 (TGI's mapping), which must be >= {lowest}. Given: {value}"
        )
    return value


# ---- chat --------------------------------------------------------------------------------------


@dataclass(slots=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    fields: SamplingFields
    logprobs: bool = False
    top_logprobs: int | None = None
    grammar: dict[str, Any] | None = None
    # The functions offered and the tool prompt (None: no tools, or `tool_choice: "none"`).
    tools: ChatTools | None = None
    # More variables for the chat template (vLLM's `chat_template_kwargs`: `enable_thinking`).
    template_kwargs: dict[str, Any] | None = None
    # The images of every message's content, in order (router/http/media/).
    images: list[ImageRef] = field(default_factory=list)

    def parameters(self) -> GenerateParameters:
        p = self.fields.parameters(top_n_tokens=self.top_logprobs)
        p.grammar = self.tools.grammar() if self.tools is not None else self.grammar
        return p


def _content(value: Any, path: str, images: list[ImageRef]) -> str | list[dict[str, Any]] | None:
    """A message's content: a string, or its parts. Text parts alone join into one string; with
    images it stays a list of parts in transformers' shape (`{"type": "text", "text"}` and
    `{"type": "image"}`, which vision-language templates iterate), each image's URL kept in
    `images` with the place it came from (a converted Responses or Messages body names its own
    place in the part's `where`)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type(path, "a string or an array of content parts", value)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(value):
        part = obj(part, f"{path}[{i}]")
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": str(required(part, "text", f"{path}[{i}]."))})
        elif kind == "image_url":
            url = obj(required(part, "image_url", f"{path}[{i}]."), f"{path}[{i}].image_url")
            link = required(url, "url", f"{path}[{i}].image_url.")
            if not isinstance(link, str):
                raise wrong_type(f"{path}[{i}].image_url.url", "a string", link)
            where = part.get("where")
            images.append(ImageRef(where if isinstance(where, str) else f"{path}[{i}]", link))
            parts.append({"type": "image"})
        else:
            raise ValidationError(f"`{path}[{i}].type` must be \"text\" or \"image_url\"")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _message(value: Any, i: int, images: list[ImageRef]) -> dict[str, Any]:
    path = f"messages[{i}]"
    data = obj(value, path)
    role = required(data, "role", f"{path}.")
    if not isinstance(role, str):
        raise wrong_type(f"{path}.role", "a string", role)
    content = _content(data.get("content"), f"{path}.content", images)
    message: dict[str, Any] = {"role": role, "content": content}
    # `reasoning_content`: an earlier turn's thinking, for templates that render it (Qwen3).
    for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        if data.get(key) is not None:
            message[key] = data[key]
    if message["content"] is None and "tool_calls" not in message:
        message["content"] = ""
    return message


def parse_chat(body: Any) -> ChatRequest:
    data = obj(body, "body")
    raw = required(data, "messages")
    if not isinstance(raw, list):
        raise wrong_type("messages", "an array of messages", raw)
    if not raw:
        raise ValidationError("`messages` cannot be empty")
    tools = parse_tools(data.get("tools"))
    grammar = response_format_grammar(opt_obj(data, "response_format"))
    if tools and grammar is not None:
        raise ToolError("Grammar and tools are mutually exclusive")
    tool_prompt = opt_str(data, "tool_prompt")
    offered = chat_tools(tools, parse_tool_choice(data.get("tool_choice")), tool_prompt)
    logprobs = bool(opt_bool(data, "logprobs"))
    top = opt_int(data, "top_logprobs")
    images: list[ImageRef] = []
    return ChatRequest(
        messages=[_message(m, i, images) for i, m in enumerate(raw)],
        fields=_sampling_fields(data),
        logprobs=logprobs,
        top_logprobs=top if logprobs else None,
        grammar=grammar,
        tools=offered,
        template_kwargs=opt_obj(data, "chat_template_kwargs"),
        images=images,
    )


def logprob_entry(t: TokenInfo, top: list[TokenInfo]) -> dict[str, Any]:
    return {
        "token": t.text,
        "logprob": logprob_or_none(t.logprob),
        "bytes": list(t.text.encode()),
        "top_logprobs": [
            {"token": x.text, "logprob": logprob_or_none(x.logprob), "bytes": list(x.text.encode())}
            for x in top
        ],
    }


def chat_logprobs(tokens: list[TokenInfo], top: list[list[TokenInfo]]) -> dict[str, Any]:
    return {
        "content": [
            logprob_entry(t, top[i] if i < len(top) else []) for i, t in enumerate(tokens)
        ]
    }


def usage(
    prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; `completion_tokens_details.reasoning_tokens` when a reasoning parser
    counted them (None: none serves)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


@dataclass(slots=True)
class Envelope:
    """The fields every OpenAI object of one response repeats."""

    model: str
    system_fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def head(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }


def chat_completion(
    env: Envelope, message: dict[str, Any], finish_reason: str,
    logprobs: dict[str, Any] | None, usage_json: dict[str, Any],
) -> dict[str, Any]:
    """A `chat.completion` of one choice: its message and OpenAI's finish reason."""
    out = env.head("chat.completion")
    out["choices"] = [{
        "index": 0,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }]
    out["usage"] = usage_json
    return out


# ---- completions -------------------------------------------------------------------------------


@dataclass(slots=True)
class CompletionRequest:
    prompts: list[str]
    fields: SamplingFields
    echo: bool = False
    grammar: dict[str, Any] | None = None

    def parameters(self) -> GenerateParameters:
        p = self.fields.parameters()
        p.return_full_text = self.echo
        p.grammar = self.grammar
        return p


def parse_completion(body: Any) -> CompletionRequest:
    data = obj(body, "body")
    if data.get("suffix"):
        raise CompletionRequestError(
            "suffix not supported",
            "Suffix is not supported and can be achieved by preprocessing the prompt.",
        )
    prompt = required(data, "prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    else:
        raise wrong_type("prompt", "a string or an array of strings", prompt)
    if not prompts:
        raise ValidationError("`prompt` cannot be empty")
    return CompletionRequest(
        prompts=prompts, fields=_sampling_fields(data), echo=bool(opt_bool(data, "echo")),
        grammar=response_format_grammar(opt_obj(data, "response_format")),
    )


def completion(
    env: Envelope, choices: list[tuple[str, str]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    out = env.head("text_completion")
    out["choices"] = [
        {"index": i, "text": text, "logprobs": None,
         "finish_reason": FINISH_REASONS.get(reason, reason)}
        for i, (text, reason) in enumerate(choices)
    ]
    out["usage"] = usage(prompt_tokens, completion_tokens)
    return out


def models_list(model_id: str, adapters: tuple[str, ...] = ()) -> dict[str, Any]:
    """The served model, then each LoRA adapter with the model as its `parent` (vLLM's shape);
    an adapter's id is what `model` selects it by."""
    base: dict[str, Any] = {"id": model_id, "object": "model", "created": 0, "owned_by": model_id}
    if adapters:
        base["parent"] = None
    lora = [{"id": name, "object": "model", "created": 0, "owned_by": model_id,
             "parent": model_id} for name in adapters]
    return {"object": "list", "data": [base, *lora]}
