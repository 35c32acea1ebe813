"""adapter_id against the shards' LoRA adapters: an unknown id is a 422 naming the loaded ones
(never a silent base-model answer); OpenAI's `model` selects an adapter it names and otherwise
keeps the base model (TGI's behaviour)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from tokenizers import Tokenizer

from pytgi_router.core.batch_wire import request_pb
from pytgi_router.core.errors import ValidationError
from pytgi_router.http.openai.schemas import parse_chat, parse_completion
from pytgi_router.http.schemas import GenerateParameters, GenerateRequest, parse_generate
from pytgi_router.http.validation import ValidationLimits, Validator
from tests.tiny_models import _CORPUS, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(_CORPUS)


def validator(tokenizer: Tokenizer, adapters: tuple[str, ...]) -> Validator:
    limits = ValidationLimits(2, 4, 5, 64, 128, adapters=adapters)
    return Validator(tokenizer, limits, rng=random.Random(3))


def index_of(v: Validator, body: dict[str, Any]) -> int:
    return asyncio.run(v.validate(parse_generate(body))).request.adapter_index


def refusal(v: Validator, body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        index_of(v, body)
    assert info.value.status_code == 422 and info.value.error_type == "validation"
    return info.value.message


def test_unknown_adapter_without_adapters_says_none_are_loaded(tokenizer: Tokenizer) -> None:
    v = validator(tokenizer, ())
    msg = refusal(v, {"inputs": "hello", "parameters": {"adapter_id": "sql"}})
    assert "'sql' is not a loaded adapter" in msg and "no adapters are loaded" in msg
    assert index_of(v, {"inputs": "hello", "parameters": {}}) == 0


def test_loaded_adapters_resolve_to_their_index_and_unknown_ones_are_named(
    tokenizer: Tokenizer,
) -> None:
    v = validator(tokenizer, ("sql", "chat"))
    assert index_of(v, {"inputs": "hello", "parameters": {"adapter_id": "sql"}}) == 1
    assert index_of(v, {"inputs": "hello", "parameters": {"adapter_id": "chat"}}) == 2
    msg = refusal(v, {"inputs": "hello", "parameters": {"adapter_id": "Chat"}})
    assert "loaded adapters: sql, chat" in msg


def test_openai_model_selects_a_named_adapter_and_otherwise_the_base(tokenizer: Tokenizer) -> None:
    v = validator(tokenizer, ("sql", "chat"))
    msgs = [{"role": "user", "content": "hi"}]

    def chat_index(model: str | None) -> int:
        body: dict[str, Any] = {"messages": msgs, **({"model": model} if model else {})}
        params = parse_chat(body).parameters()
        req = GenerateRequest("hello", params, adapter_from_model=True)
        return asyncio.run(v.validate(req)).request.adapter_index

    assert [chat_index(m) for m in ("chat", "sql", "tgi", "my-base-model", None)] == [2, 1, 0, 0, 0]
    comp = parse_completion({"model": "chat", "prompt": "hello"}).parameters()
    req = GenerateRequest("hi", comp, adapter_from_model=True)
    assert asyncio.run(v.validate(req)).request.adapter_index == 2
    # The same name as TGI's adapter_id (not OpenAI's `model`) must name a loaded adapter.
    with pytest.raises(ValidationError):
        asyncio.run(v.validate(GenerateRequest("hi", parse_completion(
            {"model": "other", "prompt": "hello"}).parameters())))


def test_the_wire_request_carries_the_adapter_index(tokenizer: Tokenizer) -> None:
    v = validator(tokenizer, ("sql",))
    params = GenerateParameters(adapter_id="sql", max_new_tokens=2)
    valid = asyncio.run(v.validate(GenerateRequest("hello", params)))
    assert request_pb(5, valid.request).adapter_index == 1
