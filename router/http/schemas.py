"""TGI's generate bodies: request parsing with TGI's defaults, and the JSON of its responses.

The per-token SSE encoders are on the hot path: they splice pre-escaped strings instead of
building dicts for `json.dumps`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from json.encoder import encode_basestring as _quote  # type: ignore[attr-defined]
from typing import Any

from pytgi_proto.parameters import BY_NAME, U32_MAX, Parameter
from pytgi_router.core.request_stream import End, TokenInfo
from pytgi_router.http.json_fields import (
    obj,
    opt_bool,
    opt_float,
    opt_int,
    opt_obj,
    opt_str,
    req_str,
    str_list,
)
from pytgi_router.http.media.source import ImageRef


@dataclass(slots=True)
class GenerateParameters:
    """`parameters` of a generate request; None means "not given" (TGI's Option fields).
    One field per row of pytgi_proto.parameters.PARAMETERS, which says how each is read,
    bounded and documented (a test keeps the two equal)."""

    best_of: int | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: int | None = None
    return_full_text: bool | None = None
    stop: list[str] = field(default_factory=list)
    truncate: int | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: int | None = None
    top_n_tokens: int | None = None
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None
    ignore_eos: bool = False


@dataclass(slots=True)
class GenerateRequest:
    inputs: str
    parameters: GenerateParameters
    # Internal (TGI too): true for the generate routes, false for chat (the template adds BOS).
    add_special_tokens: bool = True
    stream: bool = False
    # True when parameters.adapter_id is OpenAI's `model`, which names the served model or an
    # adapter: a name that is neither then runs the base model (TGI's behaviour) instead of
    # being refused as an unknown `adapter_id` is.
    adapter_from_model: bool = False
    # A prompt already tokenized (SGLang's `input_ids`, sglang_generate.py): validated as ids,
    # never re-tokenized; `inputs` is then empty.
    input_ids: list[int] | None = None
    # A chat prompt's images, in the order its template placed them (router/http/media/);
    # /generate's are markdown inside `inputs`.
    images: list[ImageRef] = field(default_factory=list)


def parse_parameters(data: dict[str, Any] | None, path: str = "parameters.") -> GenerateParameters:
    """An omitted `parameters` object samples (TGI's default_parameters); `{}` is greedy.
    Each field is read as its row of pytgi_proto.parameters says (type, range, aliases)."""
    if data is None:
        return GenerateParameters(do_sample=True)
    return GenerateParameters(*[read(data, name, path) for name, read in _READ_PLAN])


Reader = Callable[[dict[str, Any], str, str], Any]


def reader(param: Parameter) -> Reader:
    """How one row is read from a body: by its JSON kind (an integer within its range); a flag
    (TGI's plain `bool`) is True if any of its spellings says so."""
    if param.flag and param.aliases:
        return partial(_any_flag, spellings=(param.name, *param.aliases))
    if param.flag:
        return _flag
    if param.kind == "integer" and (param.lo, param.hi) != (0, U32_MAX):
        return partial(opt_int, lo=param.lo, hi=param.hi)
    return _READERS[param.kind]


def _flag(data: dict[str, Any], key: str, path: str) -> bool:
    return bool(opt_bool(data, key, path))


def _any_flag(data: dict[str, Any], key: str, path: str, *, spellings: tuple[str, ...]) -> bool:
    return any(opt_bool(data, spelling, path) for spelling in spellings)


_READERS: dict[str, Reader] = {
    "integer": opt_int,  # TGI's u32, opt_int's own default range
    "number": opt_float,
    "boolean": opt_bool,
    "string": opt_str,
    "object": opt_obj,
    "strings": str_list,
}
# In the dataclass's order, which is the order fields were always read in (the first wrong one
# is the 422); a field without a row fails here, at import. Built once: a request costs one
# call per field, as the hand-written reads did.
_READ_PLAN: tuple[tuple[str, Reader], ...] = tuple(
    (f.name, reader(BY_NAME[f.name])) for f in fields(GenerateParameters))


def parse_generate(body: Any) -> GenerateRequest:
    """`{"inputs": str, "parameters"?: {...}, "stream"?: bool}` (stream only matters on `/`)."""
    data = obj(body, "body")
    return GenerateRequest(
        inputs=req_str(data, "inputs"),
        parameters=parse_parameters(opt_obj(data, "parameters")),
        stream=bool(opt_bool(data, "stream")),
    )


# ---- responses ---------------------------------------------------------------------------------


def logprob_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def token_dict(t: TokenInfo) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": logprob_or_none(t.logprob), "special": t.special}


def prefill_dict(t: TokenInfo) -> dict[str, Any]:
    return {"id": t.id, "text": t.text, "logprob": logprob_or_none(t.logprob)}


@dataclass(slots=True)
class Sequence:
    """One finished generation: everything a response may show of it."""

    generated_text: str
    end: End
    prefill: list[TokenInfo]
    tokens: list[TokenInfo]
    top_tokens: list[list[TokenInfo]]
    input_length: int

    @property
    def mean_logprob(self) -> float:
        if not self.tokens:
            return -math.inf
        return sum(t.logprob for t in self.tokens) / len(self.tokens)


def _sequence_details(seq: Sequence, *, with_text: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if with_text:
        out["generated_text"] = seq.generated_text
    out["finish_reason"] = seq.end.finish_reason
    out["generated_tokens"] = seq.end.generated_tokens
    out["seed"] = seq.end.seed
    out["prefill"] = [prefill_dict(t) for t in seq.prefill]
    out["tokens"] = [token_dict(t) for t in seq.tokens]
    if any(seq.top_tokens):
        out["top_tokens"] = [[token_dict(t) for t in step] for step in seq.top_tokens]
    return out


def generate_response(
    best: Sequence, others: list[Sequence], *, details: bool
) -> dict[str, Any]:
    """TGI's GenerateResponse; `details` is omitted unless asked for."""
    out: dict[str, Any] = {"generated_text": best.generated_text}
    if details:
        d = _sequence_details(best, with_text=False)
        if others:
            d["best_of_sequences"] = [_sequence_details(s, with_text=True) for s in others]
        out["details"] = d
    return out


# ---- SSE events of /generate_stream (hot path) -------------------------------------------------


def _float(value: float) -> str:
    return repr(value) if math.isfinite(value) else "null"


def token_json(t: TokenInfo) -> str:
    return (
        f'{{"id":{t.id},"text":{_quote(t.text)},"logprob":{_float(t.logprob)},'
        f'"special":{"true" if t.special else "false"}}}'
    )


def _top_tokens_json(top: list[TokenInfo]) -> str:
    return ',"top_tokens":[' + ",".join(token_json(t) for t in top) + "]" if top else ""


def stream_token_event(index: int, token: TokenInfo, top: list[TokenInfo]) -> bytes:
    return (
        f'data: {{"index":{index},"token":{token_json(token)}{_top_tokens_json(top)},'
        '"generated_text":null,"details":null}\n\n'
    ).encode()


def stream_end_event(
    index: int, end: End, generated_text: str, input_length: int, *, details: bool
) -> bytes:
    if details:
        seed = "null" if end.seed is None else str(end.seed)
        detail = (
            f'{{"finish_reason":"{end.finish_reason}","generated_tokens":{end.generated_tokens},'
            f'"seed":{seed},"input_length":{input_length}}}'
        )
    else:
        detail = "null"
    return (
        f'data: {{"index":{index},"token":{token_json(end.token)}'
        f"{_top_tokens_json(end.top_tokens)},"
        f'"generated_text":{_quote(generated_text)},"details":{detail}}}\n\n'
    ).encode()


def error_event(status_error: dict[str, str]) -> bytes:
    return b"data: " + json.dumps(status_error).encode() + b"\n\n"
