"""Every float parameter is a finite number the shard can use, or a 422 in the API's shape:
JSON integers past float's range, values past the wire's float32, and penalties that overflow
the float32 scores (NaN logprobs, token 0 forever)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import numpy as np
import pytest

from pytgi_proto.parameters import FLOAT32_MAX, FLOAT32_TINY, REPETITION_PENALTY_RANGE
from pytgi_router.core.errors import InferError
from pytgi_router.http.json_fields import decode_body, finite_float
from pytgi_router.http.openai.schemas import parse_chat, parse_completion
from pytgi_router.http.schemas import parse_generate
from pytgi_router.http.validation import ValidationLimits, Validator
from tests.tiny_models import _CORPUS, train_tokenizer

LIMITS = ValidationLimits(
    max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5, max_input_tokens=64,
    max_total_tokens=128,
)
HUGE = int("1" + "0" * 400)  # a valid JSON number; float() raises OverflowError on it
FLOATS = ("temperature", "repetition_penalty", "frequency_penalty", "top_p", "typical_p")
OPENAI_FLOATS = ("temperature", "top_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty")


def wire(value: float) -> float:
    """What the wire's float32 carries: a request's sampling is the wire's own message."""
    return float(np.float32(value))


@pytest.fixture(scope="module")
def validator() -> Validator:
    return Validator(train_tokenizer(_CORPUS), LIMITS, rng=random.Random(1))


def refused(fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InferError) as info:
        fn(*args, **kwargs)
    assert info.value.status_code == 422 and info.value.error_type == "validation"
    return info.value.message


def test_an_integer_past_floats_range_is_a_422_not_a_500() -> None:
    assert refused(finite_float, HUGE, "x").startswith("Input validation error: `x` must be a "
                                                       "finite number, got integer 1000")
    assert finite_float(2**60, "x") == float(2**60)
    for name in FLOATS:
        body = decode_body(json.dumps({"inputs": "a", "parameters": {name: HUGE}}).encode())
        assert f"`parameters.{name}` must be a finite number" in refused(parse_generate, body)
    for name in OPENAI_FLOATS:
        chat = {"messages": [{"role": "user", "content": "a"}], name: HUGE}
        assert f"`{name}` must be a finite number" in refused(parse_chat, chat)
        assert f"`{name}` must be a finite number" in refused(
            parse_completion, {"prompt": "a", name: HUGE})


def validate(v: Validator, **parameters: Any) -> Any:
    return asyncio.run(v.validate(parse_generate({"inputs": "a", "parameters": parameters})))


def test_repetition_penalty_stays_where_float32_scores_stay_finite(validator: Validator) -> None:
    low, high = REPETITION_PENALTY_RANGE
    for penalty in (1e-40, 1e-7, low / 2, high * 2, 1e300):
        message = refused(validate, validator, repetition_penalty=penalty)
        assert message.endswith(f"`repetition_penalty` must be >= {low} and <= {high}. "
                                f"Given: {penalty}")
    for penalty in (0.0, -1.0):  # TGI's own message below zero
        assert refused(validate, validator, repetition_penalty=penalty).endswith(
            "`repetition_penalty` must be strictly positive")
    for penalty in (low, 0.5, 1.2, high):
        sampling = validate(validator, repetition_penalty=penalty).request.sampling
        assert sampling.repetition_penalty == wire(penalty)


def test_temperature_fits_the_wires_float32(validator: Validator) -> None:
    assert "`temperature` must be <= 3.4028234663852886e+38" in refused(
        validate, validator, temperature=1e39)
    assert validate(validator, temperature=FLOAT32_MAX).request.sampling.temperature == (
        FLOAT32_MAX)


def chat_parameters(**fields: Any) -> Any:
    return parse_chat({"messages": [{"role": "user", "content": "a"}], **fields}).parameters()


def test_presence_penalty_keeps_openais_range_and_a_usable_mapping(validator: Validator) -> None:
    for value in (-2.5, 2.01):
        assert refused(chat_parameters, presence_penalty=value).endswith(
            "`presence_penalty` must be >= -2.0 and <= 2.0")
    for value in (-2.0, -1.9999999, -1.999):
        message = refused(chat_parameters, presence_penalty=value)
        assert "`presence_penalty` must be > -1.999: it runs as `repetition_penalty`" in message
    for value in (-1.9989, 0.0, 2.0):
        params = chat_parameters(presence_penalty=value)
        valid = asyncio.run(validator.validate(
            parse_generate({"inputs": "a", "parameters": {
                "repetition_penalty": params.repetition_penalty}})))
        assert valid.request.sampling.repetition_penalty == wire(value + 2.0)


def test_a_mass_below_float32s_range_still_filters(validator: Validator) -> None:
    """5e-324 is 0 in float32, which the shard reads as "unset": no filtering at all."""
    sampling = validate(validator, top_p=5e-324, typical_p=5e-324).request.sampling
    assert sampling.top_p == sampling.typical_p == FLOAT32_TINY
    assert float(np.float32(FLOAT32_TINY)) > 0.0
    assert validate(validator, top_p=0.5).request.sampling.top_p == 0.5
