"""SGLang's /generate body and answer, beside TGI's on the same route: SGLang's router
(sglang-router) re-serializes every /generate it forwards in SGLang's shape (`text`,
`sampling_params`, `stream`, and its flags), so a worker behind it must read that shape.

Told apart without ambiguity: a body with `inputs` is TGI's; one with `text` or `input_ids` and
no `inputs` is SGLang's; one with both is a 422. SGLang's sampling parameters become TGI's
parameters, so the same validation and limits apply."""

from __future__ import annotations

import json
import time
from typing import Any

from pytgi_router.core.errors import InferError, ValidationError
from pytgi_router.core.request_stream import End, Token
from pytgi_router.http.http_io import other_api_body
from pytgi_router.http.schemas import GenerateRequest, Sequence, parse_parameters

# SGLang's own keys (the default values its router always sends) that change nothing here.
IGNORED = frozenset({
    "model", "rid", "log_metrics", "no_logs", "return_text_in_logprobs", "stream_output",
})
# Keys accepted only at their neutral value (false, null): pytgi has no such feature here.
NEUTRAL_ONLY = frozenset({
    "return_logprob", "return_hidden_states", "background", "return_bytes", "return_entropy",
    "image_data", "audio_data", "video_data", "session_params", "custom_logit_processor",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "data_parallel_rank",
})
# sampling_params → TGI parameter (same meaning); the others below are mapped by hand.
SAME = {"max_new_tokens": "max_new_tokens", "stop": "stop", "ignore_eos": "ignore_eos",
        "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
        "sampling_seed": "seed"}
# SGLang's defaults: 128 new tokens, temperature 1 (sampling).
DEFAULT_MAX_NEW_TOKENS = 128
NEUTRAL_SAMPLING = {"n": 1, "presence_penalty": 0.0, "min_p": 0.0, "min_new_tokens": 0,
                    "skip_special_tokens": True, "spaces_between_special_tokens": True,
                    "no_stop_trim": False, "stop_token_ids": None}


def is_sglang(body: Any) -> bool:
    """SGLang's shape: `text` or `input_ids` and no `inputs` (both: a 422, never a guess)."""
    return other_api_body(body, ("text", "input_ids"), "SGLang")


def parse_sglang(body: dict[str, Any]) -> GenerateRequest:
    """SGLang's GenerateReqInput (one prompt, as text or token ids) → TGI's GenerateRequest."""
    for key, value in body.items():
        if key in NEUTRAL_ONLY and value not in (None, False):
            raise ValidationError(f"`{key}` is not supported on SGLang's /generate by pytgi")
        if key not in NEUTRAL_ONLY and key not in IGNORED and key not in (
                "text", "input_ids", "sampling_params", "stream", "lora_path"):
            raise ValidationError(f"unknown field `{key}` in SGLang's /generate body")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ValidationError("send one of `text` and `input_ids`")
    if text is not None and not isinstance(text, str):
        raise ValidationError("`text` must be one string (batches are not supported)")
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ValidationError("`input_ids` must be one list of token ids (batches are not "
                              "supported)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValidationError("`stream` must be a boolean")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise ValidationError("`sampling_params` must be an object")
    params = tgi_parameters(sampling)
    lora = body.get("lora_path")
    if lora is not None:
        if not isinstance(lora, str):
            raise ValidationError("`lora_path` must be one adapter name (batches are not "
                                  "supported)")
        params["adapter_id"] = lora  # a loaded adapter's name, validated as TGI's adapter_id
    return GenerateRequest(inputs=text or "", input_ids=ids,
                           parameters=parse_parameters(params, "sampling_params."), stream=stream)


def tgi_parameters(sampling: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling_params as TGI's parameters (then validated as TGI's): temperature 0 is
    greedy, SGLang's "off" values (top_p 1, top_k -1 or 0) are left out."""
    out: dict[str, Any] = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "details": True}
    for key, value in sampling.items():
        if value is None:
            continue
        if key in SAME:
            out[SAME[key]] = value
        elif key in ("temperature", "top_p", "top_k", "json_schema", "regex"):
            continue
        elif key in NEUTRAL_SAMPLING:
            if value != NEUTRAL_SAMPLING[key]:
                raise ValidationError(f"`sampling_params.{key}` is not supported by pytgi "
                                      f"(only {NEUTRAL_SAMPLING[key]!r})")
        else:
            raise ValidationError(f"unknown field `sampling_params.{key}`")
    temperature = sampling.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValidationError("`sampling_params.temperature` must be a number >= 0")
    if temperature > 0:
        out["do_sample"] = True
        if temperature != 1.0:
            out["temperature"] = temperature
    top_p, top_k = sampling.get("top_p"), sampling.get("top_k")
    if top_p is not None and top_p != 1.0:
        out["top_p"] = top_p
    if top_k is not None and top_k not in (-1, 0):
        out["top_k"] = top_k
    if sampling.get("json_schema") is not None and sampling.get("regex") is not None:
        raise ValidationError("`sampling_params.json_schema` and `regex` are exclusive")
    if sampling.get("json_schema") is not None:
        schema = sampling["json_schema"]
        try:
            value = json.loads(schema) if isinstance(schema, str) else schema
        except ValueError as err:
            raise ValidationError(f"`sampling_params.json_schema` is not JSON: {err}") from err
        out["grammar"] = {"type": "json", "value": value}
    if sampling.get("regex") is not None:
        out["grammar"] = {"type": "regex", "value": sampling["regex"]}
    return out


def finish_reason(end: End) -> dict[str, Any]:
    """SGLang's finish_reason object: `length` (with the limit), else `stop`."""
    if end.finish_reason == "length":
        return {"type": "length", "length": end.generated_tokens}
    return {"type": "stop", "matched": None}


def meta_info(rid: str, end: End | None, prompt_tokens: int, completion_tokens: int,
              started: float) -> dict[str, Any]:
    return {
        "id": rid,
        "finish_reason": finish_reason(end) if end is not None else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "e2e_latency": time.monotonic() - started,
    }


def sglang_response(rid: str, seq: Sequence, started: float) -> dict[str, Any]:
    """The non-streamed answer: the generated text and its meta_info."""
    return {
        "text": seq.generated_text,
        "output_ids": [t.id for t in seq.tokens],
        "meta_info": meta_info(rid, seq.end, seq.input_length, seq.end.generated_tokens, started),
    }


class SglangEncoder:
    """SGLang's stream: one `data:` event per token with the text so far and its meta_info,
    the last with its finish_reason; then `data: [DONE]` (the route's trailer)."""

    __slots__ = ("rid", "input_length", "started", "text", "ids")

    def __init__(self, rid: str, input_length: int) -> None:
        self.rid, self.input_length, self.started = rid, input_length, time.monotonic()
        self.text = ""
        self.ids: list[int] = []

    def _event(self, end: End | None) -> bytes:
        body = {"text": self.text, "output_ids": self.ids,
                "meta_info": meta_info(self.rid, end, self.input_length, len(self.ids),
                                       self.started)}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def token(self, index: int, ev: Token) -> bytes:
        self.text += ev.token.text
        self.ids.append(ev.token.id)
        return self._event(None)

    def end(self, index: int, ev: End) -> bytes:
        self.text = ev.generated_text  # the last token comes with the End, as does the text
        self.ids.append(ev.token.id)
        return self._event(ev)

    def error(self, err: InferError) -> bytes:
        body = {"error": {"message": err.message, "code": err.status_code}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"
