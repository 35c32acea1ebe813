"""Validator: TGI's defaults and exact messages, tokenization with the model's tokenizer, limits."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.schemas import GenerateRequest, parse_generate
from pytgi_router.http.validation import (
    OFFLOAD_CHARS,
    ValidationLimits,
    Validator,
    ValidGenerateRequest,
)
from tests.tiny_models import _CORPUS, train_tokenizer

LIMITS = ValidationLimits(
    max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=64,
    max_total_tokens=128,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(_CORPUS)


@pytest.fixture
def validator(tokenizer: Tokenizer) -> Validator:
    return Validator(tokenizer, LIMITS, rng=random.Random(7))


def run(v: Validator, body: dict[str, Any], stream: bool = False) -> ValidGenerateRequest:
    return asyncio.run(v.validate(parse_generate(body), stream=stream))


def error(v: Validator, body: dict[str, Any], stream: bool = False) -> str:
    with pytest.raises(ValidationError) as info:
        run(v, body, stream)
    assert info.value.status_code == 422 and info.value.error_type == "validation"
    return info.value.message


def test_omitted_parameters_sample_and_empty_parameters_are_greedy(validator: Validator) -> None:
    sampled = run(validator, {"inputs": "Hello world"})
    greedy = run(validator, {"inputs": "Hello world", "parameters": {}})
    assert sampled.request.sampling.do_sample is True
    assert greedy.request.sampling.do_sample is False
    assert greedy.details is False and greedy.best_of == 1


def test_tokenizes_with_bos_and_defaults_max_new_tokens_to_the_rest(
    validator: Validator, tokenizer: Tokenizer
) -> None:
    valid = run(validator, {"inputs": "Hello world", "parameters": {}})
    ids = tokenizer.encode("Hello world").ids
    assert valid.request.input_ids == ids
    assert ids[0] == tokenizer.token_to_id("<s>")
    assert valid.request.stopping.max_new_tokens == LIMITS.max_total_tokens - len(ids)


def test_seed_is_random_u64_when_unset_and_kept_when_given(validator: Validator) -> None:
    seeds = {run(validator, {"inputs": "a b"}).request.sampling.seed for _ in range(5)}
    assert len(seeds) == 5 and all(0 <= s < 2**64 for s in seeds)
    given = run(validator, {"inputs": "a", "parameters": {"seed": 2**64 - 1}})
    assert given.request.sampling.seed == 2**64 - 1


def test_a_warper_implies_sampling_like_the_shard_chooser(validator: Validator) -> None:
    for params in ({"temperature": 0.5}, {"top_k": 3}, {"top_p": 0.9}, {"typical_p": 0.5}):
        assert run(validator, {"inputs": "x", "parameters": params}).request.sampling.do_sample
    neutral = run(validator, {"inputs": "x", "parameters": {"temperature": 1.0, "top_p": 1.0}})
    assert neutral.request.sampling.do_sample is False


@pytest.mark.parametrize("temperature", [1e-50, 1e-40, 1e-6])
def test_a_temperature_below_the_threshold_is_greedy(validator: Validator, temperature: float) -> None:
    """Below float32's range (1e-50 reached the shard as 0: unset, sampled at temperature 1) or
    overflowing it (1e-40: NaN logprobs): greedy, with every warper neutral."""
    s = run(validator, {"inputs": "Hello", "parameters": {
        "temperature": temperature, "do_sample": True, "top_k": 5, "top_p": 0.9}}).request.sampling
    assert (s.temperature, s.top_k, s.top_p, s.typical_p, s.do_sample) == (1.0, 0, 1.0, 1.0, False)
    at = run(validator, {"inputs": "Hello", "parameters": {"temperature": 1e-5}}).request.sampling
    assert at.temperature == pytest.approx(1e-5) and at.do_sample  # float32 on the wire


def test_truncate_keeps_the_last_tokens(validator: Validator, tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text).ids
    valid = run(validator, {"inputs": text, "parameters": {"truncate": 3}})
    assert valid.request.input_ids == ids[-3:]
    assert valid.request.inputs == text  # the text itself is kept for return_full_text


def test_parameters_reach_the_request(validator: Validator) -> None:
    valid = run(validator, {"inputs": "x", "parameters": {
        "max_new_tokens": 7, "stop": ["a", "b"], "top_n_tokens": 2, "repetition_penalty": 1.2,
        "frequency_penalty": -0.5, "watermark": True, "decoder_input_details": True,
        "return_full_text": True,
    }})
    r = valid.request
    assert r.stopping.max_new_tokens == 7 and r.stopping.stop_sequences == ["a", "b"]
    assert r.top_n_tokens == 2 and r.prefill_logprobs is True
    assert r.sampling.repetition_penalty == pytest.approx(1.2)
    assert r.sampling.frequency_penalty == pytest.approx(-0.5) and r.sampling.watermark
    assert valid.details and valid.return_full_text


def test_top_p_one_is_accepted_as_no_filtering(validator: Validator) -> None:
    valid = run(validator, {"inputs": "x", "parameters": {"top_p": 1.0}})
    assert valid.request.sampling.top_p == 1.0


@pytest.mark.parametrize(("params", "message"), [
    ({"temperature": 0.0}, "`temperature` must be strictly positive"),
    ({"temperature": -1}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"top_p": 1.5}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"top_k": -3}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"stop": ["a", "b" * 513]}, "`stop` sequences must be at most 512 characters long. Given: 513"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 0}, "`best_of` must be > 0 and <= 2. Given: 0"),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
    ({"truncate": 0}, "`truncate` must be strictly positive and less than 64. Given: 0"),
    ({"truncate": 65}, "`truncate` must be strictly positive and less than 64. Given: 65"),
    ({"max_new_tokens": 200},
     "`inputs` tokens + `max_new_tokens` must be <= 128. Given: 2 `inputs` tokens and 200 "
     "`max_new_tokens`"),
])
def test_bad_parameters_get_tgi_messages(
    validator: Validator, params: dict[str, Any], message: str
) -> None:
    assert error(validator, {"inputs": "x", "parameters": params}) == (
        f"Input validation error: {message}"
    )


def test_streaming_forbids_best_of_and_prefill_details(validator: Validator) -> None:
    best_of = {"inputs": "x", "parameters": {"best_of": 2, "do_sample": True}}
    assert error(validator, best_of, stream=True).endswith(
        "`best_of` != 1 is not supported when streaming tokens"
    )
    prefill = {"inputs": "x", "parameters": {"decoder_input_details": True}}
    assert error(validator, prefill, stream=True).endswith(
        "`decoder_input_details` == true is not supported when streaming tokens"
    )


def test_best_of_disabled_when_the_limit_is_one(tokenizer: Tokenizer) -> None:
    one = Validator(tokenizer, ValidationLimits(1, 4, 5, 64, 128))
    assert error(one, {"inputs": "x", "parameters": {"best_of": 2}}).endswith(
        "`best_of` != 1 is not allowed for this endpoint"
    )


def test_empty_and_too_long_inputs(validator: Validator, tokenizer: Tokenizer) -> None:
    assert error(validator, {"inputs": ""}).endswith("`inputs` cannot be empty")
    words = 1
    while len(tokenizer.encode(" ".join(["hello"] * words)).ids) <= 64:
        words += 1
    text = " ".join(["hello"] * words)
    n = len(tokenizer.encode(text).ids)
    assert n < 127
    assert error(validator, {"inputs": text, "parameters": {"max_new_tokens": 1}}).endswith(
        f"`inputs` must have less than 64 tokens. Given: {n}"
    )
    # Without max_new_tokens the total check speaks first, as in TGI.
    longer = " ".join(["hello"] * 200)
    m = len(tokenizer.encode(longer).ids)
    assert error(validator, {"inputs": longer}).endswith(
        f"Given: {m} `inputs` tokens and 0 `max_new_tokens`"
    )


def test_long_inputs_tokenize_in_the_pool_with_the_same_result(tokenizer: Tokenizer) -> None:
    text = ("Continuous batching adds new requests between decode steps. " * 60)[: OFFLOAD_CHARS * 2]
    limits = ValidationLimits(2, 4, 5, 10_000, 20_000)
    with ThreadPoolExecutor(1) as pool:
        pooled = Validator(tokenizer, limits, pool)
        inline = Validator(tokenizer, limits)

        async def both() -> tuple[list[int], list[int]]:
            a = await pooled.validate(GenerateRequest(text, parse_generate(
                {"inputs": text, "parameters": {}}).parameters))
            b = await inline.validate(GenerateRequest(text, parse_generate(
                {"inputs": text, "parameters": {}}).parameters))
            return a.request.input_ids, b.request.input_ids

        a, b = asyncio.run(both())
    assert a == b == tokenizer.encode(text).ids


def test_chat_prompts_skip_special_tokens(validator: Validator, tokenizer: Tokenizer) -> None:
    req = parse_generate({"inputs": "<s>Hi", "parameters": {}})
    req.add_special_tokens = False
    valid = asyncio.run(validator.validate(req))
    assert valid.request.input_ids == tokenizer.encode("<s>Hi", add_special_tokens=False).ids
    assert valid.request.add_special_tokens is False


_num = st.one_of(st.none(), st.floats(-10, 10, allow_nan=False), st.integers(-5, 300))


@settings(max_examples=200, deadline=None)
@given(
    params=st.fixed_dictionaries({}, optional={
        "temperature": _num, "top_p": _num, "top_k": st.integers(-5, 50) | st.none(),
        "typical_p": _num, "repetition_penalty": _num, "frequency_penalty": _num,
        "max_new_tokens": st.integers(0, 300) | st.none(), "truncate": st.integers(0, 80),
        "best_of": st.integers(0, 3), "do_sample": st.booleans(),
        "seed": st.integers(0, 2**64 - 1), "top_n_tokens": st.integers(0, 7),
        "stop": st.lists(st.text(max_size=3), max_size=6),
    }),
    inputs=st.text(max_size=300),
    stream=st.booleans(),
)
def test_any_typed_parameters_validate_or_fail_cleanly(
    tokenizer: Tokenizer, params: dict[str, Any], inputs: str, stream: bool
) -> None:
    v = Validator(tokenizer, LIMITS)
    try:
        valid = run(v, {"inputs": inputs, "parameters": params}, stream)
    except ValidationError as err:
        assert err.message.startswith("Input validation error: ")
        return
    r = valid.request
    # Whatever passes fits the shard's limits and the proto's field types.
    assert 0 < r.input_length <= LIMITS.max_input_tokens
    assert r.input_length + r.stopping.max_new_tokens <= LIMITS.max_total_tokens
    assert r.stopping.max_new_tokens >= 1 and 0 <= r.sampling.seed < 2**64
    assert r.sampling.temperature > 0 and 0 < r.sampling.top_p <= 1
    assert 0 <= r.sampling.top_k < 2**32 and r.top_n_tokens <= LIMITS.max_top_n_tokens


def test_a_grammar_reaches_the_sampling_parameters(validator: Validator) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    json_req = run(validator, {"inputs": "x", "parameters": {"grammar": {
        "type": "json", "value": schema}}}).request.sampling
    assert (json_req.grammar_type, json.loads(json_req.grammar)) == (1, schema)
    regex = run(validator, {"inputs": "x", "parameters": {"grammar": {
        "type": "regex", "value": "[ab]+"}}}).request.sampling
    assert (regex.grammar_type, regex.grammar) == (2, "[ab]+")
    free = run(validator, {"inputs": "x"}).request.sampling
    assert (free.grammar_type, free.grammar) == (0, "")


def test_a_large_schema_compiles_in_the_pool_and_a_bad_one_is_refused(
    tokenizer: Tokenizer,
) -> None:
    with ThreadPoolExecutor(1) as pool:
        v = Validator(tokenizer, LIMITS, pool)
        props = {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(200)}
        big = {"type": "object", "properties": props}
        assert len(json.dumps(big)) > OFFLOAD_CHARS
        body = {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": big}}}
        assert run(v, body).request.sampling.grammar_type == 1
        props["field_0"] = {"type": "strin"}
        assert error(v, body) == "Input validation error: grammar is not valid: Invalid type: strin"


def test_grammar_support_disabled_refuses_every_grammar(tokenizer: Tokenizer) -> None:
    limits = ValidationLimits(2, 4, 5, 64, 128, grammar_supported=False)
    v = Validator(tokenizer, limits)
    for grammar in ({"type": "regex", "value": "a+"}, {"type": "json_object"}):
        body = {"inputs": "x", "parameters": {"grammar": grammar}}
        assert error(v, body) == "Input validation error: grammar is not supported"
