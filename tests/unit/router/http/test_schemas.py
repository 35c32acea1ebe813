"""Request parsing (types, defaults, errors) and response JSON, checked against the real clients'
own response types (text-generation, openai)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from text_generation.types import Response as TGResponse
from text_generation.types import StreamResponse as TGStreamResponse

from pytgi_router.core.errors import InferError, ValidationError
from pytgi_router.core.request_stream import End, TokenInfo
from pytgi_router.http.grammar import GrammarChecker, parse_grammar
from pytgi_router.http.http_errors import BadRequestError, CompletionRequestError, ToolError
from pytgi_router.http.json_fields import decode_body
from pytgi_router.http.openai.schemas import (
    Envelope,
    chat_completion,
    chat_logprobs,
    completion,
    parse_chat,
    parse_completion,
    usage,
)
from pytgi_router.http.openai.stream import ChatChunks, CompletionChunks, error_chunk
from pytgi_router.http.schemas import (
    GenerateParameters,
    Sequence,
    generate_response,
    parse_generate,
    stream_end_event,
    stream_token_event,
)

# The checker validation runs (compiles as the shards will, within the limits).
CHECKER = GrammarChecker()

TOK = TokenInfo(17, ' "café"\n', -0.25, False)
EOS = TokenInfo(1, "</s>", -0.5, True)


def sse_json(chunk: bytes) -> Any:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    return json.loads(chunk[6:-2])


def status_of(body: Any) -> tuple[int, str]:
    with pytest.raises(InferError) as info:
        parse_generate(body)
    return info.value.status_code, info.value.message


# ---- parsing -----------------------------------------------------------------------------------


def test_decode_body_rejects_malformed_json_non_utf8_and_nan() -> None:
    for raw in (b"{", b"\xff\xfe{}", b'{"inputs": NaN}', b"", b"   "):
        with pytest.raises(BadRequestError) as info:
            decode_body(raw)
        assert info.value.status_code == 400


def test_decode_body_refuses_deep_nesting_and_lone_surrogates() -> None:
    for raw, fragment in ((b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                          (b'{"inputs": "a\\ud800b"}', "lone UTF-16 surrogate"),
                          (b'{"x": ["\\udfff"]}', "lone UTF-16 surrogate"),
                          (b'{"\\ud800": 1}', "lone UTF-16 surrogate")):
        with pytest.raises(BadRequestError, match=fragment):
            decode_body(raw)
    # A surrogate pair is one character, and other \u escapes are plain text.
    assert decode_body(b'{"inputs": "\\ud83d\\ude00 \\ud55c"}') == {"inputs": "\U0001f600 \ud55c"}


@pytest.mark.parametrize(("body", "fragment"), [
    ({}, "missing field `inputs`"),
    ({"inputs": 3}, "`inputs` must be a string"),
    ([], "`body` must be a JSON object"),
    ({"inputs": "x", "parameters": []}, "`parameters` must be a JSON object"),
    ({"inputs": "x", "parameters": {"temperature": "hot"}}, "`parameters.temperature` must be a number"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 1.5}}, "`parameters.max_new_tokens` must be an integer"),
    ({"inputs": "x", "parameters": {"max_new_tokens": True}}, "`parameters.max_new_tokens` must be an integer"),
    ({"inputs": "x", "parameters": {"seed": -1}}, "`parameters.seed` must be an integer"),
    ({"inputs": "x", "parameters": {"seed": 2**64}}, "`parameters.seed` must be an integer"),
    ({"inputs": "x", "parameters": {"details": "yes"}}, "`parameters.details` must be a boolean"),
    ({"inputs": "x", "parameters": {"stop": [1]}}, "`parameters.stop` must be an array of strings"),
    ({"inputs": "x", "parameters": {"temperature": 1e999}}, "must be a finite number"),
])
def test_wrong_shapes_are_422_with_the_field_named(body: Any, fragment: str) -> None:
    status, message = status_of(body)
    assert status == 422
    assert fragment in message


def test_nulls_mean_not_given_and_unknown_fields_are_ignored() -> None:
    req = parse_generate({"inputs": "x", "extra": 1, "parameters": {
        "temperature": None, "details": None, "stop": None, "unknown": [1, 2], "top_k": 3,
    }})
    p = req.parameters
    assert p.temperature is None and p.details is False and p.stop == [] and p.top_k == 3
    assert p.do_sample is False
    assert parse_generate({"inputs": "x"}).parameters.do_sample is True
    assert parse_generate({"inputs": "x", "stream": True}).stream is True


# ---- TGI responses -----------------------------------------------------------------------------


def _end(**kw: Any) -> End:
    base = dict(generated_text="ab", finish_reason="eos_token", generated_tokens=2, seed=None)
    base.update(kw)
    return End(EOS, [], **base)  # type: ignore[arg-type]


def test_stream_token_event_matches_tgi_and_the_client_parses_it() -> None:
    data = sse_json(stream_token_event(1, TOK, []))
    assert data == {"index": 1, "token": {"id": 17, "text": ' "café"\n', "logprob": -0.25,
                                          "special": False},
                    "generated_text": None, "details": None}
    with_top = sse_json(stream_token_event(2, TOK, [TOK, EOS]))
    assert [t["id"] for t in with_top["top_tokens"]] == [17, 1]
    TGStreamResponse(**with_top)


def test_stream_end_event_carries_text_and_details() -> None:
    data = sse_json(stream_end_event(3, _end(seed=42), "full text", 5, details=True))
    assert data["generated_text"] == "full text" and data["index"] == 3
    assert data["details"] == {"finish_reason": "eos_token", "generated_tokens": 2, "seed": 42,
                               "input_length": 5}
    assert TGStreamResponse(**data).details.seed == 42  # type: ignore[union-attr]
    bare = sse_json(stream_end_event(3, _end(), "t", 5, details=False))
    assert bare["details"] is None


def test_nan_logprob_is_null() -> None:
    data = sse_json(stream_token_event(1, TokenInfo(3, "x", float("nan"), False), []))
    assert data["token"]["logprob"] is None


def test_generate_response_details_only_when_asked() -> None:
    seq = Sequence("ab", _end(), [TokenInfo(0, "<s>", float("nan"), True)], [TOK, EOS],
                   [[], []], 1)
    assert generate_response(seq, [], details=False) == {"generated_text": "ab"}
    full = generate_response(seq, [seq], details=True)
    d = full["details"]
    assert d["prefill"] == [{"id": 0, "text": "<s>", "logprob": None}]
    assert [t["id"] for t in d["tokens"]] == [17, 1] and "top_tokens" not in d
    assert d["best_of_sequences"][0]["generated_text"] == "ab"
    parsed = TGResponse(**json.loads(json.dumps(full)))
    assert parsed.details.finish_reason.value == "eos_token"


# ---- OpenAI ------------------------------------------------------------------------------------


def test_chat_mapping_follows_tgi() -> None:
    chat = parse_chat({
        "model": "tgi", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "look: "},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        "temperature": 0, "presence_penalty": 0.5, "max_completion_tokens": 9, "stop": "END",
        "logprobs": True, "top_logprobs": 2, "stream": True,
        "stream_options": {"include_usage": True},
    })
    # Images stay parts (transformers' shape) with their URL and place kept aside; a text model
    # refuses them on the route (router/http/media/), instead of reading markdown it cannot see.
    assert chat.messages == [{"role": "user", "content": [
        {"type": "text", "text": "look: "}, {"type": "image"}]}]
    assert [(r.where, r.url) for r in chat.images] == [("messages[0].content[1]", "http://x/y.png")]
    p = chat.parameters()
    assert p.do_sample is False and p.temperature is None
    assert p.repetition_penalty == pytest.approx(2.5)
    assert p.max_new_tokens == 9 and p.stop == ["END"] and p.top_n_tokens == 2
    assert p.adapter_id is None and p.details is True
    assert chat.fields.stream and chat.fields.include_usage
    sampled = parse_chat({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7})
    assert sampled.parameters().do_sample is True


def test_chat_tool_errors_and_empty_messages() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(ToolError) as info:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                    "tool_choice": "g"})
    assert info.value.status_code == 422 and info.value.error_type == "tool_error"
    assert info.value.message == "Tool error: Tool with name g not found"
    with pytest.raises(ValidationError):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [{}],
                    "tool_choice": "none"})
    with pytest.raises(InferError):
        parse_chat({"messages": []})


def test_completions_parsing_and_errors() -> None:
    comp = parse_completion({"prompt": ["a", "b"], "max_tokens": 3, "temperature": 0.0})
    assert comp.prompts == ["a", "b"] and comp.parameters().do_sample is False
    with pytest.raises(CompletionRequestError) as info:
        parse_completion({"prompt": "a", "suffix": "z"})
    assert info.value.error_type == "suffix not supported"
    with pytest.raises(InferError):
        parse_completion({"prompt": [1, 2]})


def test_openai_objects_parse_with_the_sdk_types() -> None:
    env = Envelope(model="m", system_fingerprint="0.1.0-native")
    message = {"role": "assistant", "content": "hi"}
    body = chat_completion(env, message, "stop", chat_logprobs([TOK], [[TOK]]), usage(3, 1))
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.usage is not None and parsed.usage.total_tokens == 4
    assert parsed.usage.completion_tokens_details is None
    thought = {**message, "reasoning_content": "hm", "reasoning": "hm"}
    thinking = ChatCompletion.model_validate(
        chat_completion(env, thought, "stop", None, usage(3, 4, reasoning_tokens=3)))
    assert thinking.choices[0].message.model_extra == {"reasoning_content": "hm",
                                                        "reasoning": "hm"}
    details = thinking.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and details.reasoning_tokens == 3
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.content[0].token == TOK.text  # type: ignore[index]

    chunks = ChatChunks(env, logprobs=False)
    first = ChatCompletionChunk.model_validate(sse_json(chunks.token(TOK, [])))
    assert first.choices[0].delta.content == TOK.text and first.choices[0].finish_reason is None
    assert first.choices[0].delta.role == "assistant"
    last = ChatCompletionChunk.model_validate(sse_json(chunks.token(EOS, [], "length")))
    assert last.choices[0].delta.content == "" and last.choices[0].finish_reason == "length"
    # The role once, as OpenAI sends it: the SDK's stream helper joins repeated strings.
    assert last.choices[0].delta.role is None
    usage_chunk = ChatCompletionChunk.model_validate(sse_json(chunks.usage(3, 2)))
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.total_tokens == 5

    comp = Completion.model_validate(completion(env, [("a", "stop_sequence"), ("b", "length")], 4, 2))
    assert [c.finish_reason for c in comp.choices] == ["stop", "length"]
    cchunks = CompletionChunks(env)
    # Like OpenAI's own streams, intermediate chunks say finish_reason null (the SDK builds
    # stream chunks without validation; its strict type only lists final reasons).
    tok = sse_json(cchunks.token(1, TOK))
    assert tok["choices"] == [{"index": 1, "text": TOK.text, "logprobs": None,
                               "finish_reason": None}]
    assert tok["object"] == "text_completion" and tok["model"] == "m"
    end = Completion.model_validate(sse_json(cchunks.last(0, EOS, "eos_token", 3, 2)))
    assert end.choices[0].finish_reason == "stop" and end.usage.completion_tokens == 2  # type: ignore[union-attr]


def test_openai_stream_error_has_a_message() -> None:
    err = InferError("boom")
    data = sse_json(error_chunk(err))
    assert data["error"]["message"] == "boom" and data["error"]["http_status_code"] == 500


# ---- arbitrary JSON never crashes the parsers ---------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8,
)
_keys = st.sampled_from([
    "best_of", "temperature", "repetition_penalty", "frequency_penalty", "top_k", "top_p",
    "typical_p", "do_sample", "max_new_tokens", "return_full_text", "stop", "truncate",
    "watermark", "details", "decoder_input_details", "seed", "top_n_tokens", "grammar",
    "adapter_id", "messages", "prompt", "max_tokens", "logprobs", "top_logprobs",
    "stream_options", "response_format", "tools", "suffix", "presence_penalty", "tool_choice",
    "tool_prompt",
])


@settings(max_examples=300, deadline=None)
@given(params=st.dictionaries(_keys, _json, max_size=6), inputs=_json)
def test_any_json_is_parsed_or_refused_cleanly(params: dict[str, Any], inputs: Any) -> None:
    for parse, body in (
        (parse_generate, {"inputs": inputs, "parameters": params}),
        (parse_chat, {**params, "messages": inputs}),
        (parse_completion, {**params, "prompt": inputs}),
    ):
        try:
            request = parse(body)
            p = request.parameters
            grammar = (p if isinstance(p, GenerateParameters) else p()).grammar
            if grammar is not None:
                CHECKER.check(parse_grammar(grammar))
        except InferError as err:
            assert err.status_code in (400, 422) and err.message
